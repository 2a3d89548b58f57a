"""A graph driven in stages, for a Trainer that trains some nodes where they run.

The Trainer's graph is never touched. A private copy is rewired so that each trained
node ``n`` sits between its trainer's two positions — ``p → n:in → n:computes → n``,
the trainer keeping the id ``n`` so nobody below it changes — and cut into stages by
the core's ``stages`` (on host and trained). Then one step is:

- **forward**, stage by stage, through the ordinary walk (here, or on workers). A
  value handed from one stage to a later one becomes a fresh leaf, so each stage's
  autograd graph here ends at its own inputs and can be walked back exactly once.
- **backward**, stage by stage from the last: the trained part of a stage is walked
  back through the core (``transposed``), envelopes in and envelopes out, so a
  trainer on a worker is reached by the same channel as its forward; the untrained
  part here is one ``torch.autograd.backward`` over the outputs later stages sent
  gradients for; what a stage's inputs received is owed to the stage that made them.
- ``update`` across a cut is a closing empty envelope, walked back the same way.

A stage sent to a worker and trained by nobody gets nothing back: its parameters are
there, not here, and nobody asked for them to learn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._engine import execute
from .._errors import CacheError, DeclarationError, NodeError
from .._graph import Graph
from .._node import Opaque
from .._plan import stages
from ._learning import Learning, envelope, gradient

__all__ = ["Staged", "rewired"]


def rewired(graph: Graph, trains: Mapping[str, Learning]) -> Graph:
    """A copy of ``graph`` with each trained node between its trainer's two positions."""
    private = Graph()
    for n in graph.nodes():
        impl = graph.implementation(n)
        if n in trains:
            enters, learning = trains[n].of(impl).beside()
            _copy_node(private, graph, n, f"{n}:in", enters)
            _copy_node(private, graph, n, f"{n}:computes", impl)
            _copy_node(private, graph, n, n, learning)
        else:
            _copy_node(private, graph, n, n, impl)
    for n in trains:
        private._connect(f"{n}:in", f"{n}:computes")
        private._connect(f"{n}:computes", n)
    for a, b in graph.edges():
        private._connect(a, f"{b}:in" if b in trains else b)
    return private


def _copy_node(private: Graph, graph: Graph, source: str, node_id: str, impl: Any) -> None:
    private._add(node_id, impl)
    for mine, theirs in ((private._devices, graph._devices), (private._hosts, graph._hosts),
                         (private._fingerprints, graph._fingerprints)):
        if source in theirs:
            mine[node_id] = theirs[source]
    if node_id == source or node_id.endswith(":computes"):
        for mine, theirs in ((private._cached, graph._cached), (private._frozen, graph._frozen),
                             (private._mapped, graph._mapped)):
            if source in theirs:
                mine[node_id] = theirs[source]
        if source in graph._declarations and node_id == source:
            private._declarations[node_id] = graph._declarations[source]


class Stage:
    """One stage, as the driver needs it."""

    def __init__(self, private: Graph, nodes: list[str], trains: Mapping, leaves: set[str]):
        inside = set(nodes)
        self.nodes = nodes
        self.outside = sorted({p for n in nodes for p in private._preds[n] if p not in inside})
        self.wanted = [n for n in nodes if n in leaves
                       or any(s not in inside for s in private._succs[n])]
        self.trainers = [n for n in nodes if n in trains]
        self.trained = [m for n in self.trainers for m in (f"{n}:in", f"{n}:computes", n)]
        self.entries = [(f"{n}:in", private._preds[f"{n}:in"][0]) for n in self.trainers
                        if private._preds[f"{n}:in"] and private._preds[f"{n}:in"][0] not in inside]
        self.back_given = [n for n in self.trainers if n in self.wanted]
        self.reporting = [f"{n}:in" for n in self.trainers]  # every trainer's answer
        trained = set(self.trained)
        self.untrained_here = [n for n in self.wanted
                               if n not in trained and private._hosts.get(n) is None]


class Staged:
    """Drives one Trainer's graph stage by stage; see the module's docstring."""

    def __init__(self, graph: Graph, trains: Mapping[str, Learning], *, broker: Any,
                 store: Any, steps_per_update: int):
        self.trains = dict(trains)
        for learning in self.trains.values():
            learning.accumulating(steps_per_update)
        self.private = rewired(graph, self.trains)
        positions = {m for n in self.trains for m in (f"{n}:in", f"{n}:computes", n)}
        grouped = stages(self.private, positions)
        leaves = set(self.private.leaves())
        self.leaves = graph.leaves()
        self.stages = [Stage(self.private, nodes, self.trains, leaves) for nodes in grouped]
        for k, stage in enumerate(self.stages[1:], start=1):
            for n in stage.nodes:
                if n in self.private._cached:
                    raise CacheError(
                        f"node {n!r} is .cached() after a cut (stage {k}): the roots of a "
                        "later stage are handed values, not the graph's input, so two "
                        "different batches would be kept under one name; cache only in "
                        "front of the first trained or remote node"
                    )
        self.through = {n for stage in self.stages for n in stage.untrained_here
                        if n in self.leaves}
        self.broker = broker
        self.store = store
        self._pass: Any = None
        self.health: list[dict[str, Any]] = []  # what trainers on workers measured

    def told(self, watching: Any) -> Any:
        """``watching`` as the record should see this graph: the node a trainer stands
        beside is the user's ``n``, not ``n:computes``, and the positions' own forward
        passes (a leaf made, an activation let go of) are not nodes of the user's."""
        if watching is None:
            return None
        watchers = list(watching) if isinstance(watching, (list, tuple)) else [watching]
        trains = self.trains

        def tell(fact: dict) -> None:
            node = fact.get("node")
            if node is not None:
                if node in trains and fact.get("fact") == "ran" and not fact.get("backward"):
                    return
                base, colon, part = node.rpartition(":")
                if colon and base in trains:
                    if part == "in" and fact.get("fact") == "ran":
                        return
                    fact["node"] = base
            for watcher in watchers:
                watcher(fact)
        return tell

    def forward(self, x: Any, watching: Any, since: int) -> Any:
        """Runs every stage in order; answers the graph's output, made of fresh leaves
        so the objective's backward stops at the seam."""
        produced: dict[str, Any] = {}
        handed: list[dict[str, Any]] = []
        for k, stage in enumerate(self.stages):
            leaves = {p: _fresh(produced[p]) for p in stage.outside}
            produced.update(execute(
                self.private, x, nodes=stage.nodes,
                given={p: Opaque(v) for p, v in leaves.items()}, want=stage.wanted,
                broker=self.broker, store=self.store if k == 0 else None,
                watching=watching, framed=False, since=since))
            handed.append(leaves)
        # An output made here by an untrained node keeps its graph, so the objective's
        # backward runs straight through its stage; only a trainer's (detached) or a
        # worker's output needs a leaf of its own to catch its gradient.
        outputs = {n: produced[n] if n in self.through else _fresh(produced[n])
                   for n in self.leaves}
        self._pass = (produced, handed, outputs)
        if len(outputs) == 1:
            return next(iter(outputs.values()))
        return outputs

    def backward(self, watching: Any, since: int) -> None:
        """After the objective's backward: hands every stage what it is owed, last first."""
        if self._pass is None:
            raise DeclarationError("a backward without a forward: step() runs them in pairs")
        produced, handed, outputs = self._pass
        self._pass = None
        owed: dict[str, torch.Tensor] = {}
        for n, leaf in outputs.items():
            if n not in self.through:  # those already passed their gradient on
                _add(owed, n, getattr(leaf, "grad", None))
        for stage, leaves in zip(reversed(self.stages), reversed(handed)):
            if stage.trainers:
                answers = self._walk_back(stage, {n: envelope(owed.get(n))
                                                  for n in stage.back_given}, watching, since)
                for entry, producer in stage.entries:
                    _add(owed, producer, gradient(answers[entry], _device(produced[producer])))
                self._heard(answers)
            tensors, grads = [], []
            for n in stage.untrained_here:
                value, grad = produced[n], owed.get(n)
                if grad is not None and isinstance(value, torch.Tensor) and value.requires_grad:
                    tensors.append(value)
                    grads.append(grad)
            if tensors:
                torch.autograd.backward(tensors, grads)
            for producer, leaf in leaves.items():
                _add(owed, producer, getattr(leaf, "grad", None))

    def close(self, watching: Any, since: int) -> None:
        """Ends every trainer's open group: a closing, empty envelope walked back."""
        for stage in reversed(self.stages):
            if stage.trainers:
                self._walk_back(stage, {n: envelope(None, closing=True)
                                        for n in stage.back_given}, watching, since)

    def weights(self, node: str) -> dict[str, Any]:
        """The weights of a trained node as they are where it runs: asked of its
        trainer, walked back like a gradient, since that is the channel there is."""
        from ._learning import ASKING

        answer = execute(self.private, nodes=[node], given={node: {ASKING: True}},
                         want=[node], transposed=True, broker=self.broker)
        return answer[node][ASKING]

    def load(self, node: str, weights: Any, *, check_only: bool) -> None:
        """Hands a trained node's weights to its trainer where it runs, the way
        ``weights`` asks for them. ``check_only`` has the trainer check every key, shape
        and dtype and copy nothing, so that a load across machines can be all or nothing."""
        from ._learning import LOADING

        asked = {LOADING: {"node": node, "weights": dict(weights), "check": check_only}}
        try:
            execute(self.private, nodes=[node], given={node: asked}, want=[node],
                    transposed=True, broker=self.broker)
        except NodeError as exc:
            cause = exc.__cause__
            if not isinstance(cause, (DeclarationError, TypeError)):
                raise
            raise DeclarationError(
                f"{cause} (checked by the trainer of {node!r} on host {exc.host!r}); nothing "
                "was loaded, here or there") from exc

    def _walk_back(self, stage: Stage, given: dict[str, Any], watching: Any,
                   since: int) -> dict[str, Any]:
        return execute(self.private, nodes=stage.trained, given=given,
                       want=stage.reporting, transposed=True,
                       broker=self.broker, watching=watching, framed=False, since=since)

    def _heard(self, answers: dict[str, Any]) -> None:
        """Keeps the health facts that came back beside the gradients, with the host
        of the trainer that measured them."""
        from ._learning import HEALTH

        hosts = self.private._hosts
        for entry, answer in answers.items():
            host = hosts.get(entry)
            for fact in answer.get(HEALTH, ()) if type(answer) is dict else ():
                self.health.append({**fact, "host": host} if host else fact)

    def audited(self, audit: Any, pieces: int) -> None:
        """Has each trainer on a worker measure its node like ``audit`` would here
        (the Audit there cannot hook what it cannot reach; the trainer sees it all)."""
        from ._audit import Audit

        for node, learning in self.trains.items():
            if node in self.private._hosts:
                learning.audited(Audit(every=audit.every, snapshot=audit.snapshot,
                                       channels=audit.channels, window=audit.window),
                                 node, pieces)


def _fresh(value: Any) -> Any:
    """A value handed across a stage boundary: a tensor becomes a new leaf."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        if leaf.is_floating_point() or leaf.is_complex():
            leaf.requires_grad_(True)
        return leaf
    return value


def _add(owed: dict[str, torch.Tensor], node: str, grad: torch.Tensor | None) -> None:
    if grad is not None:
        owed[node] = grad if node not in owed else owed[node] + grad


def _device(value: Any) -> Any:
    return value.device if isinstance(value, torch.Tensor) else None
