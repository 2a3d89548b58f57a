"""Slices of a graph that run somewhere else, as the walk sees them.

The walk never learns what a worker, a socket or a cluster is. A stretch of nodes on
another host is a ``Slice`` (plain data: its ``Shape`` — which nodes, what they are
handed, what is wanted back, decided once per walk — and this time's values), and
whoever can run it there is a ``Runner``: a small interface with
``prepare`` (tell every host what it will need, before the first node runs), ``run``
(one slice, answered by an ``Outcome``) and ``submit`` (start one now, read its answer
later, the way dask's scheduler is handed its ``submit``). The wire's Broker is one
runner; a cluster engine is another; the walk takes whichever it is handed.

The other half, a slice run by the host it was sent to, is the walk's own
(``_engine.run_slice``), shared by every transport.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Later", "Outcome", "Runner", "Shape", "Slice", "fan_out", "finish", "new_forward_id", "runner_of",
           "spread", "stands_for"]


@dataclass(slots=True, eq=False)  # compared and hashed by identity: runners key on it
class Shape:
    """What a slice is apart from its values: the host, the nodes, what is handed in
    and what is wanted back. Decided once per walk and sent again and again, so a
    runner may derive whatever it needs of it once (``memo``), keyed on the shape
    itself, and a transport may say it to its host once per connection.

    ``given`` names the predecessors outside the slice whose values it is handed;
    ``needs_input`` says it reads the graph's input; ``transposed`` walks the nodes
    against their edges (a stage's backward).
    """

    host: str
    data: Any  # the GraphData the slice is part of
    nodes: tuple[str, ...]
    given: tuple[str, ...] = ()
    needs_input: bool = False
    wanted: tuple[str, ...] = ()
    transposed: bool = False
    memo: dict = field(default_factory=dict)


@dataclass(slots=True)  # not frozen: a frozen one costs 4 µs more to make, per slice
class Slice:
    """One stretch of a graph for one host: its ``shape``, and this time's values.

    ``given`` holds the values of the shape's ``given`` predecessors (a ``LostValue``
    where one stayed on a host: the runner resolves it there, or raises ``Lost``);
    ``input`` is the graph's input, sent only if the shape needs it; ``forward`` ties
    the slices of one forward together (so what a host kept for it can be referred
    to).
    """

    shape: Shape
    given: Mapping[str, Any] = field(default_factory=dict)
    input: Any = None
    watching: bool = False
    stamping: Mapping[str, Any] | None = None
    forward: str | None = None


class Outcome:
    """What came back from a slice: values by node, what could not travel and why
    (node -> reason), and the facts seen there (with ``host`` set)."""

    __slots__ = ("facts", "lost", "values")

    def __init__(self, values: dict[str, Any], lost: dict[str, str], facts: list[dict]):
        self.values, self.lost, self.facts = values, lost, facts


# What ties the slices of one forward together: unique in this process for its life
# (a random start, then counted), without a random draw per forward.
_forwards = itertools.count(int.from_bytes(os.urandom(8), "big") << 64)


def new_forward_id() -> str:
    """A fresh id for one forward's slices: 32 hex digits, as a uuid's."""
    return f"{next(_forwards) & ((1 << 128) - 1):032x}"


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="somatize-slice")
        return _pool


class Runner:
    """Runs slices of a graph on the hosts it knows. Subclass it; override ``run``, and
    ``prepare`` and ``submit`` where the transport can do better than the defaults.

    ``ordered`` says that a host runs its slices in the order they were submitted,
    which a pipelined step needs (the default ``submit`` promises no order)."""

    ordered = False

    def prepare(self, data: Any) -> None:
        """Tells every host of a graph (its data form) what it will need, before the
        first node runs: the whole graph's share of each host, never half of it."""
        return None

    def run(self, piece: Slice) -> Outcome:
        """Runs one slice on its host and answers what came back."""
        raise NotImplementedError

    def submit(self, piece: Slice) -> Future:
        """Starts one slice and answers a Future of its Outcome. By default on a thread
        of a shared pool; a transport that can send now and read later overrides it."""
        return _shared_pool().submit(self.run, piece)

    def session(self, keeps: bool = False, shares: bool = False) -> Runner:
        """A runner whose slices run against state of their own on every host, apart
        from anybody else's; ``keeps`` says that state learns there (a trainer's), so
        losing it must be said, never made good from the first copy, and ``shares``
        that its slices may wait there for other clients' (a shared trainer's). A
        runner that keeps nothing apart answers itself."""
        return self

    def close(self) -> None:
        """Lets go of what this runner holds on its hosts (a session's state)."""
        return None


def fan_out(runner: Runner, pieces: list[Slice],
            meanwhile: Callable[[], None] | None = None) -> list[tuple[Outcome | None, Exception | None]]:
    """Every slice sent, ``meanwhile`` run here while they are out, every answer read:
    ``(outcome, None)`` or ``(None, error)`` per slice, in order, so a caller can tell
    what the others saw before raising the first error."""
    if len(pieces) == 1 and meanwhile is None:  # the common case: nothing to overlap
        try:
            return [(runner.run(pieces[0]), None)]
        except Exception as exc:
            return [(None, exc)]
    return finish(spread(runner, pieces, meanwhile))


def spread(runner: Runner, pieces: list[Slice], meanwhile: Callable[[], None] | None = None):
    """``fan_out`` as a generator that yields once, when every slice is out and
    ``meanwhile`` ran: whoever drives it may do more here before the answers are read
    (the next piece of a pipelined step). It returns what ``fan_out`` answers."""
    futures = []
    try:
        for piece in pieces:
            futures.append(runner.submit(piece))
        if meanwhile is not None:
            meanwhile()
    except BaseException:
        for future in futures:  # read, so none is left half-answered on its wire
            _answer_or_error(future)
        raise
    yield
    return [_answer_or_error(f) for f in futures]


def finish(generator: Any) -> Any:
    """Runs a generator to its end and answers what it returned."""
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value


class Later:
    """A walk whose slices are out and whose answers are not read yet: started when
    made, up to its first wait; ``result()`` reads what came back and finishes it."""

    __slots__ = ("_answer", "_rest", "_walking")

    def __init__(self, walking: Any, answer: Callable[[], Any]):
        self._rest, self._answer = walking, answer
        try:
            next(walking)
        except StopIteration:
            self._rest = None

    @property
    def waiting(self) -> bool:
        """Whether answers are still out (False for a walk that sent nothing away)."""
        return self._rest is not None

    def result(self) -> Any:
        if self._rest is not None:
            rest, self._rest = self._rest, None
            finish(rest)
        return self._answer()


def _answer_or_error(future: Future) -> tuple[Outcome | None, Exception | None]:
    try:
        return future.result(), None
    except Exception as exc:
        return None, exc


# -- a {host: Worker} map stands for a runner --------------------------------------------
# (the ``runners`` registry: who fills it is declared in ``_registries``)
_stand_ins: dict[type, Callable[[dict], Runner]] = {}
_makers: dict[type, Callable[[dict], Runner] | None] = {}  # a kind's, found once (forwards ask)


def stands_for(kind: type, make: Callable[[dict], Runner]) -> None:
    """Says that ``{host: kind}`` maps stand for the runner ``make(map)`` answers, so
    ``forward(broker={"gpu": Worker.at(...)})`` works; registered by the transport."""
    _stand_ins[kind] = make
    _makers.clear()  # a kind looked up before may now find a maker through its bases


def runner_of(broker: Any) -> Runner | None:
    """The runner a caller handed in: one, or a ``{host: worker}`` map of a kind a
    transport registered."""
    if broker is None or isinstance(broker, Runner):
        return broker
    if isinstance(broker, dict):
        kinds = set(map(type, broker.values()))
        makers = {_maker(kind) for kind in kinds}  # each found once per kind
        if len(makers) == 1 and None not in makers:
            return makers.pop()(broker)
        named = ", ".join(sorted(kind.__qualname__ for kind in kinds)) or "nothing"
        raise TypeError(f"broker= maps hosts to {named}; map each host to a Worker "
                        "(Worker.at('HOST:PORT')), or pass a Broker")
    if callable(getattr(broker, "run", None)) and callable(getattr(broker, "prepare", None)):
        return broker
    raise TypeError(f"broker= takes a Broker or {{host: Worker}}, not a {type(broker).__qualname__}")


def _maker(kind: type) -> Callable[[dict], Runner] | None:
    make = _makers.get(kind)
    if make is None:
        make = _makers[kind] = next((_stand_ins[b] for b in kind.__mro__ if b in _stand_ins), None)
    return make

