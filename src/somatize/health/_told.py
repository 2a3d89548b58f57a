"""A run's findings told as lines of text, for a terminal (``somatize health``)."""

from __future__ import annotations

from typing import Any

from .._text import table
from ._rules import DEFAULTS, findings_of

__all__ = ["findings_told"]


def findings_told(run: str, facts: list[dict[str, Any]], thresholds: dict[str, float]) -> list[str]:
    """The findings of ``facts`` (``judged_facts``) at these thresholds: a head saying
    what was judged, then a table with the advice under each finding."""
    health = [fact for fact in facts if fact["fact"] == "health"]
    losses = sum(fact["fact"] == "loss" for fact in facts)
    not_audited = ("it was not audited (train it with Trainer(..., auditing=True) and a "
                   "Recorder)")
    if not health and not losses:
        return [f"run {run} has no health facts: {not_audited}"]
    if health:
        places = len({f['where'] for f in health})
        head = (f"run {run}: {len({f['step'] for f in health})} measured steps of {places} "
                f"{'place' if places == 1 else 'places'} (a node, or a layer in one), "
                f"{losses} losses")
    else:
        head = f"run {run}: {losses} losses and no health facts, so only the loss is judged: {not_audited}"
    changed = {k: v for k, v in thresholds.items() if v != DEFAULTS[k]}
    if changed:
        head += f"; thresholds changed: {', '.join(f'{k}={v:g}' for k, v in changed.items())}"
    findings = findings_of(facts, **thresholds)
    if not findings:
        return [head, "no findings"]
    rows = [[f.where, f.what, str(f.since), f.brief] for f in findings]
    aligned = table(["where", "what", "since", "evidence"], rows, right={2})
    lines = [head, ""] + aligned[:2]
    for line, finding in zip(aligned[2:], findings):  # each finding, and under it what to do
        lines += [line, f"    advice: {finding.advice}"]
    return lines
