"""Zero-cost proxies: cheap scores that rank untrained candidates, ``proxies``/``proxy``.

Each one follows the formula of its paper, read against the reference code of
Abdelfattah et al. (``zero-cost-nas``) and of Mellor et al. (``nas-without-training``).
The score is of the whole graph: the nodes run as the engine runs them, on a batch
wrapped in ``Opaque``, all of them here in this process whatever host they are placed
on (a proxy needs the autograd graph from input to output in one place). Every proxy
works on its own deep copy of the graph, under a forked random stream, so the graph's
weights, gradients and ``requires_grad`` flags are exactly what they were, the
caller's random stream is not moved, and ``proxies(...)[name] == proxy(..., name)``.
Modules run in the train/eval mode they are in, as the reference leaves them.

Where a proxy sums over weights, it is the ``weight`` of every linear and
convolutional module (by ``kind_of``), as the reference does, frozen ones included
(the copy's are made to want a gradient); a graph that has none is measured on every
parameter it holds. ``params`` is the parameter count (every
parameter the nodes hold, once, trainable or not), the floor any proxy has to beat.
Higher is better for every score, and the ones that span decades (``synflow``,
``snip``, ``grad_norm``, ``params``) are natural logarithms, ``-inf`` for a sum of zero.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from .._engine import Pass
from .._node import Opaque
from ._architecture import kind_of
from ._tensors import tensors_in
from ._weights import held, modules_of

__all__ = ["EVERY", "proxies", "proxy"]

EVERY = ("synflow", "jacob_cov", "nwot", "params", "snip", "grasp", "grad_norm")
READ_LOSS = ("snip", "grasp", "grad_norm")
JACOB_COV_K = 1e-5  # the reference's guard against log(0) and 1/0 in the eigenvalues


class _CannotTake(Exception):
    """This proxy cannot be taken with what it was given; the message says why."""


def proxies(graph: Any, example: Any, *, target: Any = None,
            objective: Callable[[Any, Any], Any] | None = None) -> dict[str, float]:
    """Every proxy that can be taken with what was given, as ``{name: score}``.

    Without ``target`` and ``objective`` the three that read a loss are not in the
    answer at all — a missing score and a bad one must look different. Likewise a proxy
    the example cannot feed is left out: ``jacob_cov`` for an integer input (token ids
    have no gradient), ``nwot`` when nothing gives one code per example.
    """
    batch = _batch(example)
    reads = _reads_loss(target, objective)
    answer: dict[str, float] = {}
    for name in EVERY:
        if name in READ_LOSS and not reads:
            continue
        try:
            answer[name] = _taken(name, graph, batch, _unwrapped(target), objective)
        except _CannotTake:
            continue
    return answer


def proxy(graph: Any, example: Any, of: str, *, target: Any = None,
          objective: Callable[[Any, Any], Any] | None = None) -> float:
    """One cheap score for one candidate, higher being better; ``of`` is one of ``EVERY``.

    The units are the proxy's own: compare the same proxy across candidates, never two
    proxies. Refused: a name not in ``EVERY``, a loss-reading proxy without ``target``
    and ``objective``, and a proxy this example cannot feed (the message says why).
    """
    if of not in EVERY:
        raise ValueError(f"there is no proxy called {of!r}; the proxies are "
                         f"{', '.join(map(repr, EVERY))} (see somatize.torch.EVERY)")
    batch = _batch(example)
    if not _reads_loss(target, objective) and of in READ_LOSS:
        raise TypeError(f"{of!r} reads a loss, so it needs target= and objective=, e.g. "
                        f"proxy(g, x, {of!r}, target=y, "
                        "objective=torch.nn.functional.cross_entropy)")
    try:
        return _taken(of, graph, batch, _unwrapped(target), objective)
    except _CannotTake as exc:
        raise ValueError(f"{of!r} cannot be taken here: {exc}") from None


# -- what was given -------------------------------------------------------------------
def _unwrapped(value: Any) -> Any:
    return value.value if isinstance(value, Opaque) else value


def _batch(example: Any) -> torch.Tensor:
    batch = _unwrapped(example)
    if not isinstance(batch, torch.Tensor) or batch.dim() < 1:
        raise TypeError(
            "a proxy is taken on a batch: a tensor whose first dimension counts the "
            f"examples (Opaque(tensor) is fine too), not {_what_it_is(batch)}"
        )
    return batch.detach()


def _what_it_is(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__qualname__}"


def _reads_loss(target: Any, objective: Any) -> bool:
    if (target is None) != (objective is None):
        missing = "objective=" if objective is None else "target="
        raise TypeError(f"the proxies that read a loss need both target= and objective=; "
                        f"{missing} is missing (give both, or neither to leave those proxies out)")
    if objective is not None and not callable(objective):
        raise TypeError(f"objective= is a {type(objective).__qualname__}, which cannot be "
                        "called; give a function of (output, target), such as "
                        "torch.nn.functional.cross_entropy")
    return objective is not None


# -- the copy every proxy works on ----------------------------------------------------
def _taken(name: str, graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    if name == "params":  # counting changes nothing, so there is nothing to copy
        return _log(_parameter_count(graph))
    try:
        mine = copy.deepcopy(graph)
    except Exception as exc:
        raise TypeError(f"proxies work on a copy of the graph, so that its weights stay as "
                        f"they are, and this graph cannot be copied: {exc}") from exc
    for parameter in _all_parameters(mine):
        parameter.grad = None
    cuda = [batch.device.index or 0] if batch.is_cuda else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        return _MEASURES[name](mine, batch, target, objective)


def _run(graph: Any, batch: torch.Tensor) -> Any:
    return Pass().run(graph, Opaque(batch), here=True)


def _all_parameters(graph: Any) -> list[torch.Tensor]:
    once: dict[int, torch.Tensor] = {}
    for node_id in graph.nodes():
        for parameter in held(graph.implementation(node_id), node_id):
            once.setdefault(id(parameter), parameter)
    return list(once.values())


def _parameter_count(graph: Any) -> int:
    return sum(p.numel() for p in _all_parameters(graph))


def _modules(graph: Any) -> list[torch.nn.Module]:
    once: dict[int, torch.nn.Module] = {}
    for node_id in graph.nodes():
        for module in modules_of(graph.implementation(node_id)):
            for inner in module.modules():
                once.setdefault(id(inner), inner)
    return list(once.values())


def _measured(graph: Any) -> list[torch.Tensor]:
    """The weights the scores are sums over, made to want a gradient (this is a copy)."""
    weights: dict[int, torch.Tensor] = {}
    for module in _modules(graph):
        weight = module._parameters.get("weight")
        if weight is not None and kind_of(module) in ("linear", "conv"):
            weights.setdefault(id(weight), weight)
    found = list(weights.values()) or [p for p in _all_parameters(graph) if p.is_floating_point()]
    if not found:
        raise _CannotTake("the graph holds no parameters to score")
    for weight in found:
        weight.requires_grad_(True)
    return found


def _summed(output: Any, who: str) -> torch.Tensor:
    """R, the sum of everything the graph produced (every leaf, every element)."""
    found = [t for t in tensors_in(output) if t.is_floating_point()]
    if not found:
        raise TypeError(f"{who} sums what the graph produced, and it produced "
                        f"{_what_it_is(output)}, with no floating-point tensor in it; a graph "
                        "scored by proxies answers tensors (Opaque(tensor) from its leaves)")
    return sum(t.sum() for t in found)


def _loss(objective: Any, output: Any, target: Any) -> torch.Tensor:
    if (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
            and target.device != output.device):  # as the Trainer does
        target = target.to(output.device)
    loss = objective(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(f"the objective answered {_what_it_is(loss)}; it has to answer a single "
                        "number that depends on the graph's weights (a tensor with a grad_fn)")
    return loss.reshape(())


def _log(value: float) -> float:
    return math.log(value) if value > 0 else float("-inf")


def _summed_over(pairs: list[tuple[torch.Tensor, torch.Tensor | None]],
                 term: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    total = 0.0
    for weight, grad in pairs:
        if grad is not None:  # a weight the output does not depend on adds nothing
            total += float(term(weight.detach(), grad.detach()).double())
    return total


# -- the measures ---------------------------------------------------------------------
def _synflow(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """SynFlow, Tanaka et al. 2020, "Pruning neural networks without any data by
    iteratively conserving synaptic flow": in float64, every weight made |W|, batch
    norms bypassed (as the reference does), an all-ones input with a batch of one;
    R = sum of the output, score = log Σ |θ ⊙ ∂R/∂θ|. An integer input (token ids) is
    fed ones of its own type."""
    measured = _measured(graph)
    with torch.no_grad():
        inside: set[int] = set()
        for module in _modules(graph):
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.forward = _passed_through
            module.double()
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                inside.add(id(tensor))
                if tensor.is_floating_point():
                    tensor.abs_()
        for parameter in _all_parameters(graph):
            if id(parameter) not in inside and parameter.is_floating_point():
                parameter.data = parameter.data.double().abs()
    dtype = torch.float64 if batch.is_floating_point() else batch.dtype
    ones = torch.ones((1, *batch.shape[1:]), dtype=dtype, device=batch.device)
    flow = _summed(_run(graph, ones), "synflow")
    grads = torch.autograd.grad(flow, measured, allow_unused=True)
    return _log(_summed_over(list(zip(measured, grads)), lambda w, g: (w * g).abs().sum()))


def _passed_through(x: torch.Tensor) -> torch.Tensor:
    return x


def _jacob_cov(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """Jacobian covariance, Mellor et al. 2021 (v1 of "Neural architecture search without
    training"): the Jacobian of the summed output by each example's input, the
    correlation matrix of those Jacobians over the batch, and as in the reference code
    -Σ log(λ + k) + 1/(λ + k) over its eigenvalues λ, k = 1e-5 (higher is better as it
    stands). NaN when an example's Jacobian is constant, whose correlation is undefined."""
    if not batch.is_floating_point():
        raise _CannotTake(f"jacob_cov differentiates by the input, and this batch is "
                         f"{batch.dtype}, which has no gradient")
    given = batch.clone().requires_grad_(True)
    (jacobian,) = torch.autograd.grad(_summed(_run(graph, given), "jacob_cov"), given,
                                      allow_unused=True)
    if jacobian is None:
        return float("nan")
    rows = jacobian.reshape(batch.shape[0], -1).double()
    correlation = torch.corrcoef(rows).reshape(rows.shape[0], rows.shape[0])
    if not torch.isfinite(correlation).all():
        return float("nan")
    eigenvalues = torch.linalg.eigvalsh(correlation) + JACOB_COV_K
    return float(-(torch.log(eigenvalues) + 1.0 / eigenvalues).sum())


def _relu_like(module: torch.nn.Module) -> bool:
    return "ReLU" in type(module).__name__ or isinstance(
        module, (torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.ELU, torch.nn.CELU,
                 torch.nn.SELU, torch.nn.Hardswish))


def _nwot(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """NASWOT, Mellor et al. 2021 (v2 of "Neural architecture search without training"):
    each example's binary code is which units are on (the input > 0 of every ReLU-like
    module: a class named …ReLU…, as the reference picks them, or GELU, SiLU, Mish,
    ELU, CELU, SELU, Hardswish); K[i, j] counts the units on which examples i and j agree; the score is
    log |det K|. With no ReLU-like module in the graph the codes are read off every
    node's output instead (a forward that calls F.relu). Codes of a layer whose rows
    are not the examples (attention's insides) are skipped. -inf for a singular K."""
    rows = batch.shape[0]
    relus = [m for m in _modules(graph) if _relu_like(m)]
    codes: list[torch.Tensor] = []

    def caught(module: Any, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[:1] == (rows,):
            codes.append((args[0].detach().reshape(rows, -1) > 0).double())

    handles = [m.register_forward_pre_hook(caught) for m in relus]
    try:
        with torch.no_grad():
            values = Pass().run(graph, Opaque(batch), here=True,
                                want=None if relus else graph.nodes())
    finally:
        for handle in handles:
            handle.remove()
    if not relus:
        codes = [(t.detach().reshape(rows, -1) > 0).double() for t in tensors_in(values)
                 if t.dim() >= 1 and t.shape[0] == rows]
    if not codes:
        raise _CannotTake("nwot reads which units are on for each example, and no ReLU-like "
                         "module nor any node's output gave one code per example")
    on = torch.cat(codes, dim=1)
    kernel = on @ on.T + (1 - on) @ (1 - on).T
    sign, logdet = torch.linalg.slogdet(kernel)
    return float(logdet) if sign > 0 else float("-inf")


def _with_loss(graph: Any, batch: torch.Tensor, target: Any, objective: Any,
               create_graph: bool = False) -> tuple[list[torch.Tensor], tuple]:
    measured = _measured(graph)
    loss = _loss(objective, _run(graph, batch), target)
    return measured, torch.autograd.grad(loss, measured, allow_unused=True,
                                         create_graph=create_graph)


def _snip(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """SNIP, Lee et al. 2019, "SNIP: single-shot network pruning based on connection
    sensitivity": the loss's sensitivity to a mask on each weight, |∂L/∂m| = |θ ⊙ ∂L/∂θ|,
    summed; score = log Σ |θ ⊙ ∂L/∂θ|."""
    measured, grads = _with_loss(graph, batch, target, objective)
    return _log(_summed_over(list(zip(measured, grads)), lambda w, g: (w * g).abs().sum()))


def _grasp(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """GraSP, Wang et al. 2020, "Picking winning tickets before training by preserving
    gradient flow": score = Σ -θ ⊙ (H g), g = ∂L/∂θ, with the Hessian-vector product
    taken by differentiating g·g (g held constant). Signed, so no logarithm; the sign
    is the reference code's, which it chose because accuracy goes with it. One forward
    gives both g and H, where the reference runs two on the same batch."""
    measured, grads = _with_loss(graph, batch, target, objective, create_graph=True)
    used = [(w, g) for w, g in zip(measured, grads) if g is not None and g.requires_grad]
    if not used:
        return 0.0
    flow = sum((g.detach() * g).sum() for _, g in used)
    hessian_grad = torch.autograd.grad(flow, [w for w, _ in used], allow_unused=True)
    return _summed_over(list(zip([w for w, _ in used], hessian_grad)),
                        lambda w, hg: (-w * hg).sum())


def _grad_norm(graph: Any, batch: torch.Tensor, target: Any, objective: Any) -> float:
    """Gradient norm, Abdelfattah et al. 2021, "Zero-cost proxies for lightweight NAS":
    as their reference code sums it, the Euclidean norm of ∂L/∂W for each layer's
    weight, added over layers (not the norm of the whole gradient); score = log of that."""
    measured, grads = _with_loss(graph, batch, target, objective)
    return _log(_summed_over(list(zip(measured, grads)), lambda w, g: g.norm()))


_MEASURES = {"synflow": _synflow, "jacob_cov": _jacob_cov, "nwot": _nwot,
             "snip": _snip, "grasp": _grasp, "grad_norm": _grad_norm}
