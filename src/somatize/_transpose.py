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
from ._slices import Later, Shape, Slice, runner_of, fan_out, new_forward_id, spread
from ._walk import FAR, MANY, ONE, ROOT, SKIP, Hooks, Program, gather, walk

__all__ = ["Back", "GIVEN", "POSITION", "backward", "walk_back"]

POSITION = "_soma_position"
GIVEN = "__given__"


def walk_back(data: Any, nodes: Iterable[str] | None, given: dict[str, Any],
              want: Iterable[str], *, broker: Any, here: bool, one: Any,
              later: bool = False) -> Any:
    """Walks ``nodes`` against their edges, as part of the forward ``one`` (an
    ``_engine.Pass``); answers ``{node: what it gave back}`` for each node in ``want``.
    ``given`` is what arrives at a node from outside the walk. ``later`` answers a
    ``Later`` of that as soon as the slices are out."""
    back = backward(data, nodes, tuple(given), tuple(want), here)
    return back.run(one, given, broker, later)


def backward(data: Any, nodes: Iterable[str] | None, given: tuple[str, ...],
             want: tuple[str, ...], here: bool) -> Back:
    """The walk back over ``nodes`` handed values for ``given``, answering ``want``:
    built once per graph and shape of walk, since a trainer walks the same one every
    step."""
    key = ("walk back", None if nodes is None else tuple(nodes), given, want, here)
    found = data.memo.get(key)
    if found is None:
        found = data.memo[key] = Back(data, key[1], given, want, here)
    return found


class Back:
    """One walk back decided once: the shapes of the slices it sends away, the
    program of what it walks here, and what it answers, checked."""

    __slots__ = ("away", "data", "local", "want")

    def __init__(self, data: Any, nodes: tuple[str, ...] | None, given: tuple[str, ...],
                 want: tuple[str, ...], here: bool):
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
                        f"{n!r} and {s!r} are on different hosts, so the edge between them is "
                        "a cut; walk each stage back on its own"
                    )
        self.data, self.want = data, wanted
        self.away = [Shape(h, data, tuple(part), given=tuple(n for n in part if n in given),
                           wanted=tuple(n for n in wanted if n in part), transposed=True)
                     for h, part in parts.items() if h is not None]
        local = parts.get(None)
        self.local = transposed(data, tuple(local), given) if local else None

    def run(self, one: Any, given: dict[str, Any], broker: Any, later: bool = False) -> Any:
        """Walks back once with these values, as part of the forward ``one``."""
        emit, away, want = one.emit, self.away, self.want
        answered: dict[str, Any] = {}
        if not away:
            if self.local is not None:
                self._here(given, emit, one.since, answered)
            done = {n: answered[n] for n in want}
            return Later(iter(()), lambda: done) if later else done
        runner = runner_of(broker)
        if runner is None:
            raise DeclarationError(
                f"walking back {away[0].nodes[0]!r} means reaching host {away[0].host!r}, and "
                "no broker was given"
            )
        runner.prepare(self.data)
        forward_id = new_forward_id()
        watching = emit is not None
        pieces = [Slice(shape, {n: given[n] for n in shape.given}, None, watching, one.stamping,
                        forward_id)
                  for shape in away]
        meanwhile = None
        if self.local is not None:
            meanwhile = lambda: self._here(given, emit, one.since, answered)  # noqa: E731

        def gathered(answers: list) -> dict[str, Any]:
            for outcome, error in answers:
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
            return gathered(fan_out(runner, pieces, meanwhile))
        spreading = spread(runner, pieces, meanwhile)
        out: list[dict[str, Any]] = []

        def walking():
            out.append(gathered((yield from spreading)))
        return Later(walking(), lambda: out[0])

    def _here(self, given: dict[str, Any], emit: Any, since: int,
              answered: dict[str, Any]) -> None:
        """Walks back the part of it here, into ``answered``."""
        prog, hooks = self.local
        count = len(prog.ids)
        vals: list[Any] = [None] * (count + len(given))
        for k, value in enumerate(given.values()):
            vals[count + k] = value
        walk(prog, list(range(count)), vals, None, hooks, _backward(emit), since)
        answered.update(zip(prog.ids, vals))


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


def _backward(emit: Any) -> Any:
    """``emit``, with what a position ran walking back said to be a backward run."""
    if emit is None:
        return None

    def told(fact: dict) -> None:
        if fact["fact"] == "ran":
            fact["backward"] = True
        emit(fact)
    return told
