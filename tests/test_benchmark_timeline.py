"""The plain split that benchmarks/timeline.py lays beside ours: marking its moments
must not change what it computes, and it must mark each moment where ours does."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the split benchmarks train torch models")

STEPS = 3
BODY = ["worker read slice", "worker walks", "worker walked", "worker sends done",
        "worker sent done"]
HERE = ["here sends slice", "here sent slice", "here read done"]


def test_the_marked_plain_split_computes_what_the_plain_one_does_and_marks_every_exchange(
        benchmark_file, tmp_path):
    timeline, split = benchmark_file("timeline"), benchmark_file("split")
    data = [split.batch(16, 8) for _ in range(STEPS)]
    losses = {}
    for name in ("plain", "marked"):
        torch.manual_seed(0)  # both start from the same weights
        timeline.MARKS.clear()
        contender = split.PlainSplit(16, 8) if name == "plain" else \
            timeline.plain_marked(16, 8, str(tmp_path / "marks.json"))
        try:
            losses[name] = [contender.step(b) for b in data]
        finally:
            contender.close()
    assert losses["marked"] == losses["plain"]
    # Here: each step sends the activation and reads the body's output, then sends the
    # gradient and reads the one owed back.
    assert [label for _, label in timeline.MARKS] == HERE * 2 * STEPS
    # There: the body reads, walks and answers twice a step, in that order; the marks
    # are written once the client hangs up, which close() waited for.
    there = json.loads((tmp_path / "marks.json").read_text())
    assert [label for _, label in there] == BODY * 2 * STEPS
    stamps = [at for at, _ in there]
    assert stamps == sorted(stamps)
