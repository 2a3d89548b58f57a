"""An ``nn.Module`` as a node, in one call: ``somatize.torch.module(m)``.

Without it everybody writes the same few lines (a node holding ``m``, a forward that
calls it and wraps the answer in ``Opaque``, a ``parameters()``), and the wrapper's
attribute then prefixes every export key (``module.layers.0.weight``), so what was
trained no longer loads back into ``m``. Here the node answers ``m``'s own
``state_dict``, so ``m.load_state_dict(trainer.export()[node_id])`` works. The
core refuses a module used as a node directly, naming this function (``_dsl``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._node import Ctx, Node, Opaque

__all__ = ["Module", "module"]


class Module(Node):
    """A ``torch.nn.Module`` standing as a node: its forward is ``m(x)``, its answer
    crosses as ``Opaque``, and its parameters, weights and export keys are ``m``'s own.
    Made by ``module(m)``; ``.module`` is ``m`` itself, not a copy."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def forward(self, x: Any, ctx: Ctx) -> Any:
        return Opaque(self.module(x))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``m.state_dict(...)``: the keys ``m.load_state_dict`` takes back."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

    def __repr__(self) -> str:
        return f"module({type(self.module).__qualname__})"


def module(m: torch.nn.Module) -> Module:
    """``m`` as a node (see ``Module``); anything but an ``nn.Module`` is refused."""
    if not isinstance(m, torch.nn.Module):
        hint = " (the class itself: instantiate it first)" if isinstance(m, type) else ""
        raise TypeError(f"somatize.torch.module takes a torch.nn.Module, not a "
                        f"{type(m).__qualname__}{hint}")
    return Module(m)
