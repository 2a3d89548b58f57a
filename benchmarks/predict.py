"""``Trainer.predict`` per call, beside the plain forward it stands for.

The same MLP (encoder here >> body >> head here, 64 -> width -> width -> 1), one thread.

1. All here: the anchor is the PyTorch user's own call, ``model.eval()`` once and
   ``with torch.no_grad(): model(x)``; beside it ``Trainer.predict(x)``, which puts
   every module in eval mode and back around each call, and the graph's own forward
   under ``torch.no_grad()`` (the walk without the mode switching).
2. The body on a worker on loopback, trained there by ``Split``: the anchor is a plain
   forward of the same graph through the same worker (``g.forward(x, broker=...)`` of a
   graph no Trainer holds, in its own session), beside ``Trainer.predict(x)``, which
   also asks the worker's session the ``evaluating`` verb on and off (two round trips
   more per call), and ``Trainer.evaluate`` over ten batches, per batch (the switch
   paid once for all of them).

Contenders are interleaved in blocks (``_bench.interleaved``); each figure is the median
per call. Ratios are to the anchor of the same section, measured in the same run.

    python benchmarks/predict.py            # --quick for fewer blocks
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _bench import interleaved

from somatize import Broker, Graph, Node, Opaque, Worker
from somatize.torch import Split, Trainer, parameters

QUICK = "--quick" in sys.argv
ROUNDS, COUNT = (5, 20) if QUICK else (15, 50)
INPUTS = 64


class Dense(Node):
    def __init__(self, a, b, last=False):
        self.lin = torch.nn.Linear(a, b)
        self.last = last

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y if self.last else torch.relu(y))

    def parameters(self):
        return list(self.lin.parameters())


def graph(width, host=None):
    torch.manual_seed(0)
    body = Dense(width, width).named("body")
    return Graph.somatize(Dense(INPUTS, width).named("encoder") >> (body.at(host) if host else body)
                          >> Dense(width, 1, last=True).named("head"))


def whole(g):
    """The graph's modules as one PyTorch model, sharing their weights."""
    layers = [g.implementation(n).lin for n in ("encoder", "body", "head")]
    return torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])


def here(width, rows):
    g = graph(width)
    t = Trainer(g, objective=torch.nn.functional.mse_loss,
                optimizer=torch.optim.SGD(parameters(g), lr=0.01))
    model = whole(g)
    x = torch.randn(rows, INPUTS)
    model.eval()

    def plain(_):
        with torch.no_grad():
            return model(x)

    def walked(_):
        with torch.no_grad():
            return g.forward(Opaque(x))

    assert torch.equal(t.predict(x), plain(0))
    times = interleaved({"plain": plain, "g.forward": walked, "predict": lambda _: t.predict(x)},
                        ROUNDS, COUNT)
    model.train()
    return times


def on_worker(worker, width, rows):
    broker = Broker.embedded({"w": worker})
    g = graph(width, "w")
    trains = {"body": Split(torch.optim.SGD, lr=0.01)}
    t = Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains, broker=broker,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01))
    x, y = torch.randn(rows, INPUTS), torch.randn(rows, 1)
    t.step((x, y))
    anchor = graph(width, "w")  # the same graph no Trainer holds: a plain remote forward
    batches = [(x, y)] * 10

    def plain(_):
        with torch.no_grad():
            return anchor.forward(Opaque(x), broker=broker)

    return interleaved({"plain": plain, "predict": lambda _: t.predict(x),
                        "evaluate/batch": lambda _: t.evaluate(batches)}, ROUNDS, COUNT // 5)


def show(title, times, per_batch=()):
    anchor = times["plain"]
    print(title)
    for name, seconds in times.items():
        if name in per_batch:
            seconds /= 10
        ratio = "anchor" if name == "plain" else f"{seconds / anchor:.2f}x"
        print(f"  {name:16s} {seconds * 1e6:10.1f} us   {ratio}")


def main():
    for width, rows in ((256, 256), (32, 64)):
        show(f"here, width {width}, batch {rows}", here(width, rows))
    with Worker.generic(mode="network") as worker:
        for width, rows in ((256, 256), (32, 64)):
            show(f"body on a worker (loopback), width {width}, batch {rows}",
                 on_worker(worker, width, rows), per_batch=("evaluate/batch",))


if __name__ == "__main__":
    main()
