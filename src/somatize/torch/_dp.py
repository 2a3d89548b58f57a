"""Client-level differential privacy for a round (DP-FedAvg, McMahan et al., 2018).

Each client's update — its export minus the weights the round started from — is
scaled down to at most ``clip`` in L2 norm over all its float weights, the clipped
updates are averaged with equal weight, and Gaussian noise of standard deviation
``noise * clip / parts`` is added to that average. One client then moves the average
by at most ``clip / parts``, which is what the noise hides.

The noise is drawn from a generator seeded by (``seed``, run, round), so whichever
client averages a round draws the same noise and the round still has one answer.

What the rounds spend is counted by Google's ``dp-accounting`` (its RDP accountant
over a Poisson-sampled Gaussian, the sampling rate being the share of the population
whose part was averaged): each round's ε at ``delta`` is kept in that round's meta, and
``privacy_spent`` reads them back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch

from .._optional import optional
from ._aggregate import Export, _averaged

__all__ = ["ClientPrivacy", "noise_for", "privacy_spent"]


def _accounting() -> Any:
    return optional("dp_accounting", "dp", "ClientPrivacy")


class ClientPrivacy:
    """DP-FedAvg for ``gather(privacy=...)``: updates clipped to ``clip``, noise of
    ``noise`` times the clip on the average, ε counted at ``delta``.

    ``population`` is how many clients the parts of a round are drawn from (default:
    the round's ``clients``); the accountant takes each round as a sample of
    ``parts / population`` of them. ``noise_for`` finds the ``noise`` for a target ε.
    """

    def __init__(self, clip: float, noise: float, *, delta: float = 1e-5, seed: int = 0,
                 population: int | None = None):
        _accounting()  # refused now, naming the extra, rather than at the first average
        for name, value in (("clip", clip), ("delta", delta)):
            if isinstance(value, bool) or not isinstance(value, Real) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} is refused: it is a positive number")
        if isinstance(noise, bool) or not isinstance(noise, Real) or not noise > 0 \
                or not math.isfinite(noise):
            raise ValueError(f"noise={noise!r} is refused: it is the noise's standard "
                             "deviation as a multiple of clip=, above 0; noise_for() finds "
                             "it for an epsilon")
        if not delta < 1:
            raise ValueError(f"delta={delta!r} is refused: it is a probability below 1, "
                             "typically below 1 / the number of clients")
        if type(seed) is not int:
            raise TypeError(f"seed= is an int, not a {type(seed).__qualname__}")
        if population is not None and (type(population) is not int or population < 1):
            raise ValueError(f"population={population!r} is refused: it is how many "
                             "clients there are, at least 1")
        self.clip, self.noise, self.delta = float(clip), float(noise), float(delta)
        self.seed, self.population = seed, population

    def __repr__(self) -> str:
        return (f"ClientPrivacy(clip={self.clip:g}, noise={self.noise:g}, "
                f"delta={self.delta:g}, seed={self.seed})")

    @torch.no_grad()
    def average(self, start: Mapping[str, Mapping[str, Any]], parts: Sequence[Export],
                run: str, round: int) -> Export:
        """The start moved by the noised mean of the clipped updates."""
        updates = []
        for part in parts:
            update = {(node, key): value.detach().to(torch.float64)
                      - start[node][key].detach().to(torch.float64)
                      for node, weights in part.items() for key, value in weights.items()
                      if _averaged(value)}
            norm = math.sqrt(sum(float(u.pow(2).sum()) for u in update.values()))
            scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
            updates.append({k: u * scale for k, u in update.items()})
        generator = torch.Generator().manual_seed(_seed(self.seed, run, round))
        deviation = self.noise * self.clip / len(parts)
        result: Export = {}
        for node, weights in parts[0].items():
            result[node] = {}
            for key, value in weights.items():
                if not _averaged(value):
                    result[node][key] = value.detach().clone() \
                        if isinstance(value, torch.Tensor) else value
                    continue
                mean = sum(u[(node, key)] for u in updates) / len(parts)
                drawn = torch.randn(mean.shape, generator=generator, dtype=torch.float64)
                moved = start[node][key].detach().to(torch.float64) + mean + deviation * drawn
                result[node][key] = moved.to(value.dtype)
        return result

    def spent(self, before: Sequence[Sequence[float]], parts: int,
              clients: int) -> dict[str, Any]:
        """The record of a round: the rounds so far (sampling rate, noise) and ε."""
        rate = min(1.0, parts / (self.population or clients))
        rounds = [list(r) for r in before] + [[rate, self.noise]]
        return {"clip": self.clip, "noise": self.noise, "delta": self.delta,
                "rounds": rounds, "epsilon": _epsilon(rounds, self.delta)}


def _epsilon(rounds: Sequence[Sequence[float]], delta: float) -> float:
    accounting = _accounting()
    accountant = accounting.rdp.RdpAccountant()
    for rate, noise in rounds:
        accountant.compose(accounting.dp_event.PoissonSampledDpEvent(
            rate, accounting.dp_event.GaussianDpEvent(noise)))
    return float(accountant.get_epsilon(delta))


def _seed(seed: int, run: str, round: int) -> int:
    text = f"{seed}/{run}/{round}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


def noise_for(epsilon: float, delta: float, rounds: int, sampled: float = 1.0) -> float:
    """The noise multiplier that spends ``epsilon`` at ``delta`` over ``rounds`` rounds,
    each averaging a ``sampled`` share of the clients (dp-accounting's calibration)."""
    accounting = _accounting()

    def event(noise: float) -> Any:
        return accounting.dp_event.SelfComposedDpEvent(accounting.dp_event.PoissonSampledDpEvent(
            sampled, accounting.dp_event.GaussianDpEvent(noise)), rounds)

    return float(accounting.calibrate_dp_mechanism(
        accounting.rdp.RdpAccountant, event, epsilon, delta,
        accounting.mechanism_calibration.LowerEndpointAndGuess(0.01, 1.0)))


def privacy_spent(store: Any, run: str) -> dict[int, float]:
    """ε spent by each round of ``run`` so far that was averaged with ``privacy=``,
    round by round, as recorded in the store."""
    spent = {}
    for bound in store.bound(f"fed/{run}"):
        parts = bound.name.split("/")
        if len(parts) == 4 and parts[3] == "average" and parts[2].isdigit() \
                and "privacy" in bound.meta:
            spent[int(parts[2])] = float(bound.meta["privacy"]["epsilon"])
    return dict(sorted(spent.items()))
