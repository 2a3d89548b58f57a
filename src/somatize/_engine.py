"""A forward: which nodes run where, in what order, and what they are told.

``execute`` takes a graph's data form, works out the route of this walk (which nodes,
in which waves, which of them are sent away), and drives it: the nodes here through the
one loop (``_walk.walk``), the slices on other hosts through whatever ``Runner`` the
caller handed in, side by side with what runs here meanwhile. Remembering
(``_remember``) and walking a stage against its edges (``_transpose``) are hooks and
programs for that same loop, not second walks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from . import _plan
from ._errors import DeclarationError
from ._graph import hand_down
from ._node import Opaque
from ._remember import Memory, foreseen
from ._slices import Runner, Later, Shape, Slice, runner_of, fan_out, new_forward_id, spread
from ._transpose import backward, walk_back
from ._walk import LostValue, Mapping, Program, program, unwrapped, walk

__all__ = ["Pass", "execute", "foresee", "run_slice"]


class Route:
    """Which nodes one walk runs, in what order, and which of them are sent away."""

    def __init__(self, prog: Program, nodes: tuple[str, ...] | None, here: bool):
        data = prog.data
        if nodes is None:
            chosen = None
            order = list(data.order)
        else:
            for n in nodes:
                data.known(n)
            chosen = set(nodes)
            order = [n for n in data.order if n in chosen]
        preds = {n: [p for p in data.preds[n] if chosen is None or p in chosen] for n in order}
        hosts = {} if here else {n: h for n, h in data.hosts.items() if chosen is None or n in chosen}
        self.plan = _plan.distribute(_plan.waves(order, preds), hosts)
        self.order = [prog.index[n] for n in order]
        inside = set(self.order)
        # The values this walk hands back: leaves of the graph it covers, and whatever
        # a node outside it reads.
        self.wanted = [i for i in self.order
                       if not prog.succs[i] or any(s not in inside for s in prog.succs[i])]
        self.segments: list[tuple[str, Any, Any]] = []
        run: list[int] = []
        for step in self.plan.steps:
            locals_, remotes = _split(step)
            if remotes:
                if run:
                    self.segments.append(("here", run, None))
                    run = []
                shapes = [_away(data, r) for r in remotes]
                # each with the slots its given values are read from, found once
                self.segments.append(("away", [prog.index[n] for n in locals_],
                                      [(shape, [(p, prog.index[p]) for p in shape.given])
                                       for shape in shapes]))
            else:
                run.extend(prog.index[n] for n in locals_)
        if run:
            self.segments.append(("here", run, None))
        self.away = any(kind == "away" for kind, _, _ in self.segments)
        self.sent = {n for kind, _, remotes in self.segments if kind == "away"
                     for shape, _ in remotes for n in shape.nodes}
        # Predecessors outside the walk, which the caller has to hand in.
        self.outside = sorted({p for n in order for p in data.preds[n]
                               if chosen is not None and p not in chosen})
        self._picked: dict[tuple, list[int]] = {}
        self._index = prog.index

    def picked(self, want: Iterable[str], data: Any) -> list[int]:
        """The slots of the outputs a caller wants by name, found once per list of names."""
        key = tuple(want)
        found = self._picked.get(key)
        if found is None:
            found = self._picked[key] = [self._index[data.known(n)] for n in key]
        return found


def route(prog: Program, nodes: Iterable[str] | None, here: bool) -> Route:
    """The route of a walk over ``nodes`` (all of them for None), built once per program."""
    key = (None if nodes is None else tuple(nodes), here)
    found = prog.routes.get(key)
    if found is None:
        found = prog.routes[key] = Route(prog, key[0], here)
    return found


def _split(step: _plan.Plan) -> tuple[list[str], list[_plan.Remote]]:
    if isinstance(step, _plan.Step):
        return [step.id], []
    if isinstance(step, _plan.Remote):
        return [], [step]
    locals_: list[str] = []
    remotes: list[_plan.Remote] = []
    for part in step.steps:
        more, far = _split(part)
        locals_ += more
        remotes += far
    return locals_, remotes


def _away(data: Any, remote: _plan.Remote) -> Shape:
    """The shape of the slice one Remote sends: its nodes, what it is handed, what it
    hands back."""
    nodes = tuple(_plan.node_ids(remote.plan))
    here = set(nodes)
    given: list[str] = []
    needs_input = False
    for n in nodes:
        preds = data.preds[n]
        if not preds:
            needs_input = True
        for p in preds:
            if p not in here and p not in given:
                given.append(p)
    wanted = tuple(n for n in nodes
                   if not data.succs[n] or any(s not in here for s in data.succs[n]))
    return Shape(remote.host, data, nodes, tuple(given), needs_input, wanted)


# -- facts ------------------------------------------------------------------------
def emitter(watching: Any, stamping: dict[str, Any] | None) -> Callable[[dict], None] | None:
    """One callable telling every watcher each fact, with ``stamping``'s pairs added;
    None when nobody watches (the cheapest thing for the loop to test)."""
    if watching is None:
        return None
    watchers = list(watching) if isinstance(watching, (list, tuple)) else [watching]
    for w in watchers:
        if not callable(w):
            raise TypeError(f"watching takes callables (or a list of them); {w!r} is not one")
    if not watchers:
        return None
    if stamping:
        if not isinstance(stamping, dict) or not all(isinstance(k, str) for k in stamping):
            raise TypeError("stamping is a dict with str keys, e.g. {'epoch': '3'}")
        stamp = dict(stamping)

        def emit(fact: dict) -> None:
            for key, value in stamp.items():
                fact.setdefault(key, value)
            for w in watchers:
                w(fact)
        return emit
    if len(watchers) == 1:
        return watchers[0]

    def emit(fact: dict) -> None:
        for w in watchers:
            w(fact)
    return emit


# -- the walk ---------------------------------------------------------------------
def execute(graph: Any, input: Any = None, *, broker: Any = None, store: Any = None,
            watching: Any = None, stamping: dict[str, Any] | None = None) -> Any:
    """Runs a graph and returns what it produced: one forward, said ``began`` and
    ``finished`` to ``watching``. ``graph`` is a Graph or its data form. Whoever drives
    a graph in pieces (a part of it, a stage walked back) makes a ``Pass``."""
    with Pass(watching, stamping) as one:
        return one.run(graph, input, broker=broker, store=store)


class Pass:
    """One forward as the record sees it, run as one walk or several: its ``began`` and
    ``finished`` facts, said here and nowhere else, and the clock every walk's node
    times count from.

    ``opening`` adds its pairs to ``began`` (a trainer's step number); ``framed=False``
    says neither (a slice a host runs, or a walk back whose forward was said already).
    ``run`` walks the graph or the part of it named by ``nodes``, ``back`` walks
    ``nodes`` against their edges (``_transpose``); either answers a ``Later`` with
    ``later``, as soon as its first slices are out, so a pipeline runs its next piece
    meanwhile. ``close`` says ``finished`` (once); a ``with`` block does it for you.
    """

    __slots__ = ("_open", "emit", "since", "stamping")

    def __init__(self, watching: Any = None, stamping: dict[str, Any] | None = None, *,
                 opening: dict[str, Any] | None = None, framed: bool = True):
        self.emit = emitter(watching, stamping)
        self.stamping = stamping
        self.since = time.perf_counter_ns()
        self._open = framed and self.emit is not None
        if self._open:
            self.emit({"fact": "began", "at_us": time.time_ns() // 1000, **(opening or {})})

    def __enter__(self) -> Pass:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        self.close(failed=kind is not None)

    def close(self, failed: bool = False) -> None:
        """Says ``finished`` (with ``failed`` when the forward raised), once."""
        if self._open:
            self._open = False
            fact = {"fact": "finished", "took_us": (time.perf_counter_ns() - self.since) // 1000}
            if failed:
                fact["failed"] = True
            self.emit(fact)

    def run(self, graph: Any, input: Any = None, *, nodes: Iterable[str] | None = None,
            given: dict[str, Any] | None = None, want: Iterable[str] | None = None,
            broker: Any = None, store: Any = None, here: bool = False,
            later: bool = False) -> Any:
        """Walks ``graph`` (or the part of it named by ``nodes``) and answers its answer.

        ``given`` hands in values for predecessors outside ``nodes``; ``want`` says
        which outputs to answer with (as a dict) instead of the leaves; ``here`` runs
        every node in this process whatever its host (what a host does with its slice).
        """
        data = graph.data() if hasattr(graph, "data") else graph
        way = compiled(data, nodes, tuple(given) if given else (), want, here)
        return way.run(self, input, given.values() if given else (), broker, store, later)

    def back(self, graph: Any, nodes: Iterable[str] | None, given: dict[str, Any],
             want: Iterable[str], *, broker: Any = None, here: bool = False,
             later: bool = False) -> Any:
        """Walks ``nodes`` against their edges (``_transpose``); answers ``{node: what
        it gave back}`` for each node in ``want``."""
        data = graph.data() if hasattr(graph, "data") else graph
        return walk_back(data, nodes, given or {}, want or [], broker=broker, here=here,
                         one=self, later=later)


def compiled(data: Any, nodes: Iterable[str] | None, given: tuple[str, ...],
             want: Iterable[str] | None, here: bool) -> Walk:
    """The walk over ``nodes`` handed values for ``given``, answering ``want``: built
    once per graph and shape of walk (a trainer walks the same stages every step)."""
    key = ("walk", None if nodes is None else tuple(nodes), given,
           None if want is None else tuple(want), here)
    found = data.memo.get(key)
    if found is None:
        found = data.memo[key] = Walk(data, key[1], given, key[3], here)
    return found


class Walk:
    """One walk decided once: its route, the slot each value handed in goes to, the
    outputs it answers, and the shapes of the slices it sends away. ``run`` is then
    only what this time's values need. Whoever runs the same walk every step may hold
    one (``compiled``) and call ``run`` with the values in ``given``'s order."""

    __slots__ = ("away", "given", "hooked", "named", "prog", "route", "size", "slots", "wanted")

    def __init__(self, data: Any, nodes: tuple[str, ...] | None, given: tuple[str, ...],
                 want: tuple[str, ...] | None, here: bool):
        prog = self.prog = program(data)
        way = self.route = route(prog, nodes, here)
        index = prog.index
        self.slots = [index[n] if n in index else index[data.known(n)] for n in given]
        missing = [p for p in way.outside if p not in given]
        if missing:
            raise DeclarationError(
                f"this part of the graph reads {', '.join(map(repr, missing))}, which it does "
                "not run; hand their values in with given={...}"
            )
        self.given = given
        picked = way.wanted if want is None else way.picked(want, data)
        self.wanted = [(i, prog.ids[i]) for i in picked]
        self.named = want is not None
        self.away = way.away
        self.size = len(prog.ids)
        self.hooked = prog.remembers or prog.maps  # whether any node is more than a call

    def run(self, one: Pass, input: Any, values: Iterable[Any], broker: Any, store: Any,
            later: bool = False) -> Any:
        """Walks it once with these values (in ``given``'s order), as part of ``one``."""
        value = input.value if type(input) is Opaque else unwrapped(input, None)
        vals: list[Any] = [None] * self.size
        for at, node_id, v in zip(self.slots, self.given, values):
            vals[at] = v.value if type(v) is Opaque else unwrapped(v, node_id)
        hooks = None
        if self.hooked:
            prog = self.prog
            if store is not None and prog.remembers:
                hooks = Memory.start(prog, self.route, input, store,
                                     [i for i, _ in self.wanted], one.emit)
            elif prog.maps:
                hooks = Mapping(prog)
        if not self.away:
            if not later:  # all of it here (a host's slice, a stage): no stops
                prog, emit, since = self.prog, one.emit, one.since
                for _, order, _ in self.route.segments:
                    walk(prog, order, vals, value, hooks, emit, since)
                return self.answered(vals)
            return Later(self._segments(one, vals, value, None, hooks),
                         lambda: self.answered(vals))
        runner = runner_of(broker)
        if runner is None:
            host = next(seg[2][0][0].host for seg in self.route.segments if seg[0] == "away")
            raise DeclarationError(
                f"this graph sends nodes to host {host!r} and no broker was given; say "
                f"where it is: forward(..., broker=Broker.embedded({{{host!r}: "
                f"Worker.at('HOST:PORT')}})), or for a Trainer, Trainer(..., "
                f"workers={{{host!r}: Worker.at('HOST:PORT')}})"
            )
        if later:
            return Later(self._segments(one, vals, value, runner, hooks),
                         lambda: self.answered(vals))
        self._through(one, vals, value, runner, hooks)
        return self.answered(vals)

    def answered(self, vals: list[Any]) -> Any:
        """What a walk answers: the outputs asked for by name, or else its one output,
        or a map of its outputs."""
        if self.named:  # an output that stayed on a host is read (refused) by name
            return {node_id: v if type(v := vals[i]) is not LostValue else _read(v, node_id)
                    for i, node_id in self.wanted}
        if len(self.wanted) == 1:
            return _read(vals[self.wanted[0][0]], "the caller")
        return {node_id: _read(vals[i], "the caller") for i, node_id in self.wanted}

    def _through(self, one: Pass, vals: list[Any], value: Any, runner: Runner,
                 hooks: Any) -> None:
        """The walk's segments in order, each wave's slices out and read back before
        the next: what a caller that waits for the answer runs. It is ``_segments``
        without the generator, whose making and driving to its end cost a stage that is
        walked every step about a hundred opcodes."""
        prog = self.prog
        runner.prepare(prog.data)
        forward_id = new_forward_id()
        for kind, order, remotes in self.route.segments:
            if kind == "here":
                walk(prog, order, vals, value, hooks, one.emit, one.since)
            else:
                pieces, here = _wave(prog, order, remotes, vals, value, hooks, one, forward_id)
                _into_slots(prog, remotes, fan_out(runner, pieces, here), vals, one.emit)

    def _segments(self, one: Pass, vals: list[Any], value: Any, runner: Runner | None,
                  hooks: Any):
        """The walk's segments in order, as a generator that yields once a wave's slices
        are out, so that whoever drives it does more meanwhile (a pipeline)."""
        prog = self.prog
        forward_id = None
        if runner is not None:
            runner.prepare(prog.data)
            forward_id = new_forward_id()
        for kind, order, remotes in self.route.segments:
            if kind == "here":
                walk(prog, order, vals, value, hooks, one.emit, one.since)
            else:
                pieces, here = _wave(prog, order, remotes, vals, value, hooks, one, forward_id)
                _into_slots(prog, remotes, (yield from spread(runner, pieces, here)), vals, one.emit)


def _read(v: Any, reader: str) -> Any:
    if type(v) is LostValue:
        v.read(reader)
    return v


def _wave(prog: Program, order: list[int], remotes: list[tuple[Shape, list]], vals: list[Any],
          value: Any, hooks: Any, one: Pass, forward_id: str) -> tuple[list[Slice], Any]:
    """This time's slice of each shape in a wave, handed what it reads, and what runs
    here meanwhile (its nodes here, or None)."""
    emit, began, stamping = one.emit, one.since, one.stamping
    pieces = [Slice(shape, {p: vals[at] for p, at in slots}, value, emit is not None,
                    stamping, forward_id)
              for shape, slots in remotes]
    here = (lambda: walk(prog, order, vals, value, hooks, emit, began)) if order else None
    return pieces, here


def _into_slots(prog: Program, remotes: list[tuple[Shape, list]],
             answers: list[tuple[Any, Exception | None]], vals: list[Any], emit: Any) -> None:
    """What came back from a wave's slices, into their slots (a ``LostValue`` for an
    output that stayed where it was made); the first failure raised once every answer
    was read and every fact said."""
    failure = None
    index = prog.index
    for (shape, _), (outcome, error) in zip(remotes, answers):
        if error is not None:
            failure = failure or error
            if emit is not None:
                for fact in getattr(error, "facts", ()):
                    emit(fact)
            continue
        values = outcome.values
        for node_id in shape.wanted:
            if node_id in values:
                vals[index[node_id]] = values[node_id]
            else:
                why = outcome.lost.get(node_id, "it did not come back")
                vals[index[node_id]] = LostValue(node_id, shape.host, why)
        if emit is not None:
            for fact in outcome.facts:
                emit(fact)
    if failure is not None:
        raise failure


_UNWATCHED = Pass(framed=False)  # says nothing, so its clock is never read: one serves them all


def run_slice(graph: Any, piece: Slice, facts: list[dict]) -> dict[str, Any]:
    """A slice run by the host it was sent to, whatever carried it there: every node
    here, ``given`` as handed (its keys the shape's ``given``, in that order). Answers
    the wanted values; what it saw is appended to ``facts`` as it happens (so a failure
    still has them), without the forward's bracket, which the caller says."""
    one = Pass(facts.append, framed=False) if piece.watching else _UNWATCHED
    shape = piece.shape
    found = shape.memo.get("here")  # the shape's walk, here: a host runs it again and again
    if found is None or found[0] is not graph:
        way = (backward if shape.transposed else compiled)(
            graph, shape.nodes, shape.given, shape.wanted, True)
        found = shape.memo["here"] = (graph, way)
    if shape.transposed:
        return found[1].run(one, piece.given, None)
    return found[1].run(one, piece.input, piece.given.values(), None, None)


def foresee(graph: Any, input: Any = None, *, store: Any = None) -> dict[str, Any]:
    """What ``forward`` would call each output, and what it would not run, with nothing
    executed. Without a store nothing is named."""
    if store is None:
        return {"keys": {}, "unneeded": []}
    prog = program(graph.data())
    return foreseen(prog, route(prog, None, False), input, store)


hand_down(execute=execute, foresee=foresee, runner_of=runner_of)
