"""The tensors inside a value: one walk through tensors, lists, tuples and dicts."""

from __future__ import annotations

from typing import Any

import torch

from .._node import Done, Opaque

__all__ = ["measurable_in", "tensors_in"]


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
