"""A compressed cut (``Split(..., compress="bf16")``) against full precision, on a thin link.

Two measurements, each beside its anchor in the same run:

1. the ~10 ms model of ``split.py`` (Encoder here >> Body on a worker >> Head here,
   batch 256 x width 512) behind a slow link (``link.py``; ``--link``, by default
   ``2ms,100mbit``): the step and the bytes each way per step, full precision and
   compressed, interleaved in blocks, each beside its floor (2 RTT + 4 x the bytes of
   one activation / rate). Targets: bytes per step halved, step <= 0.6x full precision.
2. the digits task (scikit-learn) trained 300 steps with Adam, the body on a worker on
   loopback: the held-out loss and accuracy, full precision and compressed, over five
   seeds, with how far apart full precision's own seeds land (a rounding anywhere sends
   a run down another path, as another seed does). Target: the mean loss within 1% of
   full precision's.

    python benchmarks/compress.py            # --quick for fewer steps
    python benchmarks/compress.py --link 20ms,100mbit
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

from _bench import cycled, median
from link import LinkProcess, parse

QUICK = "--quick" in sys.argv
LINK = sys.argv[sys.argv.index("--link") + 1] if "--link" in sys.argv else "2ms,100mbit"
STEPS = 12 if QUICK else 40
WIDTH, ROWS = 512, 256
KINDS = (None, "bf16", "fp16")


class Dense(Node):
    def __init__(self, a, b, last=False):
        self.lin = torch.nn.Linear(a, b)
        self.last = last

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y if self.last else torch.relu(y))

    def parameters(self):
        return list(self.lin.parameters())


def model(a, width, b, seed=0):
    torch.manual_seed(seed)
    return Graph.somatize(Dense(a, width).named("encoder") >> Dense(width, width).named("body").at("w")
                          >> Dense(width, b, last=True).named("head"))


def trainer(g, compress, worker, optimizer, objective, **how):
    trains = {"body": Split(optimizer, compress=compress, **how)}
    return Trainer(g, objective=objective, trains=trains, broker=Broker.embedded({"w": worker}),
                   optimizer=optimizer(parameters(g, without=trains), **how))


def linked_numbers(far) -> dict:
    """Median step and bytes per step each way, per kind, in interleaved blocks."""
    torch.manual_seed(1)
    data = [(torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)) for _ in range(8)]
    mse = torch.nn.functional.mse_loss
    trainers = {k: trainer(model(WIDTH, WIDTH, WIDTH), k, far, torch.optim.SGD, mse, lr=0.01)
                for k in KINDS}
    times = {k: [] for k in KINDS}
    bytes_ = {}
    for t in trainers.values():
        t.step(data[0])  # the catalog goes out with the first step
    for block in range(3):
        for k, t in trainers.items():
            times[k].append(median(cycled(t.step, data), STEPS // 3, warm=2))
            before = far.link.traffic()
            for b in data[:4]:
                t.step(b)
            after = far.link.traffic()
            bytes_[k] = {w: (after[w] - before[w]) / 4 for w in ("sent", "received")}
    return {k: (min(times[k]), bytes_[k]) for k in KINDS}


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (x[order[360:]], y[order[360:]]), (x[order[:360]], y[order[:360]])


SEEDS = (0, 1, 2, 3, 4)


def digits_numbers(worker, steps=300) -> dict:
    """Held-out loss and accuracy after ``steps`` of Adam, per kind and seed (the model's
    initial weights and the order of the batches)."""
    (x, y), (tx, ty) = digits()
    ce = torch.nn.functional.cross_entropy
    out = {k: [] for k in KINDS}
    for seed in SEEDS:
        for k in KINDS:
            g = model(64, 48, 10, seed=seed)
            t = trainer(g, k, worker, torch.optim.Adam, ce, lr=3e-3)
            pick = torch.Generator().manual_seed(100 + seed)
            for _ in range(steps):
                rows = torch.randint(len(x), (32,), generator=pick)
                t.step((x[rows], y[rows]))
            w = t.export()
            h = tx
            for name, last in (("encoder", False), ("body", False), ("head", True)):
                h = h @ w[name]["lin.weight"].T + w[name]["lin.bias"]
                h = h if last else torch.relu(h)
            out[k].append((ce(h, ty).item(), (h.argmax(1) == ty).float().mean().item()))
    return out


def main() -> None:
    torch.set_num_threads(1)
    delay, rate = parse(LINK)
    with Worker.generic(mode="network") as worker:
        with LinkProcess(LINK, worker.address("w")) as link:
            far = Worker.at(f"{link.address[0]}:{link.address[1]}", mode="network",
                            token=worker.token)
            try:
                linked = linked_numbers(far)
            finally:
                far.close()
        learnt = digits_numbers(worker, 60 if QUICK else 300)
    print(f"the ~10 ms split model behind {LINK} (a proxy process on loopback), batch {ROWS} x "
          f"width {WIDTH}; median step of {STEPS // 3}, best of 3 interleaved blocks")
    print(f"floor: 2 RTT + 4 x one activation's bytes / rate (bf16/fp16: half the bytes)")
    print(f"{'':14}{'step':>10}{'floor':>10}{'/floor':>8}{'vs full':>9}"
          f"{'sent/step':>12}{'back/step':>12}{'vs full':>9}")
    full_step, full_bytes = linked[None]
    for k, (step, carried) in linked.items():
        size = ROWS * WIDTH * (4 if k is None else 2)
        floor = 4 * delay + 4 * size / (rate or float("inf"))
        print(f"{k or 'full':14}{step * 1e3:8.1f}ms{floor * 1e3:8.1f}ms{step / floor:7.2f}x"
              f"{step / full_step:8.2f}x{carried['sent']:12.0f}{carried['received']:12.0f}"
              f"{(carried['sent'] + carried['received']) / sum(full_bytes.values()):8.3f}x")
    print("targets: bytes per step 0.5x, step <= 0.6x full precision")
    steps = 60 if QUICK else 300
    print(f"\ndigits, {steps} steps of Adam (lr 3e-3, batch 32), the body on a worker; held-out "
          f"loss and accuracy, mean of {len(SEEDS)} seeds (weights and batch order):")
    mean = lambda xs: sum(xs) / len(xs)
    full = [loss for loss, _ in learnt[None]]
    for k, runs in learnt.items():
        losses = [loss for loss, _ in runs]
        apart = mean([abs(a - b) / b for a, b in zip(losses, full)])
        print(f"  {k or 'full':6} loss {mean(losses):.4f} ({(mean(losses) - mean(full)) / mean(full):+.2%}"
              f" vs full; seed by seed {apart:.2%} apart)   accuracy {mean([a for _, a in runs]):.3f}")
    spread = (max(full) - min(full)) / mean(full)
    print(f"  full precision's own loss from seed to seed: {min(full):.4f} to {max(full):.4f} "
          f"({spread:.0%} of its mean)")
    print("target: the loss within 1% of full precision's")

if __name__ == "__main__":
    main()
