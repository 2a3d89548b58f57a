"""Opinions over the record: ``diagnose``, its rules, ``Finding`` and ``overlay``.

Every rule reads the history the Audit left and the run's loss, and nothing else, so
a threshold can be argued about, changed and applied again to a run that finished
weeks ago. The rules, their defaults and where each comes from are in ``diagnose``'s
documentation; the run-level ones (``where="loss"``) live in ``_loss``, and what to do
about each finding in ``_advice``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ._advice import advice
from ._loss import LOSS, loss_findings
from ._read import history_of, judged_facts, optimizer_of, places_of

__all__ = ["DEFAULTS", "KINDS", "Finding", "diagnose", "findings_of", "overlay"]

#: What a finding can say, in the order findings of one step and where are listed.
KINDS = ("nonfinite", "dying", "dead_channels", "exploding", "vanishing", "saturated",
         "not_updating", "update_too_large", "label_leak", "plateau", "diverging",
         "oscillating")
#: Every threshold ``diagnose`` takes, at its default (see ``diagnose`` for each one's
#: meaning and source).
DEFAULTS: dict[str, float] = {"dying": 0.9, "dead_channels": 0.5, "saturated": 0.5,
                              "vanishing": 1e-3, "exploding": 70.0, "not_updating": 1e-6,
                              "update_too_large": 0.5, "weight_growth": 0.07,
                              "plateau": 0.1, "converged": 0.5, "diverging": 0.25,
                              "oscillating": 0.5, "label_leak": 0.8, "window": 10,
                              "loss_window": 40}
_WINDOWS = ("window", "loss_window")


@dataclass(frozen=True)
class Finding:
    """What a rule found: at which ``where`` (a node, ``node.path`` inside one, or
    ``"loss"`` for the run's own symptoms), what (one of ``KINDS``), since which
    step, the numbers that made it say so (``evidence``: plain data — the measure,
    the threshold, how many steps it held, the median and the worst) and ``advice``:
    one sentence on what to do about it there.

    ``node`` and ``path`` are the where kept apart: the node id and the path of the
    submodule inside it ('' for the node itself; ``node`` is None for the loss). A
    node id may hold dots (``enc.v2``), so a where is never split to find them:
    ``diagnose`` places each against the graph the run described. A Finding made by
    hand without them is placed at its where's first dot."""

    where: str
    what: str
    since: int
    evidence: dict[str, Any] = field(default_factory=dict, compare=True, hash=False)
    advice: str = ""
    node: str | None = None
    path: str = ""

    def __post_init__(self) -> None:
        if self.node is None and self.where != LOSS and isinstance(self.where, str):
            node, _, path = self.where.partition(".")
            object.__setattr__(self, "node", node)
            object.__setattr__(self, "path", path)

    def __str__(self) -> str:
        text = f"{self.where}: {self.what} since step {self.since} ({brief(self.evidence)})"
        return f"{text} — {self.advice}" if self.advice else text

    @property
    def brief(self) -> str:
        """Its evidence in a few words (``brief``)."""
        return brief(self.evidence)

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data, the same in every process."""
        return asdict(self)


def brief(evidence: dict[str, Any]) -> str:
    """Evidence in a few words: ``act_zero >= 0.9 for 12 steps (median 1, worst 1)``."""
    if "count" in evidence:
        return f"{evidence['count']} NaN or Inf {evidence['measure']}"
    text = (f"{evidence['measure']} {evidence['rule']} {evidence['threshold']:g} for "
            f"{evidence['steps']} steps (median {evidence['median']:.3g}, worst "
            f"{evidence['worst']:.3g})")
    return f"{text}; loss {evidence['loss']:.3g}" if "loss" in evidence else text


def diagnose(store: Any, run: str, **thresholds: float) -> list[Finding]:
    """What the rules find in a run's record, ordered by step then where, each finding
    with its advice. Reads the record only: no model, no torch.

    Keywords are the thresholds below; an unknown one is refused, naming the known
    ones. A layer rule needs its condition at every measured step of a ``window``
    (consecutive measured steps of that where; all of them when it has fewer), and
    ``since`` is the window's first step. ``nonfinite`` is said at the first NaN or
    Inf, and once any where has counted one, the steps from there on are left to it:
    after a NaN every other number is noise. The run-level rules read the loss over
    ``loss_window`` steps against its own noise (a line fitted to the window, and two
    standard errors of its slope), and say ``where="loss"``. Each finding keeps its
    where apart as ``node`` and ``path``, placed against the node ids of the run's
    ``graph`` fact (a node id may hold dots), and advice that depends on the optimizer
    fits the one that fact names (``evidence["optimizer"]``).

    Two published defaults fire on clean runs (ReLU nets sit at 40–80% zeros, an SGD
    run's last layer moves by 20–30% of its size a step early on); those were raised
    after measuring the clean runs of the seeded-fault suite
    (``tests/torch/test_fault_suite.py``: multilayer perceptrons, conv nets on digits,
    GRU and LSTM nets, a transformer block), as noted beside them.

    | keyword | default | holds at a step when — and the source |
    |---|---|---|
    | (``nonfinite``) | — | the Audit counted a NaN or an Inf in what a where produced or got back, or the loss is one (AUTOTRAINER's ``nan_gradient``/``nan_loss``; DeepDiagnosis' numerical errors) |
    | ``dying`` | 0.9 | ``act_zero`` is at least this. AUTOTRAINER (Zhang et al., ICSE 2021, γ) and DeepDiagnosis (Wardat et al., ICSE 2022) use 0.7; clean ReLU layers here reach 0.8 on single steps and hold 0.76, so 0.9 |
    | ``dead_channels`` | 0.5 | at least this share of a where's channels (dimension 1: a conv's filters) stayed 0 through the Audit's whole channel window (``Audit(channels=True)``). A channel at 0 that long is DeepDiagnosis' dead node, and its 0.7 share is the same rule per value; clean conv runs here lose none, and a conv whose bias starts at -10 loses all |
    | ``saturated`` | 0.5 | ``act_saturated`` (the share within 1% of the bounds of a bounded output: sigmoid, tanh, hardtanh, clamp, softsign, a GLU's gate, a recurrent layer's hidden state) is at least this: DeepDiagnosis flags a layer when more than half its values are past ±5 before a sigmoid or tanh, which is within 1% of the bounds; clean runs here stay under 0.2, inputs × 255 into a tanh layer or a GRU hold 0.75 to 0.99 |
    | ``vanishing`` | 1e-3 | ``grad_norm`` is below this times the gradient where the loss enters (the last node the Audit watched in that step): AUTOTRAINER's β₁, its first-to-last layer gradient ratio; clean runs here stay above 0.05 |
    | ``exploding`` | 70 | ``grad_norm`` is above this times the gradient where the loss enters: AUTOTRAINER's β₃; clean runs here stay under 3 |
    | ``not_updating`` | 1e-6 | ``update_ratio`` (‖Δw‖/‖w‖ of a step) is below this. CS231n's notes put a healthy ratio near 1e-3 and call lower a learning rate that may be too low; clean runs here dip to 1e-4 (SGD at its start), so the rule is kept for a layer that moves a million times slower than its size — one left out of the optimizer, or in a group at lr=0 |
    | ``update_too_large`` | 0.5 | ``update_ratio`` is above this: CS231n's 1e-3 scale, less strict by far, since Adam at 1e-3 reaches 1e-2 and a clean SGD run's last layer held 0.2 for ten steps here |
    | ``weight_growth`` | 0.07 | (said as ``update_too_large``) over a ``window`` of measured steps, ``weight_norm`` grew by more than this a step on average (from the norm the window's first update found, ``update_norm / update_ratio``), at a where other than the loss end. Adam moves every weight by about its learning rate whatever the weight's size (Kingma & Ba, 2015), so with a learning rate 100× too high the steps pile up and the weights multiply in size within ten steps, while ``update_ratio``, measured against the weights it has just inflated, soon looks ordinary. The loss end is left out: a last layer has to grow to the targets' scale. Clean runs here grow by at most 0.04 a step away from the loss end, Adam at 100× its learning rate by 0.09 to 0.13 (0.07 doubles the weights in ten steps). Weights initialised far too small grow as fast, and are found too |
    | ``plateau`` | 0.1 | over a loss window, the most the loss can have fallen (the fitted line's fall plus two standard errors) is under this share of its level, while the loss is still above ``converged`` of where it began. DeepDiagnosis' "loss not decreasing" (a loss that has not moved over 5 epochs) and AUTOTRAINER's slow convergence (under δ = 0.01 of accuracy gained per epoch), measured here against the loss's own noise, so a slow but steady fall is not one, nor is a noisy loss whose fall cannot be told: runs on shuffled labels, or at a learning rate 1000× too small, move by under 0.05 of their level, clean runs by at least 0.2. Judged with what came after: a flat stretch the loss then leaves for good, ending the run more than this share below it, is a slow start and no finding (a GRU at Adam 1e-3 sits near ln 2 for 60 steps, then learns) |
    | ``converged`` | 0.5 | (part of ``plateau``) a loss under this share of where it began has learnt: a flat stretch after it is convergence, not a plateau |
    | ``diverging`` | 0.25 | the loss climbs: over a loss window it rises (the fitted rise less two standard errors) by at least this share of its level, or the window sits at least this share above where the run began. AUTOTRAINER calls a loss past 1e5 exploded; a finite climb is caught long before that. Clean runs here never rise by more than 0.01; SGD at 100× its learning rate sits 1.8 to 9 above its start |
    | ``oscillating`` | 0.5 | in a loss window with no trend (a slope within two standard errors of flat), the swings around it are at least this share of the loss's scale (its level, or where it began when that was higher): AUTOTRAINER's unstable loss (swings of ζ = 0.03 accuracy between neighbouring peaks and troughs in η = 0.2 of the epochs), for per-step losses, whose batches swing far more than per-epoch accuracy, so measured against the scale the loss started at: clean runs here stay under 0.25, SGD at 100× its learning rate swings by 0.7 to 5 |
    | ``label_leak`` | 0.8 | ``leak_direction_auc`` (``Audit(leaks=True)``: how well the cosine of the gradients sent to a trained cut tells who shares a label with an example whose label is known; 0.5 is a guess) is at least this. An undefended U-shape here (``benchmarks/privacy.py``) reads 0.99 to 1 from its first step, ``Protection(gradients=1.0)`` 0.5 to 0.63; 0.8 is well clear of both |
    | ``window`` | 10 | measured steps a layer rule's condition has to hold |
    | ``loss_window`` | 40 | steps a run-level rule reads at once (all of them in a shorter run of at least six) |
    """
    limits = thresholds_from(thresholds)
    return findings_of(judged_facts(store, run), **limits)


def findings_of(facts: list[dict[str, Any]], **thresholds: float) -> list[Finding]:
    """The findings in ``health`` and ``loss`` facts, as the Audit and a Trainer say
    them or a record holds them (the loss of step ``n`` being the ``n``-th)."""
    limits = thresholds_from(thresholds)
    window = int(limits["window"])
    history = history_of(facts)
    places = places_of(facts)
    optimizer = optimizer_of(facts)
    ends = _ends(facts, places)
    broken = _first_nonfinite(history)
    found: list[tuple[int, int, int, Finding]] = []
    order = {where: at for at, where in enumerate(history)}
    for where, measures in history.items():
        make = _maker(where, *places.get(where, (where, "")), optimizer)
        for finding in _found(make, where, measures, history, ends, limits, window, broken):
            found.append((finding.since, order[where], KINDS.index(finding.what), finding))
    losses = [fact.get("value") for fact in facts
              if type(fact) is dict and fact.get("fact") == "loss"]
    for finding in loss_findings(losses, limits, broken, _maker(LOSS, None, "", optimizer)):
        found.append((finding.since, len(order), KINDS.index(finding.what), finding))
    return [finding for *_, finding in sorted(found, key=lambda item: item[:3])]


def _maker(where: str, node: str | None, path: str, optimizer: str | None
           ) -> Callable[[str, int, dict[str, Any]], Finding]:
    """Builds a where's findings; the optimizer the run used joins the evidence of the
    findings whose advice depends on it, so the advice is still the finding's alone."""
    def make(what: str, since: int, evidence: dict[str, Any]) -> Finding:
        if optimizer is not None and what in _BY_OPTIMIZER:
            evidence = {**evidence, "optimizer": optimizer}
        return Finding(where, what, since, evidence,
                       advice(where, what, evidence, node=node), node, path)
    return make


_BY_OPTIMIZER = ("update_too_large", "not_updating")


def thresholds_from(given: dict[str, Any]) -> dict[str, float]:
    """Every threshold, ``given`` over the defaults; an unknown name is a TypeError and a
    value out of range a ValueError, each naming it."""
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"diagnose() has no threshold {', '.join(map(repr, unknown))}; the "
                        f"thresholds are {', '.join(DEFAULTS)}")
    limits = {**DEFAULTS, **given}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"threshold {name}={value!r}: a threshold is a finite number from 0")
    for name, least in zip(_WINDOWS, (1, 3)):
        if int(limits[name]) != limits[name] or limits[name] < least:
            raise ValueError(f"{name}={limits[name]!r}: a window is a whole number of "
                             f"steps, from {least}")
    return limits


def _first_nonfinite(history: dict[str, dict[str, list[tuple[int, Any]]]]) -> int | None:
    steps = [step for measures in history.values() for step, count in measures.get("nonfinite", [])
             if isinstance(count, (int, float)) and count > 0]
    return min(steps) if steps else None


def _found(make: Callable[..., Finding], where: str, measures: dict[str, list[tuple[int, Any]]],
           history: dict[str, dict[str, list[tuple[int, Any]]]], ends: dict[int, str],
           limits: dict[str, float], window: int, broken: int | None) -> Iterable[Finding]:
    for step, count in measures.get("nonfinite", []):
        if isinstance(count, (int, float)) and count > 0:
            yield make("nonfinite", step, {"measure": "values",
                                           "count": int(min(count, _MOST_COUNTED))})
            break

    def before(series: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        return [(s, v) for s, v in series if broken is None or s < broken]

    said_here: list[Finding] = []

    def streak(what: str, measure: str, rule: str, series: list[tuple[int, Any]],
               threshold: float) -> Finding | None:
        return _streak(make, what, measure, rule, before(series), threshold, window)

    simple = (("dying", "act_zero", ">="), ("saturated", "act_saturated", ">="),
              ("not_updating", "update_ratio", "<"),
              ("label_leak", "leak_direction_auc", ">="))
    for what, measure, rule in simple:
        finding = streak(what, measure, rule, measures.get(measure, []), limits[what])
        if finding is not None and what == "not_updating":
            finding = _why_still(make, finding, before(measures.get("grad_norm", [])),
                                 dying=any(f.what == "dying" for f in said_here))
        if finding is not None:
            said_here.append(finding)
            yield finding
    finding = streak("dead_channels", "dead_channels / channels", ">=",
                     _dead_share(measures), limits["dead_channels"])
    if finding is not None:
        yield finding
    at_end = where in set(ends.values())
    large = [streak("update_too_large", "update_ratio", ">", measures.get("update_ratio", []),
                    limits["update_too_large"])]
    if not at_end:
        large.append(_growing(make, _norms(measures, broken), limits["weight_growth"], window))
    large = [f for f in large if f is not None]
    if large:  # one finding of a kind per where: the earlier reading
        yield min(large, key=lambda f: f.since)
    if not at_end:
        relative = _relative(measures, history, ends)
        for what, rule in (("vanishing", "<"), ("exploding", ">")):
            finding = streak(what, "grad_norm / loss end", rule, relative, limits[what])
            if finding is not None:
                yield finding


_MOST_COUNTED = 2**63 - 1  # a record may say a count of inf, which no int is

_HOLDS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda v, t: v >= t, ">": lambda v, t: v > t, "<": lambda v, t: v < t}


def _streak(make: Callable[..., Finding], what: str, measure: str, rule: str,
            series: list[tuple[int, Any]], threshold: float, window: int) -> Finding | None:
    """A finding at the first run of ``window`` consecutive measured steps (all of them
    when there are fewer) at which ``rule`` holds — or None."""
    holds = _HOLDS[rule]
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
                return make(what, values[start][0], {
                    "measure": measure, "rule": rule, "threshold": threshold,
                    "steps": len(held), "median": statistics.median(held), "worst": worst})
        else:
            start = None
    return None


def _why_still(make: Callable[..., Finding], finding: Finding,
               gradients: list[tuple[int, Any]], dying: bool) -> Finding:
    """Weights that do not move were left out of the optimizer, or get no gradient: a
    where whose units are dead, or to which nothing came back, is the second. Weights
    that do move, only by next to nothing (a median ratio above 0: an optimizer that
    holds them), get a gradient that has all but gone, as when a run has learnt all it
    can from its batches. Said in the evidence (``because``), so the advice points at
    the right one."""
    got = [v for step, v in gradients if step >= finding.since and isinstance(v, (int, float))]
    because = ("dying" if dying else "no gradient" if got and max(got) == 0
               else "barely" if finding.evidence.get("median", 0) > 0 else None)
    if because is None:
        return finding
    return make(finding.what, finding.since, {**finding.evidence, "because": because})


def _dead_share(measures: dict[str, list[tuple[int, Any]]]) -> list[tuple[int, float]]:
    """Per step, the share of channels that stayed 0 (the largest of any group's)."""
    channels = dict(measures.get("channels", []))
    out = []
    for step, dead in measures.get("dead_channels", []):
        of = channels.get(step)
        if isinstance(dead, dict) and isinstance(of, dict):
            shares = [dead[g] / of[g] for g in dead if _number(dead[g]) and _number(of.get(g))
                      and of[g] > 0]
            if shares:
                out.append((step, max(shares)))
        elif _number(dead) and _number(of) and of > 0:
            out.append((step, dead / of))
    return out


def _number(value: Any) -> bool:
    """A finite number, as a measure should be (a record may hold anything there)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _norms(measures: dict[str, list[tuple[int, Any]]], broken: int | None
           ) -> list[tuple[int, float]]:
    """``(step, weight_norm after it)``, led by the norm the first measured update
    found (``update_norm / update_ratio``, said as the step before it)."""
    ratios = dict(measures.get("update_ratio", []))
    norms = dict(measures.get("update_norm", []))
    series = [(step, v) for step, v in measures.get("weight_norm", [])
              if isinstance(v, (int, float)) and math.isfinite(v) and v > 0
              and (broken is None or step < broken)]
    for step, _ in series:
        ratio, moved = ratios.get(step), norms.get(step)
        if isinstance(ratio, (int, float)) and isinstance(moved, (int, float)) \
                and math.isfinite(ratio) and ratio > 0 and moved > 0:
            return [(step - 1, moved / ratio)] + [(s, v) for s, v in series if s >= step]
    return []


def _growing(make: Callable[..., Finding], norms: list[tuple[int, float]], threshold: float,
             window: int) -> Finding | None:
    """A finding at the first ``window`` measured steps over which the weights grew by
    more than ``threshold`` a step on average — or None. Read per step, so that an
    Audit measuring every tenth step judges the same growth."""
    rates = []
    for at in range(len(norms) - window):
        (first, before), (last, after) = norms[at], norms[at + window]
        if last <= first:  # steps said out of order, or twice: no rate a step to read
            continue
        try:
            rate = (after / before) ** (1 / (last - first)) - 1
        except OverflowError:
            rate = math.inf
        rates.append((norms[at + 1][0], rate, last))
    held = []
    for since, rate, last in rates:
        if rate > threshold:
            held.append((since, rate, last))
        elif held:
            break
    if not held:
        return None
    values = [rate for _, rate, _ in held]
    return make("update_too_large", held[0][0], {
        "measure": "weight_norm growth a step", "rule": ">", "threshold": threshold,
        "steps": held[-1][2] - held[0][0] + 1, "median": statistics.median(values),
        "worst": max(values)})


def _ends(facts: list[dict[str, Any]], places: dict[str, tuple[str, str]]) -> dict[int, str]:
    """Per step, the where the loss enters: the last node (a where that is a node
    itself, not a path inside one) with a gradient among that step's facts. The Audit
    says a step's facts in the graph's topological order, so that node is a leaf of
    the graph."""
    ends: dict[int, str] = {}
    for fact in facts:
        if type(fact) is dict and fact.get("fact") == "health" and "grad_norm" in fact \
                and places.get(fact["where"], ("", ""))[1] == "":
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
    """``{node: [what, ...]}`` for ``Graph.figure(overlay=...)``: a finding colours its
    ``node`` (one on ``body.net.0``, a path inside ``body``, colours ``body``). Each
    what once per node, in order; the run's own findings (``where="loss"``) belong to
    no node and colour none."""
    out: dict[str, list[str]] = {}
    for finding in findings:
        if not isinstance(finding, Finding):
            raise TypeError(f"overlay() takes what diagnose() answers (Findings), not a "
                            f"{type(finding).__qualname__}")
        if finding.node is None:
            continue
        said_here = out.setdefault(finding.node, [])
        if finding.what not in said_here:
            said_here.append(finding.what)
    return out
