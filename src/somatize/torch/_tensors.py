"""The tensors inside a value: one walk through tensors, lists, tuples and dicts."""

from __future__ import annotations

from typing import Any

import torch

from .._node import Done, Opaque

__all__ = ["detached", "device_of", "gradients_of", "leafed", "measurable_in", "moved", "paired",
           "rebuilt", "summed", "tensors_in"]


def tensors_in(value: Any, *, refusing: str | None = None, depth: int | None = None) -> list[torch.Tensor]:
    """Every tensor in ``value``, in order: through ``Opaque``/``Done``, lists, tuples and
    dict values, at most ``depth`` containers deep. Anything else is skipped, or, when
    ``refusing`` names what is being cut (``"the input"``), refused with a TypeError."""
    found: list[torch.Tensor] = []
    _walk(value, refusing, depth, found)
    return found


def measurable_in(value: Any) -> list[torch.Tensor]:
    """The tensors of an output the Audit measures and a probe differentiates: the
    floating-point, non-empty ones, at most three containers deep."""
    return [t for t in tensors_in(value, depth=3) if t.is_floating_point() and t.numel()]


def _walk(value: Any, refusing: str | None, depth: int | None, found: list) -> None:
    if type(value) is Opaque or type(value) is Done:
        value = value.value
    if isinstance(value, torch.Tensor):
        found.append(value)
        return
    deeper = None if depth is None else depth - 1
    if isinstance(value, (list, tuple)) and (depth is None or depth > 0):
        for item in value:
            _walk(item, refusing, deeper, found)
    elif isinstance(value, dict) and (depth is None or depth > 0):
        for item in value.values():
            _walk(item, refusing, deeper, found)
    elif refusing is not None:
        raise TypeError(f"micro= cuts the batch with torch.chunk, and {refusing} holds a "
                        f"{type(value).__qualname__}; give tensors (or tuples, lists and dicts "
                        "of them), or use micro=1")


# -- what crosses a cut: a tensor, or tuples, lists and dicts of them with plain data --
#
# A value handed across a cut may hold several tensors (a transformer's hidden states
# and its integer mask). Its gradient has the value's own shape: a tensor's gradient
# where a tensor had one, None everywhere else (an integer tensor, plain data, a
# tensor nothing reached). A lone tensor's gradient is a tensor, as it always was.


def rebuilt(value: Any, change: Any) -> Any:
    """``value`` with every tensor inside it replaced by ``change(tensor)``: tuples,
    lists, dicts and ``Opaque`` kept as they were around them; a value holding no
    tensor is handed back as it is, not copied."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if type(value) is Opaque:
        inner = rebuilt(value.value, change)
        return value if inner is value.value else Opaque(inner)
    if isinstance(value, (list, tuple)):
        items = [rebuilt(item, change) for item in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else _same_kind(value, items)
    if isinstance(value, dict):
        items = {key: rebuilt(item, change) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _same_kind(value, items)
    return value


def _same_kind(value: Any, items: Any) -> Any:
    """``items`` in the container type ``value`` had, or a plain one where that type
    cannot be made from its items (a dict subclass with an ``__init__`` of its own)."""
    if type(value) in (tuple, dict):
        return type(value)(items)
    try:
        return type(value)(items)
    except TypeError:
        return tuple(items) if isinstance(value, tuple) else dict(items)


def leafed(value: Any) -> Any:
    """``value`` cut from the graph that made it: each tensor a fresh leaf, a floating
    (or complex) one asking for its gradient, any other not (an integer mask has none)."""
    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        fresh = tensor.detach()
        if fresh.is_floating_point() or fresh.is_complex():
            fresh.requires_grad_(True)
        return fresh
    return rebuilt(value, leaf)


def detached(value: Any) -> Any:
    """``value`` with every tensor inside detached from the graph that made it."""
    return rebuilt(value, torch.Tensor.detach)


def gradients_of(value: Any) -> Any:
    """The gradient each tensor of ``value`` received, in ``value``'s shape; None where
    none arrived anywhere in it, so that "owed nothing" stays one None."""
    if isinstance(value, torch.Tensor):
        return value.grad
    found = [False]

    def grad(tensor: torch.Tensor) -> Any:
        if tensor.grad is not None:
            found[0] = True
        return tensor.grad
    shaped = _shaped(value, grad)
    return shaped if found[0] else None


def _shaped(value: Any, at_tensor: Any) -> Any:
    """``value``'s shape with ``at_tensor(t)`` at each tensor and None at everything else."""
    if type(value) is Opaque or type(value) is Done:
        value = value.value
    if isinstance(value, torch.Tensor):
        return at_tensor(value)
    if isinstance(value, (list, tuple)):
        return [_shaped(item, at_tensor) for item in value]
    if isinstance(value, dict):
        return {key: _shaped(item, at_tensor) for key, item in value.items()}
    return None


def paired(value: Any, grad: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of ``value`` that ask for a gradient and have one in ``grad`` (its
    gradient, in its shape), and those gradients, in order: what one
    ``torch.autograd.backward`` takes."""
    tensors: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    _pair(value, grad, tensors, grads)
    return tensors, grads


def _pair(value: Any, grad: Any, tensors: list, grads: list) -> None:
    if grad is None:
        return
    if type(value) is Opaque or type(value) is Done:
        value = value.value
    if isinstance(value, torch.Tensor):
        if isinstance(grad, torch.Tensor) and value.requires_grad:
            tensors.append(value)
            grads.append(grad)
    elif isinstance(value, (list, tuple)) and isinstance(grad, (list, tuple)):
        for item, g in zip(value, grad):
            _pair(item, g, tensors, grads)
    elif isinstance(value, dict) and isinstance(grad, dict):
        for key, item in value.items():
            _pair(item, grad.get(key), tensors, grads)


def summed(a: Any, b: Any) -> Any:
    """Two gradients of one value added, tensor by tensor; None is nothing owed."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, torch.Tensor):
        return a + b
    if isinstance(a, dict):
        return {key: summed(a.get(key), b.get(key)) for key in {**a, **b}}
    return [summed(x, y) for x, y in zip(a, b)]


def moved(grad: Any, device: Any) -> Any:
    """A gradient with every tensor in it on ``device`` (None: where it is)."""
    if grad is None or device is None:
        return grad
    if isinstance(grad, torch.Tensor):
        return grad.to(device)
    return rebuilt(grad, lambda tensor: tensor.to(device))


def device_of(value: Any) -> Any:
    """Where the first tensor of ``value`` lives, or None for a value without one."""
    if isinstance(value, torch.Tensor):
        return value.device
    found = tensors_in(value)
    return found[0].device if found else None
