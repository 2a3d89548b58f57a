"""Do the zero-cost proxies rank a search space the way training does? And what they cost.

A small search space trained here: MLPs and small CNNs of varied depth and width on
scikit-learn's digits (8×8 images, 10 classes), the same split, seeds and budget for
all. Every proxy is taken on the untrained candidate (one batch of the training set),
then the candidate is trained with the Trainer and scored on the held-out set; the
table is the signed Spearman rank correlation of each proxy with that accuracy, with
``params`` as the floor a proxy has to beat, beside the published NAS-Bench-201
CIFAR-10 numbers (Abdelfattah et al. 2021; Mellor et al. 2021 for nwot).

Also: every proxy for one candidate against one training epoch of it (the target is
well under one epoch), and ``architecture`` on a model of about 100 modules (the
target is under 2 s).

    PYTHONPATH=src python benchmarks/proxies.py            # 44 candidates, 3 seeds each
    PYTHONPATH=src python benchmarks/proxies.py --quick    # a handful, one epoch, one seed
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from somatize import Graph, Node, Opaque
from somatize.torch import Trainer, parameters
from somatize.torch._architecture import architecture
from somatize.torch._proxies import EVERY, proxies

from _bench import best

ANCHORS = {  # NAS-Bench-201, CIFAR-10, signed Spearman ρ as published
    "synflow": "0.74", "jacob_cov": "0.73–0.75", "nwot": "0.77", "params": "0.72",
    "snip": "0.58–0.60", "grasp": "—", "grad_norm": "0.58",
}
SPLIT_SEED = 0
BATCH = 32
PROXY_BATCH = 64


# -- the candidates -------------------------------------------------------------------
class Features(Node):
    """The body of a candidate: whatever layers it was given, in a Sequential."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Classifier(Node):
    def __init__(self, width: int):
        self.out = torch.nn.Linear(width, 10)

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


@dataclass
class Candidate:
    name: str
    build: Callable[[], tuple[list[torch.nn.Module], int]]  # (layers, width into the head)

    def graph(self, seed: int) -> Graph:
        torch.manual_seed(seed)
        layers, width = self.build()
        return Graph.somatize(Features(layers).named("body") >> Classifier(width).named("head"))


def mlp(depth: int, width: int) -> Candidate:
    def build():
        layers: list[torch.nn.Module] = [torch.nn.Flatten()]
        size = 64
        for _ in range(depth):
            layers += [torch.nn.Linear(size, width), torch.nn.ReLU()]
            size = width
        return layers, size
    return Candidate(f"mlp d{depth} w{width}", build)


def cnn(depth: int, channels: int, norm: bool) -> Candidate:
    def build():
        layers: list[torch.nn.Module] = []
        size = 1
        for i in range(depth):
            layers.append(torch.nn.Conv2d(size, channels, 3, padding=1))
            if norm:
                layers.append(torch.nn.BatchNorm2d(channels))
            layers.append(torch.nn.ReLU())
            if i == 0:
                layers.append(torch.nn.MaxPool2d(2))
            size = channels
        return layers + [torch.nn.Flatten()], channels * 16
    return Candidate(f"cnn d{depth} c{channels}{' bn' if norm else ''}", build)


def search_space() -> list[Candidate]:
    """44 candidates: 20 MLPs (1–4 hidden layers, 8–128 wide), 24 CNNs (1–3 convolutions,
    4–32 channels, with and without batch norm)."""
    out = [mlp(d, w) for d in (1, 2, 3, 4) for w in (8, 16, 32, 64, 128)]
    out += [cnn(d, c, bn) for bn in (False, True) for d in (1, 2, 3) for c in (4, 8, 16, 32)]
    return out


def quick_space() -> list[Candidate]:
    return [mlp(1, 8), mlp(2, 64), cnn(1, 4, False), cnn(2, 16, True)]


# -- data, training, scoring ------------------------------------------------------------
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.33, random_state=SPLIT_SEED, stratify=y)
    return x_train, y_train, x_test, y_test


def batches(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> list[tuple]:
    """The same shuffles for every candidate: ``epochs`` passes, cut in batches."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        out += [(x[order[i:i + BATCH]], y[order[i:i + BATCH]]) for i in range(0, len(x), BATCH)]
    return out


def accuracy(graph: Graph, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        for module in _modules(graph):
            module.eval()
        predicted = graph.forward(Opaque(x)).argmax(dim=1)
        for module in _modules(graph):
            module.train()
    return float((predicted == y).float().mean())


def _modules(graph: Graph) -> list[torch.nn.Module]:
    return [m for n in graph.nodes() for m in vars(graph.implementation(n)).values()
            if isinstance(m, torch.nn.Module)]


def trained(graph: Graph, data: list[tuple]) -> Graph:
    trainer = Trainer(graph, objective=F.cross_entropy,
                      optimizer=torch.optim.Adam(parameters(graph), lr=1e-3))
    trainer.fit(data, epochs=1)
    return graph


def evaluate(space: list[Candidate], epochs: int,
             seeds: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """One row per candidate: its proxies, taken once on the untrained network of the
    first seed (what a search would have in hand), and its test accuracy after training,
    the mean over ``seeds`` (each its own initialisation and shuffles), to damp the
    luck of one run."""
    x_train, y_train, x_test, y_test = digits()
    probe_x, probe_y = x_train[:PROXY_BATCH], y_train[:PROXY_BATCH]
    shuffled = {seed: batches(x_train, y_train, epochs, seed) for seed in seeds}
    rows = []
    for candidate in space:
        graph = candidate.graph(seeds[0])
        scores = proxies(graph, probe_x, target=probe_y, objective=F.cross_entropy)
        reached = [accuracy(trained(candidate.graph(seed), shuffled[seed]), x_test, y_test)
                   for seed in seeds]
        rows.append({"name": candidate.name, "accuracy": sum(reached) / len(reached), **scores})
    return rows


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> tuple[float, int]:
    """Signed Spearman ρ, and over how many pairs: a NaN score is left out, as NASWOT's
    evaluation leaves it out; -inf (nwot's singular kernel) is a score, the lowest."""
    pairs = [(x, y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 3:
        return float("nan"), len(pairs)
    ra, rb = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return (cov / var if var else float("nan")), len(pairs)


def correlations(rows: list[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    accuracies = [row["accuracy"] for row in rows]
    return {name: spearman([row.get(name, float("nan")) for row in rows], accuracies)
            for name in EVERY}


# -- what they cost ---------------------------------------------------------------------
def cost_against_an_epoch(candidate: Candidate) -> tuple[float, float]:
    x_train, y_train, _, _ = digits()
    graph = candidate.graph(0)
    probe_x, probe_y = x_train[:PROXY_BATCH], y_train[:PROXY_BATCH]
    every = best(lambda: proxies(graph, probe_x, target=probe_y, objective=F.cross_entropy), 3)
    epoch = batches(x_train, y_train, 1, 0)
    one_epoch = best(lambda: trained(candidate.graph(0), epoch), 3)
    return every, one_epoch


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.ff = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                      torch.nn.Linear(2 * width, width))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        x = self.norm1(x + self.drop(self.attn(x, x, x, need_weights=False)[0]))
        return self.norm2(x + self.drop(self.ff(x)))


class Stack(Node):
    def __init__(self, blocks: int, width: int = 32):
        self.embed = torch.nn.Embedding(100, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, tokens, ctx):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return Opaque(self.head(x.mean(dim=1)))


def architecture_time() -> tuple[int, float, float, float]:
    stack = Stack(blocks=10)
    graph = Graph.somatize(stack)
    tokens = torch.randint(0, 100, (8, 16))
    count = sum(1 for _ in torch.nn.ModuleList([stack.embed, stack.blocks, stack.head]).modules()) - 1
    start = time.perf_counter()
    architecture(graph, tokens)
    cold = time.perf_counter() - start
    return (count, cold, best(lambda: architecture(graph, tokens), 3),
            best(lambda: architecture(graph, tokens, depth=2), 3))


# -- the report -------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of candidates, one epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3, help="training runs averaged per candidate")
    args = parser.parse_args()
    torch.set_num_threads(1)
    space = quick_space() if args.quick else search_space()
    epochs, seeds = (1, (0,)) if args.quick else (args.epochs, tuple(range(args.seeds)))
    start = time.perf_counter()
    rows = evaluate(space, epochs, seeds)
    took = time.perf_counter() - start
    accuracies = sorted(row["accuracy"] for row in rows)
    print(f"{len(rows)} candidates on digits, {epochs} epochs each (Adam 1e-3, batch {BATCH}), "
          f"accuracy the mean of {len(seeds)} training seeds, proxies on one batch of "
          f"{PROXY_BATCH}; test accuracy from {accuracies[0]:.3f} to {accuracies[-1]:.3f}, "
          f"median {accuracies[len(accuracies) // 2]:.3f}; {took:.0f} s")
    every = correlations(rows)
    family = {kind: correlations([r for r in rows if r["name"].startswith(kind)])
              for kind in ("mlp", "cnn")}
    print(f"{'proxy':<10} {'signed ρ here':>13} {'n':>3} {'MLPs only':>10} {'CNNs only':>10}   "
          f"{'NAS-Bench-201 CIFAR-10':>22}")
    for name in EVERY:
        (rho, n), mlps, cnns = every[name], family["mlp"][name][0], family["cnn"][name][0]
        floor = every["params"][0]
        mark = "" if name == "params" else "  beats params" if rho > floor + 1e-9 else (
            "  ties params" if abs(rho - floor) <= 1e-9 else "  below params")
        print(f"{name:<10} {rho:>13.3f} {n:>3} {mlps:>10.3f} {cnns:>10.3f}   {ANCHORS[name]:>22}{mark}")

    every, epoch = cost_against_an_epoch(cnn(2, 16, True))
    print(f"\nall {len(EVERY)} proxies for 'cnn d2 c16 bn': {every * 1e3:.1f} ms; one training "
          f"epoch of it: {epoch * 1e3:.1f} ms; ratio {every / epoch:.3f} (target: well under 1)")
    count, cold, warm, deep = architecture_time()
    print(f"architecture on a {count}-module model: {cold * 1e3:.0f} ms first call, "
          f"{warm * 1e3:.0f} ms after, {deep * 1e3:.0f} ms at depth=2 (target: under 2000 ms)")


if __name__ == "__main__":
    main()
