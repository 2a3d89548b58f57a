"""What to do: one sentence for each what, naming where it was found."""

import math

import pytest

from somatize.health import KINDS
from somatize.health._advice import advice

AT_A_PLACE = [k for k in KINDS if k not in ("plateau", "diverging", "oscillating")]
AT_THE_LOSS = ("nonfinite", "plateau", "diverging", "oscillating")


@pytest.mark.parametrize("what", AT_A_PLACE)
def test_every_what_at_a_place_has_one_sentence_naming_it(what):
    said = advice("enc.net.2", what, {"measure": "m", "worst": 0.75})
    assert "enc.net.2" in said and said.endswith(".") and said.count(". ") == 0, said


@pytest.mark.parametrize("what", AT_THE_LOSS)
def test_every_run_level_what_has_one_sentence(what):
    said = advice("loss", what, {"measure": "m", "loss": 0.9})
    assert said.startswith("The loss") and said.endswith("."), said


@pytest.mark.parametrize("level, classes", [(math.log(3), 3), (2.31, 10), (math.log(12), 12),
                                            (2.01, None), (math.log(40), None)])
def test_a_plateau_at_the_cross_entropy_of_a_uniform_guess_names_the_classes(level, classes):
    said = advice("loss", "plateau", {"loss": level})
    assert (f"= ln {classes}," in said) if classes else ("= ln" not in said)


def test_the_advice_tells_a_group_at_lr_0_from_weights_that_grow():
    assert "not in the optimizer" in advice("l2", "not_updating", {})
    assert "ten to a hundred times" in advice(
        "l2", "update_too_large", {"measure": "weight_norm growth a step"})
    assert "ten to a hundred" not in advice("l2", "update_too_large", {"measure": "update_ratio"})
