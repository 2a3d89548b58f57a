"""The one way a node runs: a compiled program and the loop over it.

A graph is compiled once per data form into flat per-node arrays (the bound
``forward``, its Ctx, where its input comes from), so a walk costs a loop over them
and nothing that could be decided once per graph is decided again. ``walk`` is the
only place a node's ``forward`` is called: the plain forward, a remembered one, a
mapped one and the walk of a stage against its edges all go through it, and what
makes them differ is a ``Hooks`` object that is asked before and after the nodes it
marks as special (looked up, kept, handed only the missing items, walked through).

What crosses an edge is checked at the edge where it appears: data (None, bool, int,
float, str, bytes, list, tuple, dict) or an ``Opaque``; anything else is refused
naming the node and the two right answers. Values are held unwrapped, so the node
below and the caller both receive what was inside the ``Opaque``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._codec import DATA_TYPES
from ._errors import EdgeError, Lost, NodeError, walk_error
from ._graph import made_from
from ._node import Ctx, Done, Opaque

__all__ = ["FAR", "Hooks", "LostValue", "MANY", "ONE", "Program", "ROOT", "SKIP", "gather",
           "mapped_answer", "mapped_items", "program", "unwrapped", "walk"]

_DATA = frozenset(DATA_TYPES)
ROOT, ONE, MANY, FAR = 0, 1, 2, 3
SKIP = object()  # what a hook answers when it has put the node's value in place itself


class LostValue:
    """Stands where an output that stayed on another host would be."""

    __slots__ = ("node", "host", "why")

    def __init__(self, node: str, host: str, why: str):
        self.node, self.host, self.why = node, host, why

    def read(self, reader: str) -> Any:
        reader, node = made_from(reader), made_from(self.node)
        raise walk_error(Lost(
            f"node {reader!r} reads the output of {node!r}, which stayed on host "
            f"{self.host!r}: {self.why}. Place {reader!r} on {self.host!r} too, or make "
            f"{node!r} answer with something that can travel (data, or an Opaque with a codec)",
            node=node, host=self.host,
        ))


class Program:
    """A graph compiled for walking: one slot per node, in the data form's id order.

    ``gathers[i]`` says where node ``i``'s input comes from: ``(ROOT, None)`` the walk's
    input, ``(ONE, j)`` slot ``j``, ``(MANY, ((key, j), ...))`` a map of slots, and
    ``(FAR, j)`` slot ``j`` of a node that runs on a host, whose output may have stayed
    there (a ``LostValue``). Only a host's node leaves one behind, so only ``FAR`` and
    ``MANY`` look for it, and the walk's commonest step, ``ONE``, reads the slot as it is.
    """

    def __init__(self, ids: list[str], impls: list[Any], devices: list[str | None],
                 gathers: list[tuple[int, Any]]):
        self.ids = ids
        self.index = {n: i for i, n in enumerate(ids)}
        self.classes = [type(impl).__qualname__ for impl in impls]
        self.forwards = [getattr(impl, "forward", None) for impl in impls]
        self.ctxs = [Ctx(device, n) for n, device in zip(ids, devices)]
        self.gathers = gathers
        self.plain = [False] * len(ids)
        self.routes: dict[Any, Any] = {}  # what walkers of this program derive from it

    @classmethod
    def of(cls, data: Any) -> Program:
        """The forward program of a graph's data form."""
        ids = list(data.ids)
        index = {n: i for i, n in enumerate(ids)}
        gathers: list[tuple[int, Any]] = []
        for n in ids:
            preds = data.preds[n]
            if not preds:
                gathers.append((ROOT, None))
            elif len(preds) == 1:
                gathers.append((FAR if preds[0] in data.hosts else ONE, index[preds[0]]))
            else:
                gathers.append((MANY, tuple((p, index[p]) for p in preds)))
        prog = cls(ids, [data.impls[n] for n in ids], [data.devices.get(n) for n in ids],
                   gathers)
        prog.data = data
        prog.succs = [[index[s] for s in data.succs[n]] for n in ids]
        prog.mapped = [n in data.mapped for n in ids]
        prog.maps = any(prog.mapped)
        prog.cached = [n in data.cached for n in ids]
        prog.remembers = any(prog.cached) or prog.maps
        return prog


def program(data: Any) -> Program:
    """The compiled form of a graph's data form, built once per data form."""
    prog = data.memo.get("program")
    if prog is None:
        prog = data.memo["program"] = Program.of(data)
    return prog


class Hooks:
    """What makes one walk differ from the plain one, for the nodes it marks ``special``.

    ``before`` answers the input to run the node on, or ``SKIP`` once it has put the
    node's value in ``vals`` itself; ``after`` answers what the node's output becomes;
    ``told`` may add to the node's ``ran`` fact.
    """

    special: list[bool]

    def before(self, i: int, vals: list[Any], value: Any) -> Any:
        raise NotImplementedError

    def after(self, i: int, x: Any, out: Any) -> Any:
        return out

    def told(self, i: int, x: Any, fact: dict[str, Any]) -> None:
        return None


def unwrapped(value: Any, who: str | None) -> Any:
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
        where = "the input" if who is None else f"node {made_from(who)!r}"
        said = "was given" if who is None else "returned"
        raise walk_error(EdgeError(
            f"{where} {said} a {cls.__module__}.{cls.__qualname__}, which cannot cross an "
            f"edge as it is: wrap it in Opaque(...) to pass it untouched, or convert it to "
            "data (None, bool, int, float, str, bytes, list, tuple, dict)"
        ))


def walk(prog: Program, order: list[int], vals: list[Any], value: Any, hooks: Hooks | None,
         emit: Callable[[dict], None] | None, began: int) -> None:
    """Runs these nodes here, in order, each value into its slot. The hot loop: keep it
    plain; whatever is not plain is the hooks' business."""
    forwards, ctxs, gathers, ids = prog.forwards, prog.ctxs, prog.gathers, prog.ids
    special = prog.plain if hooks is None else hooks.special
    data = _DATA
    clock = time.perf_counter_ns
    last = 0 if emit is None else (clock() - began) // 1000
    i = -1
    try:
        for i in order:
            marked = special[i]
            if marked:
                x = hooks.before(i, vals, value)
                if x is SKIP:
                    continue
                if emit is not None:  # a lookup is not the node's time
                    last = (clock() - began) // 1000
            else:
                kind, source = gathers[i]
                if kind == ONE:
                    x = vals[source]
                elif kind == ROOT:
                    x = value
                elif kind == FAR:  # what a host's node made: on that host, every node's
                    x = vals[source]
                    if type(x) is LostValue:
                        x.read(ids[i])
                else:
                    x = gather(prog, i, vals, value)
            if emit is None:
                out = forwards[i](x, ctxs[i])
            else:
                # One clock reading per node: each node's time runs from the end of the
                # one before, so a watcher's own cost for a fact is charged to the next
                # node. Watchers of `ran` are appends; the price of a second reading
                # would be a third of the whole watched walk.
                out = forwards[i](x, ctxs[i])
                now = (clock() - began) // 1000
                fact = {"fact": "ran", "node": ids[i], "began_us": last, "took_us": now - last}
                if marked:
                    hooks.told(i, x, fact)
                emit(fact)
                last = now
            cls = type(out)
            if cls is Opaque:
                out = out.value
            elif cls not in data:
                out = unwrapped(out, ids[i])
            vals[i] = hooks.after(i, x, out) if marked else out
    except Exception as exc:
        if getattr(exc, "soma_walk", False):  # the walk's own refusal, already named
            raise
        raise failed(prog, i, exc, emit) from exc
    except BaseException as exc:  # Ctrl-C and exit go on as they are, saying where
        exc.soma_node = made_from(prog.ids[i])
        raise


def gather(prog: Program, i: int, vals: list[Any], value: Any) -> Any:
    """The input of node ``i``: the walk's input, its one source's value, or a map."""
    kind, source = prog.gathers[i]
    if kind == ROOT:
        return value
    if kind == ONE:
        return vals[source]
    if kind == FAR:
        x = vals[source]
        if type(x) is LostValue:
            x.read(prog.ids[i])
        return x
    out = {}
    for key, at in source:
        x = vals[at]
        if type(x) is LostValue:
            x.read(prog.ids[i])
        out[key] = x
    return out


def failed(prog: Program, i: int, exc: BaseException, emit: Any) -> NodeError:
    """A node's exception as the walk reports it: a ``failed`` fact and a NodeError,
    naming the user's node where the id is one the library made beside it (a trainer's
    positions): the user never wrote that id, and cannot look it up."""
    node = made_from(prog.ids[i])
    kind = type(exc).__name__
    if emit is not None:
        emit({"fact": "failed", "node": node, "error": f"{kind}: {exc}"})
    return NodeError(f"node {node!r} ({prog.classes[i]}) raised {kind}: {exc}",
                     node=node, kind=kind)


# -- a mapped node: a list in, a list as long out ------------------------------------------
def mapped_items(prog: Program, i: int, items: Any) -> list[Any]:
    """The items a ``.mapped()`` node is handed; anything but a list refused."""
    if not isinstance(items, list):
        raise walk_error(EdgeError(
            f"node {made_from(prog.ids[i])!r} is .mapped() and takes a list, but was handed a "
            f"{type(items).__qualname__}; give it a list, or drop .mapped()"
        ))
    return items


def mapped_answer(prog: Program, i: int, items: list[Any], out: Any) -> list[Any]:
    """What a ``.mapped()`` node answered, refused unless it is one item per item."""
    if not isinstance(out, list) or len(out) != len(items):
        what = f"{len(out)} items" if isinstance(out, list) else f"a {type(out).__qualname__}"
        raise walk_error(EdgeError(
            f"node {made_from(prog.ids[i])!r} is .mapped(): handed {len(items)} items it "
            f"answered with {what}; a mapped node answers with a list as long as its input, "
            "item for item"
        ))
    return out


class Mapping(Hooks):
    """The hooks of a walk with ``.mapped()`` nodes and nothing remembered."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.special = prog.mapped

    def before(self, i: int, vals: list[Any], value: Any) -> Any:
        return mapped_items(self.prog, i, gather(self.prog, i, vals, value))

    def after(self, i: int, x: Any, out: Any) -> Any:
        return mapped_answer(self.prog, i, x, out)

    def told(self, i: int, x: Any, fact: dict[str, Any]) -> None:
        fact["items"] = len(x)
