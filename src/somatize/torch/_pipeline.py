"""A split step's pieces overlapped: the schedule of GPipe, the arithmetic unchanged.

With ``micro=N`` and a stage on a worker, a step run piece after piece leaves each
side idle while the other computes. Here every piece is a generator (the staged
driver's ``forwarding`` and ``backwarding``, the loss between) that stops where a
stage is out on a worker, and the pieces are advanced in turns, in order: while the
worker runs piece k's stage, this side runs piece k+1's stages before it, or piece
k-1's after it. Since every piece takes the same stops, each stage sees the pieces'
forwards in order and their backwards in order, as the unpipelined step does, so
every gradient is added up in the same order and the losses and weights are equal
bit for bit. What changes is when this side's own work happens, so random draws
(dropout) here come in another order.

A worker's trainer holds every forward still owed a gradient; each envelope says how
many forwards of its stage ran after the one it is for (``Counts.behind``), so a step
that failed half-way leaves nothing the next one could pick up by mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._engine import Pass
from .._node import Opaque
from ._envelope import MOST_OWED

__all__ = ["Counts", "pipelined", "worthwhile"]


class Counts:
    """How many pieces' forwards each stage has run in this step."""

    def __init__(self, stages: int):
        self.done = [0] * stages

    def forwarded(self, stage: int) -> int:
        """Counts one more forward of ``stage``; answers its number, from 0."""
        number = self.done[stage]
        self.done[stage] += 1
        return number

    def behind(self, stage: int, number: int) -> int:
        """How many forwards of ``stage`` ran after forward ``number``."""
        return self.done[stage] - 1 - number


def worthwhile(driver: Any, pieces: int) -> bool:
    """Whether a step of this many pieces is pipelined: more than one, not more than a
    trainer keeps waiting, and a stage on a worker whose backend keeps order."""
    return 1 < pieces <= MOST_OWED and driver.pipelines(pieces)


def pipelined(driver: Any, pieces: list[tuple[Any, Any, float]],
              loss_of: Callable[[Any, Any], Any],
              seed: Callable[[Any, float], None]) -> list[Any]:
    """One step's pieces ``(input, target, share)`` run overlapped; answers their
    losses in order. ``loss_of(output, target)`` is the objective, checked;
    ``seed(loss, share)`` the loss's own backward, scaled as the Trainer scales it."""
    counts = Counts(len(driver.stages))
    one = Pass(framed=False)  # unwatched: a watched step is not pipelined
    runs = [_piece(driver, counts, one, x, y, share, loss_of, seed) for x, y, share in pieces]
    losses: list[Any] = [None] * len(runs)
    turn = list(range(len(runs)))
    try:
        while turn:
            left = []
            for k in turn:  # in order: every stage sees the pieces in order
                try:
                    next(runs[k])
                    left.append(k)
                except StopIteration as stop:
                    losses[k] = stop.value
            turn = left
    finally:
        for run in runs:  # after a failure: the others stop where they are
            run.close()
    return losses


def _piece(driver: Any, counts: Counts, one: Pass, x: Any, y: Any, share: float,
           loss_of: Callable[[Any, Any], Any], seed: Callable[[Any, float], None]):
    """One piece: its forward, its loss, its backward, stopping where a stage is out."""
    x = x if type(x) is Opaque else Opaque(x)
    passed, output = yield from driver.forwarding(x, one, counts)
    loss = loss_of(output, y)
    seed(loss, share)
    yield from driver.backwarding(passed, one, counts)
    return loss
