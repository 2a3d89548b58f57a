"""What a worker could learn from what crosses a trained cut, measured and defended.

A node trained where it runs (``Split`` on a worker) is handed two things by this
process: the activations of the nodes that feed it, and the gradients of what it made.
Both say more than they seem to. The gradients give the labels away (Li et al.,
"Label Leakage and Protection in Two-party Split Learning", ICLR 2022): the norm of an
example's gradient, and its direction next to another example's whose label is known,
sort a batch by label. The activations keep the input's shape, which is what inverting
them starts from (Vepakomma et al., "NoPeek", 2020, measure that with the distance
correlation between the two).

The measures (``Audit(leaks=True)``) are taken here, where the labels are, on exactly
what was sent:

- ``leak_norm_auc``: the ROC AUC of the per-example gradient norm as a score for the
  label, a larger norm read as the rarer class of the batch, as the paper's attack
  reads it; with more than two classes, each class against the rest in turn, averaged
  (a floor: classes whose norms stand out and classes whose norms hide cancel), and
  each class's own AUC in ``leak_norm_classes``, from which ``run_norm_leak`` reads a
  run's worst class.
- ``leak_direction_auc``: each example in turn is the one whose label the worker knows;
  the cosine of every other example's gradient with its gradient scores "same label as
  it", and the AUCs are averaged over the examples. Read one way: a positive cosine
  means the same label, as the paper's attack reads it.
- ``input_dcor``: the distance correlation between the batch's input and what was
  sent, the textbook estimator NoPeek uses; ``input_dcor_corrected`` the bias-corrected
  one (``distance_correlation``), which reads near 0 for a batch independent of the
  input where the textbook one reads 0.7 or more at a batch of 32.

The defences (``Protection``) are applied here, before the value leaves the process —
one the receiver applies protects nobody — and draw their noise from a generator of
their own, seeded by ``Trainer.seed`` and kept in a checkpoint, so a seeded run
repeats ``==``, resumed or not, and the random state of the model's own layers is not
touched. The gradient defence adds to each example's gradient zero-mean noise along
the directions that tell the classes apart (each class's mean gradient from the
average of them), ``gradients`` times their size, and isotropic noise as large:
isotropic noise alone would need a multiple of the gradient in every direction to
blur the one direction the attack reads. Zero-mean, the gradient stays unbiased and
training pays in variance, not in a shifted objective.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import DeclarationError, StoreError
from .._node import Opaque
from ._tensors import tensors_in

__all__ = ["LEAKS", "Privacy", "Protection", "class_norm_leaks", "corrected_squared",
           "direction_leak", "distance_correlation", "norm_leak", "roc_auc", "run_norm_leak"]

#: The measures ``Audit(leaks=True)`` adds to the ``health`` fact of a trained cut.
LEAKS = ("leak_norm_auc", "leak_norm_classes", "leak_direction_auc", "input_dcor",
         "input_dcor_corrected")


# -- the measures, as pure functions ------------------------------------------------------
def roc_auc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """The area under the ROC curve of ``scores`` for ``positive`` (bools), ties counted
    half (the Mann-Whitney U over the pair count); None where one side is empty."""
    scores = scores.detach().reshape(-1).double()
    positive = positive.reshape(-1).bool()
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # tied scores share their mean rank
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _rows(value: torch.Tensor) -> torch.Tensor:
    return value.detach().reshape(value.shape[0], -1).double()


def norm_leak(gradients: torch.Tensor, labels: torch.Tensor) -> float | None:
    """How well each example's gradient norm tells its label, as the paper's norm attack
    reads it: a larger norm says "the positive class". With two classes the positive
    one is the rarer in the batch (the larger label on a tie), as in the paper, where
    the rare class is the one whose gradients stand out; with more, each class against
    the rest in turn, averaged over the classes that have examples on both sides.
    Read one way only, so a batch where norms say nothing reads 0.5 on average (read
    either way round, chance alone would read 0.6 at a batch of 32); a run whose steps
    read well below 0.5 leaks as much as one above (the rarer class's norms are the
    smaller), so a run's leak is its mean read either way round. With many classes,
    those whose norms stand out and those whose norms hide cancel in the average:
    there it is a floor, not the worst case. None where no class has examples on both
    sides."""
    norms = _rows(gradients).norm(dim=1)
    classes, counts = torch.unique(labels, return_counts=True)
    if len(classes) == 2:
        classes = classes[int(counts[1] <= counts[0])].reshape(1)
    found = [auc for label in classes if (auc := roc_auc(norms, labels == label)) is not None]
    return sum(found) / len(found) if found else None


def class_norm_leaks(gradients: torch.Tensor, labels: torch.Tensor) -> list[list[float]]:
    """Each class's own norm-attack AUC, that class against the rest (read one way: a
    larger norm says "this class"), as ``[label, auc]`` pairs, for the classes with
    examples on both sides: what ``run_norm_leak`` reads a run's worst class from."""
    norms = _rows(gradients).norm(dim=1)
    return [[int(label), auc] for label in torch.unique(labels)
            if (auc := roc_auc(norms, labels == label)) is not None]


def run_norm_leak(facts: list[dict[str, Any]]) -> float | None:
    """The norm attack's leak AUC over a run, from its ``health`` facts of one cut.

    With two classes, the mean of the steps' ``leak_norm_auc``, read either way round
    (a run whose rarer class's norms are the smaller leaks as much). With more, the
    worst class: each class's AUC against the rest averaged over the steps, read
    either way round, and the largest of them. The average over classes that
    ``leak_norm_auc`` is would understate it (one class's norms standing out and
    another's hiding cancel), and the worst class of a single step would overstate it
    (at a few examples a class, chance alone reads 0.7); averaged over a run's steps
    first, one class's chance wanders by a hundredth. None without the measures."""
    by_class: dict[int, list[float]] = {}
    binary = []
    for fact in facts:
        if "leak_norm_classes" in fact:
            for label, auc in fact["leak_norm_classes"]:
                by_class.setdefault(int(label), []).append(auc)
        elif fact.get("leak_norm_auc") is not None:
            binary.append(fact["leak_norm_auc"])
    means = [sum(v) / len(v) for v in by_class.values()]
    if binary:
        means.append(sum(binary) / len(binary))
    return max(max(m, 1 - m) for m in means) if means else None


def direction_leak(gradients: torch.Tensor, labels: torch.Tensor) -> float | None:
    """How well the direction of the gradients tells who shares a label with an example
    whose label is known: for each example in turn, the AUC of the cosine of every
    other example's gradient with its own, for "same label"; averaged over the examples
    for which both answers occur among the others."""
    rows = _rows(gradients)
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-300)
    cosines = unit @ unit.T
    labels = labels.reshape(-1)
    found = []
    others = ~torch.eye(len(rows), dtype=torch.bool)
    for known in range(len(rows)):
        auc = roc_auc(cosines[known][others[known]],
                      (labels == labels[known])[others[known]])
        if auc is not None:
            found.append(auc)
    return sum(found) / len(found) if found else None


def distance_correlation(x: torch.Tensor, y: torch.Tensor, *,
                         corrected: bool = False) -> torch.Tensor:
    """The sample distance correlation of two batches, row ``i`` of one paired with row
    ``i`` of the other: 0 when independent, 1 for a rotation and scaling.

    By default the textbook estimator (Székely et al., 2007), the one NoPeek trains
    with. It is biased upward, and at a batch of 32 with tens of features the bias is
    most of it: a batch of noise drawn independently of the input reads 0.7 to 0.8.
    ``corrected=True`` is the bias-corrected one (Székely and Rizzo, 2014: the
    distances U-centred, which estimates the squared correlation without bias), given
    as its square root, clamped at 0, in the textbook's units; independent batches
    read near 0 on average. Differentiable in both (two equal rows give a zero
    gradient, not a NaN: see ``_distances``)."""
    if corrected:
        return corrected_squared(x, y).clamp_min(0).sqrt()
    a, b = _centred(x), _centred(y)
    covariance = (a * b).mean()
    variances = (a * a).mean() * (b * b).mean()
    if float(variances.detach()) <= 0:
        return covariance * 0  # a constant batch shares nothing with anything
    return (covariance.clamp_min(0) / variances.sqrt()).sqrt()


def corrected_squared(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bias-corrected squared distance correlation of two batches (Székely and
    Rizzo, 2014), unclamped: near 0, and as often below as above, when they are
    independent. What ``Protection(dcor="corrected")`` trains NoPeek with: its
    square root's slope is unbounded near 0, and the square is not."""
    a, b = _u_centred(x), _u_centred(y)
    return (a * b).sum() / ((a * a).sum() * (b * b).sum()).sqrt().clamp_min(1e-300)


def _distances(x: torch.Tensor) -> torch.Tensor:
    """The rows' pairwise Euclidean distances, each from its own differences (not the
    Gram matrix's, whose cancellation leaves equal rows a hair apart), without the
    rows x rows x features tensor broadcasting would hold; cdist's backward gives equal
    rows a zero gradient, not a NaN."""
    rows = x.reshape(x.shape[0], -1)
    return torch.cdist(rows, rows, compute_mode="donot_use_mm_for_euclid_dist")


def _centred(x: torch.Tensor) -> torch.Tensor:
    distances = _distances(x)
    return (distances - distances.mean(0, keepdim=True) - distances.mean(1, keepdim=True)
            + distances.mean())


def _u_centred(x: torch.Tensor) -> torch.Tensor:
    distances = _distances(x)
    n = distances.shape[0]
    if n < 4:
        raise ValueError(f"the bias-corrected distance correlation needs a batch of 4 rows "
                         f"or more, not {n}; give larger batches, or Protection(dcor="
                         "'textbook') for NoPeek")
    centred = (distances - distances.sum(0, keepdim=True) / (n - 2)
               - distances.sum(1, keepdim=True) / (n - 2) + distances.sum() / ((n - 1) * (n - 2)))
    return centred * (1 - torch.eye(n, dtype=centred.dtype, device=centred.device))


# -- the defences -----------------------------------------------------------------------
class Protection:
    """What this process does to what crosses one trained cut before it is sent.

    ``noise``: the standard deviation of Gaussian noise added to the activations sent
    (in their own units). ``nopeek``: the weight of the distance correlation between
    the batch's input and the activations sent, added to the objective so the part
    here learns to send less of the input; ``dcor`` says which: ``"textbook"`` (the
    default, NoPeek's own, Székely et al. 2007) or ``"corrected"``, the bias-corrected
    square (``corrected_squared``), which at a batch of 32 presses on what the input
    and the activations share rather than on the estimator's bias, and halved the
    corrected measure at a third of the accuracy the textbook term took on digits
    (benchmarks/privacy.py). ``gradients``: the strength of the noise
    added to the gradients sent — along the directions that tell the batch's classes
    apart, this many times their size, and isotropic noise as large
    (``noisy_gradient``); 0 leaves them as they are.
    All three 0 (the default) change nothing.
    """

    def __init__(self, *, noise: float = 0.0, nopeek: float = 0.0, gradients: float = 0.0,
                 dcor: str = "textbook"):
        for name, value in (("noise", noise), ("nopeek", nopeek), ("gradients", gradients)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise TypeError(f"Protection({name}=...) is a finite number from 0 up, not "
                                f"{value!r}")
        if dcor not in ("textbook", "corrected"):
            raise ValueError(f"Protection(dcor=...) is 'textbook' or 'corrected', not {dcor!r}")
        self.noise, self.nopeek, self.gradients = float(noise), float(nopeek), float(gradients)
        self.dcor = dcor

    def said(self) -> dict[str, Any]:
        """What the record says of it: the defences that are on, at their settings."""
        said: dict[str, Any] = {name: value for name, value in (
            ("noise", self.noise), ("nopeek", self.nopeek), ("gradients", self.gradients)) if value}
        if self.nopeek and self.dcor != "textbook":
            said["dcor"] = self.dcor
        return said

    def term(self, given: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """The NoPeek term of one batch, its weight in: what the objective adds."""
        if self.dcor == "corrected":
            return self.nopeek * corrected_squared(given, sent)
        return self.nopeek * distance_correlation(given, sent)

    def __repr__(self) -> str:
        said = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v!r}"
                         for k, v in self.said().items())
        return f"Protection({said})"


def noisy_gradient(gradient: torch.Tensor, strength: float, generator: torch.Generator,
                   labels: torch.Tensor | None = None) -> torch.Tensor:
    """``gradient`` (one row per example) with the gradient defence's noise added.

    Zero-mean, so the sum the weights learn from stays unbiased. Where ``labels`` say
    the examples' classes: noise along the directions the direction attack reads —
    each class's mean gradient less the average of the class means, each drawn with a
    standard normal weight times ``strength`` — the structure Marvell finds optimal for
    two classes, without its optimisation; and isotropic noise of the same expected
    squared norm, without which two classes' noise would lie on one line, along which
    a row's sign still says its class. Every row gets the same expected squared norm
    of noise, which drowns the norm attack too. Without labels (or with one class in
    the batch), each row's expected squared norm is brought to the batch's largest
    (Li et al.'s "max norm") plus isotropic noise of ``strength`` times the largest
    norm. (Max norm is not used with labels: late in a run a batch's largest gradient
    is a misclassified example's, many times the rest, and noise that large on every
    row cost digits 4.7 points where this costs under one; benchmarks/privacy.py.)"""
    rows = gradient.reshape(gradient.shape[0], -1)
    width = rows.shape[1]
    classes = torch.unique(labels) if labels is not None and len(labels) == len(rows) else None
    if strength and classes is not None and len(classes) > 1:
        labels = labels.to(rows.device)
        means = torch.stack([rows[labels == c].mean(0) for c in classes])
        apart = means - means.mean(0)
        weights = torch.randn((len(rows), len(classes)), generator=generator, dtype=rows.dtype)
        drawn = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
        size = apart.pow(2).sum().div(width).sqrt()  # the directed noise's, per coordinate
        return (rows + strength * (weights.to(rows.device) @ apart + size * drawn)
                ).reshape(gradient.shape)
    squared = rows.pow(2).sum(1, keepdim=True)
    largest = squared.max()
    drawn = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
    noise = (largest - squared).clamp_min(0).div(width).sqrt() * drawn
    if strength:
        drawn = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
        noise = noise + strength * largest.div(width).sqrt() * drawn
    return (rows + noise).reshape(gradient.shape)


class Privacy:
    """One Trainer's protections and leak measures, at the seams of its staged driver:
    the driver hands it what each trained cut is about to be sent (``sending``,
    ``gradient_sent``), the Trainer the labels of each piece (``labelled``), the NoPeek
    term for its objective (``penalty``) and, after a measured step, the measures
    (``observed``)."""

    def __init__(self, protecting: Mapping[str, Protection], measuring: bool):
        self.protecting = dict(protecting)
        self.measuring = measuring
        self.generator = torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        self._penalty: Any = None
        self._sent: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (input, sent)
        self._grads: dict[str, list[torch.Tensor]] = {}
        self._labels: list[torch.Tensor] = []
        self._unlabelled = False
        self._current: torch.Tensor | None = None  # the labels of the piece under way

    def seed(self, seed: int) -> None:
        """Seeds the defences' noise (``Trainer.seed`` calls it)."""
        self.generator.manual_seed((seed * 2654435761 + 47) % 2**63)

    def random_state(self) -> torch.Tensor:
        """Where the defences' noise stands, for a checkpoint to keep."""
        return self.generator.get_state()

    def check_random(self, state: Any, whose: str) -> None:
        """Refuses a kept state of the defences' noise this generator could not take,
        before a resume changes anything."""
        mine = self.generator.get_state()
        if not isinstance(state, torch.Tensor) or state.dtype != mine.dtype \
                or state.shape != mine.shape:
            raise StoreError(f"{whose}: the state of the defences' noise it holds is not a "
                             f"torch generator's ({mine.numel()} bytes); the checkpoint was "
                             "changed after it was kept: keep a new one")

    def set_random_state(self, state: torch.Tensor) -> None:
        """Takes a state ``random_state`` answered."""
        self.generator.set_state(state)

    def sending(self, node: str, x: Any, value: Any) -> Any:
        """What goes to ``node``'s trainer in place of ``value``, the activation handed
        to it: noise added if asked, and the NoPeek term (over what is sent, kept in
        the graph back to ``value``) kept for the objective. What stays here is not
        changed: the noise is added to a new tensor."""
        protection = self.protecting.get(node)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        sent = value
        if protection is not None and protection.noise:
            drawn = torch.randn(value.shape, generator=self.generator, dtype=value.dtype)
            sent = value + protection.noise * drawn.to(value.device)
        given = _input(x)
        if protection is not None and protection.nopeek and given is not None:
            term = protection.term(given.to(sent.dtype), sent)
            self._penalty = term if self._penalty is None else self._penalty + term
        if self.measuring and given is not None:
            self._sent.setdefault(node, []).append((given, sent.detach()))
        return sent

    def gradient_sent(self, node: str, gradient: Any) -> Any:
        """What goes to ``node``'s trainer in place of ``gradient``: the gradient
        defence applied if asked, and kept for the measures."""
        protection = self.protecting.get(node)
        if isinstance(gradient, torch.Tensor) and gradient.dim() >= 1:
            if protection is not None and protection.gradients:
                gradient = noisy_gradient(gradient, protection.gradients, self.generator,
                                          self._current)
            if self.measuring:
                self._grads.setdefault(node, []).append(gradient.detach())
        return gradient

    def penalty(self) -> Any:
        """The NoPeek terms of the forward just run, to add to its loss (None if none),
        handed out once."""
        term, self._penalty = self._penalty, None
        return term

    def labelled(self, target: Any) -> None:
        """The labels of the piece about to run, read as classes (integer targets as they
        are, one column of 0/1 floats as two classes, one-hot rows by their largest):
        the gradient defence aims its noise with them, the measures score against them."""
        labels = _classes(target)
        self._current = labels
        self._penalty = None  # a forward that failed before its loss leaves none behind
        if not self.measuring:
            return
        if labels is None:
            self._unlabelled = True
        else:
            self._labels.append(labels)

    def observed(self, step: int, measured: bool) -> list[dict[str, Any]]:
        """The leak measures of the step just ended, one ``health`` fact per trained cut
        it sent something to; [] on a step not measured. Forgets the step either way."""
        sent, grads, labels = self._sent, self._grads, self._labels
        self._sent, self._grads, self._labels = {}, {}, []
        if not measured or not self.measuring:
            return []
        if self._unlabelled:
            self._unlabelled = False
            warnings.warn("Audit(leaks=True) reads the targets as class labels, and these are "
                          "not (integers, one column of 0/1, or one-hot rows): the label-leak "
                          "AUCs are left out, the distance correlation is still measured",
                          UserWarning, stacklevel=3)
        facts = []
        for node in dict.fromkeys([*sent, *grads]):
            fact: dict[str, Any] = {"fact": "health", "where": node, "step": step}
            if node in grads and labels:
                g, y = torch.cat(grads[node]), torch.cat(labels).to(grads[node][0].device)
                if len(g) == len(y):
                    fact.update(_said(leak_norm_auc=norm_leak(g, y),
                                      leak_direction_auc=direction_leak(g, y)))
                    if len(torch.unique(y)) > 2:  # the worst class is read over the run
                        fact["leak_norm_classes"] = class_norm_leaks(g, y)
            if node in sent:
                x = torch.cat([given for given, _ in sent[node]])
                a = torch.cat([value for _, value in sent[node]])
                fact["input_dcor"] = float(distance_correlation(x.double(), a.double()))
                if len(x) >= 4:
                    fact["input_dcor_corrected"] = float(
                        distance_correlation(x.double(), a.double(), corrected=True))
            if len(fact) > 3:
                facts.append(fact)
        return facts


def _said(**measures: float | None) -> dict[str, float]:
    return {name: value for name, value in measures.items() if value is not None}


def _input(x: Any) -> torch.Tensor | None:
    """The batch's input as one tensor, the first of them if it holds several."""
    x = x.value if type(x) is Opaque else x
    found = tensors_in(x, refusing="the input") if x is not None else []
    return found[0].detach() if found else None


def _classes(target: Any) -> torch.Tensor | None:
    target = target.value if type(target) is Opaque else target
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        return None
    if not target.is_floating_point():
        return target.reshape(target.shape[0], -1)[:, 0].long() if target.dim() > 1 \
            else target.long()
    rows = target.reshape(target.shape[0], -1)
    if rows.shape[1] == 1 and bool(((rows == 0) | (rows == 1)).all()):
        return rows[:, 0].long()
    if rows.shape[1] > 1 and bool(((rows == 0) | (rows == 1)).all()) \
            and bool((rows.sum(1) == 1).all()):
        return rows.argmax(1)
    return None


def privacy_for(protecting: Any, audit: Any, trains: Mapping[str, Any]) -> Privacy | None:
    """What a Trainer's ``protecting=`` and ``Audit(leaks=True)`` ask for, checked: a
    protection of a node that is not trained where it runs is refused, naming the node
    and the ones that are, before anything changes."""
    protecting = {} if protecting is None else protecting
    if not isinstance(protecting, Mapping):
        raise TypeError("protecting= maps a trained node to its Protection, "
                        "{'body': Protection(gradients=2.0)}, not a "
                        f"{type(protecting).__qualname__}")
    for node, protection in protecting.items():
        if node not in trains:
            raise DeclarationError(
                f"protecting= names node {node!r}, which this Trainer does not train where "
                f"it runs (trains= names {', '.join(map(repr, trains)) or 'none'}); a "
                "protection guards what crosses a trained cut, so name one of those")
        if not isinstance(protection, Protection):
            raise TypeError(f"protecting= maps {node!r} to a {type(protection).__qualname__}; "
                            "give a Protection(noise=..., nopeek=..., gradients=...)")
    measuring = audit is not None and audit.leaks
    if measuring and not trains:
        warnings.warn("Audit(leaks=True) measures what crosses a trained cut, and this Trainer "
                      "trains no node where it runs (trains=): nothing will be measured",
                      UserWarning, stacklevel=3)
    if not protecting and not measuring:
        return None
    return Privacy(protecting, measuring)
