"""What happened, written down and read back: the Recorder, the views over a run,
its figures, and the trackers it can be sent to.

A Recorder is a watcher that binds one record per forward as ``run/{run}/{i}``;
``facts``, ``forwards``, ``nodes``, ``curve`` and ``runs`` read them back, and
``progress``, ``spent`` and ``report`` draw them (with plotly, imported only when
something is drawn). ``Live`` shows a run while it happens. ``export_tensorboard``
and ``export_mlflow`` copy a run into those trackers, and ``to_tensorboard`` and
``to_mlflow`` stream one there as it trains (each with its tracker's own library,
imported only when asked for: the ``trackers`` extra).

A store is written by many hands: the readers of a whole run (``nodes``, ``curve``,
the figures, the report) read past a record they cannot read and say which they left
out and why; only ``facts``, asked for one forward, refuses a damaged one, naming it.
"""

from __future__ import annotations

from ._figures import progress, spent
from ._live import Live
from ._read import Run, curve, facts, forwards, nodes, runs
from ._recorder import FORMAT, Recorder
from ._report import report
from ._trackers import Streaming, export_mlflow, export_tensorboard, to_mlflow, to_tensorboard

__all__ = ["FORMAT", "Live", "Recorder", "Run", "Streaming", "curve", "export_mlflow",
           "export_tensorboard", "facts", "forwards", "nodes", "progress", "report", "runs",
           "spent", "to_mlflow", "to_tensorboard"]
