"""The run's own symptoms, read off its ``loss`` facts alone: ``plateau``,
``diverging``, ``oscillating`` and a ``nonfinite`` loss, each said with
``where="loss"``.

The loss of step ``n`` is the ``n``-th ``loss`` fact of the run (a Trainer says one
per step). Each rule looks at windows of ``loss_window`` consecutive steps (all of
them in a shorter run of at least six) and judges a window by a straight line fitted
to it: its slope, the scatter of the losses around it, and the standard error of
the slope that scatter implies. So "meaningfully" always means "against this loss's
own noise": two standard errors. A finding starts at the first window where its
rule holds and covers the windows that follow while it keeps holding.

A plateau is judged with what the run did after it: a flat stretch that the loss then
leaves, falling clearly below it (by ``plateau`` of its level, beyond two standard
errors of where the run ends), is a slow start, not a plateau, and is no finding. One
that lasts to the end of the run, or that the loss leaves only to come back to, is.

The losses are judged as the positive numbers cross entropy and squared error are:
a window holding a loss of 0 or below is not judged. Nothing after the first NaN or
Inf (in the loss, or counted anywhere by the Audit) is judged either; the first
non-finite loss is itself a ``nonfinite`` finding.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["LOSS", "loss_findings"]

LOSS = "loss"  # the where a run-level finding is said at
_ERRORS = 2.0  # how many standard errors make a change meaningful
_FEWEST = 6  # a run with fewer losses than this is too short to judge


@dataclass(frozen=True)
class _Window:
    """A straight line through ``loss_window`` losses: where they stand and move."""

    first: int  # the step of its first loss
    level: float  # their mean
    slope: float  # per step
    slope_error: float  # the standard error of ``slope``
    scatter: float  # the standard deviation around the line
    mean_error: float  # the standard error of ``level``
    length: int

    @property
    def span(self) -> int:
        return self.length - 1


def _fitted(first: int, values: list[float]) -> _Window:
    """The line through positive ``values``, fitted to them divided by the largest so
    that no square overflows however large a finite loss is (every rule reads ratios
    to the level, so the scale changes no judgement), then scaled back."""
    n = len(values)
    scale = max(values)
    values = [v / scale for v in values]
    middle = (n - 1) / 2
    mean = sum(values) / n
    spread = sum((t - middle) ** 2 for t in range(n))
    slope = sum((t - middle) * (v - mean) for t, v in enumerate(values)) / spread
    residual = sum((v - mean - slope * (t - middle)) ** 2 for t, v in enumerate(values))
    scatter = math.sqrt(residual / (n - 2))
    return _Window(first, mean * scale, slope * scale, scatter / math.sqrt(spread) * scale,
                   scatter * scale, statistics.stdev(values) / math.sqrt(n) * scale, n)


def loss_findings(losses: list[Any], limits: dict[str, float], broken: int | None,
                  make: Any) -> list[Any]:
    """The run-level findings in ``losses`` (one per step, from step 1), judged before
    step ``broken`` (the first NaN the Audit counted; None: none); ``make(what, since,
    evidence)`` builds each finding."""
    found = []
    steps = [(at, v) for at, v in enumerate(losses, 1)
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    bad = [(at, v) for at, v in steps if not math.isfinite(v)]
    if bad:
        found.append(make("nonfinite", bad[0][0], {"measure": "loss values", "count": len(bad)}))
    end = min([broken or math.inf] + [at for at, _ in bad])
    judged = [(at, v) for at, v in steps if at < end]
    if len(judged) < _FEWEST:
        return found
    start = statistics.median(v for _, v in judged[:3])  # before training has done much
    if start <= 0:
        return found
    width = min(int(limits["loss_window"]), len(judged))
    windows = [_fitted(judged[i][0], [v for _, v in judged[i:i + width]])
               for i in range(len(judged) - width + 1)
               if all(v > 0 for _, v in judged[i:i + width])]
    for what, reading in (("plateau", _plateau), ("diverging", _diverging),
                          ("oscillating", _oscillating)):
        stretches = _stretches(windows, lambda w, r=reading: r(w, start, limits))
        if what == "plateau":  # judged by what came after each flat stretch
            stretches = [held for held in stretches
                         if not _left(held, windows, limits["plateau"])]
        if stretches:
            found.append(_finding(what, stretches[0], make))
    return found


def _plateau(w: _Window, start: float, limits: dict[str, float]) -> tuple[float, dict] | None:
    """The most the loss can have moved across the window, either way (the fitted
    change plus two standard errors), as a share of its level: a plateau when that is
    under the threshold while the loss is still above ``converged`` of where it began.
    A loss too noisy to say so, or rising, is not a plateau."""
    moved = (abs(w.slope) + _ERRORS * w.slope_error) * w.span / w.level
    if moved < limits["plateau"] and w.level > limits["converged"] * start:
        return moved, {"measure": "loss change (upper bound) / loss", "rule": "<",
                       "threshold": limits["plateau"]}
    return None


def _diverging(w: _Window, start: float, limits: dict[str, float]) -> tuple[float, dict] | None:
    """A rise across the window (less two standard errors) of at least the threshold
    of its level — or the window sitting that far above where the run began."""
    rise = (w.slope - _ERRORS * w.slope_error) * w.span / w.level
    above = (w.level - _ERRORS * w.mean_error - start) / start
    threshold = limits["diverging"]
    if rise >= threshold:
        return rise, {"measure": "loss rise (lower bound) / loss", "rule": ">=",
                      "threshold": threshold}
    if above >= threshold:
        return above, {"measure": "loss above its start (lower bound) / start", "rule": ">=",
                       "threshold": threshold}
    return None


def _oscillating(w: _Window, start: float, limits: dict[str, float]) -> tuple[float, dict] | None:
    """Swings (the scatter around the fitted line) of at least the threshold of the
    loss's scale — its level, or where it began if that was higher — in a window
    whose slope is within two standard errors of flat."""
    if abs(w.slope) >= _ERRORS * w.slope_error:
        return None
    swing = w.scatter / max(w.level, start)
    if swing >= limits["oscillating"]:
        return swing, {"measure": "loss swing / its scale", "rule": ">=",
                       "threshold": limits["oscillating"]}
    return None


def _stretches(windows: Iterable[_Window], reading: Any) -> list[list[tuple[_Window, float, dict]]]:
    """Each run of consecutive windows that ``reading`` holds in, in order."""
    out: list[list[tuple[_Window, float, dict]]] = []
    held: list[tuple[_Window, float, dict]] = []
    for window in windows:
        said = reading(window)
        if said is not None:
            held.append((window, *said))
        elif held:
            out.append(held)
            held = []
    if held:
        out.append(held)
    return out


def _left(held: list[tuple[_Window, float, dict]], windows: list[_Window], share: float) -> bool:
    """Whether the run left a flat stretch for good: it ends before the run's last
    window, and the run's last window sits below the stretch's level by more than
    ``share`` of it, beyond two standard errors of its own level. A run that falls and
    then climbs back up to the level has not left it."""
    end = held[-1][0]
    if end is windows[-1]:
        return False  # it lasts to the end
    level = min(w.level for w, _, _ in held)
    final = windows[-1]
    return final.level + _ERRORS * final.mean_error < (1 - share) * level


def _finding(what: str, held: list[tuple[_Window, float, dict]], make: Any) -> Any:
    """The finding for one stretch of windows a rule held in."""
    first, last = held[0][0], held[-1][0]
    values = [value for _, value, _ in held]
    rule = held[0][2]
    worst = min(values) if rule["rule"] == "<" else max(values)
    return make(what, first.first, {
        **rule, "steps": last.first + last.length - first.first,
        "median": statistics.median(values), "worst": worst, "loss": first.level})
