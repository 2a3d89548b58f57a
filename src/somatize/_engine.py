"""The one walk: a plan executed, node by node, here or through a broker.

A graph is compiled once per version into flat per-node arrays (the bound
``forward``, its Ctx, where its input comes from), so a forward costs a loop over
them and nothing that could be decided once per graph is decided again.

What crosses an edge is checked at the edge where it appears: data (None, bool,
int, float, str, bytes, list, tuple, dict) or an ``Opaque``; anything else is refused
naming the node and the two right answers. Values are held unwrapped, so the node
below and the caller both receive what was inside the ``Opaque``.

Remembering (``_remember``) and sending away (a broker's ``_run_slice``) are adapters
around this loop, not second walks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import _plan
from ._codec import DATA_TYPES
from ._errors import DeclarationError, EdgeError, Lost, NodeError, walk_error
from ._node import Ctx, Done, Opaque

__all__ = ["execute", "foresee", "program", "Program"]

_DATA = frozenset(DATA_TYPES)
ROOT, ONE, MANY = 0, 1, 2


class LostValue:
    """Stands where an output that stayed on a worker would be."""

    __slots__ = ("node", "host", "why")

    def __init__(self, node: str, host: str, why: str):
        self.node, self.host, self.why = node, host, why

    def read(self, reader: str) -> Any:
        raise walk_error(Lost(
            f"node {reader!r} reads the output of {self.node!r}, which stayed on host "
            f"{self.host!r}: {self.why}. Place {reader!r} on {self.host!r} too, or make "
            f"{self.node!r} answer with something that can travel (data, or an Opaque with a codec)",
            node=self.node, host=self.host,
        ))


class Program:
    """A graph compiled for walking. Thrown away whenever the graph changes."""

    def __init__(self, graph: Any):
        ids = graph.nodes()
        index = {n: i for i, n in enumerate(ids)}
        devices, hosts = graph._devices, graph._hosts
        self.graph = graph
        self.ids = ids
        self.index = index
        self.forwards = [graph._impl[n].forward for n in ids]
        self.ctxs = [Ctx(devices.get(n), n) for n in ids]
        self.gathers: list[tuple[int, Any]] = []
        for n in ids:
            preds = graph._preds[n]
            if not preds:
                self.gathers.append((ROOT, None))
            elif len(preds) == 1:
                self.gathers.append((ONE, index[preds[0]]))
            else:
                self.gathers.append((MANY, tuple((p, index[p]) for p in preds)))
        self.succs = [[index[s] for s in graph._succs[n]] for n in ids]
        self.hosts = hosts
        self.mapped = [n in graph._mapped for n in ids]
        self.cached = [n in graph._cached for n in ids]
        self.remembers = any(self.cached) or any(self.mapped)
        self.routes: dict[Any, Route] = {}
        self.memory: Any = None  # the static half of remembering, built on first use

    def route(self, nodes: Iterable[str] | None, here: bool) -> Route:
        key = (None if nodes is None else tuple(nodes), here)
        route = self.routes.get(key)
        if route is None:
            route = self.routes[key] = Route(self, key[0], here)
        return route


class Route:
    """Which nodes one walk runs, in what order, and which of them are sent away."""

    def __init__(self, prog: Program, nodes: tuple[str, ...] | None, here: bool):
        graph = prog.graph
        if nodes is None:
            chosen = None
            order = graph.topological_sort()
        else:
            for n in nodes:
                graph._known(n)
            chosen = set(nodes)
            order = [n for n in graph.topological_sort() if n in chosen]
        preds = {n: [p for p in graph._preds[n] if chosen is None or p in chosen] for n in order}
        hosts = {} if here else {n: h for n, h in prog.hosts.items() if chosen is None or n in chosen}
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
                self.segments.append(("away", [prog.index[n] for n in locals_],
                                      [_away(prog, r) for r in remotes]))
            else:
                run.extend(prog.index[n] for n in locals_)
        if run:
            self.segments.append(("here", run, None))
        self.away = any(kind == "away" for kind, _, _ in self.segments)
        self.sent = {n for kind, _, remotes in self.segments if kind == "away"
                     for away in remotes for n in away.nodes}
        # Predecessors outside the walk, which the caller has to hand in.
        self.outside = sorted({p for n in order for p in graph._preds[n]
                               if chosen is not None and p not in chosen})


def _split(step: _plan.Plan) -> tuple[list[str], list[_plan.Remote]]:
    if isinstance(step, _plan.Node):
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


class Away:
    """One Remote as the walk needs it: the slice, what it is handed, what it hands back."""

    def __init__(self, host: str, nodes: list[str], given: list[str], needs_input: bool,
                 wanted: list[str]):
        self.host, self.nodes, self.given = host, nodes, given
        self.needs_input, self.wanted = needs_input, wanted


def _away(prog: Program, remote: _plan.Remote) -> Away:
    graph = prog.graph
    nodes = _plan.node_ids(remote.plan)
    here = set(nodes)
    given: list[str] = []
    needs_input = False
    for n in nodes:
        preds = graph._preds[n]
        if not preds:
            needs_input = True
        for p in preds:
            if p not in here and p not in given:
                given.append(p)
    wanted = [n for n in nodes
              if not graph._succs[n] or any(s not in here for s in graph._succs[n])]
    return Away(remote.host, nodes, given, needs_input, wanted)


def program(graph: Any) -> Program:
    """The compiled form of a graph, built once per version of it."""
    prog = graph._compiled
    if prog is None:
        prog = graph._compiled = Program(graph)
    return prog


# -- facts ------------------------------------------------------------------------
def _emitter(watching: Any, stamping: dict[str, Any] | None) -> Callable[[dict], None] | None:
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


def _us() -> int:
    return time.perf_counter_ns() // 1000


# -- the edge check ---------------------------------------------------------------
def settle(value: Any, who: str) -> Any:
    """What may cross an edge, unwrapped; anything else refused at this edge."""
    while True:
        cls = type(value)
        if cls is Opaque:
            return value.value
        if cls in _DATA or isinstance(value, DATA_TYPES):
            return value
        if cls is Done:
            value = value.value
            continue
        where = "the input" if who is None else f"node {who!r}"
        said = "was given" if who is None else "returned"
        raise walk_error(EdgeError(
            f"{where} {said} a {cls.__module__}.{cls.__qualname__}, which cannot cross an "
            f"edge as it is: wrap it in Opaque(...) to pass it untouched, or convert it to "
            "data (None, bool, int, float, str, bytes, list, tuple, dict)"
        ))


# -- the walk ---------------------------------------------------------------------
def execute(graph: Any, input: Any = None, *, broker: Any = None, store: Any = None,
            watching: Any = None, stamping: dict[str, Any] | None = None,
            nodes: Iterable[str] | None = None, given: dict[str, Any] | None = None,
            want: Iterable[str] | None = None, here: bool = False,
            transposed: bool = False, framed: bool = True, since: int | None = None,
            opening: dict[str, Any] | None = None) -> Any:
    """Runs a graph (or the part of it named by ``nodes``) and returns its answer.

    ``given`` hands in values for predecessors outside ``nodes``; ``want`` says which
    outputs to answer with (as a dict) instead of the leaves; ``here`` runs every node
    in this process whatever its host (what a worker does with its slice).

    For whoever drives a graph in pieces (a trainer, stage by stage): ``transposed``
    walks ``nodes`` against their edges (see ``_transpose``); ``framed=False`` leaves
    out ``began``/``finished``, so that several walks make one forward in the record,
    with ``since`` (a ``perf_counter_ns`` reading) as the start their times count from;
    ``opening`` adds its pairs to the ``began`` fact alone (a trainer's step number).
    """
    if isinstance(broker, dict):  # {host: Worker}, as forward also takes it: made once
        from ._graph import as_broker

        broker = as_broker(broker)
    if transposed:
        from ._transpose import walk_back

        return walk_back(graph, nodes, given or {}, want or [], broker=broker, here=here,
                         emit=_emitter(watching, stamping), stamping=stamping,
                         since=time.perf_counter_ns() if since is None else since)
    prog = program(graph)
    route = prog.route(nodes, here)
    emit = _emitter(watching, stamping)
    value = settle(input, None)
    vals: list[Any] = [None] * len(prog.ids)
    if given:
        for node_id, v in given.items():
            vals[prog.index[graph._known(node_id)]] = settle(v, node_id)
    missing = [p for p in route.outside if not given or p not in given]
    if missing:
        raise DeclarationError(
            f"this part of the graph reads {', '.join(map(repr, missing))}, which it does "
            "not run; hand their values in with given={...}"
        )
    wanted = route.wanted if want is None else [prog.index[graph._known(n)] for n in want]

    memory = None
    if store is not None and prog.remembers:
        from ._remember import Memory

        memory = Memory.start(prog, route, input, store, wanted, emit)
    if route.away and broker is None:
        host = next(iter(seg[2][0].host for seg in route.segments if seg[0] == "away"))
        raise DeclarationError(
            f"this graph sends nodes to host {host!r} and no broker was given; say where it "
            f"is: forward(..., broker=Broker.embedded({{{host!r}: Worker.at('HOST:PORT')}}))"
        )

    forward_id = uuid.uuid4().hex if route.away else None
    began = time.perf_counter_ns() if since is None else since
    if emit is not None and framed:
        emit({"fact": "began", "at_us": time.time_ns() // 1000, **(opening or {})})
    try:
        if route.away:
            graph.provision(broker)
        for kind, order, remotes in route.segments:
            if kind == "here":
                _walk(prog, order, vals, value, memory, emit, began)
            else:
                _meanwhile(prog, order, remotes, vals, value, broker, memory, emit, began,
                           stamping, forward_id)
    except BaseException:
        if emit is not None and framed:
            emit({"fact": "finished", "took_us": (time.perf_counter_ns() - began) // 1000,
                  "failed": True})
        raise
    if emit is not None and framed:
        emit({"fact": "finished", "took_us": (time.perf_counter_ns() - began) // 1000})
    if want is not None:
        return {prog.ids[i]: _read(vals[i], prog.ids[i]) for i in wanted}
    if len(wanted) == 1:
        return _read(vals[wanted[0]], "the caller")
    return {prog.ids[i]: _read(vals[i], "the caller") for i in wanted}


def _read(v: Any, reader: str) -> Any:
    if type(v) is LostValue:
        v.read(reader)
    return v


def _walk(prog: Program, order: list[int], vals: list[Any], value: Any, memory: Any,
          emit: Callable[[dict], None] | None, began: int) -> None:
    """Runs these nodes here, in order. The hot loop: keep it plain."""
    forwards, ctxs, gathers, ids = prog.forwards, prog.ctxs, prog.gathers, prog.ids
    special = prog.mapped if memory is None else memory.special
    data = _DATA
    clock = time.perf_counter_ns
    last = (clock() - began) // 1000
    i = -1
    try:
        for i in order:
            if special[i]:
                if memory is None:
                    vals[i] = run_mapped(prog, i, _gather(prog, i, vals, value), emit, began)
                else:
                    vals[i] = memory.run(i, vals, value)
                continue
            kind, source = gathers[i]
            if kind == ONE:
                x = vals[source]
                if type(x) is LostValue:
                    x.read(ids[i])
            elif kind == ROOT:
                x = value
            else:
                x = _gather(prog, i, vals, value)
            if emit is None:
                out = forwards[i](x, ctxs[i])
            else:
                # One clock reading per node: each node's time runs from the end of the
                # one before, so a watcher's own cost for a fact is charged to the next
                # node. Watchers of `ran` are appends; the price of a second reading
                # would be a third of the whole watched walk.
                out = forwards[i](x, ctxs[i])
                now = (clock() - began) // 1000
                emit({"fact": "ran", "node": ids[i], "began_us": last, "took_us": now - last})
                last = now
            cls = type(out)
            if cls is Opaque:
                out = out.value
            elif cls not in data:
                out = settle(out, ids[i])
            vals[i] = out
    except Exception as exc:
        if getattr(exc, "_soma_walk", False):  # the walk's own refusal, already named
            raise
        raise _failed(prog, i, exc, emit) from exc


def _gather(prog: Program, i: int, vals: list[Any], value: Any) -> Any:
    """The input of node ``i``: the graph's input, its one predecessor's value, or a map."""
    kind, source = prog.gathers[i]
    if kind == ROOT:
        return value
    if kind == ONE:
        x = vals[source]
        if type(x) is LostValue:
            x.read(prog.ids[i])
        return x
    out = {}
    for pred, at in source:
        x = vals[at]
        if type(x) is LostValue:
            x.read(prog.ids[i])
        out[pred] = x
    return out


def _failed(prog: Program, i: int, exc: BaseException, emit: Any) -> NodeError:
    node = prog.ids[i]
    kind = type(exc).__name__
    if emit is not None:
        emit({"fact": "failed", "node": node, "error": f"{kind}: {exc}"})
    impl = type(prog.graph._impl[node]).__qualname__
    error = NodeError(f"node {node!r} ({impl}) raised {kind}: {exc}", node=node, kind=kind)
    return error


def run_mapped(prog: Program, i: int, items: Any, emit: Any, began: int,
               forward: Callable[[list], Any] | None = None) -> list[Any]:
    """A ``.mapped()`` node: a list in, a list as long out, checked both ways."""
    node = prog.ids[i]
    if not isinstance(items, list):
        raise walk_error(EdgeError(
            f"node {node!r} is .mapped() and takes a list, but was handed a "
            f"{type(items).__qualname__}; give it a list, or drop .mapped()"
        ))
    start = time.perf_counter_ns()
    out = (forward or (lambda xs: prog.forwards[i](xs, prog.ctxs[i])))(items)
    end = time.perf_counter_ns()
    out = settle(out, node)
    if emit is not None:
        emit({"fact": "ran", "node": node, "began_us": (start - began) // 1000,
              "took_us": (end - start) // 1000, "items": len(items)})
    if not isinstance(out, list) or len(out) != len(items):
        what = f"{len(out)} items" if isinstance(out, list) else f"a {type(out).__qualname__}"
        raise walk_error(EdgeError(
            f"node {node!r} is .mapped(): handed {len(items)} items it answered with {what}; "
            "a mapped node answers with a list as long as its input, item for item"
        ))
    return out


def _meanwhile(prog: Program, order: list[int], remotes: list[Away], vals: list[Any],
               value: Any, broker: Any, memory: Any, emit: Any, began: int,
               stamping: Any, forward_id: str) -> None:
    """A wave with Remotes in it: they go out concurrently, local nodes run meanwhile.

    The broker's side of the contract: ``_run_slice(host, graph, nodes, given=,
    input=, needs_input=, wanted=, watching=, stamping=, forward=)`` runs ``nodes``
    (in that order) on ``host`` and returns an outcome with ``values`` (what came
    back, by node), ``lost`` (node -> why it could not travel) and ``facts``. A
    value in ``given`` may be a LostValue: the broker resolves it where it stayed,
    or raises Lost.
    """
    def job(away: Away) -> tuple[Any, Exception | None]:
        given = {p: vals[prog.index[p]] for p in away.given}
        try:
            return broker._run_slice(away.host, prog.graph, away.nodes, given=given,
                                     input=value, needs_input=away.needs_input,
                                     wanted=away.wanted, watching=emit is not None,
                                     stamping=stamping, forward=forward_id), None
        except Exception as exc:  # raised below, once what the worker saw is told
            return None, exc

    if len(remotes) == 1 and not order:
        settled = [job(remotes[0])]
    else:
        with ThreadPoolExecutor(max_workers=len(remotes)) as pool:
            futures = [pool.submit(job, away) for away in remotes]
            if order:
                _walk(prog, order, vals, value, memory, emit, began)
            settled = [f.result() for f in futures]
    failure = None
    for away, (outcome, error) in zip(remotes, settled):
        if error is not None:
            failure = failure or error
            if emit is not None:
                for fact in getattr(error, "facts", ()):
                    emit(fact)
            continue
        for node_id in away.wanted:
            at = prog.index[node_id]
            if node_id in outcome.values:
                vals[at] = outcome.values[node_id]
            else:
                why = outcome.lost.get(node_id, "it did not come back")
                vals[at] = LostValue(node_id, away.host, why)
        if emit is not None:
            for fact in outcome.facts:
                emit(fact)
    if failure is not None:
        raise failure


def foresee(graph: Any, input: Any = None, *, store: Any = None) -> dict[str, Any]:
    """What ``forward`` would call each output, and what it would not run, with nothing
    executed. Without a store nothing is named."""
    if store is None:
        return {"keys": {}, "unneeded": []}
    from ._remember import foreseen

    return foreseen(program(graph), input, store)
