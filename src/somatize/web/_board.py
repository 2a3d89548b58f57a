"""What the pages show, worked out from a ``Following``: the runs, a run's state, and
the sections its report draws.

The light parts (the list of runs, a run's forward count and newest losses) are
worked out on every look and cost what changed since the last one. The sections
(progress, health, the graph, where the time went) are the report's own figures,
drawn again only once the run has moved, and no more often than ``DRAW_EVERY``
seconds or ``DRAW_SHARE`` times what drawing them took, so a long run that trains
is not drawn over and over. Everything is plain JSON data: a value that is not a
finite number is sent as None (a gap in a curve), or as text where it is said.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

from .._errors import CorruptObject, RecordError
from ..record import facts
from ..record._read import damaged
from ._follow import Following
from ._seen import Losses, Shape

__all__ = ["Board"]

DRAW_EVERY = 2.0  # seconds between two drawings of one run's sections, at least
DRAW_SHARE = 5  # ...and at least this many times what the last drawing took
DIAGNOSE_FOR = 0.3  # seconds a look at the list of runs may spend judging runs
LIVE_FOR = 10.0  # a run whose last forward is younger than this is shown as recording...
LIVE_AT_LEAST = 5.0  # ...or, once its pace is known, than this or STILL_AFTER bindings' time
STILL_AFTER = 10  # bindings' time without one after which a run is said to have stopped
RATE_OVER = 20  # forwards the rate is measured over


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None, all the way down."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _as_shown(value: Any) -> Any:
    """A number as the page says it: NaN and infinities as words, not as gaps."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf'
    return finite(value)


def _last_loss(said: list[Any]) -> Any:
    for fact in reversed(said):
        if type(fact) is dict and fact.get("fact") == "loss":
            value = fact.get("value")
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


class _Row:
    """One run in the list: its shape, its last loss, and its findings."""

    __slots__ = ("damaged", "findings", "judged", "loss", "shape", "version")

    def __init__(self, run: str) -> None:
        self.version = -1
        self.shape = Shape(run)
        self.loss: Any = None
        self.findings: list[dict[str, Any]] | None = None
        self.judged = -1  # the version the findings are of
        self.damaged: list[str] = []  # why records of it could not be read, as far as read


class _Drawn:
    __slots__ = ("at", "lock", "text", "took", "version")

    def __init__(self) -> None:
        self.version = -1
        self.text: str | None = None
        self.at = 0.0
        self.took = 0.0
        self.lock = threading.Lock()


class Board:
    """The pages' data over one store, shared by every open page."""

    def __init__(self, following: Following):
        self.following = following
        self._lock = threading.Lock()
        self._rows: dict[str, _Row] = {}
        self._losses: dict[str, Losses] = {}
        self._drawn: dict[str, _Drawn] = {}

    def _row(self, run: str) -> _Row:
        with self._lock:
            row = self._rows.get(run)
            if row is None:
                row = self._rows[run] = _Row(run)
            return row

    # -- the list of runs ------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        """Every run, the one begun last first: forwards, times, last loss, findings."""
        self.following.scan()
        rows = []
        for name, version in self.following.runs().items():
            row = self._row(name)
            if row.version != version:
                row.version = row.shape.update(self.following)
                loss = row.shape.run_now().summary.get("loss")
                # Not summarised: the last record says it, and only that one is opened.
                row.loss = loss if isinstance(loss, (int, float)) else \
                    _last_loss(_said(self.following, name, -1))
            rows.append((name, row, row.shape.run_now()))
        rows.sort(key=lambda seen: (_sortable(seen[2].first), seen[0]), reverse=True)
        self._judge([(name, row) for name, row, _ in rows])
        now = time.time()
        return [{"name": name, "forwards": run.forwards, "first": run.first, "last": run.last,
                 "ago": _ago(now, run.last),
                 "live": _live(now, run.last, row.shape.pace(RATE_OVER)),
                 "loss": _as_shown(row.loss), "findings": row.findings,
                 "damaged": self._damage(name, row)} for name, row, run in rows]

    def _damage(self, name: str, row: _Row) -> list[str]:
        row.damaged = list(damaged(self.following, name).values())
        return row.damaged[:5] + ([f"and {len(row.damaged) - 5} more"]
                                  if len(row.damaged) > 5 else [])

    def _judge(self, rows: list[tuple[str, _Row]]) -> None:
        """Brings the findings of the newest runs up to date, for a moment at most (and
        one run at least): the rest wait for the next look."""
        from ..health import diagnose

        until = time.monotonic() + DIAGNOSE_FOR
        for name, row in rows:
            if row.judged == row.version:
                continue
            version = row.version
            row.findings = [{"where": f.where, "what": f.what, "since": f.since}
                            for f in diagnose(self.following, name)]  # past damaged records
            row.judged = version
            if time.monotonic() > until:  # one run a look at least, however long it takes
                break

    def known(self, run: str) -> bool:
        return self.following.version(run) is not None

    # -- one run, as it goes ---------------------------------------------------------------
    def state(self, run: str, after: int = -1) -> dict[str, Any] | None:
        """A run now: its version, forwards, times, rate, last loss, and the losses of
        the forwards after ``after``. None for a run the store does not hold."""
        if self.following.follow(run) is None:
            return None
        row = self._row(run)
        version = row.shape.update(self.following)
        shape = row.shape.run_now()
        rate = row.shape.rate(RATE_OVER)
        losses = self._losses_of(run)
        points = losses.after(after)
        now = time.time()
        return {"run": run, "version": version, "forwards": shape.forwards, "first": shape.first,
                "last": shape.last, "ago": _ago(now, shape.last),
                "live": _live(now, shape.last, row.shape.pace(RATE_OVER)), "rate": rate,
                "loss": _as_shown(losses.last()), "points": [[i, finite(v)] for i, v in points]}

    def _losses_of(self, run: str) -> Losses:
        with self._lock:
            losses = self._losses.get(run)
            if losses is None:
                losses = self._losses[run] = Losses(run)
        losses.update(self.following)
        return losses

    def sections(self, run: str) -> tuple[int, str] | None:
        """``(version, JSON)`` of the run's sections, drawn again if due; None for a run
        the store does not hold. While another page draws them, the last drawing."""
        version = self.following.version(run)
        if version is None:
            return None
        with self._lock:
            drawn = self._drawn.setdefault(run, _Drawn())
        due = drawn.version != version and \
            time.monotonic() - drawn.at >= max(DRAW_EVERY, DRAW_SHARE * drawn.took)
        if (due or drawn.text is None) and drawn.lock.acquire(blocking=drawn.text is None):
            try:
                if drawn.version != version:
                    began = time.monotonic()
                    losses = self._losses_of(run).any()
                    drawn.text = json.dumps(
                        {"version": version, "sections": draw(self.following, run, losses=losses)},
                        allow_nan=False, separators=(",", ":"))
                    drawn.version = version
                    drawn.took = time.monotonic() - began
                    drawn.at = time.monotonic()
            finally:
                drawn.lock.release()
        return drawn.version, drawn.text


def _said(store: Any, run: str, forward: int) -> list[Any]:
    """A forward's facts; none for one whose record cannot be read (the list of runs
    says it is damaged, and lists the run all the same)."""
    try:
        return facts(store, run, forward)
    except (RecordError, CorruptObject):
        return []


def _ago(now: float, last: float) -> float | None:
    ago = now - last
    return max(0.0, ago) if math.isfinite(ago) else None


def _live(now: float, last: float, pace: float | None) -> bool:
    """Whether a run is still being recorded, as far as its names tell: its last binding
    is younger than ten times the run's own time between bindings (five seconds at
    least; ``LIVE_FOR`` before it has a pace), so a run that ended is said to have
    stopped within seconds, and a slow one is not, between two steps. A time that is
    no number (NaN) is not live."""
    within = LIVE_FOR if not pace else max(LIVE_AT_LEAST, STILL_AFTER * pace)
    return bool(now - last < within)


def _sortable(when: float) -> float:
    return when if math.isfinite(when) else -math.inf


def _figure(fig: Any) -> Any:
    return json.loads(fig.to_json())  # plotly's encoder turns NaN into null already


def draw(store: Any, run: str, *, losses: bool = True) -> list[dict[str, Any]]:
    """The report's sections of a run as plain data: a title, and a figure, a note, or
    (for health) the findings with their advice. ``losses`` says whether the run has
    any loss to draw (the caller knows it already)."""
    try:
        from ..record import progress, spent

        import plotly  # noqa: F401  (progress and spent import it only when they draw)
    except ImportError:
        return [{"key": "progress", "title": "Progress",
                 "note": "Drawing needs plotly, which is not installed: pip install 'somatize[web]'."}]
    from ..health import diagnose, drawing, history, panel

    if losses:
        out = [{"key": "progress", "title": "Progress", "figure": _figure(progress(store, run))}]
    else:
        out = [{"key": "progress", "title": "Progress",
                "note": "This run has no loss facts: a Trainer says one after every step, a "
                        "bare forward does not."}]
    found = diagnose(store, run)
    health: dict[str, Any] = {"key": "health", "title": "Health",
                              "findings": [_finding(f) for f in found]}
    if history(store, run):
        health["figure"] = _figure(panel(store, run, found))
    else:
        health["note"] = "This run has no health facts: a Trainer says them with auditing=True."
    out.append(health)
    graph = drawing()(store, run)
    if graph is None:
        out.append({"key": "graph", "title": "The graph",
                    "note": "This run did not describe its graph (a Trainer says it in its "
                            "first forward)."})
    else:
        out.append({"key": "graph", "title": graph[0], "figure": _figure(graph[1])})
    out.append({"key": "spent", "title": "Where the time went", "figure": _figure(spent(store, run))})
    found = damaged(store, run)  # after every section has read what it needed
    if found:
        out.append({"key": "damaged", "title": "Damaged records", "note": (
            f"{len(found)} record{'s' if len(found) != 1 else ''} of this run could not be "
            "read; what is drawn is the rest: " + "; ".join(list(found.values())[:10])
            + (f"; and {len(found) - 10} more" if len(found) > 10 else ""))})
    return out


def _finding(finding: Any) -> dict[str, Any]:
    advice = getattr(finding, "advice", None)  # newer than Finding: older ones have none
    return {"where": finding.where, "what": finding.what, "since": finding.since,
            "evidence": finding.brief,
            "advice": None if not advice else advice if isinstance(advice, str) else str(advice)}
