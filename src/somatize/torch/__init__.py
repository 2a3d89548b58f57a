"""Training, which only makes sense with torch in front of you.

The core knows nothing of losses, gradients or optimizers, and this package is where
they live: a ``Trainer`` takes a graph and trains it from outside, so the same graph
can be trained in several ways without being touched::

    from somatize.torch import Trainer, parameters

    t = Trainer(g, objective=torch.nn.functional.cross_entropy,
                optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    t.fit(data, epochs=10)

Importing it also registers how a tensor is written down (``somatize.torch._codec``),
which is what lets a graph key, keep and recall tensors. The name does not shadow
the real torch: imports are absolute, so ``import torch`` in here is the usual one.
"""

from __future__ import annotations

from .._errors import NoGradient, OutOfStep
from ._codec import register as _register
from ._trainer import Result, Trainer
from ._weights import freeze, parameters

_register()

__all__ = ["NoGradient", "OutOfStep", "Result", "Trainer", "freeze", "parameters"]
