"""Using what was trained: eval mode wherever the nodes live, and averages over rows.

``Trainer.predict`` and ``Trainer.evaluate`` run the graph the way a PyTorch user runs
a trained model — ``model.eval()`` and ``torch.no_grad()`` — with the nodes spread over
machines. Here that is a context manager (``evaluated``); on a worker it is a verb of
the Trainer's session, ``evaluating``, which puts the session's modules in eval mode,
turns off ``requires_grad`` on their parameters (``torch.no_grad`` is a state of the
thread that runs a slice, which a verb does not reach, and a parameter's own flag is
what makes a forward build a graph at all), tells its trainers to hold nothing while it
lasts (``Seat.evaluating``), and answers each module's and parameter's own flag, so
that the verb that ends it puts every one back as it was (a batch norm the user keeps
in eval mode inside a trained body stays so).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._errors import DeclarationError
from .._graph import made_from
from ._learning import Learning
from ._weights import held, modules_of

__all__ = ["VERBS", "averaged", "better", "checked_metrics", "evaluated",
           "evaluating_verb", "number", "owned", "put_back", "put_in_eval", "rows_of"]


def owned(nodes: Mapping[str, Any], grads: bool = True) -> dict[str, tuple[list[Any], list[Any]]]:
    """``(modules, parameters)`` each node holds, submodules included, in a fixed order,
    each under the first node that holds it: a trainer's are those of the node it
    trains, which also stands in the session under a made id, and two nodes may share
    a module. Without ``grads`` no parameter is listed: where ``torch.no_grad`` holds
    (the thread that evaluates here) their flags need not move."""
    seen: set[int] = set()
    found: dict[str, tuple[list[Any], list[Any]]] = {}
    for node_id, impl in nodes.items():
        target = impl.seat.node if isinstance(impl, Learning) else impl
        if target is None:
            continue
        modules = [m for top in modules_of(target) for m in top.modules()]
        mine = ([m for m in modules if _first(m, seen)],
                [p for p in held(target, node_id) if _first(p, seen)] if grads else [])
        if mine[0] or mine[1]:
            found[node_id] = mine
    return found


def _first(thing: Any, seen: set[int]) -> bool:
    if id(thing) in seen:
        return False
    seen.add(id(thing))
    return True


def put_in_eval(nodes: Mapping[str, Any], holding: Any = None) -> dict[str, list[list[bool]]]:
    """Puts every module of ``nodes`` in eval mode, has none of their parameters ask
    for a gradient (so no autograd graph is built, wherever the grad mode of the thread
    that runs them stands) and every trainer among them hold nothing; answers each
    node's ``[modes, requires_grad]`` as they were. ``holding`` is what ``owned``
    answered for them, where it was asked already."""
    flags = {}
    for node_id, (modules, parameters) in (owned(nodes) if holding is None else holding).items():
        flags[node_id] = [[m.training for m in modules], [p.requires_grad for p in parameters]]
        for module in modules:
            module.training = False  # each one's own flag: its children are listed too
        for parameter in parameters:
            parameter.requires_grad_(False)
    for impl in nodes.values():
        if isinstance(impl, Learning):
            impl.seat.evaluating(True)
    return flags


def put_back(nodes: Mapping[str, Any], flags: Mapping[str, list[list[bool]]],
             holding: Any = None) -> None:
    """Undoes ``put_in_eval``: each module's mode and each parameter's requires_grad as
    ``flags`` kept them, each trainer training again."""
    for impl in nodes.values():
        if isinstance(impl, Learning):
            impl.seat.evaluating(False)
    for node_id, (modules, parameters) in (owned(nodes) if holding is None else holding).items():
        modes, grads = flags.get(node_id, ((), ()))
        if len(modules) != len(modes) or len(parameters) != len(grads):
            raise DeclarationError(
                f"node {node_id!r} holds {len(modules)} modules and {len(parameters)} "
                f"parameters now, and held {len(modes)} and {len(grads)} when it was put in "
                "eval mode; a node cannot change what it holds while it is evaluated")
        for module, training in zip(modules, modes):
            module.training = training
        for parameter, asks in zip(parameters, grads):
            parameter.requires_grad_(asks)


def evaluating_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """``evaluating``: with ``{"on": True}`` the session's nodes in eval mode, its
    trainers holding nothing, answering the flags to give back; with ``{"on": False,
    "flags": ...}`` everything as those flags say."""
    if asked["on"]:
        _alone(nodes)
        return put_in_eval(nodes)
    put_back(nodes, asked["flags"])
    return {}


def _alone(nodes: Mapping[str, Any]) -> None:
    """Refuses to put a shared trainer's node in eval mode while other clients train it:
    their steps would run through it in eval mode, without gradients, between this
    client's requests. Nothing has changed when it refuses."""
    for node_id, impl in nodes.items():
        group = impl.seat.group if isinstance(impl, Learning) else None
        others = [] if group is None else [m for m in group.members.values()
                                           if m is not impl.seat]
        if others:
            raise DeclarationError(
                f"node {made_from(node_id)!r} is trained shared={group.key!r} by "
                f"{len(others)} other client(s) on this host, and evaluating it would switch "
                "the node they train to eval mode under their steps; predict with a graph of "
                "your own built again with the weights of Trainer.export(), or once the "
                "others are done")


VERBS = {"evaluating": evaluating_verb}


@contextlib.contextmanager
def evaluated(here: Mapping[str, Any], hosts: Iterable[str],
              ask: Callable[[str, str, Any], Any]):
    """Eval mode over ``here`` (nodes in this process) and over the Trainer's session on
    each of ``hosts`` (asked with ``ask(host, verb, args)``), without autograd here;
    everything back as it was afterwards, after an error too. Where putting it back
    fails as well, the first error is the one raised."""
    holding = owned(here, grads=False)
    kept: dict[str, Any] = {"": put_in_eval(here, holding)}
    try:
        for host in hosts:
            kept[host] = ask(host, "evaluating", {"on": True})
        with torch.no_grad():
            yield
    except BaseException:
        _restore(here, holding, kept, ask, quiet=True)
        raise
    _restore(here, holding, kept, ask, quiet=False)


def _restore(here: Mapping[str, Any], holding: Any, kept: Mapping[str, Any],
             ask: Callable[[str, str, Any], Any], *, quiet: bool) -> None:
    failed: list[BaseException] = []
    for host, flags in kept.items():
        try:
            if host == "":
                put_back(here, flags, holding)
            else:
                ask(host, "evaluating", {"on": False, "flags": flags})
        except Exception as exc:  # noqa: BLE001 (whatever it was, the others are still put back)
            failed.append(exc)
    if failed and not quiet:
        raise failed[0]


def checked_metrics(metrics: Any) -> dict[str, Callable[[Any, Any], Any]]:
    """``metrics`` as ``{name: function(output, target)}``; a name that is not a
    string, ``loss`` (the objective's own), or something that cannot be called is
    refused, naming it."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics= maps names to functions of (output, target), such as "
                        f"{{'accuracy': accuracy}}, not a {type(metrics).__qualname__}")
    for name, function in metrics.items():
        if type(name) is not str or not name or name == "loss":
            raise DeclarationError(
                f"metrics= names a metric {name!r}; give each a non-empty name of its own "
                "('loss' is the objective's)")
        if not callable(function):
            raise TypeError(f"metric {name!r} is a {type(function).__qualname__}, which cannot "
                            "be called; give a function of (output, target) answering a number")
    return dict(metrics)


def rows_of(target: Any, output: Any) -> int:
    """How many rows a batch has: its target's first dimension (its output's where the
    target is not a tensor)."""
    for value in (target, output):
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    raise TypeError("evaluate() weighs each batch by its rows, the first dimension of its "
                    f"target, and this target is a {type(target).__qualname__}; give a tensor")


def number(value: Any, name: str) -> float:
    """A metric's answer as a float: a number, or a tensor of one element."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} answered a tensor of shape {tuple(value.shape)}; it has "
                            "to answer one number for the batch (reduce it, e.g. .mean())")
        return value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} answered a {type(value).__qualname__}; it has to answer a number")


def averaged(sums: Mapping[str, float], rows: int) -> dict[str, float]:
    """Each sum of ``value * rows`` over the batches, over all the rows."""
    if rows == 0:
        raise ValueError("evaluate() was given no batches; give it (input, target) pairs")
    return {name: total / rows for name, total in sums.items()}


def better(value: float, best: float | None, lower: bool) -> bool:
    """Whether ``value`` improves on ``best`` (None: nothing yet); nan never does."""
    if math.isnan(value):
        return False
    return best is None or (value < best if lower else value > best)
