"""How a graph is walked, as data: pure functions from a topology to a Plan.

``Step(id)`` runs one node (``{"Node": id}`` in the plan's JSON), ``Seq`` runs its steps in order, ``Wave`` holds steps
that do not depend on each other, and ``Remote(host, plan)`` is a stretch sent away as
one round trip. A plan is the topological waves of the graph (a node sits in the
wave after its latest predecessor), then distributed by host: within a wave the nodes
of one host become one Remote, and consecutive steps that are wholly on one host
merge, so ``(A() >> B()).at("w1")`` is one trip and not two.

``stages`` is the other cut, the one training needs: a boundary wherever the pair
(host, trained) changes along an edge.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "Plan", "Remote", "Seq", "Step", "Wave",
    "distribute", "levels", "node_ids", "plan_from_json", "plan_to_json", "stages", "waves",
]


@dataclass(frozen=True, slots=True)
class Step:
    """Run one node. (Not ``Node``: that is the user's class, and this is a plan's step.)"""

    id: str

    def __repr__(self) -> str:
        return self.id


@dataclass(frozen=True, slots=True)
class Seq:
    """Run these steps one after the other."""

    steps: tuple[Plan, ...]

    def __repr__(self) -> str:
        return "Seq[" + ", ".join(map(repr, self.steps)) + "]"


@dataclass(frozen=True, slots=True)
class Wave:
    """These steps do not depend on each other; Remotes among them run concurrently."""

    steps: tuple[Plan, ...]

    def __repr__(self) -> str:
        return "Wave[" + ", ".join(map(repr, self.steps)) + "]"


@dataclass(frozen=True, slots=True)
class Remote:
    """A stretch of the plan sent to ``host`` in one round trip."""

    host: str
    plan: Plan

    def __repr__(self) -> str:
        return f"Remote({self.host}: {self.plan!r})"


Plan = Union[Step, Seq, Wave, Remote]


def levels(order: Sequence[str], preds: Mapping[str, Sequence[str]],
           cut: Any = None) -> dict[str, int]:
    """Each node's level: 0 with no predecessors, else the max over predecessors of
    their level plus ``cut(p, n)`` (1 everywhere when no cut is given). ``order`` must
    be topological."""
    level: dict[str, int] = {}
    for n in order:
        best = 0
        for p in preds[n]:
            step = 1 if cut is None else int(cut(p, n))
            if level[p] + step > best:
                best = level[p] + step
        level[n] = best
    return level


def waves(order: Sequence[str], preds: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Nodes grouped so that each one's predecessors are all in earlier groups."""
    level = levels(order, preds)
    grouped: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for n in order:
        grouped[level[n]].append(n)
    return grouped


def distribute(grouped: Sequence[Sequence[str]], hosts: Mapping[str, str]) -> Seq:
    """The waves as a Seq, with the nodes of each host gathered into Remotes."""
    steps: list[Plan] = []
    for wave in grouped:
        local: list[Plan] = []
        remote: dict[str, list[Plan]] = {}
        for n in wave:
            host = hosts.get(n)
            if host is None:
                local.append(Step(n))
            else:
                remote.setdefault(host, []).append(Step(n))
        parts = local + [Remote(h, _one(nodes, Wave)) for h, nodes in remote.items()]
        step = _one(parts, Wave)
        previous = steps[-1] if steps else None
        if (isinstance(step, Remote) and isinstance(previous, Remote)
                and previous.host == step.host):
            steps[-1] = Remote(step.host, _joined(previous.plan, step.plan))
        else:
            steps.append(step)
    return Seq(tuple(steps))


def _one(parts: list[Plan], kind: type) -> Plan:
    return parts[0] if len(parts) == 1 else kind(tuple(parts))


def _joined(first: Plan, then: Plan) -> Seq:
    head = first.steps if isinstance(first, Seq) else (first,)
    return Seq(head + (then,))


def plan_to_json(plan: Plan) -> Any:
    """The plan as plain data: ``{"Seq": [...]}``, ``{"Wave": [...]}``, ``{"Node": id}``,
    ``{"Remote": {"host": h, "plan": {...}}}``."""
    if isinstance(plan, Step):
        return {"Node": plan.id}
    if isinstance(plan, Seq):
        return {"Seq": [plan_to_json(s) for s in plan.steps]}
    if isinstance(plan, Wave):
        return {"Wave": [plan_to_json(s) for s in plan.steps]}
    return {"Remote": {"host": plan.host, "plan": plan_to_json(plan.plan)}}


def plan_from_json(data: Any) -> Plan:
    """The mirror of ``plan_to_json``; accepts the dict or its JSON text."""
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"not a plan: {data!r}")
    (kind, body), = data.items()
    if kind == "Node":
        return Step(body)
    if kind == "Seq":
        return Seq(tuple(plan_from_json(s) for s in body))
    if kind == "Wave":
        return Wave(tuple(plan_from_json(s) for s in body))
    if kind == "Remote":
        return Remote(body["host"], plan_from_json(body["plan"]))
    raise ValueError(f"not a kind of plan: {kind!r}")


def node_ids(plan: Plan) -> list[str]:
    """Every node a plan runs, in the order it runs them."""
    if isinstance(plan, Step):
        return [plan.id]
    if isinstance(plan, Remote):
        return node_ids(plan.plan)
    return [n for step in plan.steps for n in node_ids(step)]


def stages(graph: Any, trained: Any = ()) -> list[list[str]]:
    """The graph cut where a value stops being one forward: along an edge whose two
    ends differ in (host, trained). Stage k holds the nodes of level k, in topological
    order, so walking the stages backwards is a valid order for a backward pass.

    ``graph`` is anything that answers ``hosts()``, ``topological_sort()`` and
    ``predecessors(n)`` (a Graph), or a graph's data form."""
    if hasattr(graph, "order"):  # a data form
        hosts, order, preds = graph.hosts, list(graph.order), graph.preds
    else:
        hosts, order = graph.hosts(), graph.topological_sort()
        preds = {n: graph.predecessors(n) for n in order}
    trained = frozenset(trained)

    def cut(p: str, c: str) -> bool:
        return (hosts.get(p), p in trained) != (hosts.get(c), c in trained)

    level = levels(order, preds, cut)
    grouped: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for n in order:
        grouped[level[n]].append(n)
    return grouped
