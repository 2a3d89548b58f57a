"""What the nodes of a graph hold, asked by duck: parameters, weights by name, freezing.

A node is never required to be a ``torch.nn.Module``. Its parameters are what its
``.parameters()`` answers; its weights, by name, are its ``state_dict()`` where it has
one, otherwise what the modules it keeps as attributes hold (``net.0.weight``), and as
a last resort its parameters by position (``parameters.0``). Freezing reaches both, so
a node whose ``.parameters()`` leaves something out is still settled whole.

A node trained where it runs is asked for its weights, or handed some, through its
trainer: two verbs of its session there (``VERBS``: ``weights`` and ``load``, registered
by ``somatize.torch``), answered with what the trainer holds.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch

from .._errors import DeclarationError, UnwritableError
from .._keys import Unwritable, hexdigest_of
from .._node import MADE_WITH
from ._module import Module

__all__ = [
    "VERBS", "checked_node", "checked_weights", "copy_weights", "freeze", "has_parameters",
    "held", "load_verb", "mode_verb", "modules_of", "parameters", "snapshot", "trainer_at",
    "weights_digest", "weights_of", "weights_verb",
]

Weights = dict[str, dict[str, Any]]


def parameters(graph: Any, without: Container[str] = ()) -> list[torch.nn.Parameter]:
    """Every parameter the nodes of ``graph`` say they have, once each, in node order.

    A node without ``.parameters()`` is skipped, not refused: a tokenizer is still a
    node. Repeats are dropped by identity, since two nodes may share a module, and an
    optimizer handed one tensor twice would step it twice. ``without`` names nodes to
    leave out — the ones something else updates; a name that is not a node is refused,
    because a typo there would quietly train what was meant to be left alone.
    """
    if isinstance(without, (str, bytes)):
        raise TypeError(f"without= takes a collection of node ids, not the str {without!r}; "
                        f"write without=[{without!r}]")
    nodes = graph.nodes()
    if isinstance(without, Iterable):
        unknown = [n for n in without if graph.implementation(n) is None]
        if unknown:
            raise DeclarationError(
                f"without= names {', '.join(map(repr, unknown))}, which this graph does not "
                f"have; its nodes are {', '.join(map(repr, nodes))}"
            )
    seen: set[int] = set()
    found: list[torch.nn.Parameter] = []
    for node_id in nodes:
        if node_id in without:
            continue
        for parameter in _declared_parameters(graph.implementation(node_id), node_id):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                found.append(parameter)
    return found


def _declared_parameters(node: Any, node_id: str) -> list[torch.Tensor]:
    """What the node's own ``.parameters()`` answers, checked; [] if it has none."""
    ask = getattr(node, "parameters", None)
    if not callable(ask):
        return []
    said = list(ask())
    for item in said:
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"node {node_id!r}: .parameters() answered a {type(item).__qualname__}; it "
                "has to answer torch tensors (list(self.net.parameters()), for instance)"
            )
    return said


def modules_of(node: Any) -> list[torch.nn.Module]:
    """The modules a node holds: itself if it is one, else its module attributes."""
    if isinstance(node, torch.nn.Module):
        return [node]
    return [module for _, module in _attribute_modules(node)]


def _attribute_modules(node: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, module)`` for each module kept as an attribute, or in a list, tuple or
    dict kept as one. What the node was constructed with is not looked at: the
    arguments are noted for its key, and a module passed in is also kept by the node
    if it matters."""
    found = []
    for name, value in getattr(node, "__dict__", {}).items():
        if name == MADE_WITH:
            continue
        if isinstance(value, torch.nn.Module):
            found.append((name, value))
        elif isinstance(value, (list, tuple)):
            found += [(f"{name}.{i}", v) for i, v in enumerate(value)
                      if isinstance(v, torch.nn.Module)]
        elif isinstance(value, dict):
            found += [(f"{name}.{k}", v) for k, v in value.items()
                      if isinstance(k, str) and isinstance(v, torch.nn.Module)]
    return found


def held(node: Any, node_id: str = "?") -> list[torch.Tensor]:
    """Every parameter a node holds: what it says, and what its modules hold."""
    seen: set[int] = set()
    out = []
    inside = (p for module in modules_of(node) for p in module.parameters())
    for parameter in [*_declared_parameters(node, node_id), *inside]:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            out.append(parameter)
    return out


def has_parameters(node: Any, node_id: str = "?") -> bool:
    """Whether the node holds anything a backward pass could change."""
    return bool(held(node, node_id))


def weights_of(node: Any, node_id: str = "?") -> dict[str, Any]:
    """A node's weights by name, live (the node's own tensors, not copies)."""
    state_dict = getattr(node, "state_dict", None)
    if callable(state_dict):
        # a module's own (and module(m)'s, which is m's) keep their Parameters, so a
        # checkpoint reads their gradients too
        return dict(state_dict(keep_vars=True) if isinstance(node, (torch.nn.Module, Module))
                    else state_dict())
    weights: dict[str, Any] = {}
    for prefix, module in _attribute_modules(node):
        weights.update(module.state_dict(prefix=prefix + ".", keep_vars=True))
    for name, value in getattr(node, "__dict__", {}).items():
        if isinstance(value, torch.nn.Parameter):
            weights[name] = value
    if not weights:
        weights = {f"parameters.{i}": p for i, p in enumerate(_declared_parameters(node, node_id))}
    return weights


def weights_digest(node: Any, node_id: str) -> str | None:
    """The digest of a node's weights, through the tensor codec; None if it has none.

    Through the codec, so that it is the same bytes a store would keep: two
    checkpoints are two digests, and the same values on another device are one.
    """
    weights = weights_of(node, node_id)
    if not weights:
        return None
    try:
        return hexdigest_of(weights)
    except Unwritable as exc:
        raise UnwritableError(
            f"node {node_id!r}: its weights hold a {exc.what.__qualname__}, which cannot be "
            "written down, so the state it is frozen at cannot be named; register a codec "
            "for it with somatize.codec(...)"
        ) from None


def freeze(graph: Any, *node_ids: str) -> None:
    """Settles nodes: declares them frozen at the digest of their weights, and makes it
    true — no gradient for their parameters, and their modules in eval mode.

    With ids, those nodes are declared and settled; with none, whatever the graph
    already declares ``.frozen()`` is settled, its state filled in. Eval mode because
    frozen means the output does not change: a batch norm in training mode would still
    move its running statistics, and a dropout would answer differently every time, so
    a kept output would stop being what the node produces. All ids are checked, and
    every digest taken, before anything is changed.
    """
    for node_id in node_ids:
        if not isinstance(node_id, str) or graph.implementation(node_id) is None:
            raise DeclarationError(
                f"freeze() was asked for {node_id!r}, which this graph does not have; its "
                f"nodes are {', '.join(map(repr, graph.nodes()))}"
            )
    ids = list(dict.fromkeys(node_ids)) if node_ids else list(graph.frozen())
    states = {n: weights_digest(graph.implementation(n), n) for n in ids}
    for node_id in ids:
        node = graph.implementation(node_id)
        graph.freeze(node_id, state=states[node_id])
        for parameter in held(node, node_id):
            parameter.requires_grad_(False)
            parameter.grad = None  # a gradient left from before would still be applied
        for module in modules_of(node):
            module.eval()


def snapshot(graph: Any) -> Weights:
    """``{node: {key: tensor}}`` for every node that holds weights: detached copies."""
    out: Weights = {}
    for node_id in graph.nodes():
        weights = weights_of(graph.implementation(node_id), node_id)
        if weights:
            out[node_id] = {key: _copied(value) for key, value in weights.items()}
    return out


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def checked_weights(graph: Any, weights: Mapping[str, Mapping[str, Any]]) -> list[tuple]:
    """What ``copy_weights`` will copy, once every node, key, shape and dtype has been
    checked against the graph; a refusal names the node and the key, and copies nothing."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"load() takes {{node: {{key: tensor}}}}, as export() gives it, "
                        f"not a {type(weights).__qualname__}")
    plan = []
    for node_id, given in weights.items():
        node = graph.implementation(node_id) if isinstance(node_id, str) else None
        if node is None:
            raise DeclarationError(
                f"these weights name node {node_id!r}, which this graph does not have; its "
                f"nodes are {', '.join(map(repr, graph.nodes()))}"
            )
        plan.append(checked_node(node, node_id, given))
    return plan


def checked_node(node: Any, node_id: str, given: Any) -> tuple[Any, dict[str, Any], Mapping]:
    """One node's part of a load, checked: ``(node, its live weights, the given ones)``."""
    if not isinstance(given, Mapping):
        raise TypeError(f"the weights for node {node_id!r} are a {type(given).__qualname__}; "
                        "they have to be {key: tensor}")
    if callable(getattr(node, "state_dict", None)) and not callable(
            getattr(node, "load_state_dict", None)):
        raise DeclarationError(f"node {node_id!r} has state_dict() but no load_state_dict(), "
                               "so nothing can be loaded into it; give it one")
    here = weights_of(node, node_id)
    missing = [k for k in here if k not in given]
    extra = [k for k in given if k not in here]
    if missing or extra:
        said = []
        if missing:
            said.append(f"lack {', '.join(map(repr, missing[:5]))}")
        if extra:
            said.append(f"have {', '.join(map(repr, extra[:5]))}, which it does not")
        raise DeclarationError(
            f"the weights for node {node_id!r} {' and '.join(said)}; load what export() gave "
            f"for a node built the same way (its keys are {', '.join(map(repr, list(here)[:8]))})"
        )
    for key, mine in here.items():
        _fits(node_id, key, mine, given[key])
    return node, here, given


def copy_weights(plan: list[tuple]) -> None:
    """Copies what ``checked_weights``/``checked_node`` answered, in place, so that an
    optimizer holding these tensors goes on holding them."""
    with torch.no_grad():
        for node, here, given in plan:
            if callable(getattr(node, "state_dict", None)):
                node.load_state_dict(dict(given))
            else:
                for key, value in given.items():
                    here[key].copy_(value)


def _fits(node_id: str, key: str, mine: Any, theirs: Any) -> None:
    if not isinstance(mine, torch.Tensor):
        if type(theirs) is not type(mine):
            raise DeclarationError(f"node {node_id!r}, {key!r}: a {type(theirs).__qualname__} "
                                   f"was given where it holds a {type(mine).__qualname__}")
        return
    if not isinstance(theirs, torch.Tensor):
        raise DeclarationError(f"node {node_id!r}, {key!r}: a {type(theirs).__qualname__} was "
                               "given where it holds a tensor")
    if theirs.shape != mine.shape:
        raise DeclarationError(
            f"node {node_id!r}, {key!r}: the weights given have shape {tuple(theirs.shape)} "
            f"and the node holds {tuple(mine.shape)}; nothing was loaded — load weights of a "
            "node built with the same sizes"
        )
    if theirs.dtype != mine.dtype:
        raise DeclarationError(
            f"node {node_id!r}, {key!r}: the weights given are {theirs.dtype} and the node "
            f"holds {mine.dtype}; nothing was loaded — convert them with .to({mine.dtype}) first"
        )


# -- what a session's trainers answer, where they run (its verbs) -----------------------
def trainer_at(nodes: Mapping[str, Any], node: Any) -> Any:
    """The trainer standing under ``node``'s id among a session's nodes, or the
    DeclarationError naming what stands there instead. What a verb asks of it is its
    seat's (``_seat.Seat``)."""
    found = nodes.get(node) if type(node) is str else None
    if found is None or _trained_by(found) is None:
        what = "nothing" if found is None else f"a {type(found).__qualname__}"
        raise DeclarationError(f"node {node!r} is not trained where it runs ({what} stands "
                               "there); only a trainer's node is asked this way")
    return found


def _trained_by(impl: Any) -> Any:
    """The seat of ``impl`` if it is a trainer (a Learning, known here by its seat),
    else None."""
    seat = getattr(impl, "seat", None)
    return seat if callable(getattr(seat, "answering", None)) else None


def weights_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """``weights``: a trained node's weights, copied, so that training on changes
    nothing that was handed out."""
    learning = trainer_at(nodes, asked["node"])
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in weights_of(learning.seat.node).items()}


def load_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> bool:
    """``load``: the weights given checked against a trained node, and copied in
    unless ``check`` says this is only the check every machine passes before any of
    them copies."""
    learning = trainer_at(nodes, asked["node"])
    plan = checked_node(learning.seat.node, asked["node"], asked["weights"])
    if not asked["check"]:
        copy_weights([plan])
    return True


def mode_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    """``mode``: the modules of the session's nodes (``asked["nodes"]``, or all) put in
    training (``asked["train"]``) or eval mode; a frozen node stays in eval mode, as
    ``freeze`` left it. Answers the nodes that hold a module."""
    train, wanted = bool(asked["train"]), asked.get("nodes")
    frozen = asked.get("frozen") or ()
    moved = []
    for node_id, impl in nodes.items():
        if wanted is not None and node_id not in wanted:
            continue
        seat = _trained_by(impl)
        target = impl if seat is None else seat.node
        modules = modules_of(target) if target is not None else []
        for module in modules:
            module.train(train and node_id not in frozen)
        if modules:
            moved.append(node_id)
    return moved


VERBS = {"weights": weights_verb, "load": load_verb, "mode": mode_verb}
