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

import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._errors import DeclarationError

__all__ = ["GIVEN", "POSITION", "walk_back"]

POSITION = "_soma_position"
GIVEN = "__given__"


def walk_back(graph: Any, nodes: Iterable[str] | None, given: dict[str, Any],
              want: Iterable[str], *, broker: Any, here: bool, emit: Any, stamping: Any,
              since: int) -> dict[str, Any]:
    """Walks ``nodes`` against their edges; answers ``{node: what it gave back}`` for
    each node in ``want``. ``given`` is what arrives at a node from outside the walk."""
    chosen = [graph._known(n) for n in (graph.nodes() if nodes is None else nodes)]
    want = [graph._known(n) for n in want]
    for n in list(given) + want:
        if n not in chosen:
            raise DeclarationError(f"{n!r} is given to or wanted from a walk it is not part of")
    hosts = {} if here else graph._hosts
    parts: dict[str | None, list[str]] = {}
    for n in chosen:
        parts.setdefault(hosts.get(n), []).append(n)
    inside = set(chosen)
    for n in chosen:
        for s in graph._succs[n]:
            if s in inside and hosts.get(s) != hosts.get(n):
                raise DeclarationError(
                    f"{n!r} and {s!r} are on different hosts, so the edge between them is a "
                    "cut; walk each stage back on its own"
                )
    answered: dict[str, Any] = {}
    away = [(h, part) for h, part in parts.items() if h is not None]
    if away and broker is None:
        raise DeclarationError(
            f"walking back {away[0][1][0]!r} means reaching host {away[0][0]!r}, and no "
            "broker was given"
        )
    if away:
        graph.provision(broker)
    local = parts.get(None, [])
    if not away:
        answered.update(_here(graph, local, given, emit, since))
        return {n: answered[n] for n in want}
    forward_id = uuid.uuid4().hex

    def send(host: str, part: list[str]) -> Any:
        return broker._run_slice(
            host, graph, part, given={n: given[n] for n in part if n in given}, input=None,
            needs_input=False, wanted=[n for n in want if n in part],
            watching=emit is not None, stamping=stamping, forward=forward_id, transposed=True)

    if len(away) == 1 and not local:  # the common case: no thread to start
        outcomes = [send(*away[0])]
    else:
        with ThreadPoolExecutor(max_workers=len(away)) as pool:
            futures = [pool.submit(send, h, part) for h, part in away]
            if local:
                answered.update(_here(graph, local, given, emit, since))
            outcomes = [f.result() for f in futures]
    for outcome in outcomes:
        answered.update(outcome.values)
        if emit is not None:
            for fact in outcome.facts:
                emit(fact)
    missing = [n for n in want if n not in answered]
    if missing:
        raise DeclarationError(f"walking back, {missing} gave nothing that could travel")
    return {n: answered[n] for n in want}


def _here(graph: Any, nodes: list[str], given: dict[str, Any], emit: Any,
          since: int) -> dict[str, Any]:
    from ._engine import _failed, program, settle

    prog = program(graph)
    inside = set(nodes)
    order = [n for n in reversed(graph.topological_sort()) if n in inside]
    values: dict[str, Any] = {}
    for n in order:
        arriving = [(s, values[s]) for s in graph._succs[n] if s in inside]
        if n in given:
            arriving.append((GIVEN, given[n]))
        x = None if not arriving else arriving[0][1] if len(arriving) == 1 else dict(arriving)
        impl = graph._impl[n]
        if not getattr(impl, POSITION, False):
            values[n] = x
            continue
        i = prog.index[n]
        start = time.perf_counter_ns()
        try:
            out = settle(impl.forward(x, prog.ctxs[i]), n)
        except Exception as exc:
            if getattr(exc, "_soma_walk", False):
                raise
            raise _failed(prog, i, exc, emit) from exc
        if emit is not None:
            end = time.perf_counter_ns()
            emit({"fact": "ran", "node": n, "began_us": (start - since) // 1000,
                  "took_us": (end - start) // 1000, "backward": True})
        values[n] = out
    return values
