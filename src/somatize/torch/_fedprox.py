"""FedProx (Li et al., 2020): a client's objective plus ``mu / 2 * ||w - w_round||^2``,
which keeps its weights near the ones the round started from, so clients whose data
differ drift apart less in the rounds between averages."""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch

from ._weights import parameters

__all__ = ["fedprox"]


class Proximal:
    """An objective with FedProx's proximal term; ``restart()`` takes the graph's
    weights as they are now as the round's start (call it after loading the round's
    average)."""

    def __init__(self, objective: Callable[[Any, Any], Any], graph: Any, mu: float):
        self._objective, self._mu = objective, float(mu)
        self._weights = parameters(graph)
        self._start: list[torch.Tensor] = []
        self.restart()

    def restart(self) -> None:
        """The weights the round starts from are the graph's weights now."""
        self._start = [p.detach().clone() for p in self._weights]

    def __call__(self, output: Any, target: Any) -> Any:
        loss = self._objective(output, target)
        if self._mu == 0.0:
            return loss
        drift = sum((p - s).pow(2).sum() for p, s in zip(self._weights, self._start))
        return loss + self._mu / 2 * drift

    def __repr__(self) -> str:
        return f"fedprox({self._objective!r}, mu={self._mu:g})"


def fedprox(objective: Callable[[Any, Any], Any], graph: Any, mu: float) -> Proximal:
    """``objective`` with FedProx's proximal term over ``graph``'s parameters, ready to
    be a Trainer's ``objective=``: ``Trainer(g, objective=fedprox(loss, g, mu=0.01))``.

    The round's start is the graph's weights when this is called; after loading each
    round's average, call ``.restart()`` on it. ``mu=0`` is the objective itself.
    """
    if not callable(objective):
        raise TypeError(f"objective is a {type(objective).__qualname__}, which cannot be "
                        "called; give a function of (output, target) answering the loss")
    if isinstance(mu, bool) or not isinstance(mu, Real) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu={mu!r} is refused: it is the proximal term's weight, 0 or more "
                         "(FedProx's paper tries 0.001 to 1)")
    return Proximal(objective, graph, mu)
