"""Opinions over the record: ``diagnose``, its rules, ``Finding`` and ``overlay``.

Every rule reads the history the Audit left and nothing else, so a threshold can be
argued about, changed and applied again to a run that finished weeks ago. Each needs
its condition to hold at every measured step of a window (``window`` consecutive
measured steps of that where; all of them when it has fewer), except ``nonfinite``,
said at the first NaN or Inf. ``since`` is the window's first step. Once any where
has counted a NaN or an Inf, the steps from there on are left to ``nonfinite``: after
a NaN every other number is noise.

The defaults, and where they come from. Two published defaults fire on clean runs
(ReLU nets sit at 40–80% zeros, an SGD run's last layer moves by 20–30% of its size a
step early on); those were raised after measuring twenty clean runs of the seeded
fault suite (``tests/torch/test_fault_suite.py``), as noted beside them.

==================  =======  ====================================================================
rule (keyword)      default  holds at a step when, and the source
==================  =======  ====================================================================
``nonfinite``       —        the Audit counted a NaN or an Inf in what a where produced or got
                             back (AUTOTRAINER's ``nan_gradient``/``nan_loss``; DeepDiagnosis'
                             numerical errors)
``dying``           0.9      ``act_zero`` is at least this. AUTOTRAINER (Zhang et al., ICSE
                             2021, γ) and DeepDiagnosis (Wardat et al., ICSE 2022) use 0.7;
                             clean ReLU layers here reach 0.8 on single steps and hold 0.72,
                             so 0.9
``saturated``       0.5      ``act_saturated`` (the share within 1% of a bounded activation's
                             bounds) is at least this: DeepDiagnosis' saturation rule flags a
                             layer when more than half its values are past ±5 before a sigmoid
                             or tanh, which is within 1% of the bounds; clean tanh runs here
                             stay under 0.05
``vanishing``       1e-3     ``grad_norm`` is below this times the gradient where the loss
                             enters (the last node the Audit watched in that step): AUTOTRAINER's
                             β₁, its first-to-last layer gradient ratio; clean runs here stay
                             above 0.04
``exploding``       70       ``grad_norm`` is above this times the gradient where the loss
                             enters: AUTOTRAINER's β₃; clean runs here stay under 3.5
``not_updating``    1e-6     ``update_ratio`` (‖Δw‖/‖w‖ of a step) is below this. CS231n's notes
                             put a healthy ratio near 1e-3 and call lower a learning rate that
                             may be too low; clean runs here dip to 1e-4 (SGD at its start), so
                             the rule is kept for a layer that moves a million times slower
                             than its size — one left to nobody
``update_too_large``0.5      ``update_ratio`` is above this: CS231n's 1e-3 scale, less strict
                             by far, since Adam at 1e-3 reaches 1e-2 and a clean SGD run's last
                             layer held 0.2 for ten steps here
==================  =======  ====================================================================

``window`` (default 10 measured steps) is a threshold too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ._read import health_facts, history_of

__all__ = ["DEFAULTS", "KINDS", "Finding", "diagnose", "findings_of", "overlay"]

KINDS = ("nonfinite", "dying", "exploding", "vanishing", "saturated", "not_updating",
         "update_too_large")
DEFAULTS: dict[str, float] = {"dying": 0.9, "saturated": 0.5, "vanishing": 1e-3,
                              "exploding": 70.0, "not_updating": 1e-6,
                              "update_too_large": 0.5, "window": 10}


@dataclass(frozen=True)
class Finding:
    """What a rule found: at which ``where``, what (one of ``KINDS``), since which
    measured step, and the numbers that made it say so (``evidence``: plain data —
    the measure, the threshold, how many steps it held, the median and the worst)."""

    where: str
    what: str
    since: int
    evidence: dict[str, Any] = field(default_factory=dict, compare=True, hash=False)

    def __str__(self) -> str:
        return f"{self.where}: {self.what} since step {self.since} ({said(self.evidence)})"

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data, the same in every process."""
        return asdict(self)


def said(evidence: dict[str, Any]) -> str:
    """Evidence in a few words: ``act_zero >= 0.9 for 12 steps (median 1, worst 1)``."""
    if "count" in evidence:
        return f"{evidence['count']} NaN or Inf {evidence['measure']}"
    return (f"{evidence['measure']} {evidence['rule']} {evidence['threshold']:g} for "
            f"{evidence['steps']} steps (median {evidence['median']:.3g}, worst "
            f"{evidence['worst']:.3g})")


def diagnose(store: Any, run: str, **thresholds: float) -> list[Finding]:
    """What the rules find in a run's record, ordered by step then where.

    Keywords are the thresholds (see this module's table for each default and its
    source) and ``window``; an unknown keyword is refused, naming the known ones.
    Reads the record only: no model, no torch.
    """
    limits = _thresholds(thresholds)
    return findings_of(health_facts(store, run), **limits)


def findings_of(facts: list[dict[str, Any]], **thresholds: float) -> list[Finding]:
    """The findings in ``health`` facts, as the Audit says them or a record holds them."""
    limits = _thresholds(thresholds)
    window = int(limits["window"])
    history = history_of(facts)
    ends = _ends(facts)
    broken = _first_nonfinite(history)
    found: list[tuple[int, int, int, Finding]] = []
    order = {where: at for at, where in enumerate(history)}
    for where, measures in history.items():
        for finding in _found(where, measures, history, ends, limits, window, broken):
            found.append((finding.since, order[where], KINDS.index(finding.what), finding))
    return [finding for *_, finding in sorted(found, key=lambda item: item[:3])]


def _thresholds(given: dict[str, Any]) -> dict[str, float]:
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"diagnose() has no threshold {', '.join(map(repr, unknown))}; the "
                        f"thresholds are {', '.join(DEFAULTS)}")
    limits = {**DEFAULTS, **given}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"threshold {name}={value!r}: a threshold is a finite number from 0")
    if int(limits["window"]) != limits["window"] or limits["window"] < 1:
        raise ValueError(f"window={limits['window']!r}: a window is a whole number of "
                         "measured steps, from 1")
    return limits


def _first_nonfinite(history: dict[str, dict[str, list[tuple[int, Any]]]]) -> int | None:
    steps = [step for measures in history.values() for step, count in measures.get("nonfinite", [])
             if isinstance(count, (int, float)) and count > 0]
    return min(steps) if steps else None


def _found(where: str, measures: dict[str, list[tuple[int, Any]]],
           history: dict[str, dict[str, list[tuple[int, Any]]]], ends: dict[int, str],
           limits: dict[str, float], window: int, broken: int | None) -> Iterable[Finding]:
    for step, count in measures.get("nonfinite", []):
        if isinstance(count, (int, float)) and count > 0:
            yield Finding(where, "nonfinite", step, {"measure": "values", "count": int(count)})
            break

    def before(series: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        return [(s, v) for s, v in series if broken is None or s < broken]

    simple = (("dying", "act_zero", ">=", lambda v, t: v >= t),
              ("saturated", "act_saturated", ">=", lambda v, t: v >= t),
              ("not_updating", "update_ratio", "<", lambda v, t: v < t),
              ("update_too_large", "update_ratio", ">", lambda v, t: v > t))
    for what, measure, rule, holds in simple:
        finding = _streak(where, what, measure, rule, before(measures.get(measure, [])),
                          limits[what], window, holds)
        if finding is not None:
            yield finding
    if where not in set(ends.values()):
        relative = before(_relative(measures, history, ends))
        for what, rule, holds in (("vanishing", "<", lambda v, t: v < t),
                                  ("exploding", ">", lambda v, t: v > t)):
            finding = _streak(where, what, "grad_norm / loss end", rule, relative,
                              limits[what], window, holds)
            if finding is not None:
                yield finding


def _streak(where: str, what: str, measure: str, rule: str, series: list[tuple[int, Any]],
            threshold: float, window: int, holds: Callable[[float, float], bool]) -> Finding | None:
    """A finding at the first run of ``window`` consecutive measured steps (all of them
    when there are fewer) at which ``holds`` — or None."""
    values = [(s, v) for s, v in series if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not values:
        return None
    need = min(window, len(values))
    start = None
    for at, (_, value) in enumerate(values):
        if not math.isnan(value) and holds(value, threshold):  # a NaN holds nothing
            start = at if start is None else start
            if at - start + 1 >= need:
                held = [v for _, v in values[start:at + 1]]
                while at + 1 < len(values) and holds(values[at + 1][1], threshold):
                    at += 1
                    held.append(values[at][1])
                worst = max(held) if rule in (">", ">=") else min(held)
                return Finding(where, what, values[start][0], {
                    "measure": measure, "rule": rule, "threshold": threshold,
                    "steps": len(held), "median": statistics.median(held), "worst": worst})
        else:
            start = None
    return None


def _ends(facts: list[dict[str, Any]]) -> dict[int, str]:
    """Per step, the where the loss enters: the last node (a where without a dot) with a
    gradient among that step's facts. The Audit says a step's facts in the graph's
    topological order, so that node is a leaf of the graph."""
    ends: dict[int, str] = {}
    for fact in facts:
        if type(fact) is dict and fact.get("fact") == "health" and "grad_norm" in fact \
                and "." not in fact["where"]:
            ends[fact["step"]] = fact["where"]
    return ends


def _relative(measures: dict[str, list[tuple[int, Any]]],
              history: dict[str, dict[str, list[tuple[int, Any]]]],
              ends: dict[int, str]) -> list[tuple[int, float]]:
    at_end = {where_: dict(history[where_].get("grad_norm", [])) for where_ in set(ends.values())}
    out = []
    for step, value in measures.get("grad_norm", []):
        end = ends.get(step)
        reference = at_end.get(end, {}).get(step) if end is not None else None
        if isinstance(value, (int, float)) and isinstance(reference, (int, float)) and reference > 0:
            out.append((step, value / reference))
    return out


def overlay(findings: Iterable[Finding]) -> dict[str, list[str]]:
    """``{node: [what, ...]}`` for ``Graph.figure(overlay=...)``: a finding on
    ``body.net.0`` colours the node ``body``. Each what once per node, in order."""
    out: dict[str, list[str]] = {}
    for finding in findings:
        if not isinstance(finding, Finding):
            raise TypeError(f"overlay() takes what diagnose() answers (Findings), not a "
                            f"{type(finding).__qualname__}")
        said_here = out.setdefault(finding.where.split(".", 1)[0], [])
        if finding.what not in said_here:
            said_here.append(finding.what)
    return out
