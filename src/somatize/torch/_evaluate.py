"""Evaluation rounds: every client measures the round's weights on its own data, and
the measures are averaged weighted by how many rows each client measured on — what
Flower's ``evaluate`` rounds answer — through the same store, names and rules as a
training round (``fed/{run}/evaluate/{round}/...``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

import torch

from ..store import Store
from ._federated import through

__all__ = ["evaluate"]


def evaluate(store: Store, metrics: Mapping[str, float], *, run: str, round: int,
             clients: int, mine: int, rows: int, within: float = 600.0,
             asking: float = 1.0, lease: float | None = None,
             secret: str | bytes | None = None, quorum: int | None = None) -> dict[str, float]:
    """Keeps this client's ``metrics`` (names to numbers, such as ``{"loss": 0.31,
    "accuracy": 0.9}``) measured on ``rows`` rows of its own data, and answers each
    metric averaged over the clients weighted by their rows, the same for every
    client. Every client gives the same metric names. The other arguments are
    ``gather``'s, and mean what they mean there."""
    if not isinstance(metrics, Mapping) or not metrics:
        raise TypeError(f"metrics= is a mapping of names to numbers, such as {{'loss': 0.3}}, "
                        f"not {metrics!r}")
    for name, value in metrics.items():
        if type(name) is not str or isinstance(value, bool) or not isinstance(value, Real) \
                or not math.isfinite(value):
            raise ValueError(f"metrics[{name!r}] = {value!r} is refused: each metric is a "
                             "finite number under a str name")
    if type(rows) is not int or rows < 1:
        raise ValueError(f"rows={rows!r} is refused: it is how many rows this client "
                         "measured on, at least 1")
    what = {"metrics": {name: torch.tensor(float(value), dtype=torch.float64)
                        for name, value in sorted(metrics.items())}}
    averaged = through(store, what, run=run, round=round, stage="evaluate", clients=clients,
                       mine=mine, size=rows, within=within, asking=asking, lease=lease,
                       secret=secret, nonfinite="refuse", aggregate=None, server=None,
                       quorum=quorum, start=None, privacy=None)
    return {name: float(value) for name, value in averaged["metrics"].items()}
