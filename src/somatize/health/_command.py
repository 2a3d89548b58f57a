"""``somatize health STORE RUN``: the findings of a run, as a table on a terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .._errors import SomaError
from ..cli import Refused, _store, table
from ._read import judged_facts
from ._rules import DEFAULTS, _thresholds, findings_of, said

__all__ = ["command"]

USAGE_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize health",
        description="What the health rules find in a run's record (nothing is trained).")
    parser.add_argument("store", metavar="STORE", help="the store's directory")
    parser.add_argument("run", metavar="RUN", help="the run's name (see: somatize runs STORE)")
    parser.add_argument("--threshold", "-t", action="append", default=[], metavar="NAME=VALUE",
                        help=f"change one threshold; the names are {', '.join(DEFAULTS)}")
    return parser


def command(argv: Sequence[str] | None = None) -> int:
    """Runs ``somatize health STORE RUN [--threshold NAME=VALUE ...]``; answers the exit
    status: 0 with the findings printed (or "no findings"), 2 with one line on stderr
    for a store, run or threshold that cannot be used."""
    try:
        arguments = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse has said what was wrong (or printed --help)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    try:
        thresholds = _thresholds(_parsed(arguments.threshold))
        facts = judged_facts(_store(arguments.store), arguments.run)
    except (Refused, SomaError, OSError, ValueError, TypeError) as exc:
        print(f"somatize health: {exc}", file=sys.stderr)
        return USAGE_ERROR
    _print(_lines(arguments.run, facts, thresholds))
    return 0


def _parsed(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        try:
            number = float(value) if equals else None
        except ValueError:
            number = None
        if number is None:
            raise Refused(f"--threshold takes NAME=VALUE with a number, such as dying=0.8, "
                           f"not {pair!r}")
        out[name.strip()] = number
    return out


def _lines(run: str, facts: list[dict[str, Any]], thresholds: dict[str, float]) -> list[str]:
    health = [fact for fact in facts if fact["fact"] == "health"]
    losses = len(facts) - len(health)
    not_audited = ("it was not audited (train it with Trainer(..., auditing=True) and a "
                   "Recorder)")
    if not facts:
        return [f"run {run} has no health facts: {not_audited}"]
    if health:
        head = (f"run {run}: {len({f['step'] for f in health})} measured steps of "
                f"{len({f['where'] for f in health})} wheres, {losses} losses")
    else:
        head = f"run {run}: {losses} losses and no health facts, so only the loss is judged: {not_audited}"
    changed = {k: v for k, v in thresholds.items() if v != DEFAULTS[k]}
    if changed:
        head += f"; thresholds changed: {', '.join(f'{k}={v:g}' for k, v in changed.items())}"
    findings = findings_of(facts, **thresholds)
    if not findings:
        return [head, "no findings"]
    rows = [[f.where, f.what, str(f.since), said(f.evidence)] for f in findings]
    aligned = table(["where", "what", "since", "evidence"], rows, right={2})
    lines = [head, ""] + aligned[:2]
    for line, finding in zip(aligned[2:], findings):  # each finding, and under it what to do
        lines += [line, f"    advice: {finding.advice}"]
    return lines


def _print(lines: list[str]) -> None:
    try:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    except BrokenPipeError:  # `somatize health ... | head` stopped reading: not an error
        pass
