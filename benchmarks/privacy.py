"""What a worker could learn in split learning, and what each defence costs.

The U-shape the field calls label-protecting: an encoder here, a body trained by
``Split`` on a real worker process (over a socket), the head and the labels here. The
worker is honest but curious: it keeps every activation and gradient it is sent. On
scikit-learn's ``breast_cancer`` (two classes) and ``digits`` (ten), each run trains
with ``Audit(leaks=True)`` measuring every step what the body was sent:

- ``norm`` and ``direction``: the label-leak AUCs of the gradients sent, under the
  norm attack and the direction (cosine) attack of Li et al., "Label Leakage and
  Protection in Two-party Split Learning" (ICLR 2022), averaged over the run's steps;
  the norm's read either way round and, on digits, for its worst class (each class
  against the rest, averaged over the steps first: ``run_norm_leak``; the average
  over classes would read 0.50 where the worst class reads 0.8). ``dir ep1``: the
  direction attack over the first epoch alone, where a defence is weakest;
- ``dcor``: the distance correlation between the batch's input and the activations
  sent, averaged over the last epoch's steps, as NoPeek (Vepakomma et al., 2020)
  measures it: the textbook estimator (Székely et al., 2007); ``dcor bc``: the
  bias-corrected one (Székely and Rizzo, 2014, its square root). At a batch of 32
  the textbook one is mostly bias — a batch of noise independent of the input reads
  0.7 to 0.8 (printed as an anchor) — so "halved" is judged on the corrected one,
  which reads near 0 for that noise;
- ``acc``: the test accuracy of the trained model (no noise at test time), ``lost``
  its points against no defence, same seeds, same run.

The rows: no defence; noise on the activations; NoPeek trained with the textbook
distance correlation (``nopeek``, the paper's) and with the bias-corrected one
(``nopeek bc``, ``Protection(dcor="corrected")``); the gradient defence over its
strength (the curve). The cut is 64 wide: at 32, halving the corrected dcor on
digits cost 3.3 to 3.9 points with either term (a plain-torch sweep of weights 1 to
10, a warm-up of the weight, noise beside it, 16 epochs), at 64 under two.

Every row is the mean over ``--seeds`` seeds, each run seeded through
``Trainer.seed``. The anchors: the same run with no defence (measured here), the
input's dcor with a batch of independent noise and with the labels themselves (one
hot: what sending nothing but the answer would read), and the papers' figures where
they give one: Li et al.'s vanilla split learning leaks at AUC 0.9997 (the
Attack_SplitNN reproduction quoted in issue 47); the papers' defended figures are on
other data (Criteo, Avazu; CIFAR) and are not restated as if comparable.

Targets (issue 47), printed under each table beside what was measured: no defence,
direction AUC >= 0.95; the gradient defence, both AUCs <= 0.65 at <= 3 points lost
(the first epoch's too), and the curve of leak against accuracy over its strength;
NoPeek, the distance correlation halved at <= 3 points lost.

    python benchmarks/privacy.py           # 3 seeds, the whole curve (a few minutes)
    python benchmarks/privacy.py --quick   # fewer epochs, 1 seed, 5 rows: < 1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Audit, Protection, Split, Trainer, parameters  # noqa: E402
from somatize.torch._privacy import distance_correlation, run_norm_leak  # noqa: E402

WIDTH, BATCH, LR = 64, 32, 1e-2


class Dense(Node):
    """A layer; ``last`` leaves out the ReLU (the head's logits)."""

    def __init__(self, a, b, last=False):
        self.lin = torch.nn.Linear(a, b)
        self.last = last

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y if self.last else torch.relu(y))

    def parameters(self):
        return list(self.lin.parameters())


def dataset(name: str):
    """Standardised features, a fixed 80/20 split: (train x, train y, test x, test y)."""
    from sklearn.datasets import load_breast_cancer, load_digits

    x, y = (load_breast_cancer if name == "breast_cancer" else load_digits)(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = len(x) * 4 // 5
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def model(inputs: int, classes: int, seed: int) -> Graph:
    torch.manual_seed(seed)
    return Graph.somatize(Dense(inputs, WIDTH).named("encoder")
                          >> Dense(WIDTH, WIDTH).named("body").at("server")
                          >> Dense(WIDTH, classes, last=True).named("head"))


def accuracy(weights: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    h = x
    for name, last in (("encoder", False), ("body", False), ("head", True)):
        h = h @ weights[name]["lin.weight"].T + weights[name]["lin.bias"]
        h = h if last else torch.relu(h)
    return (h.argmax(1) == y).float().mean().item()


def run(worker, data, protection: Protection | None, seed: int, epochs: int) -> dict:
    """One training run; its leak measures as the Audit said them, and its accuracy."""
    x, y, test_x, test_y = data
    g = model(x.shape[1], int(y.max()) + 1, seed)
    trains = {"body": Split(torch.optim.Adam, lr=LR)}
    said: list[dict] = []
    trainer = Trainer(g, objective=torch.nn.functional.cross_entropy, trains=trains,
                      workers={"server": worker}, auditing=Audit(leaks=True),
                      watching=said.append,
                      optimizer=torch.optim.Adam(parameters(g, without=trains), lr=LR),
                      protecting={"body": protection} if protection else None)
    trainer.seed(seed)
    order = torch.Generator().manual_seed(seed)
    per_epoch = len(x) // BATCH
    for _ in range(epochs):
        rows = torch.randperm(len(x), generator=order)
        for k in range(per_epoch):
            picked = rows[k * BATCH:(k + 1) * BATCH]
            trainer.step((x[picked], y[picked]))
    weights = trainer.export()
    trainer.close()
    leaks = [f for f in said if f.get("fact") == "health" and "input_dcor" in f]
    last = leaks[-per_epoch:]
    return {"norm": run_norm_leak(leaks),
            "direction": statistics.mean(f["leak_direction_auc"] for f in leaks),
            "first": statistics.mean(f["leak_direction_auc"] for f in leaks[:per_epoch]),
            "dcor": statistics.mean(f["input_dcor"] for f in last),
            "corrected": statistics.mean(f["input_dcor_corrected"] for f in last),
            "acc": accuracy(weights, test_x, test_y)}


def averaged(worker, data, protection, seeds: int, epochs: int) -> dict:
    runs = [run(worker, data, protection, seed, epochs) for seed in range(seeds)]
    return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}


CURVE = (0.25, 0.5, 0.75, 1.0, 2.0, 4.0)  # the gradient defence's strengths


def rows_of(quick: bool) -> list[tuple[str, Protection | None]]:
    """``nopeek`` rows train with the textbook distance correlation, NoPeek's own;
    ``nopeek bc`` with the bias-corrected one (``Protection(dcor="corrected")``)."""
    if quick:
        return [("none", None), ("noise 2", Protection(noise=2.0)),
                ("nopeek bc 3", Protection(nopeek=3.0, dcor="corrected")),
                ("gradients 0.75", Protection(gradients=0.75)),
                ("gradients 1", Protection(gradients=1.0))]
    return ([("none", None), ("noise 0.5", Protection(noise=0.5)),
             ("noise 2", Protection(noise=2.0))]
            + [(f"nopeek {w:g}", Protection(nopeek=w)) for w in (3.0, 6.0, 10.0)]
            + [(f"nopeek bc {w:g}", Protection(nopeek=w, dcor="corrected")) for w in (2, 3, 5)]
            + [(f"gradients {s:g}", Protection(gradients=s)) for s in CURVE])


def anchors(data) -> dict[str, float]:
    """The input's distance correlation, both estimators, over the training batches,
    with a batch of noise drawn independently of it (as wide as the cut) and with the
    labels themselves, one-hot: what sending nothing but the answer would read."""
    x, y = data[0].double(), data[1]
    onehot = torch.nn.functional.one_hot(y).double()
    noise = torch.Generator().manual_seed(0)
    said: dict[str, list[float]] = {}
    for k in range(0, len(x) - BATCH + 1, BATCH):
        batch = x[k:k + BATCH]
        apart = torch.randn(BATCH, WIDTH, generator=noise, dtype=torch.double)
        for name, other in (("noise", apart), ("labels", onehot[k:k + BATCH])):
            for corrected in (False, True):
                said.setdefault(f"{name}{' bc' * corrected}", []).append(
                    float(distance_correlation(batch, other, corrected=corrected)))
    return {name: statistics.mean(values) for name, values in said.items()}


def targets(results: dict[str, dict], name: str) -> list[str]:
    """Each target of issue 47 beside what this run measured: the row that meets it,
    or the nearest one and what it lacks. The undefended leak's target is set on
    breast_cancer (the issue's U-shape); on digits it is shown, not judged."""
    none = results["none"]
    lost = {label: 100 * (none["acc"] - r["acc"]) for label, r in results.items()}
    judged = (f"{'met' if none['direction'] >= 0.95 else 'missed'}; " if name == "breast_cancer"
              else "the target is set on breast_cancer; ")
    lines = [(f"  no defence, direction AUC >= 0.95: {none['direction']:.3f}, ep1 "
              f"{none['first']:.3f} ({judged}paper 0.9997)")]
    grads = {k: r for k, r in results.items() if k.startswith("gradients")}
    if grads:
        leak = {k: max(r["norm"], r["direction"], r["first"]) for k, r in grads.items()}
        meeting = [k for k in grads if leak[k] <= 0.65 and lost[k] <= 3]
        label = meeting[0] if meeting else min(grads, key=lambda k: leak[k] + lost[k] / 100)
        r = grads[label]
        lines.append(f"  gradient defence, norm and direction AUC (and ep1) <= 0.65 at <= 3 points "
                     f"lost: {label}: norm {r['norm']:.3f}, direction {r['direction']:.3f}, ep1 "
                     f"{r['first']:.3f}, lost {lost[label]:.1f} ({'met' if meeting else 'missed'})")
    for term in ("textbook", "corrected"):
        peeks = {k: r for k, r in results.items() if k.startswith("nopeek")
                 and ("corrected" if k.startswith("nopeek bc") else "textbook") == term}
        if not peeks:
            continue
        ratio = {k: r["corrected"] / none["corrected"] for k, r in peeks.items()}
        meeting = [k for k in peeks if ratio[k] <= 0.5 and lost[k] <= 3]
        affordable = [k for k in peeks if lost[k] <= 3]
        label = meeting[0] if meeting else min(affordable or peeks, key=lambda k: ratio[k])
        r = peeks[label]
        lines.append(f"  NoPeek ({term} term), dcor (bias-corrected) <= 0.5x at <= 3 points lost: "
                     f"{label}: {ratio[label]:.2f}x (textbook {r['dcor'] / none['dcor']:.2f}x),"
                     f" lost {lost[label]:.1f} ({'met' if meeting else 'missed'})")
    return lines


#: Epochs per data set (full, quick): NoPeek needs steps to move the encoder away
#: from the input, and digits has three times breast_cancer's steps per epoch.
EPOCHS = {"breast_cancer": (30, 8), "digits": (8, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs, 1 seed, 5 rows")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    torch.set_num_threads(1)
    began = time.perf_counter()
    print(f"U-shape split learning, body on a worker process; cut {WIDTH} wide, batch {BATCH}, "
          f"Adam {LR:g}, mean of {seeds} seed(s)")
    print("paper anchor: vanilla split learning, leak AUC 0.9997 (Li et al. 2022, "
          "Attack_SplitNN reproduction)")
    with Worker.generic(mode="network", send=[__name__]) as worker:
        for name in ("breast_cancer", "digits"):
            data = dataset(name)
            epochs = args.epochs or EPOCHS[name][args.quick]
            print(f"\n{name}: {len(data[0])} train, {len(data[2])} test, {epochs} epochs")
            floor = anchors(data)
            print(f"input's dcor with independent noise: {floor['noise']:.3f} (bias-corrected "
                  f"{floor['noise bc']:.3f}); with the labels one-hot: {floor['labels']:.3f} "
                  f"({floor['labels bc']:.3f})")
            print(f"{'defence':<14} {'norm AUC':>8} {'dir AUC':>8} {'dir ep1':>8} {'dcor':>6} "
                  f"{'dcor bc':>7} {'acc':>6} {'lost':>5} {'bc/none':>7}")
            results: dict[str, dict] = {}
            for label, protection in rows_of(args.quick):
                r = results[label] = averaged(worker, data, protection, seeds, epochs)
                anchor = results["none"]
                print(f"{label:<14} {r['norm']:8.3f} {r['direction']:8.3f} {r['first']:8.3f} "
                      f"{r['dcor']:6.3f} {r['corrected']:7.3f} {r['acc']:6.3f} "
                      f"{100 * (anchor['acc'] - r['acc']):+5.1f} "
                      f"{r['corrected'] / anchor['corrected']:7.2f}", flush=True)
            print("targets (issue 47):")
            print("\n".join(targets(results, name)))
    print(f"\n{time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
