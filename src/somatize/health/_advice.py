"""What to do about a finding: one sentence per what, naming the where, as
DeepDiagnosis (Wardat et al., ICSE 2022) pairs each symptom it finds with a fix.

The sentence is a function of the finding alone (its where, node, what and
evidence), so a diagnosis read back from a record, anywhere, advises the same. What
depends on the optimizer the run used is read from the evidence (``optimizer``,
which ``diagnose`` takes from the run's ``graph`` fact); a run that did not say is
advised in terms that hold for any.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["advice"]


def advice(where: str, what: str, evidence: dict[str, Any], *, node: str | None = None) -> str:
    """The advice for ``what`` found at ``where`` (inside ``node``; without it, the
    where up to its first dot) with ``evidence``."""
    if node is None:
        node = where.split(".", 1)[0]
    if where == "loss":
        return _for_the_loss(what, evidence)
    return _FOR_A_PLACE[what](where, node, evidence)


def _nonfinite(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"NaN or Inf first showed at {where}: lower the learning rate or clip gradients "
            "(torch.nn.utils.clip_grad_norm_), and look in it for a log, square root or "
            "division that meets 0 or a negative number.")


def _dying(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"Most of what {where} produces is exactly 0, its ReLUs dead: re-initialise it "
            "(a large negative bias, or weights too large, switch units off for good), "
            "lower the learning rate, or use LeakyReLU or GELU there.")


def _dead_channels(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"{_share(evidence)} of {where}'s channels stayed 0 over the Audit's whole window: "
            "re-initialise that convolution (its bias or weights hold them below 0), lower "
            "the learning rate, or use LeakyReLU after it.")


def _exploding(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"{where} gets gradients far larger than the layers nearer the loss: "
            "re-initialise it with a smaller gain, put normalisation (LayerNorm, "
            "BatchNorm) after it, or clip gradients.")


def _vanishing(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"Almost none of the gradient the loss sends back reaches {where}: use "
            "ReLU-like activations instead of sigmoid or tanh between it and the loss, "
            "re-initialise with a larger gain, or add normalisation or skip connections.")


def _saturated(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"Most of what {where} produces sits at its bounds, where no gradient passes: "
            "normalise the inputs (to mean 0 and standard deviation 1), or re-initialise "
            "the layer before the bound with smaller weights.")


def _not_updating(where: str, node: str, evidence: dict[str, Any]) -> str:
    if evidence.get("because") == "dying":
        return (f"Nothing moves {where}'s weights because its units are dead and pass no "
                f"gradient back to them: mend its dying first (re-initialise it, lower the "
                f"learning rate, or use LeakyReLU).")
    if evidence.get("because") == "no gradient":
        return (f"Nothing moves {where}'s weights because no gradient reaches them: mend "
                f"what stops it between {where} and the loss (a dying or vanishing layer, "
                f"an output detached), or freeze(g, {node!r}) if it is meant to stay.")
    if evidence.get("because") == "barely":
        return (f"{where}'s weights still move, but by next to nothing: the gradient that "
                f"reaches them has all but gone. If the loss is as low as it needs to be, "
                f"the run has learnt what it can from these batches (stop it sooner); if "
                f"not, raise the learning rate of the param group holding {node}.")
    return (f"Nothing moves {where}'s weights: this node is not in the optimizer, or its "
            f"param group's learning rate is 0 — give it parameters(g) with a learning rate "
            f"above 0, or freeze(g, {node!r}) if it is meant to stay as it is.")


def _update_too_large(where: str, node: str, evidence: dict[str, Any]) -> str:
    optimizer = evidence.get("optimizer")
    kind = _kind(optimizer)
    if "growth" in str(evidence.get("measure", "")):
        if kind == "adaptive":
            why = (f"as {optimizer}'s do with a learning rate far too high (it moves every "
                   "weight by about the learning rate, whatever the weight's size)")
        elif kind == "plain":
            why = f"as {optimizer}'s do when the learning rate times the gradient outgrows them"
        else:
            why = "as they do under a learning rate far too high"
        return (f"{where}'s weights multiply in size step after step, {why}: lower the "
                f"learning rate of the param group holding {node} ten to a hundred times "
                f"(or, if it started with weights far below the usual scale, initialise it "
                f"at that scale).")
    if kind == "plain":
        more = (f"; with {optimizer} a step is the learning rate times the gradient, so "
                "clipping gradients (torch.nn.utils.clip_grad_norm_) bounds it too")
    elif kind == "adaptive":
        more = (f"; {optimizer} moves each weight by about the learning rate, so a learning "
                "rate near the weights' own size is the cause")
    else:
        more = ""
    return (f"Each step moves {where}'s weights by a large share of their size: lower the "
            f"learning rate of the param group holding {node}{more}.")


# Optimizers whose step is scaled per weight by its gradients' history, so that a step
# is about the learning rate whatever the gradient (Kingma & Ba, 2015), and those whose
# step is the learning rate times the gradient (with momentum, a sum of such).
_ADAPTIVE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop",
             "SparseAdam", "Adafactor", "Lion")
_PLAIN = ("SGD", "ASGD")


def _kind(optimizer: Any) -> str | None:
    if optimizer in _ADAPTIVE:
        return "adaptive"
    if optimizer in _PLAIN:
        return "plain"
    return None


def _label_leak(where: str, node: str, evidence: dict[str, Any]) -> str:
    return (f"The gradients sent to {where} tell which examples share a label (direction "
            f"attack AUC {evidence.get('worst', float('nan')):.2f}): whoever runs {node} can "
            f"read your labels, so protect its cut before they are sent "
            f"(Trainer(protecting={{{node!r}: Protection(gradients=1.0)}})).")


_FOR_A_PLACE = {"label_leak": _label_leak, "nonfinite": _nonfinite, "dying": _dying, "dead_channels": _dead_channels,
                "exploding": _exploding, "vanishing": _vanishing, "saturated": _saturated,
                "not_updating": _not_updating, "update_too_large": _update_too_large}


def _for_the_loss(what: str, evidence: dict[str, Any]) -> str:
    if what == "nonfinite":
        return ("The loss itself became NaN or Inf: lower the learning rate or clip "
                "gradients, and check the targets and the objective (a log of 0, a label "
                "beyond the classes).")
    if what == "diverging":
        return ("The loss climbs: lower the learning rate of every param group, or add "
                "warm-up or gradient clipping.")
    if what == "oscillating":
        return ("The loss swings without settling: lower the learning rate, or take larger "
                "batches so that each step's gradient is less noisy.")
    level = evidence.get("loss")
    classes = _classes(level) if isinstance(level, (int, float)) else None
    if classes is not None:
        return (f"The loss sits at {level:.3g} = ln {classes}, a uniform guess over {classes} "
                "classes: check that the labels belong to their inputs (shuffled labels sit "
                "there), then raise a learning rate too small to move the weights.")
    return ("The loss is not going down: check that the targets belong to their inputs, "
            "then raise a learning rate too small to move the weights.")


def _classes(level: float) -> int | None:
    """The number of classes, 2 to 12, whose uniform guess has this cross entropy (to
    within 3%); beyond 12, ln k and ln (k + 1) are too close to tell apart."""
    classes = round(math.exp(level)) if 0.5 < level < 3 else 0
    return classes if 2 <= classes <= 12 and abs(math.log(classes) - level) < 0.03 * level \
        else None


def _share(evidence: dict[str, Any]) -> str:
    worst = evidence.get("worst")
    return f"{worst:.0%}" if isinstance(worst, (int, float)) else "Most"
