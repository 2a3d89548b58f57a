"""Where an output is bounded, and how many of its values sit at a bound: what
``act_saturated`` counts, however the node computed the output.

Three ways to know, tried in turn for each tensor a place produced:

- a module that bounds what it answers marked the tensor while the node ran
  (``Sigmoid``, ``Tanh``, ``Softsign``, ``Hardtanh`` and ``ReLU6``, ``Hardsigmoid``;
  the hidden states of ``GRU``, ``LSTM`` and tanh ``RNN`` layers and cells, whose
  every value is a tanh or a convex mix of them — not an LSTM's cell state, which
  is not bounded, nor a projected LSTM's output; ``GLU``, whose gate is a sigmoid);
- the function that made it, read off its ``grad_fn``: ``sigmoid``, ``tanh``,
  ``hardtanh``/``relu6``, ``hardsigmoid``, ``clamp`` between two bounds, ``glu``;
- either of those for the tensor a view was taken of (``h[-1]``, ``out[:, -1]``).

A value is saturated within 1% of the range from either bound; a gate within 1% of
0 or 1, which is where its input is beyond ±ln 99. Everything is counted where the
tensor is, as one more of the step's on-device reductions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["NEAR", "marks_of", "module_is_bounded", "saturation"]

NEAR = 0.01  # "saturated" is within this share of the range from either bound
_GATE = math.log((1 - NEAR) / NEAR)  # a sigmoid's input past this is within NEAR of 0 or 1

_CLASSES = ((torch.nn.Sigmoid, (0.0, 1.0)), (torch.nn.Tanh, (-1.0, 1.0)),
            (torch.nn.Softsign, (-1.0, 1.0)), (torch.nn.Hardsigmoid, (0.0, 1.0)))
_FUNCTIONS = {"SigmoidBackward0": (0.0, 1.0), "TanhBackward0": (-1.0, 1.0),
              "HardsigmoidBackward0": (0.0, 1.0)}
_RECURRENT = (torch.nn.GRU, torch.nn.RNN, torch.nn.LSTM, torch.nn.GRUCell, torch.nn.RNNCell,
              torch.nn.LSTMCell)
_TANH = (-1.0, 1.0)
# what makes most outputs, none of them bounded: said at once, without the tries below
_UNBOUNDED = frozenset({"ReluBackward0", "AddmmBackward0", "AddBackward0", "MulBackward0",
                        "ViewBackward0", "MmBackward0", "GeluBackward0", "SiluBackward0",
                        "NativeLayerNormBackward0", "ConvolutionBackward0"})


def module_is_bounded(module: Any) -> bool:
    """Whether what ``module`` answers has a bounded part worth marking."""
    if isinstance(module, (torch.nn.RNN, torch.nn.RNNCell)):
        return module.nonlinearity == "tanh"
    if isinstance(module, torch.nn.LSTM) and module.proj_size > 0:
        return False  # its hidden state is projected by a linear map: unbounded
    return isinstance(module, (torch.nn.Hardtanh, torch.nn.GLU, *_RECURRENT)) or any(
        isinstance(module, cls) for cls, _ in _CLASSES)


def marks_of(module: Any, args: Any, output: Any) -> list[tuple[torch.Tensor, tuple]]:
    """``(tensor, how)`` for each bounded tensor in what ``module`` answered: ``how``
    is ``("bounds", low, high)``, or ``("gate", input, dim)`` for a GLU."""
    if isinstance(module, torch.nn.Hardtanh):  # ReLU6 is one
        bounds = (float(module.min_val), float(module.max_val))
    elif isinstance(module, torch.nn.GLU):
        given = args[0] if args and isinstance(args[0], torch.Tensor) else None
        return [] if given is None or not isinstance(output, torch.Tensor) else \
            [(output, ("gate", given, module.dim))]
    elif isinstance(module, torch.nn.LSTM):
        return _tensors_marked(_lstm_hidden(output), _TANH)
    elif isinstance(module, torch.nn.LSTMCell):
        return _tensors_marked(output[:1] if isinstance(output, tuple) else (), _TANH)
    elif isinstance(module, _RECURRENT):
        bounds = _TANH if module_is_bounded(module) else None
    else:
        bounds = next((b for cls, b in _CLASSES if isinstance(module, cls)), None)
    return [] if bounds is None else _tensors_marked(_flat(output), bounds)


def _lstm_hidden(output: Any) -> list[Any]:
    """An LSTM answers ``(output, (h_n, c_n))``: the first two are bounded."""
    if not isinstance(output, tuple) or len(output) != 2:
        return []
    state = output[1]
    return [output[0], *(state[:1] if isinstance(state, tuple) else ())]


def _flat(output: Any) -> list[Any]:
    if isinstance(output, (list, tuple)) and not isinstance(output, torch.Tensor):
        return [t for item in output for t in _flat(item)]
    return [output]


def _tensors_marked(items: list[Any], bounds: tuple[float, float]) -> list[tuple]:
    out = []
    for item in items:
        tensor = getattr(item, "data", item) if type(item).__name__ == "PackedSequence" else item
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            out.append((tensor, ("bounds", *bounds)))
            # batch_first answers a transposed view; views of it point at that base
            base = tensor._base
            if base is not None and base.numel() == tensor.numel():
                out.append((base, ("bounds", *bounds)))
    return out


def saturation(tensor: torch.Tensor, flat: torch.Tensor, marked: dict[int, tuple]
               ) -> tuple[torch.Tensor, int] | None:
    """How many of ``tensor``'s values are at a bound (a 0-dim tensor, on its device)
    and out of how many; None where nothing says the tensor is bounded. ``flat`` is
    the tensor as the caller measures it (detached, flat, at least single precision);
    ``marked`` maps ``id`` of a tensor to its ``how``, as ``marks_of`` said."""
    how = _how(tensor, marked)
    if how is None:
        return None
    if how[0] == "gate":
        given, dim = how[1], int(how[2])
        if dim >= 2**63:  # a negative dim, as the autograd node keeps it (unsigned)
            dim -= 2**64
        dim %= given.dim()
        half = given.shape[dim] // 2
        gate = given.detach().narrow(dim, half, half).reshape(-1)
        if gate.dtype in (torch.float16, torch.bfloat16):
            gate = gate.float()
        return _past(gate.abs(), _GATE), gate.numel()
    low, high = how[1], how[2]
    if not high > low:
        return None
    centred = (flat - (low + high) / 2).abs_()
    return _past(centred, (0.5 - NEAR) * (high - low)), flat.numel()


def _past(values: torch.Tensor, margin: float) -> torch.Tensor:
    """How many of ``values`` (a scratch tensor, overwritten) are beyond ``margin``:
    the signs are +1 past it, so half their sum plus the sum of their squares counts
    exactly those."""
    sign = values.sub_(margin).sign_()
    return (sign.sum() + torch.dot(sign, sign)) / 2


def _how(tensor: torch.Tensor, marked: dict[int, tuple]) -> tuple | None:
    base = tensor._base
    if base is None and not marked:  # the usual case, said without the loop
        return _of_function(tensor.grad_fn)
    for candidate in (tensor, base):
        if candidate is None:
            continue
        how = marked.get(id(candidate))
        if how is None:
            how = _of_function(candidate.grad_fn)
        if how is not None:
            return how
    return None


def _of_function(function: Any) -> tuple | None:
    if function is None:
        return None
    name = type(function).__name__
    if name in _UNBOUNDED:
        return None
    if name in _FUNCTIONS:
        return ("bounds", *_FUNCTIONS[name])
    try:
        if name == "HardtanhBackward0":
            return ("bounds", float(function._saved_min_val), float(function._saved_max_val))
        if name.startswith("ClampBackward"):
            low, high = function._saved_min, function._saved_max
            if isinstance(low, (int, float)) and isinstance(high, (int, float)):
                return ("bounds", float(low), float(high))
            return None
        if name == "GluBackward0":
            return ("gate", function._saved_self, function._saved_dim)
    except RuntimeError:  # what it saved is gone (a graph already walked back)
        return None
    return None
