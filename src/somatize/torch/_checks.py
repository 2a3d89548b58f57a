"""What a Trainer checks before it trains, and tells once it has: the refusals of what
is certainly wrong (a node trained twice, a cache over weights that move, a loss no
backward can start from) and the warning for what PyTorch allows on purpose
(parameters the optimizer leaves out)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import CacheError, DeclarationError, NoGradient
from .._graph import Graph
from .._remember import changing_above
from ._learning import Learning
from ._weights import has_parameters, held

__all__ = ["check_caches", "check_given_optimizer", "check_gradients", "check_trains", "grad_mark",
           "no_loss", "outside_somatize", "warn_unheld", "watchers_of"]


def check_trains(graph: Graph, trains: Any, optimizer: Any,
                  frozen: set[str]) -> dict[str, Any]:
    """What ``trains=`` says, refused where it would make a run wrong without failing."""
    if not trains:
        return {}
    if not isinstance(trains, Mapping):
        raise TypeError("trains= maps node ids to what trains them: {'body': Split(SGD, lr=0.1)}")
    holds = set() if optimizer is None else {
        id(p) for group in optimizer.param_groups for p in group["params"]}
    seen: dict[int, str] = {}
    for node_id, learning in trains.items():
        if node_id not in graph.nodes():
            raise DeclarationError(
                f"trains= names {node_id!r}, which is not a node of this graph; its nodes "
                f"are {', '.join(map(repr, graph.nodes()))}")
        if not isinstance(learning, Learning):
            raise TypeError(f"trains[{node_id!r}] is a {type(learning).__qualname__}; what "
                            "trains a node is a Learning, such as Split(torch.optim.SGD, lr=0.1)")
        if id(learning) in seen:
            raise DeclarationError(f"one {type(learning).__qualname__} is given for both "
                                   f"{seen[id(learning)]!r} and {node_id!r}; give each its own")
        seen[id(learning)] = node_id
        if node_id in frozen:
            raise DeclarationError(
                f"node {node_id!r} is frozen and trained: one says its state does not "
                "change, the other changes it every step; drop .frozen() or drop it from trains=")
        impl = graph.implementation(node_id)
        if not callable(getattr(impl, "parameters", None)):
            raise DeclarationError(
                f"node {node_id!r} ({type(impl).__qualname__}) is trained but does not say "
                "what its parameters are; give it a parameters() method answering its tensors")
        if learning.seat.shared is not None and node_id not in graph.hosts():
            warnings.warn(
                f"node {node_id!r} is trained shared={learning.seat.shared!r} and runs here, where "
                "no other client can reach it: it is trained by this Trainer alone. Put it on "
                "a worker (.at(host)) for clients to share it there", stacklevel=3)
        twice = [p for p in held(impl, node_id) if id(p) in holds]
        if twice:
            raise DeclarationError(
                f"the optimizer holds parameters of {node_id!r}, which trains= also trains: "
                "it would be updated twice for one gradient; build the optimizer over "
                "parameters(g, without=trains)")
    return dict(trains)


def watchers_of(watching: Any) -> list[Callable[[dict], None]]:
    if watching is None:
        return []
    watchers = list(watching) if isinstance(watching, (list, tuple)) else [watching]
    for watcher in watchers:
        if not callable(watcher):
            raise TypeError(f"watching= takes callables (or a list of them); {watcher!r} "
                            "is not one")
    return watchers


def check_caches(graph: Graph, frozen: set[str]) -> None:
    """A kept output over something still training would be recalled after it changed."""
    changing = changing_above(graph.data(), frozen, has_parameters)
    if changing is not None:
        node_id, n = changing
        where = "is itself" if n == node_id else "is above it and"
        raise CacheError(
            f"node {node_id!r} is .cached() but {n!r} {where} has parameters and is "
            "not frozen, so training would change what was kept without the key "
            f"changing; declare {n!r} .frozen() (or freeze(g, {n!r})), or drop .cached()"
        )


def check_given_optimizer(graph: Graph, optimizer: Any, frozen: set[str],
                     elsewhere: set[str] = frozenset()) -> dict[str, list[Any]]:
    """Answers the parameters nobody would apply, by node, to be warned about once they
    get a gradient. ``elsewhere``: nodes whose weights somebody else updates (a trainer
    in ``trains=``) or that run on a worker, where the copy here is not what runs.

    A frozen node's parameters inside the optimizer are not refused: they never get a
    gradient, and every torch optimizer skips a parameter without one (weight decay
    and momentum included), so they cannot move.
    """
    if optimizer is not None and not all(
            hasattr(optimizer, a) for a in ("param_groups", "zero_grad", "step")):
        raise TypeError(f"optimizer= takes a torch.optim.Optimizer, not a "
                        f"{type(optimizer).__qualname__}")
    holds = set() if optimizer is None else {
        id(p) for group in optimizer.param_groups for p in group["params"]}
    unheld: dict[str, list[Any]] = {}
    for node_id in graph.nodes():
        if node_id in frozen or node_id in elsewhere:
            continue
        left = [p for p in held(graph.implementation(node_id), node_id)
                if id(p) not in holds and p.requires_grad]
        if left:
            unheld[node_id] = left
    if not holds and not elsewhere:
        raise DeclarationError(_nothing_to_train(optimizer, unheld))
    marked = {}
    for node_id, ps in unheld.items():
        marked[node_id] = _Left((p, grad_mark(p)) for p in ps)
        impl = graph.implementation(node_id)
        marked[node_id].silent = None if callable(getattr(impl, "parameters", None)) else \
            type(impl).__qualname__
    return marked


class _Left(list):
    """A node's parameters the optimizer leaves out, with their gradient marks; ``silent``
    is the node's class where it has no ``parameters()`` (so ``parameters(g)``, which
    reads that method, could not have found them), else None."""

    __slots__ = ("silent",)


def grad_mark(parameter: Any) -> Any:
    """What a parameter's gradient is now, to tell later whether a step gave it one."""
    grad = parameter.grad
    return None if grad is None else (id(grad), grad._version)


def check_devices(graph: Graph) -> None:
    """A node ``.on()`` a CUDA device, here, where torch sees none: its forward either
    ignores ``ctx.device`` and trains on the CPU unsaid, or uses it and fails with
    torch's own words, which do not name the node. Said once, before anything runs;
    a node on a worker is left to the worker, whose machine may have one."""
    if torch.cuda.is_available():
        return
    here = {node: device for node, device in graph.devices().items()
            if node not in graph.hosts() and str(device).startswith("cuda")}
    for node, device in here.items():
        warnings.warn(
            f"node {node!r} is .on({device!r}), and torch {torch.__version__} sees no CUDA "
            "device on this machine: a forward that ignores ctx.device runs on the CPU, one "
            "that uses it fails (\"Torch not compiled with CUDA\"). Run it where "
            "torch.cuda.is_available() is True, put it on such a worker (.at(host)), or "
            "drop .on(...) to train on the CPU here", UserWarning, stacklevel=outside_somatize())


def warn_unheld(unheld: dict[str, list[Any]]) -> None:
    """Once, at the first update: parameters the optimizer does not hold that got a
    gradient anyway. Never for those no gradient reaches by construction (above a
    technique that hands back nothing): they are nobody's to apply."""
    got = {}
    for node_id, marked in unheld.items():
        count = sum(1 for p, mark in marked if p.grad is not None and grad_mark(p) != mark)
        if count:
            got[node_id] = count
    if not got:
        return
    said = ", ".join(f"node {n!r} ({c} parameter{'s' if c > 1 else ''})" for n, c in got.items())
    first = next(iter(got))
    silent = {n: getattr(unheld[n], "silent", None) for n in got}
    silent = {n: kind for n, kind in silent.items() if kind is not None}
    if silent:  # parameters(g) reads each node's parameters(), which these lack
        fix = (", ".join(f"{n!r} ({kind})" for n, kind in silent.items())
               + f" {'has' if len(silent) == 1 else 'have'} no parameters() method, so "
               "parameters(g) finds nothing there; give "
               f"{'it' if len(silent) == 1 else 'each'} one answering its tensors (def "
               "parameters(self): return list(self.net.parameters())), or settle the node "
               f"with freeze(g, {next(iter(silent))!r})")
    else:
        fix = ("otherwise build the optimizer over parameters(g), or settle the node with "
               f"freeze(g, {first!r})")
    warnings.warn(
        f"{said} got gradients that the optimizer does not hold, so nothing applies them "
        "and they stay as they are; training goes on. If that is on purpose (another "
        "Trainer trains them, a layer kept fixed for a while, a probe), ignore this; "
        f"{'otherwise node ' if silent else ''}{fix}", UserWarning, stacklevel=outside_somatize())


def outside_somatize() -> int:
    """The stacklevel of the first frame that is not somatize's: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("somatize."):
        frame, level = frame.f_back, level + 1
    return level


def _nothing_to_train(optimizer: Any, idle: dict[str, int]) -> str:
    what = "no optimizer was given" if optimizer is None else "the optimizer holds no parameters"
    if idle:
        return (f"{what}, and node(s) {', '.join(map(repr, idle))} have parameters to train; "
                "pass optimizer=torch.optim.Adam(parameters(g), lr=...)")
    return (f"nothing to train: {what}, and no node of this graph says it has parameters "
            "that are not frozen; a node says so with a parameters() method answering its "
            "tensors")


def check_gradients(graph: Graph, optimizer: Any) -> None:
    """Once, at the first update: what the optimizer holds and got no gradient is a
    net that quietly does not train (an output detached, a leaf nobody reads)."""
    missing = {id(p) for group in optimizer.param_groups for p in group["params"]
               if p.requires_grad and p.grad is None}
    if not missing:
        return
    nodes = [n for n in graph.nodes()
             if any(id(p) in missing for p in held(graph.implementation(n), n))]
    where = (f"node(s) {', '.join(map(repr, nodes))}" if nodes
             else "parameters that belong to no node of this graph")
    placed = {node: host for node, host in graph.hosts().items() if node in nodes}
    if placed:  # its forward and backward run there: no gradient comes back to these copies
        node, host = next(iter(placed.items()))
        raise NoGradient(
            f"{len(missing)} parameter(s) the optimizer holds got no gradient, from "
            f"{where}: {', '.join(f'{n!r} runs on {h!r}' for n, h in placed.items())} "
            "(.at), so its parameters are trained there, not by the optimizer here; "
            f"give it a trainer where it runs, trains={{{node!r}: Split(torch.optim.SGD, "
            f"lr=...)}}, and leave it out of this optimizer: parameters(g, without=trains)")
    raise NoGradient(
        f"{len(missing)} parameter(s) the optimizer holds got no gradient over a whole "
        f"group, from {where}: their output does not reach the loss (detached, converted "
        "to data, or read by nobody); fix the path, or take them out of the optimizer"
    )


def no_loss(loss: Any) -> str:
    if not isinstance(loss, torch.Tensor):
        return (f"the objective answered a {type(loss).__qualname__}; it has to answer the "
                "loss as a tensor, with its graph attached, or nothing gets a gradient")
    if loss.numel() != 1:
        return (f"the objective answered a tensor of shape {tuple(loss.shape)}; a backward "
                "pass starts from one number, so reduce it (reduction='mean')")
    return ("the loss does not depend on anything that requires a gradient: every node "
            "above it is frozen, or its output was detached on the way")
