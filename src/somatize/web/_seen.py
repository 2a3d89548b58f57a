"""A run as the pages keep seeing it, brought up to date from what the Following says
changed: so a look costs what moved since the last one, not the run's length.

``Shape`` is what its names tell (forwards, when the first and last were bound, the
latest summarised values, as ``somatize.record.Run`` has them); ``Losses`` is the loss
of each forward, read from its name where the run summarised it and from its record
otherwise, once per binding.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

from .._errors import CorruptObject, RecordError
from ..record import Run, facts
from ..record._read import forwards_of
from ._follow import Following

__all__ = ["Losses", "Shape"]


class _Kept:
    """What both keep: the run, the version they are of, and a lock."""

    def __init__(self, run: str):
        self.run = run
        self.version = 0
        self.lock = threading.Lock()

    def update(self, following: Following) -> int:
        """Takes in what changed since the version this is of; answers the version now."""
        with self.lock:
            version, changes = following.changed(self.run, self.version)
            if changes:
                self.took(following, changes)
            self.version = version
            return version

    def took(self, following: Following, changes: list[tuple[int, Any]]) -> None:
        raise NotImplementedError


class Shape(_Kept):
    """A run's forwards, times and latest summarised values, kept up to date."""

    def __init__(self, run: str):
        super().__init__(run)
        self.indices: list[int] = []  # every forward read, in order
        self.whens: dict[int, float] = {}
        self.first = self.last = math.nan  # when the first and the last forward were bound
        self.latest: dict[str, tuple[int, Any]] = {}  # key -> (forward, value): the last said

    def took(self, following: Following, changes: list[tuple[int, Any]]) -> None:
        again = False
        for index, bound in changes:
            was = self.whens.get(index)
            if was is None:
                bisect.insort(self.indices, index)
            self.whens[index] = bound.when
            if was is not None and was == self.first:  # the earliest moved: find the next
                self.first = min(self.whens.values())
            elif not bound.when >= self.first:  # also when first is still NaN
                self.first = bound.when
            if not bound.when <= self.last:
                self.last = bound.when
            again |= self._summarise(index, bound.meta)
        if again:  # a forward bound again no longer says what was the latest: count afresh
            self.latest = {}
            for bound in following.bound(f"run/{self.run}"):
                for index, one in forwards_of(bound, int(bound.name.rsplit("/", 1)[1])):
                    self._summarise(index, one.meta)

    def _summarise(self, index: int, meta: dict[str, Any]) -> bool:
        """Takes one forward's meta in; answers whether the latest values must be counted again."""
        again = False
        for key, value in meta.items():
            held = self.latest.get(key)
            if value is not None and (held is None or index >= held[0]):
                self.latest[key] = (index, value)
            elif value is None and held is not None and held[0] == index:
                again = True
        return again

    def run_now(self) -> Run:
        with self.lock:
            return Run(self.run, len(self.indices), self.first, self.last,
                       {key: value for key, (_, value) in self.latest.items()})

    def pace(self, over: int) -> float | None:
        """Seconds between two of the run's bindings, the median over its last ``over``;
        None before there are two. A Recorder binds a batch of the forwards that finished
        every fraction of a second while a run goes, so a gap many times this long is a
        run that stopped."""
        with self.lock:
            whens = sorted({self.whens[i] for i in self.indices[-over:]})
        gaps = [b - a for a, b in zip(whens, whens[1:]) if b > a]
        if not gaps:
            return None
        gaps.sort()
        return gaps[len(gaps) // 2]

    def rate(self, over: int) -> float | None:
        """Forwards a second over the last ``over``, by when they were bound."""
        whens = sorted(self.whens[i] for i in self.indices[-over:])
        if len(whens) < 2 or whens[-1] <= whens[0]:
            return None
        return (len(whens) - 1) / (whens[-1] - whens[0])


class Losses(_Kept):
    """A run's loss per forward, kept up to date."""

    def __init__(self, run: str):
        super().__init__(run)
        self.values: dict[int, float] = {}
        self.said: list[int] = []  # the forwards that said a loss, in order

    def took(self, following: Following, changes: list[tuple[int, Any]]) -> None:
        for index, bound in changes:
            value = _loss(following, self.run, index, bound)
            if value is None:
                if self.values.pop(index, None) is not None:
                    self.said.remove(index)
                continue
            if index not in self.values:
                bisect.insort(self.said, index)
            self.values[index] = value

    def after(self, forward: int) -> list[tuple[int, float]]:
        """``(forward, loss)`` for the forwards after ``forward`` that said one."""
        with self.lock:
            return [(i, self.values[i]) for i in self.said[bisect.bisect_right(self.said, forward):]]

    def last(self) -> float | None:
        with self.lock:
            return self.values[self.said[-1]] if self.said else None

    def any(self) -> bool:
        return bool(self.said)


def _loss(following: Following, run: str, index: int, bound: Any) -> float | None:
    if "loss" in bound.meta:  # summarised: the name says it, no record opened
        value = bound.meta["loss"]
        value = value.get("value") if isinstance(value, dict) else value
    else:
        value = None
        try:
            said = facts(following, run, index)
        except (RecordError, CorruptObject):  # damaged: no loss for it, the rest still drawn
            said = []
        for fact in reversed(said):
            if type(fact) is dict and fact.get("fact") == "loss":
                value = fact.get("value")
                break
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
