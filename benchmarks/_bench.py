"""How the benchmarks time things, said once.

Every figure is a ratio against an anchor measured in the same run, so each helper
here times one callable the same way whoever calls it. Which statistic a figure uses
is chosen by what it is: ``best`` (the fastest run, or a low quantile) for overheads a
quiet machine shows, ``median`` for steps where the machine's noise is part of the
answer, ``interleaved`` when two contenders must share whatever the machine does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["best", "block", "cpu_seconds", "cycled", "interleaved", "median", "per_call",
           "steps_per_second"]


def _times(fn: Callable[[], Any], repeat: int, warm: int) -> list[float]:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best(fn: Callable[[], Any], repeat: int, quantile: float = 0.0) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeat`` calls after one warm-up, or
    the ``quantile`` of them (0.1 is steady rather than lucky)."""
    times = sorted(_times(fn, repeat, 1))
    return times[int(len(times) * quantile)]


def median(fn: Callable[[], Any], repeat: int, warm: int | None = None) -> float:
    """The median seconds per call after a warm-up (a twentieth of ``repeat``, at least 3)."""
    return statistics.median(_times(fn, repeat, max(3, repeat // 20) if warm is None else warm))


def per_call(fn: Callable[[int], Any], count: int) -> float:
    """Seconds per call of ``fn(i)`` over one block of ``count`` calls."""
    start = time.perf_counter()
    for i in range(count):
        fn(i)
    return (time.perf_counter() - start) / count


def cycled(step: Callable[[Any], Any], data: list[Any]) -> Callable[[], Any]:
    """A call of ``step`` on the next batch of ``data`` each time, round and round."""
    at = [0]

    def next_step() -> Any:
        batch = data[at[0] % len(data)]
        at[0] += 1
        return step(batch)
    return next_step


def block(step: Callable[[Any], Any], data: list[Any], steps: int) -> tuple[float, float]:
    """Seconds per step of ``step`` over ``steps`` batches of ``data`` (cycled), by the
    wall clock and by this thread's CPU time."""
    start, cpu = time.perf_counter(), time.thread_time()
    for i in range(steps):
        step(data[i % len(data)])
    return (time.perf_counter() - start) / steps, (time.thread_time() - cpu) / steps


def steps_per_second(step: Callable[[Any], Any], data: list[Any], warm: int = 3) -> float:
    """Seconds per step over one pass of ``data``, after ``warm`` steps."""
    for batch in data[:warm]:
        step(batch)
    start = time.perf_counter()
    for batch in data:
        step(batch)
    return (time.perf_counter() - start) / len(data)


def interleaved(contenders: dict[str, Callable[[int], Any]], rounds: int, count: int) -> dict[str, float]:
    """The median per-call time of each contender over ``rounds`` blocks of ``count``
    calls, the blocks interleaved so whatever the machine does falls on all alike."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():
        per_call(fn, 20)  # warm
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(per_call(fn, count))
    return {name: statistics.median(ts) for name, ts in times.items()}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used, as ``/proc`` says:
    another process's share of a contest, which its own clock cannot time from here.
    The kernel counts it in clock ticks (10 ms on most Linux), so a block must last many
    of them for the figure to mean anything."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # past the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
