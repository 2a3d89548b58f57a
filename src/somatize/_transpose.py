"""The backward of a stage, walked as a forward of its transpose.

A trainer that sits beside a node has to be handed what came back for the node's
output and answer with what goes back to its input. Nothing new is needed for that:
the stage's nodes are walked against their edges, each node receiving what its
successors answered (a map when there are several, keyed by successor, with
``"__given__"`` for what the caller handed in). A *position* — an object that says
``_soma_position = True``, which is what a trainer is — is run on it; any other node
is walked through, what arrived going on unchanged. The core never learns what
arrives: whether it is a gradient is the trainer's business.

A part of the stage on another host is sent there as one slice with
``transposed=True``; parts on different hosts share no edge (that would be a cut, and
a cut is a stage boundary), so they go out side by side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._errors import DeclarationError
from ._slices import Later, Slice, runner_of, fan_out, new_forward_id, spread
from ._walk import FAR, MANY, ONE, ROOT, SKIP, Hooks, Program, gather, walk

__all__ = ["GIVEN", "POSITION", "walk_back"]

POSITION = "_soma_position"
GIVEN = "__given__"


def walk_back(data: Any, nodes: Iterable[str] | None, given: dict[str, Any],
              want: Iterable[str], *, broker: Any, here: bool, emit: Any, stamping: Any,
              since: int, later: bool = False) -> Any:
    """Walks ``nodes`` against their edges; answers ``{node: what it gave back}`` for
    each node in ``want``. ``given`` is what arrives at a node from outside the walk.
    ``later`` answers a ``Later`` of that as soon as the slices are out."""
    away, local, want = _parts(data, nodes, tuple(given), tuple(want), here)
    answered: dict[str, Any] = {}
    if not away:
        answered.update(_here(data, local, given, emit, since))
        done = {n: answered[n] for n in want}
        return Later(iter(()), lambda: done) if later else done
    backend = runner_of(broker)
    if backend is None:
        raise DeclarationError(
            f"walking back {away[0][1][0]!r} means reaching host {away[0][0]!r}, and no "
            "broker was given"
        )
    backend.prepare(data)
    forward_id = new_forward_id()
    pieces = [Slice(host, data, tuple(part), given={n: given[n] for n in part if n in given},
                    wanted=tuple(n for n in want if n in part), watching=emit is not None,
                    stamping=stamping, forward=forward_id, transposed=True)
              for host, part in away]
    meanwhile = (lambda: answered.update(_here(data, local, given, emit, since))) if local else None

    def gathered(settled: list) -> dict[str, Any]:
        for outcome, error in settled:
            if error is not None:
                raise error
            answered.update(outcome.values)
            if emit is not None:
                for fact in outcome.facts:
                    emit(fact)
        missing = [n for n in want if n not in answered]
        if missing:
            raise DeclarationError(f"walking back, {missing} gave nothing that could travel")
        return {n: answered[n] for n in want}
    if not later:
        return gathered(fan_out(backend, pieces, meanwhile))
    spreading = spread(backend, pieces, meanwhile)
    out: list[dict[str, Any]] = []

    def walking():
        out.append(gathered((yield from spreading)))
    return Later(walking(), lambda: out[0])


def _parts(data: Any, nodes: Iterable[str] | None, given: tuple[str, ...],
           want: tuple[str, ...], here: bool) -> tuple[list, list[str], list[str]]:
    """Which parts of the walk go to which host, and what is wanted, checked: derived
    once per graph and shape of walk, since a trainer walks the same one every step."""
    key = ("walk back", None if nodes is None else tuple(nodes), given, want, here)
    found = data.memo.get(key)
    if found is None:
        found = data.memo[key] = _parted(data, key[1], given, want, here)
    return found


def _parted(data: Any, nodes: tuple[str, ...] | None, given: tuple[str, ...],
            want: tuple[str, ...], here: bool) -> tuple[list, list[str], list[str]]:
    chosen = [data.known(n) for n in (data.ids if nodes is None else nodes)]
    wanted = [data.known(n) for n in want]
    for n in given + tuple(wanted):
        if n not in chosen:
            raise DeclarationError(f"{n!r} is given to or wanted from a walk it is not part of")
    hosts = {} if here else data.hosts
    parts: dict[str | None, list[str]] = {}
    for n in chosen:
        parts.setdefault(hosts.get(n), []).append(n)
    inside = set(chosen)
    for n in chosen:
        for s in data.succs[n]:
            if s in inside and hosts.get(s) != hosts.get(n):
                raise DeclarationError(
                    f"{n!r} and {s!r} are on different hosts, so the edge between them is a "
                    "cut; walk each stage back on its own"
                )
    away = [(h, part) for h, part in parts.items() if h is not None]
    return away, parts.get(None, []), wanted


class _Through(Hooks):
    """A node that is not a position is walked through: what arrived goes on as it is."""

    def __init__(self, prog: Program, special: list[bool]):
        self.prog, self.special = prog, special

    def before(self, i: int, vals: list[Any], value: Any) -> Any:
        vals[i] = gather(self.prog, i, vals, value)
        return SKIP


def transposed(data: Any, nodes: tuple[str, ...], given: tuple[str, ...]) -> tuple[Program, _Through]:
    """The program of ``nodes`` against their edges: each node reads what its
    successors inside answered (a map keyed by successor, with ``GIVEN`` for what the
    caller hands in, when more than one arrives); ``given`` holds slots after the nodes'."""
    inside = set(nodes)
    order = [n for n in reversed(data.order) if n in inside]
    index = {n: i for i, n in enumerate(order)}
    slot = {n: len(order) + k for k, n in enumerate(given)}
    gathers: list[tuple[int, Any]] = []
    for n in order:
        arriving = [(s, index[s]) for s in data.succs[n] if s in inside]
        if n in slot:
            arriving.append((GIVEN, slot[n]))
        if not arriving:
            gathers.append((ROOT, None))
        elif len(arriving) == 1:
            # what a host's node answered, or what the caller hands in, may be a value
            # that stayed elsewhere; a node here hands on what it made
            source, at = arriving[0]
            gathers.append((FAR if source == GIVEN or source in data.hosts else ONE, at))
        else:
            gathers.append((MANY, tuple(arriving)))
    impls = [data.impls[n] for n in order]
    prog = Program(order, impls, [data.devices.get(n) for n in order], gathers)
    special = [not getattr(impl, POSITION, False) for impl in impls]
    return prog, _Through(prog, special)


def _here(data: Any, nodes: list[str], given: dict[str, Any], emit: Any,
          since: int) -> dict[str, Any]:
    key = ("transposed", tuple(nodes), tuple(given))
    built = data.memo.get(key)
    if built is None:
        built = data.memo[key] = transposed(data, tuple(nodes), tuple(given))
    prog, hooks = built
    vals: list[Any] = [None] * (len(prog.ids) + len(given))
    for k, n in enumerate(given):
        vals[len(prog.ids) + k] = given[n]
    walk(prog, list(range(len(prog.ids))), vals, None, hooks, _backward(emit), since)
    return {n: vals[i] for i, n in enumerate(prog.ids)}


def _backward(emit: Any) -> Any:
    """``emit``, with what a position ran walking back said to be a backward run."""
    if emit is None:
        return None

    def told(fact: dict) -> None:
        if fact["fact"] == "ran":
            fact["backward"] = True
        emit(fact)
    return told
