"""What happened, written down and read back: the Recorder, the views over a run,
and its figures.

A Recorder is a watcher that binds one record per forward as ``run/{run}/{i}``;
``facts``, ``forwards``, ``nodes``, ``curve`` and ``runs`` read them back, and
``progress``, ``spent`` and ``report`` draw them (with plotly, imported only when
something is drawn). ``Live`` shows a run while it happens.
"""

from __future__ import annotations

from ._figures import progress, spent
from ._live import Live
from ._read import Run, curve, facts, forwards, nodes, runs
from ._recorder import FORMAT, Recorder
from ._report import report

__all__ = ["FORMAT", "Live", "Recorder", "Run", "curve", "facts", "forwards", "nodes",
           "progress", "report", "runs", "spent"]
