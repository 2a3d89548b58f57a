"""``probe``: the Audit's measures of a graph at initialisation, from one forward and
backward on an example — before a single step is spent.

There is no target at initialisation, so what is differentiated is the output itself,
seen through ``probes`` random directions: each is a fixed random projection of every
output tensor, summed per sample and averaged over the batch (as a mean-reduced loss
is), and taken back through the graph on its own. A gradient's norm is then the root
mean square over the probes — an estimate of how strongly each where is connected to
the output, free of any loss's scale — and its mean and spread are pooled over them.
The directions come from a generator of their own, so the same graph and example
answer the same numbers every time, on any device.
"""

from __future__ import annotations

from typing import Any

import torch

from .._engine import Pass
from .._errors import whole_number
from .._graph import Graph
from .._node import Opaque
from ._architecture import _undisturbed
from ._audit import Audit
from ._tensors import measurable_in
from ._weights import modules_of

__all__ = ["probe"]

SEED = 0  # of the random directions


def probe(graph: Graph, example: Any, *, depth: int = 0, most: int = 48, probes: int = 24,
          watching: Any = None, broker: Any = None) -> dict[str, dict[str, Any]]:
    """What the graph looks like at initialisation, as ``{where: {measure: value}}`` —
    the shape ``somatize.health.seen`` answers, with the Audit's keys.

    ``depth`` and ``most`` choose the modules within nodes as ``architecture`` does
    (depth 0: what each node holds directly; at most ``most`` per node). A tensor
    example is wrapped in ``Opaque`` for you. With ``watching=`` (a Recorder, any
    callable, or a list) the forward's facts and one ``health`` fact per where, at
    step 0, are told too. Nothing is changed: not the weights, not a gradient already
    accumulated (the probes' gradients are taken with ``torch.autograd.grad``), not a
    batch norm's running statistics, not the random streams.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"probe() takes a somatize Graph, not a {type(graph).__qualname__}")
    for name, value, least in (("depth", depth, 0), ("most", most, 1), ("probes", probes, 1)):
        whole_number(value, name, least=least, of="probe()")
    audit = Audit(every=1, snapshot=1, inside=depth, most=most)
    audit.probes = probes
    produced = audit.keep_outputs()
    modules = list({id(m): m for n in graph.nodes() for held in modules_of(graph.implementation(n))
                    for m in held.modules()}.values())
    with _undisturbed(modules):
        audit.watch(graph)
        try:
            wrapped = Opaque(example) if isinstance(example, torch.Tensor) else example
            with Pass(watching) as one:
                output = one.run(graph, wrapped, broker=broker, here=broker is None)
            _differentiate(output, produced, probes)
            facts = audit.observed(graph, updated=False)
        finally:
            audit.release()
    for fact in facts:
        fact["step"] = 0
    if watching is not None:
        for watcher in watching if isinstance(watching, (list, tuple)) else [watching]:
            for fact in facts:
                watcher(fact)
    return {fact["where"]: {k: v for k, v in fact.items() if k not in ("fact", "where", "step")}
            for fact in facts}


def _differentiate(output: Any, produced: list[torch.Tensor], probes: int) -> None:
    """Takes each random direction of the output back to everything the Audit saw
    produced; the Audit's gradient hooks count what arrives."""
    ends = [t for t in measurable_in(output) if t.requires_grad]
    produced = [t for t in produced if t.requires_grad]
    if not ends or not produced:
        return  # nothing trainable between the input and the output: no gradient to read
    generator = torch.Generator().manual_seed(SEED)
    for at in range(probes):
        total = 0.0
        for end in ends:
            direction = torch.randn(end.shape, generator=generator, dtype=torch.float64)
            per_sample = max(end[0].numel(), 1) if end.dim() else 1
            direction = (direction / per_sample ** 0.5).to(device=end.device, dtype=end.dtype)
            total = total + (end * direction).sum() / (end.shape[0] if end.dim() else 1)
        torch.autograd.grad(total, produced, retain_graph=at < probes - 1, allow_unused=True)
