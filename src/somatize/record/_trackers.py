"""A run in the trackers people already use, TensorBoard and MLflow: after the fact
(``export_tensorboard``, ``export_mlflow``) or while it trains (``to_tensorboard``,
``to_mlflow``, watchers that sit beside a Recorder).

What goes across is the same for both trackers and both ways:

=============================  ====================================================
``loss``                       the step's ``loss`` fact
``time/forward``               ms, the forward end to end (its ``finished`` fact)
``time/<node>``                ms the node ran in that forward (its ``ran`` facts)
``time/<node>/learning``       ms spent walking back through a node trained where it runs
``wire/<host>/sent_ms``        ms and bytes sent to a host in that forward, and
``wire/<host>/sent_bytes``     the same ``received_*``
``health/<where>/<measure>``   every number the Audit said, at its measured step
``validation/<measure>``       each number a ``Trainer.evaluate`` said (its ``evaluated``
                               fact: the loss and each metric), at the steps taken then
findings                       the health rules' findings at the default thresholds: a
                               text table in TensorBoard; ``findings.json`` and
                               ``findings.md`` and a tag in MLflow
=============================  ====================================================

The step is the one a Trainer numbers its steps by (from 1), or the forward's index
for forwards that say none; the time is when the forward began. tensorboard and
mlflow are imported by the functions that write to them and nowhere else, so this
package imports without them (they are the ``trackers`` extra).
"""

from __future__ import annotations

import glob
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._optional import optional
from ._read import listed, read
from ._recorder import check_run

__all__ = ["export_mlflow", "export_tensorboard", "to_mlflow", "to_tensorboard"]

SUFFIX = ".somatize"  # the end of the event files written here, so an export replaces its own
EXPERIMENT = "somatize"
_TENSORBOARD, _MLFLOW = "writing for TensorBoard", "writing to MLflow"  # who needs it, when missing
_UNSAFE = re.compile(r"[^\w.\- ]")  # what an MLflow key may not hold (its rule, less ':')


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _Points:
    """Facts, said in order, turned into ``(tag, value, step, wall)`` points.

    Times and bytes are summed over a forward and handed on when the next one begins
    (or at ``end``); a loss and the health measures as they come. Health facts are kept,
    without their histograms, for the findings at the end.
    """

    def __init__(self, emit: Callable[[str, float, int, float], None], *, counting: bool):
        self.emit = emit
        self.counting = counting  # live: a ``began`` opens the next forward
        self.forward = -1
        self.step = 0
        self.wall = time.time()
        self.summed: dict[str, tuple[float, int]] = {}
        self.health: list[dict[str, Any]] = []
        self.measured = 0  # the last step a health fact was said at: where findings are shown

    def begin(self, forward: int, wall: float) -> None:
        self.end()
        self.forward, self.step, self.wall = forward, forward, wall

    def take(self, fact: Any) -> None:
        kind = fact.get("fact") if type(fact) is dict else None
        if kind == "began":
            if self.counting:
                self.begin(self.forward + 1, time.time())
            if type(fact.get("step")) is int:
                self.step = fact["step"]
            if isinstance(fact.get("at_us"), int):
                self.wall = fact["at_us"] / 1e6
        elif kind == "loss":
            value = _number(fact.get("value"))
            if value is not None:
                self.emit("loss", value, self.step, self.wall)
        elif kind == "finished":
            self._add("time/forward", fact.get("took_us"), 1000)
        elif kind == "ran" and isinstance(fact.get("node"), str):
            tag = f"time/{fact['node']}" + ("/learning" if fact.get("backward") else "")
            self._add(tag, fact.get("took_us"), 1000)
        elif kind in ("sent", "received") and isinstance(fact.get("host"), str):
            self._add(f"wire/{fact['host']}/{kind}_ms", fact.get("took_us"), 1000)
            self._add(f"wire/{fact['host']}/{kind}_bytes", fact.get("bytes"), 1)
        elif kind == "health" and isinstance(fact.get("where"), str) and type(fact.get("step")) is int:
            self._health(fact)
        elif kind == "evaluated":
            step = fact["step"] if type(fact.get("step")) is int else self.step
            for key, value in fact.items():
                number = _number(value)
                if key not in ("fact", "step", "rows") and number is not None:
                    self.emit(f"validation/{key}", number, step, self.wall)

    def _add(self, tag: str, value: Any, per: int) -> None:
        """Adds to a forward's sum of ``tag``, which is handed on divided by ``per``
        (1000: microseconds said, milliseconds shown)."""
        number = _number(value)
        if number is not None:
            total, _ = self.summed.get(tag, (0.0, per))
            self.summed[tag] = (total + number, per)

    def _health(self, fact: dict[str, Any]) -> None:
        kept = {"fact": "health", "where": fact["where"], "step": fact["step"]}
        for key, value in fact.items():
            number = _number(value)
            if key in kept or number is None:  # a histogram (a list) is not one number
                continue
            kept[key] = value
            self.emit(f"health/{fact['where']}/{key}", number, fact["step"], self.wall)
        self.health.append(kept)
        self.measured = max(self.measured, fact["step"])

    def end(self) -> None:
        """Hands on what was summed over the open forward."""
        for tag, (total, per) in self.summed.items():
            self.emit(tag, total / per, self.step, self.wall)
        self.summed = {}


def _findings_text(findings: list[Any]) -> str:
    """The findings as a Markdown table (what TensorBoard's text tab and MLflow show)."""
    if not findings:
        return "No findings at the default thresholds."
    advised = any(getattr(f, "advice", None) for f in findings)
    head = ["where", "what", "since step", "evidence"] + (["what to try"] if advised else [])
    rows = [[f.where, f.what, str(f.since), f.brief]
            + ([str(getattr(f, "advice", None) or "")] if advised else []) for f in findings]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _findings(findings: list[Any]) -> list[dict[str, Any]]:
    out = []
    for finding in findings:
        plain = finding.as_dict()
        advice = getattr(finding, "advice", None)
        if advice is not None:
            plain["advice"] = advice
        out.append(plain)
    return out


def _replay(store: Any, run: str, points: _Points) -> bool:
    """Every record of a run through ``points``; answers whether it held health facts."""
    for index, bound in listed(store, run):
        points.begin(index, bound.when)
        for fact in read(store, bound)["facts"]:
            points.take(fact)
    points.end()
    return bool(points.health)


# -- TensorBoard ------------------------------------------------------------------------------
class _EventFile:
    """One TensorBoard event file, written through tensorboard's own event writer."""

    def __init__(self, directory: str, flush_secs: float):
        writing = optional("tensorboard.summary.writer.event_file_writer", "trackers", _TENSORBOARD)
        self.protos = optional("tensorboard.compat.proto.summary_pb2", "trackers", _TENSORBOARD)
        self.events = optional("tensorboard.compat.proto.event_pb2", "trackers", _TENSORBOARD)
        self.writer = writing.EventFileWriter(directory, max_queue_size=1024,
                                              flush_secs=flush_secs, filename_suffix=SUFFIX)

    def scalar(self, tag: str, value: float, step: int, wall: float) -> None:
        summary = self.protos.Summary(value=[self.protos.Summary.Value(tag=tag, simple_value=value)])
        self.writer.add_event(self.events.Event(wall_time=wall, step=step, summary=summary))

    def text(self, tag: str, text: str, step: int, wall: float) -> None:
        textual = optional("tensorboard.plugins.text.metadata", "trackers", _TENSORBOARD)
        tensors = optional("tensorboard.compat.proto.tensor_pb2", "trackers", _TENSORBOARD)
        shapes = optional("tensorboard.compat.proto.tensor_shape_pb2", "trackers", _TENSORBOARD)
        tensor = tensors.TensorProto(
            dtype=7,  # DT_STRING in TensorFlow's numbering, which the text plugin reads
            string_val=[text.encode("utf-8")],
            tensor_shape=shapes.TensorShapeProto(dim=[shapes.TensorShapeProto.Dim(size=1)]))
        metadata = textual.create_summary_metadata(display_name=tag, description="")
        value = self.protos.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
        self.writer.add_event(self.events.Event(wall_time=wall, step=step,
                                                summary=self.protos.Summary(value=[value])))

    def findings(self, findings: list[Any], step: int, wall: float) -> None:
        self.text("findings", _findings_text(findings), step, wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def export_tensorboard(store: Any, run: str, directory: Any, *,
                       findings: list[Any] | None = None) -> str:
    """Writes a run as TensorBoard event files in ``directory/<run>/`` and answers that
    folder; ``tensorboard --logdir directory`` then shows it beside any other run
    exported there. ``findings`` (``somatize.health.diagnose(store, run)``, as
    ``somatize export`` passes them) are written as a text table.

    Exporting a run again replaces what an earlier export of it wrote there (the event
    files ending ``.somatize``), so a run that grew is shown once, whole. Needs
    tensorboard (the ``trackers`` extra), not torch.
    """
    listed(store, check_run(run))  # an unknown run is refused before anything is written
    folder = os.path.join(os.fspath(directory), run)
    earlier = set(glob.glob(os.path.join(glob.escape(folder), f"events.out.tfevents.*{SUFFIX}")))
    events = _EventFile(folder, flush_secs=120)
    try:
        points = _Points(events.scalar, counting=False)
        _replay(store, run, points)
        if findings is not None:
            events.findings(findings, points.measured, points.wall)
    finally:
        events.close()
    for path in earlier:  # the new file is whole; only now let the old ones go
        os.remove(path)
    return folder


# -- MLflow -----------------------------------------------------------------------------------
def _key(tag: str) -> str:
    """A tag as MLflow takes a metric key: its characters, no '.' or '..' parts, 250 long."""
    parts = [_UNSAFE.sub("_", part) for part in tag.split("/")]
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)[:250]


def _artifacts_beside(tracking_uri: str) -> str | None:
    """Where a new experiment's artifacts go for a tracking store in a SQLite file: a
    folder beside the file (``mlflow.db`` -> ``mlflow-artifacts/``), since MLflow's own
    default is ``./mlruns`` in whatever folder the export ran from. None elsewhere: a
    tracking server keeps its artifacts where it was told to."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return database.with_name(f"{database.stem}-artifacts").as_uri()


class _MlflowRun:
    """One MLflow run, written through MLflow's own client; metrics go in batches."""

    BATCH = 1000  # the most metrics MLflow takes in one log_batch
    EVERY = 2.0  # seconds a live run's metrics may wait before they are sent

    def __init__(self, tracking_uri: str | None, experiment: str, run_name: str | None,
                 tags: dict[str, str]):
        tracking = optional("mlflow.tracking", "trackers", _MLFLOW)
        self.entities = optional("mlflow.entities", "trackers", _MLFLOW)
        self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else \
            self.client.create_experiment(
                experiment, artifact_location=_artifacts_beside(self.client.tracking_uri))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name,
                                             tags=tags).info.run_id
        self.pending: list[Any] = []
        self.sent_at = time.monotonic()

    def scalar(self, tag: str, value: float, step: int, wall: float) -> None:
        self.pending.append(self.entities.Metric(key=_key(tag), value=value,
                                                 timestamp=int(wall * 1000), step=step))
        if len(self.pending) >= self.BATCH:
            self.flush()

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() - self.sent_at >= self.EVERY

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:self.BATCH], self.pending[self.BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)
        self.sent_at = time.monotonic()

    def findings(self, findings: list[Any], step: int = 0, wall: float = 0.0) -> None:
        self.client.log_dict(self.run_id, _findings(findings), "findings.json")
        self.client.log_text(self.run_id, _findings_text(findings) + "\n", "findings.md")
        said = "; ".join(f"{f.what} at {f.where} since step {f.since}" for f in findings)
        self.client.set_tag(self.run_id, "somatize.findings", said[:5000] or "none")

    def close(self, status: str = "FINISHED") -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)


def export_mlflow(store: Any, run: str, *, tracking_uri: str | None = None,
                  experiment: str = EXPERIMENT, findings: list[Any] | None = None) -> str:
    """Logs a run to MLflow as a new MLflow run in ``experiment`` and answers its id.

    ``tracking_uri`` is MLflow's (``sqlite:///mlflow.db``, ``http://host:5000``); None
    is MLflow's own default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` here).
    The MLflow run is named after the run and tagged ``somatize.run`` and
    ``somatize.store``; each export makes a new one. ``findings`` (as for
    ``export_tensorboard``) are logged as artifacts and a tag. Needs mlflow (the
    ``trackers`` extra).
    """
    listed(store, check_run(run))
    logged = _MlflowRun(tracking_uri, experiment, run, {
        "somatize.run": run, "somatize.store": str(getattr(store, "where", store))})
    status = "FAILED"
    try:
        _replay(store, run, _Points(logged.scalar, counting=False))
        if findings is not None:
            logged.findings(findings)
        status = "FINISHED"
    finally:
        logged.close(status)
    return logged.run_id


# -- live -------------------------------------------------------------------------------------
class _Streaming:
    """What a live watcher holds: the points, where they go, and whether it is closed."""

    def __init__(self, sink: Any, judge: Callable[[list], list] | None):
        self.sink, self.judge = sink, judge
        self.points = _Points(sink.scalar, counting=True)
        self.lock = threading.Lock()
        self.closed = False

    def take(self, fact: Any) -> None:
        with self.lock:
            if self.closed:
                return  # after close (or at exit) nothing more is written
            self.points.take(fact)
            if getattr(self.sink, "due", lambda: False)():
                self.sink.flush()

    def flush(self) -> None:
        with self.lock:
            if not self.closed:
                self.sink.flush()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.points.end()
            if self.points.health and self.judge is not None:
                self.sink.findings(self.judge(self.points.health), self.points.measured,
                                   self.points.wall)
            self.sink.close()


class Streaming:
    """A watcher that writes a run to a tracker while it trains (``to_tensorboard``,
    ``to_mlflow``): pass it in ``watching`` beside a Recorder.

    What a forward took is written when the next one begins; the findings when it is
    closed, or when the interpreter exits if nobody closed it.
    """

    __slots__ = ("__weakref__", "_done", "_held", "where")

    def __init__(self, sink: Any, where: str, judge: Callable[[list], list] | None = None):
        self._held = _Streaming(sink, judge)
        self.where = where
        self._done = weakref.finalize(self, self._held.close)

    def __call__(self, fact: dict[str, Any]) -> None:
        self._held.take(fact)

    def flush(self) -> None:
        """Sends on whatever the tracker's writer still holds."""
        self._held.flush()

    def close(self) -> None:
        """Writes the last forward and the findings, and closes the writer."""
        self._done()

    def __enter__(self) -> Streaming:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Streaming({self.where!r})"


def to_tensorboard(directory: Any, *, flush_secs: float = 2.0,
                   judge: Callable[[list], list] | None = None) -> Streaming:
    """A watcher that writes a run into ``directory`` as TensorBoard event files while it
    trains (``directory`` is the run's own folder, as for torch's ``SummaryWriter``).

    ``flush_secs`` is how stale TensorBoard's view may be. Needs tensorboard (the
    ``trackers`` extra), not torch.
    """
    if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) \
            or not math.isfinite(flush_secs) or flush_secs <= 0:
        raise ValueError(f"flush_secs is a number of seconds above 0, not {flush_secs!r}")
    folder = os.fspath(directory)
    return Streaming(_EventFile(folder, flush_secs), folder, judge)


def to_mlflow(*, tracking_uri: str | None = None, experiment: str = EXPERIMENT,
              run_name: str | None = None,
              judge: Callable[[list], list] | None = None) -> Streaming:
    """A watcher that logs a run to a new MLflow run while it trains, in batches at
    most two seconds old; ``run_name=recorder.run`` names it as the Recorder does.
    Needs mlflow (the ``trackers`` extra)."""
    logged = _MlflowRun(tracking_uri, experiment, run_name,
                        {"somatize.run": run_name} if run_name else {})
    return Streaming(logged, f"{logged.client.tracking_uri} run {logged.run_id}", judge)
