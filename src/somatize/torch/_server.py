"""Server optimizers (Reddi et al., "Adaptive Federated Optimization"): the round's
average is taken as a step from the weights the round started from, and that step is
given momentum or an adaptive size, as an optimizer would give a gradient.

There is no server: whoever averages a round applies the step. Each optimizer is
therefore a pure function of (the round's start, its plain average, the state the
last round left), and its state (moments, the count of steps) travels in the store
with the round's average, so the next round's averager — any client — takes it up
where this one left it, and gets ``==`` weights whichever client that was.

The arithmetic is Flower's own (``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``
``aggregate_fit``), in float64, with Flower's count of rounds: its first step is its
round 1, so FedAdam's bias correction uses the step count plus one, as Flower's does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from ._aggregate import Export, _averaged

__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer"]

State = dict[str, Any]


class ServerOptimizer:
    """What ``gather(server=...)`` takes: ``step(start, average, state)`` answers the
    round's weights and the state the next round continues from (``None`` the first
    time). Subclasses write ``_moved``, on one float tensor at a time."""

    def step(self, start: Mapping[str, Mapping[str, Any]], average: Export,
             state: State | None) -> tuple[Export, State]:
        """The weights that end the round, and the state to keep beside them."""
        steps = 0 if state is None else int(state["steps"])
        moments = {} if state is None else state["moments"]
        result: Export = {}
        kept: dict[str, dict[str, torch.Tensor]] = {}
        for node, weights in average.items():
            result[node], kept[node] = {}, {}
            for key, value in weights.items():
                if not _averaged(value):
                    result[node][key] = value
                    continue
                begun = start[node][key].detach().to(torch.float64)
                delta = value.detach().to(torch.float64) - begun
                moved, kept[node][key] = self._moved(
                    begun, delta, moments.get(node, {}).get(key), steps + 1)
                result[node][key] = moved.to(value.dtype)
        return result, {"steps": steps + 1, "moments": kept}

    def _moved(self, start: torch.Tensor, delta: torch.Tensor, moments: Any,
               round: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError


def _positive(name: str, value: Any, *, zero: bool = False, below_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero) or (below_one and value >= 1):
        allowed = "0 or more" if zero else "above 0"
        raise ValueError(f"{name}={value!r} is refused: it is a number {allowed}"
                         + (" and below 1" if below_one else ""))
    return float(value)


@dataclass(init=False)
class FedAvgM(ServerOptimizer):
    """FedAvg with server momentum (Hsu et al., 2019): the step from the start to the
    average, times ``learning_rate``, with ``momentum`` of the steps before it."""

    learning_rate: float
    momentum: float

    def __init__(self, learning_rate: float = 1.0, momentum: float = 0.0):
        self.learning_rate = _positive("learning_rate", learning_rate)
        self.momentum = _positive("momentum", momentum, zero=True, below_one=True)

    def _moved(self, start, delta, moments, round):
        pseudo_gradient = -delta  # the step is the opposite of a gradient
        if self.momentum > 0.0:
            pseudo_gradient = pseudo_gradient if moments is None \
                else self.momentum * moments + pseudo_gradient
        return start - self.learning_rate * pseudo_gradient, pseudo_gradient


@dataclass(init=False)
class _Adaptive(ServerOptimizer):
    eta: float
    beta_1: float
    beta_2: float
    tau: float

    def __init__(self, eta: float, beta_1: float, beta_2: float, tau: float):
        self.eta = _positive("eta", eta)
        self.beta_1 = _positive("beta_1", beta_1, zero=True, below_one=True)
        self.beta_2 = _positive("beta_2", beta_2, zero=True, below_one=True)
        self.tau = _positive("tau", tau)

    def _moved(self, start, delta, moments, round):
        first, second = (torch.zeros_like(delta), torch.zeros_like(delta)) \
            if moments is None else moments.unbind()
        first = self.beta_1 * first + (1 - self.beta_1) * delta
        second = self._second(second, delta)
        return start + self._rate(round) * first / (second.sqrt() + self.tau), \
            torch.stack([first, second])

    def _rate(self, round: int) -> float:
        return self.eta

    def _second(self, second: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FedAdam(_Adaptive):
    """Adam on the server, with Flower's defaults and its bias correction."""

    def __init__(self, eta: float = 1e-1, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-9):
        super().__init__(eta, beta_1, beta_2, tau)

    def _rate(self, round: int) -> float:
        return self.eta * math.sqrt(1 - self.beta_2 ** (round + 1.0)) \
            / (1 - self.beta_1 ** (round + 1.0))

    def _second(self, second, delta):
        return self.beta_2 * second + (1 - self.beta_2) * delta * delta


class FedYogi(_Adaptive):
    """Yogi on the server: the second moment moves by a sign, so it grows slowly."""

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-3):
        super().__init__(eta, beta_1, beta_2, tau)

    def _second(self, second, delta):
        squared = delta * delta
        return second - (1.0 - self.beta_2) * squared * torch.sign(second - squared)


class FedAdagrad(_Adaptive):
    """Adagrad on the server: no momentum, the squares summed."""

    def __init__(self, eta: float = 1e-1, tau: float = 1e-9):
        super().__init__(eta, 0.0, 0.0, tau)

    def _second(self, second, delta):
        return second + delta * delta
