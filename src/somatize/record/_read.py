"""Reading a run back: its forwards, their facts, and the sums over them.

Listing a run is one scan of names (``store.bound``), which also hands over each
binding's meta; that is where a summarised fact is read from, so a curve over ten
thousand forwards opens no record at all. Everything per node opens every record
of the run, once.

A store is written by many hands, so a reader of a whole run never falls over one
record it cannot read: it reads the rest, and ``damaged`` says which records it left
out and why. Only a reader of one named forward (``facts``) refuses a damaged one,
saying why, since that forward is all it was asked for.
"""

from __future__ import annotations

import bisect
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import CorruptObject, CorruptRecord, RecordError
from .._version import __version__
from ..store import Bound
from ..store._store import answers_unbound
from ._recorder import EACH, FORMAT, PER_OBJECT, check_run, flush_pending, forward_name

__all__ = ["Run", "Tally", "batches_begin", "curve", "damaged", "damaged_reason", "facts", "forwards",
           "forwards_of", "nodes", "readable", "run_of", "runs", "tally"]


@dataclass(frozen=True)
class Run:
    """One run in a store, as its names tell it: no record opened."""

    name: str
    forwards: int
    first: float  # when its first forward was bound, epoch seconds
    last: float  # when its last one was
    summary: dict[str, Any] = field(default_factory=dict)  # the latest summarised values


def forwards_of(bound: Any, index: int) -> list[tuple[int, Any]]:
    """``(forward, Bound)`` for each forward one binding at ``index`` holds: itself for a
    record of one forward; for a batch, one Bound a forward, named as that forward
    would be and with that forward's summary as its meta."""
    return [(index + at, _part(bound, index, at, each))
            for at, each in enumerate(_summaries(bound))]


def _summaries(bound: Any) -> list[Any]:
    """One entry per forward a binding holds: its summary in a batch, None for a
    binding that is one forward's record."""
    each = bound.meta.get(EACH) if type(bound.meta) is dict else None
    # A count is what the meta claims, not what the record holds: one past what a Recorder
    # writes in a batch is not a Recorder's, and is not believed (10**12 would be a
    # list of 10**12 Bounds); the binding is then the one forward it is named after.
    if type(each) is int and 0 < each <= PER_OBJECT:  # a batch of a run summarising nothing
        return [{}] * each
    if type(each) is not list or not 0 < len(each) <= PER_OBJECT:
        return [None]
    return each


def _part(bound: Any, index: int, at: int, summary: Any) -> Any:
    """The Bound of the forward ``at`` places into the binding ``bound`` at ``index``."""
    if summary is None:  # the binding is that forward's own record
        return bound if type(bound.meta) is dict else Bound(bound.name, bound.digest, {},
                                                            bound.when)
    stem = bound.name[:bound.name.rfind("/") + 1]
    return Bound(f"{stem}{index + at}", bound.digest,
                 summary if type(summary) is dict else {}, bound.when)


def _in_a_batch(store: Any, name: str) -> Any:
    """The Bound of forward ``n`` for a name ``run/<run>/<n>`` nobody bound, where it is
    inside a batch bound under an earlier index (as ``forwards_of`` names it); None
    where no batch holds it. Registered with the store (``answers_unbound``), so that
    ``store.resolve(f"run/{r.run}/{n}")`` answers every forward, batched or not.

    Where the run's batches begin is remembered from one listing of the run; after
    that a forward costs one read of the batch that holds it, and a forward past the
    run's end (what somebody following the run asks for next) one read of the last
    batch: nothing can start between its end and that forward, or it would be bound."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "run" or not (parts[2].isdigit() and parts[2].isascii()):
        return None
    if getattr(_looking, "on", False):  # its own read of a batch that is gone: no further
        return None
    _looking.on = True
    try:
        return _holding(store, parts[1], int(parts[2]))
    finally:
        _looking.on = False


def _holding(store: Any, run: str, index: int) -> Any:
    """``_in_a_batch`` for forward ``index`` of ``run``: from the batch known to begin
    nearest below it, walking on batch by batch (each begins where the last ends), and
    from one listing of the run where nothing is known or the walk is long."""
    where = (str(getattr(store, "where", id(store))), run)
    with _lock:
        starts = _starts.get(where, [])
        at = starts[bisect.bisect_right(starts, index) - 1] if starts and starts[0] <= index else None
    for _ in range(_WALK if at is not None else 0):
        batch = store.resolve(forward_name(run, at))
        if batch is None:  # what was remembered is gone: list the run afresh
            break
        _begins(where, at)
        each = _summaries(batch)  # what it holds, told by its meta; one Bound made
        end = at + len(each)
        if index < end:
            return _part(batch, at, index - at, each[index - at])
        if end == index:  # the next batch would begin here, and this name is not bound
            return None
        at = end
    listed = _indexed_bindings(store.bound(f"run/{run}"), f"run/{run}")
    with _lock:
        _starts[where] = [at for at, _ in listed]
        _starts.move_to_end(where)
        while len(_starts) > _STARTS_KEPT:
            _starts.popitem(last=False)
    for at, batch in reversed(listed):
        if at <= index:
            each = _summaries(batch)
            return _part(batch, at, index - at, each[index - at]) if index - at < len(each) else None
    return None


def _begins(where: tuple[str, str], at: int) -> None:
    """Remembers that a batch of the run ``where`` names begins at ``at``."""
    with _lock:
        starts = _starts.setdefault(where, [])
        if at not in starts:
            bisect.insort(starts, at)
        _starts.move_to_end(where)


def batches_begin(store: Any, run: str, indices: Any) -> None:
    """Says where some of a run's batches begin, as a reader that has read them knows
    (``web.Following``), so that resolving a forward of the run past them lists
    nothing: the batch that holds the last is read again instead."""
    where = (str(getattr(store, "where", id(store))), run)
    for at in indices:
        _begins(where, at)


def _indexed_bindings(bounds: list[Any], prefix: str) -> list[tuple[int, Any]]:
    """``(index, binding)`` for each binding ``prefix/<digits>``, by index."""
    cut = len(prefix) + 1
    found = [(int(bound.name[cut:]), bound) for bound in bounds
             if bound.name[cut:].isdigit() and bound.name[cut:].isascii()]
    found.sort(key=lambda pair: pair[0])
    return found


def _indexed(bounds: list[Any], prefix: str) -> list[tuple[int, Any]]:
    """The forwards of a run (bindings ``prefix/<digits>``, batches opened up), in order."""
    out = []
    cut = len(prefix) + 1
    for bound in bounds:
        rest = bound.name[cut:]
        if rest.isdigit() and rest.isascii():
            out.extend(forwards_of(bound, int(rest)))
    out.sort(key=lambda pair: pair[0])
    return out


def _run(name: str, listed: list[tuple[int, Any]]) -> Run:
    summary: dict[str, Any] = {}
    for _, bound in listed:
        for key, value in bound.meta.items():
            if value is not None:
                summary[key] = value
    whens = [bound.when for _, bound in listed
             if isinstance(bound.when, (int, float)) and math.isfinite(bound.when)]
    return Run(name, len(listed), min(whens, default=math.nan), max(whens, default=math.nan),
               summary)


def runs(store: Any) -> list[Run]:
    """Every run this store holds, sorted by name (default names sort by time)."""
    grouped: dict[str, list[tuple[int, Any]]] = {}
    for bound in store.bound("run"):
        parts = bound.name.split("/")
        if len(parts) == 3 and parts[2].isdigit() and parts[2].isascii():
            grouped.setdefault(parts[1], []).extend(forwards_of(bound, int(parts[2])))
    return [_run(name, sorted(grouped[name], key=lambda pair: pair[0])) for name in sorted(grouped)]


def run_of(store: Any, run: str) -> Run:
    """One run as its names tell it; an unknown run is refused."""
    return _run(run, listed(store, run))


def _no_run(store: Any, run: str) -> RecordError:
    known = [r.name for r in runs(store)]
    if not known:
        said = "it holds no runs yet (a Recorder(store) writes one)"
    else:
        shown = ", ".join(repr(n) for n in known[-10:])
        more = f" and {len(known) - 10} older" if len(known) > 10 else ""
        said = f"its runs are {shown}{more}"
    return RecordError(f"the store at {_where(store)} has no run {run!r}; {said}")


def _where(store: Any) -> str:
    return str(getattr(store, "where", store))


def listed(store: Any, run: str) -> list[tuple[int, Any]]:
    """``(forward, Bound)`` for every forward of a run, in order; an unknown run is refused."""
    prefix = f"run/{check_run(run)}"
    flush_pending(store, run)
    found = _indexed(store.bound(prefix), prefix)
    if not found:
        raise _no_run(store, run)
    return found


def forwards(store: Any, run: str) -> int:
    """How many forwards a run has recorded."""
    return len(listed(store, run))


def read(store: Any, bound: Any) -> dict[str, Any]:
    """One forward's record, checked: JSON, a dict, and of a format this somatize reads;
    of a batch, the forward ``bound`` is named after."""
    record = _parsed(store, bound)
    if "forwards" not in record:
        return record
    index = int(bound.name[bound.name.rfind("/") + 1:])
    first, held = record.get("forward"), record["forwards"]
    at = index - first if type(first) is int else -1
    if not 0 <= at < len(held) or type(held[at]) is not list:
        raise CorruptRecord(
            f"record {bound.name} in {_where(store)} is a batch (the object {bound.digest}) "
            f"that does not hold forward {index}; it was not written by a Recorder")
    return {"format": record["format"], "run": record.get("run"), "forward": index,
            "facts": held[at]}


def _parsed(store: Any, bound: Any) -> dict[str, Any]:
    """The record or batch ``bound`` points at, checked; the last few are kept, so that
    reading a batch's forwards one after another parses it once."""
    with _lock:
        record = _recent.get(bound.digest)
    if record is not None:
        return record
    data = store.get(bound.digest)
    if data is None:
        raise RecordError(
            f"record {bound.name} points at {bound.digest}, which the store at "
            f"{_where(store)} does not have; the record is lost — bind the name again or remove it"
        )
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptRecord(
            f"record {bound.name} in {_where(store)} is not JSON (the object {bound.digest}: "
            f"{type(exc).__name__}: {exc}); it was not written by a Recorder — bind that "
            "name to a record, or remove it"
        ) from None
    version = record.get("format") if type(record) is dict else None
    if type(version) is int and version > FORMAT:
        raise RecordError(
            f"record {bound.name} was written in record format {version}, and this somatize "
            f"({__version__}) reads formats up to {FORMAT}; upgrade somatize to read it"
        )
    if type(version) is not int or version < 1 or type(
            record.get("forwards" if version >= 2 else "facts")) is not list:
        raise CorruptRecord(
            f"record {bound.name} in {_where(store)} is JSON but not a record (a record is "
            '{"format": 2, "run": ..., "forward": i, "forwards": [[...], ...]}, or of format '
            f'1 {{"format": 1, "run": ..., "forward": i, "facts": [...]}}, and the object '
            f"{bound.digest} is neither); it was not written by a Recorder"
        )
    with _lock:
        _recent[bound.digest] = record
        while len(_recent) > 4:
            _recent.pop(next(iter(_recent)))
    return record


_lock = threading.Lock()
# (where, run) -> the indices its batches are bound at, as last listed; most recent last
_starts: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
_STARTS_KEPT = 256
_WALK = 8  # batches walked on, one read each, before the run is listed instead
_looking = threading.local()  # .on while this thread looks for the batch holding a forward
_recent: dict[str, dict[str, Any]] = {}  # digest -> record: a digest names the bytes for good
# (store, name, digest) -> why that record could not be read. Kept by digest too, so a
# name bound again to a good record is no longer said to be damaged.
_damage: OrderedDict[tuple[str, str, str], str] = OrderedDict()
_DAMAGE_KEPT = 10_000


def readable(store: Any, bound: Any) -> dict[str, Any] | None:
    """One forward's record as ``read`` answers it, or None for one that cannot be read
    (not JSON, not a record, lost, of bytes that are not theirs): then ``damaged`` says
    why. A store that cannot be reached at all still raises: that is not one record."""
    try:
        return read(store, bound)
    except (RecordError, CorruptObject) as exc:
        _note(store, bound, str(exc))
        return None


def _note(store: Any, bound: Any, why: str) -> None:
    with _lock:
        _damage[(_where(store), bound.name, bound.digest)] = why
        while len(_damage) > _DAMAGE_KEPT:
            _damage.popitem(last=False)


def damaged_reason(store: Any, bound: Any) -> str:
    """Why ``readable`` answered None for ``bound``."""
    with _lock:
        return _damage.get((_where(store), bound.name, bound.digest), "it could not be read")


def damaged(store: Any, run: str) -> dict[str, str]:
    """``{record name: why}`` for the records of a run that a reader found it could not
    read and left out (only those read so far: a curve read from names opens none)."""
    where = _where(store)
    with _lock:
        if not _damage:
            return {}
        said = {(name, digest): why for (at, name, digest), why in _damage.items() if at == where}
    out = {}
    for _, bound in listed(store, run):
        why = said.get((bound.name, bound.digest))
        if why is not None:
            out[bound.name] = why
    return out


def facts(store: Any, run: str, forward: int) -> list[dict[str, Any]]:
    """The facts of one forward, in the order they were said; ``forward=-1`` is the last."""
    check_run(run)
    if type(forward) is not int:
        raise TypeError(f"forward is an index (an int), not a {type(forward).__qualname__}")
    flush_pending(store, run)
    bound = store.resolve(forward_name(run, forward)) if forward >= 0 else None
    if bound is not None:
        bound = forwards_of(bound, forward)[0][1]
    else:
        found = listed(store, run)
        count = len(found)
        if -count <= forward < 0:
            bound = found[forward][1]
        elif forward >= 0:  # inside a batch bound under an earlier index
            bound = dict(found).get(forward)
        if bound is None:
            raise RecordError(
                f"run {run!r} has forwards 0 to {count - 1} (or -{count} to -1 from the end); "
                f"there is no forward {forward}"
            )
    return read(store, bound)["facts"]


@dataclass
class Tally:
    """A run summed over all its records: per node, per host crossed, per forward."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    hops: dict[str, dict[str, int]] = field(default_factory=dict)
    forwards: int = 0
    took_us: int = 0  # all forwards, end to end
    first_took_us: int = 0  # the first of them, end to end: its warm-up is in it
    failed: int = 0  # forwards that raised
    damaged: dict[str, str] = field(default_factory=dict)  # records left out: name -> why
    evaluated: list[dict[str, Any]] = field(default_factory=list)  # each evaluation, in order


_NODE_COUNTS = ("ran", "recalled", "kept", "unneeded", "failed")


def _node(tally: Tally, node: str) -> dict[str, Any]:
    entry = tally.nodes.get(node)
    if entry is None:
        entry = tally.nodes[node] = {**dict.fromkeys(_NODE_COUNTS, 0), "items": 0,
                                     "total_us": 0, "mean_us": 0.0, "host": None,
                                     "forward_us": 0, "backward_us": 0, "first_us": 0}
    return entry


def _hop(tally: Tally, host: str) -> dict[str, int]:
    entry = tally.hops.get(host)
    if entry is None:
        entry = tally.hops[host] = dict.fromkeys(
            ("sent", "sent_bytes", "sent_us", "received", "received_bytes", "received_us"), 0)
    return entry


def _count(tally: Tally, fact: dict[str, Any], first: bool) -> None:
    """Sums one fact in; ``first``: it is of the run's first forward, whose time (its
    warm-up: allocations, compilation, caches filled) is kept apart from the rest."""
    kind = fact.get("fact")
    if kind == "ran" and fact.get("backward") and isinstance(fact.get("node"), str):
        entry = _node(tally, fact["node"])  # a trainer walked back through it: learning
        entry["learned"] = entry.get("learned", 0) + 1
        took = _int(fact.get("took_us"))
        entry["total_us"] += took
        entry["first_us" if first else "backward_us"] += took
    elif kind in _NODE_COUNTS and isinstance(fact.get("node"), str):
        entry = _node(tally, fact["node"])
        entry[kind] += 1
        if kind == "ran":
            took = _int(fact.get("took_us"))
            entry["total_us"] += took
            entry["first_us" if first else "forward_us"] += took
            entry["items"] += _int(fact.get("items"))
            if fact.get("host") is not None:
                entry["host"] = fact["host"]
    elif kind in ("sent", "received") and isinstance(fact.get("host"), str):
        entry = _hop(tally, fact["host"])
        entry[kind] += 1
        entry[f"{kind}_bytes"] += _int(fact.get("bytes"))
        entry[f"{kind}_us"] += _int(fact.get("took_us"))
    elif kind == "evaluated":
        tally.evaluated.append({k: v for k, v in fact.items() if k != "fact"})
    elif kind == "finished":
        took = _int(fact.get("took_us"))
        tally.took_us += took
        if first:
            tally.first_took_us += took
        tally.failed += bool(fact.get("failed"))


def _int(value: Any) -> int:
    """A count or a time from a fact; 0 for what cannot be one (a record may hold any
    JSON, and a sum must not fail on it)."""
    if type(value) is int:
        return value if -_HUGE < value < _HUGE else 0
    if isinstance(value, (int, float)) and math.isfinite(value) and -_HUGE < value < _HUGE:
        return int(value)
    return 0


_HUGE = 2**63


def tally(store: Any, run: str) -> Tally:
    """Every record of a run read once and summed."""
    out = Tally()
    found = listed(store, run)
    for forward, bound in found:
        record = readable(store, bound)
        if record is None:
            out.damaged[bound.name] = damaged_reason(store, bound)
            continue
        first = forward == found[0][0]
        for fact in record["facts"]:
            if type(fact) is dict:
                _count(out, fact, first)
        out.forwards += 1
    for entry in out.nodes.values():
        entry["mean_us"] = entry["total_us"] / entry["ran"] if entry["ran"] else 0.0
    return out


def nodes(store: Any, run: str) -> dict[str, dict[str, Any]]:
    """Per node, in the order first seen: how often it ``ran``, was ``recalled``,
    ``kept``, ``unneeded`` or ``failed``; the ``items`` a mapped node was handed;
    ``total_us`` spent running (and, for a node trained where it runs, learning: how
    often is ``learned``) and ``mean_us`` per time it ran; that total apart, as
    ``forward_us`` and ``backward_us`` after the run's first forward, and ``first_us``
    in it (its warm-up); the ``host`` it ran on (None for here)."""
    return tally(store, run).nodes


def points(store: Any, run: str, fact: str = "loss", field: str = "value") -> list[tuple[int, float]]:
    """``(forward, value)`` for each forward that said ``fact``, its last one, in order.

    A forward whose binding summarised the fact is read from its meta (None there
    means the forward never said it); only the others are opened. A record that cannot
    be read, or whose value is not a number, is left out (``damaged`` says why).
    """
    return series(store, run, [(fact, field)])[0]


def series(store: Any, run: str, wanted: Sequence[tuple[str, str]]) -> list[list[tuple[int, float]]]:
    """``points`` for each ``(fact, field)`` wanted, read in one pass over the run: a
    record opened for one of them is read for all."""
    if not all(type(fact) is str and type(field) is str for fact, field in wanted):
        raise TypeError("fact and field are names (str), e.g. curve(store, run, 'loss')")
    out: list[list[tuple[int, float]]] = [[] for _ in wanted]
    for forward, bound in listed(store, run):
        record: Any = _UNREAD
        for (fact, field), found in zip(wanted, out):
            if fact in bound.meta:
                value = bound.meta[fact]
                if isinstance(value, dict):
                    value = value.get(field)
                elif field != "value":
                    value = None
            else:
                if record is _UNREAD:
                    record = readable(store, bound)
                value = None if record is None else _last(record["facts"], fact, field)
            if value is None:
                continue
            number = _number(value)
            if number is None:
                _note(store, bound, f"record {bound.name} in {_where(store)}: the {fact!r} "
                                    f"fact's {field!r} is {_short(value)}, not a number; that "
                                    "forward is left out of the curve")
            else:
                found.append((forward, number))
    return out


_UNREAD = object()  # a record not opened yet (None is one that could not be read)


def _last(said: list[Any], fact: str, field: str) -> Any:
    for one in reversed(said):
        if type(one) is dict and one.get("fact") == fact:
            return one.get(field)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except (ValueError, OverflowError):  # a str that is no number; an int past a float
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def curve(store: Any, run: str, fact: str = "loss", *, field: str = "value") -> list[float]:
    """The values of one fact over a run, one per forward that said it, in forward order.

    ``field`` picks another number of the fact (``curve(store, run, "finished",
    field="took_us")``). Summarised facts are read from names alone.
    """
    return [value for _, value in points(store, run, fact, field)]


answers_unbound(_in_a_batch)
