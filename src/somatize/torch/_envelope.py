"""What crosses a trained node's cut: envelopes, the health beside them, narrowed tensors.

An envelope is one reserved key, ``__soma_envelope__``, holding ``[gradient or None,
closing]``: a dict, so it is data and crosses an edge and a wire as any value does,
and telling one from an input is one dict lookup. A pipelined step (``_pipeline``)
runs several forwards before the first gradient comes back, so a trainer keeps every
activation still owed a gradient, oldest first, and an envelope may carry a third
item, ``behind``: how many forwards ran after the one it is for (none, the newest,
unless said). Older ones are a failed step's leftovers and are let go of.

A trainer may be told to ``compress`` what crosses its cut: the activation it is given
and the gradient it answers, what it makes and the gradient it is handed, each sent in
a narrower floating type (bf16 or fp16) and widened back on arrival to the type it had.
A narrowed tensor travels as ``{"__soma_narrowed__": [tensor, "float32"]}``, so the
side that receives it tells it from a value by one dict lookup, as an envelope is told.
Where narrowing to float16 made infinities of finite values, a third item says how
many (``overflowed``): the side that narrowed may be a worker, whose warnings nobody
reads, so the Trainer's driver warns its user wherever the overflow happened.
Both ends round the same way whether the node runs here or on a worker, so a run here
and the same run there stay ``==``; against full precision they differ by the rounding,
which is why it is never on unless asked for.

These are the only forms a step's gradient channel carries (``Pass().back``): whatever
else a trainer's owner asks of it is a verb (``somatize._verbs``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._node import Opaque
from ._tensors import moved, summed

__all__ = ["HEALTH", "KEY", "MOST_OWED", "NARROWED", "RESERVED", "behind", "carries",
           "closing", "envelope", "gradient", "is_envelope", "narrowed", "narrowing",
           "overflowed", "widened"]

KEY = "__soma_envelope__"
HEALTH = "__soma_health__"  # beside an envelope: the health facts of the trainers it passed
MOST_OWED = 256  # forwards a trainer keeps waiting for their gradient; a pipeline runs fewer
RESERVED = "__soma_"  # how every key somatize itself puts in a value begins
NARROWED = "__soma_narrowed__"  # a tensor sent in a narrower type, and the type it had
# What compress= takes, by name or as the torch dtype itself.
_NARROWER = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}

def narrowing(compress: Any, of: str = "Learning") -> torch.dtype | None:
    """The floating type ``compress=`` names (None for None); anything else is refused,
    naming what is taken."""
    if compress is None:
        return None
    try:
        return _NARROWER[compress]
    except (KeyError, TypeError):
        raise TypeError(f"{of}(compress=...) sends what crosses the cut in a narrower type: "
                        f"'bf16' or 'fp16' (or torch.bfloat16, torch.float16), not "
                        f"{compress!r}") from None


def narrowed(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` as it crosses a cut that compresses to ``dtype``: a floating tensor
    wider than ``dtype`` goes narrowed, marked with the type it had (and how many of its
    finite values became inf, if any did); anything else (a tensor already as narrow,
    integers, None) goes as it is."""
    if (dtype is None or not isinstance(value, torch.Tensor) or not value.is_floating_point()
            or value.element_size() <= dtype.itemsize):
        return value
    narrow = value.detach().to(dtype)
    carried = [Opaque(narrow), str(value.dtype).removeprefix("torch.")]
    # float16 ends at 65504 and what lies beyond becomes inf; a finite sum says none did,
    # in one cheap pass (an infinite one may be the sum's own overflow, so count)
    if dtype is torch.float16 and not math.isfinite(narrow.sum().item()):
        lost = int((torch.isinf(narrow) & torch.isfinite(value.detach())).sum())
        if lost:
            carried.append(lost)
    return {NARROWED: carried}


def overflowed(value: Any) -> int:
    """How many finite values became inf where ``value`` (what ``narrowed`` made, or an
    envelope carrying it) was narrowed to float16; 0 for anything else."""
    if type(value) is dict and KEY in value:
        value = value[KEY][0]
        value = value.value if type(value) is Opaque else value
    if type(value) is not dict or NARROWED not in value:
        return 0
    carried = value[NARROWED]
    lost = carried[2] if isinstance(carried, (list, tuple)) and len(carried) > 2 else 0
    return lost if type(lost) is int else 0  # a count, or nothing said


def widened(value: Any) -> Any:
    """What ``narrowed`` sent, back in the type it had; any other value as it is."""
    if type(value) is not dict or NARROWED not in value:
        return value
    carried, name = value[NARROWED][:2]
    tensor = carried.value if type(carried) is Opaque else carried
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"a narrowed tensor names {name!r} as the type it had, which is not "
                        "a floating torch dtype; both ends must run the same somatize")
    return tensor.to(dtype)


def envelope(gradient: Any, closing: bool = False, behind: int = 0) -> dict[str, Any]:
    """A gradient in its envelope, the way one crosses an edge. ``closing`` says this
    one ends a group of accumulated steps, so whoever accumulates applies what it has;
    ``behind`` says how many forwards ran after the one this gradient is for."""
    carried = [None if gradient is None else Opaque(gradient), bool(closing)]
    if behind:
        carried.append(int(behind))
    return {KEY: carried}


def behind(value: Any) -> int:
    """How many forwards ran after the one an envelope (or a map of them) is for."""
    if type(value) is not dict:
        return 0
    if KEY in value:  # one envelope, the common case: read at once
        carried = value[KEY]
        return int(carried[2]) if len(carried) > 2 else 0
    for one in value.values():
        if is_envelope(one) and len(one[KEY]) > 2:
            return int(one[KEY][2])
    return 0


def is_envelope(value: Any) -> bool:
    return type(value) is dict and KEY in value


def carries(value: Any) -> bool:
    """Whether a value is a backward message: an envelope, or a map of them."""
    return type(value) is dict and (KEY in value or (
        bool(value) and all(type(v) is dict and KEY in v for v in value.values())))


def _inside(value: Any) -> Any:
    carried = value[KEY][0]
    return widened(carried.value if type(carried) is Opaque else carried)


def gradient(value: Any, device: str | torch.device | None = None) -> torch.Tensor | None:
    """What an envelope carries, or the sum of what a map of them carries, as a tensor
    on ``device`` (a structure's gradient: tensors on ``device`` in its shape). None for a value that is not a backward message at all, and for an
    envelope (or a map of them) carrying nothing."""
    if type(value) is dict and KEY in value:  # one envelope, the common case: read at once
        return moved(_inside(value), device)
    if not carries(value):
        return None
    carried = [_inside(value)] if KEY in value else [_inside(v) for v in value.values()]
    total = None
    for g in carried:
        if g is None:
            continue
        if device is not None:
            g = moved(g, device)
        total = g if total is None else summed(total, g)
    return total


def closing(value: Any) -> bool:
    """Whether any envelope in ``value`` closes a group."""
    if is_envelope(value):
        return bool(value[KEY][1])
    if type(value) is dict:
        return any(is_envelope(v) and v[KEY][1] for v in value.values())
    return False
