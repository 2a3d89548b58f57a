"""The run-level rules, on losses whose answer is known: a loss sitting at ln(classes)
is a plateau and one still falling is not, a climb is diverging, swings with no trend
are oscillating — each measured against the loss's own noise."""

import math
import random

import pytest

from somatize.health import DEFAULTS
from somatize.health._rules import findings_of


def said(losses):
    """A Trainer's loss facts, one per step."""
    return [{"fact": "loss", "value": value} for value in losses]


def noisy(values, spread, seed=0):
    """``values`` times (1 + N(0, spread)): batch noise proportional to the loss."""
    rng = random.Random(seed)
    return [v * (1 + rng.gauss(0, spread)) for v in values]


def found(losses, **thresholds):
    return [(f.where, f.what, f.since) for f in findings_of(said(losses), **thresholds)]


def test_a_loss_sitting_at_ln_classes_is_a_plateau_and_the_advice_says_which_classes():
    shuffled = noisy([math.log(10)] * 60, 0.01)
    [finding] = findings_of(said(shuffled))
    assert (finding.where, finding.what, finding.since) == ("loss", "plateau", 1)
    evidence = finding.evidence
    assert evidence["steps"] == 60 and evidence["threshold"] == DEFAULTS["plateau"]
    assert evidence["worst"] < 0.05 and evidence["loss"] == pytest.approx(2.30, abs=0.02)
    assert "= ln 10" in finding.advice and "labels belong to their inputs" in finding.advice
    regression = noisy([0.9] * 60, 0.01)  # not the cross entropy of a uniform guess
    [finding] = findings_of(said(regression))
    assert finding.what == "plateau" and "= ln" not in finding.advice
    assert finding.advice.startswith("The loss is not going down")


def test_a_loss_still_falling_or_too_noisy_to_tell_is_not_a_plateau():
    slow = noisy([2.3 - 0.006 * t for t in range(60)], 0.005)  # a tenth of its level in 40
    assert found(slow) == []
    late = noisy([0.2 + 2.1 * math.exp(-t / 8) - 0.0002 * t for t in range(100)], 0.02)
    assert found(late) == []  # flat for its last 60 steps, but far below where it began
    [(where, what, since)] = found(late, converged=0.0)  # unless that is asked for
    assert (where, what) == ("loss", "plateau") and since > 30
    rough = noisy([1.0] * 60, 0.3)  # a flat loss this noisy could hide a fall of 20%
    assert found(rough) == []


def test_a_climbing_loss_is_diverging_by_its_trend_or_by_where_it_started():
    climbing = noisy([1.0 + 0.02 * t for t in range(60)], 0.02)
    assert found(climbing) == [("loss", "diverging", 1)]
    [finding] = findings_of(said(climbing))
    assert finding.evidence["measure"] == "loss rise (lower bound) / loss"
    assert "lower the learning rate" in finding.advice
    jumped = [2.3, 2.3, 2.3] + noisy([7.0] * 57, 0.1)  # up at once, and staying up
    [finding] = findings_of(said(jumped))
    assert (finding.what, finding.since) == ("diverging", 1)
    assert finding.evidence["measure"] == "loss above its start (lower bound) / start"
    assert found(climbing, diverging=5.0) == []


def test_swings_as_large_as_the_loss_with_no_trend_are_oscillating():
    swinging = [2.0] * 3 + noisy([1.0 if t % 4 < 2 else 3.0 for t in range(57)], 0.05)
    [(where, what, since)] = found(swinging)
    assert (where, what) == ("loss", "oscillating") and since <= 4
    batchy = noisy([1.0] * 60, 0.15)  # batch noise, however flat, is not a swing
    assert found(batchy) == []
    assert found(swinging, oscillating=2.0) == []


def test_a_nan_loss_is_found_at_once_and_nothing_after_it_is_judged():
    losses = noisy([2.3] * 50, 0.01)
    losses[20] = math.nan
    [plateau, nan] = findings_of(said(losses))
    assert (nan.where, nan.what, nan.since) == ("loss", "nonfinite", 21)
    assert nan.evidence == {"measure": "loss values", "count": 1}
    assert (plateau.what, plateau.since, plateau.evidence["steps"]) == ("plateau", 1, 20)
    healthy = {"fact": "health", "where": "body", "step": 15, "nonfinite": 4}
    assert [f.what for f in findings_of(said(noisy([2.3] * 50, 0.01)) + [healthy])] == [
        "plateau", "nonfinite"]  # judged up to the step the Audit counted a NaN


def test_short_runs_are_judged_whole_and_runs_of_a_few_steps_or_losses_under_0_not_at_all():
    assert found(noisy([2.3] * 12, 0.01)) == [("loss", "plateau", 1)]
    assert found(noisy([2.3] * 5, 0.01)) == []
    assert found([-1.0] * 60) == []
    with pytest.raises(ValueError, match="loss_window=2"):
        found([1.0] * 10, loss_window=2)


def test_a_flat_start_the_run_then_leaves_is_no_plateau_one_it_keeps_or_returns_to_is():
    start = [0.693 - 0.048 * t / 60 for t in range(60)]  # 0.693 -> 0.645: slow
    learns = [0.645 * math.exp(-t / 25) + 0.26 * (1 - math.exp(-t / 25)) for t in range(60)]
    assert found(noisy(start + learns, 0.01)) == []  # a slow start, then it learnt
    assert found(noisy(start, 0.01)) == [("loss", "plateau", 1)]  # flat to its end
    back = [0.4 + (0.693 - 0.4) * t / 30 for t in range(30)] + [0.693] * 40
    returned = [(f.what, f.since) for f in findings_of(said(noisy(start + learns[:30] + back,
                                                                   0.01)))]
    assert ("plateau", 1) in returned  # left, then came back to: the run never got past it
    # left by less than the threshold's share of its level: still one
    assert found(noisy(start + [0.62] * 60, 0.01))[0][1] == "plateau"


def test_losses_of_any_finite_size_are_judged_as_the_same_losses_at_any_scale():
    """The rules are ratios to the loss's own level, so scaling every loss changes no
    finding; losses near float's largest do not overflow the fit."""
    shapes = {"climbing": noisy([1.0 + 0.02 * t for t in range(60)], 0.02),
              "flat": noisy([math.log(10)] * 60, 0.01),
              "swinging": [1.0 + 0.8 * (-1) ** t for t in range(60)]}
    for name, losses in shapes.items():
        expected = found(losses)
        for scale in (1e-300, 1e150, 1e300):
            assert found([v * scale for v in losses]) == expected, (name, scale)
