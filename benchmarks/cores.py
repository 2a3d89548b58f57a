"""A worker on the client's own machine, and who gets the cores.

Encoder (here) >> Body (on a worker this process spawns, trained by ``Split``) >> Head
(here), 40 steps of a small model, timed as a whole, 20 times over (a fresh worker
each time, as each run of a script starts one). Nothing here sets a thread count: the
client runs with torch's default, as a newcomer's script does. Three ways, interleaved
run by run so that all three see the same machine:

- ``shared`` (somatize's default): the worker is spawned with half the cores, and this
  process keeps the other half;
- ``every core`` (the anchor, what happened before): both take every core, as torch
  does left to itself (``OMP_NUM_THREADS`` set to the cores, so somatize leaves it);
- ``one thread`` (the other anchor): ``OMP_NUM_THREADS=1`` on both sides, the user's
  usual cure.

Before each run this process is put back on torch's default, so each way starts from
where a fresh script would.

For each it prints the median of the 20 runs and the slowest run over that median
(target for ``shared``: no run past 2x its median).

    python benchmarks/cores.py            # --quick: 5 runs of each
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from somatize import Broker, Graph, Node, Opaque, Worker
from somatize.torch import Split, Trainer, parameters

QUICK = "--quick" in sys.argv
RUNS = 5 if QUICK else 20
STEPS, WIDTH, ROWS = 40, 256, 64
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
WAYS = {"shared": None, "every core": str(CORES), "one thread": "1"}  # OMP_NUM_THREADS
DEFAULT = torch.get_num_threads()  # torch's own choice, before any worker was started


class Dense(Node):
    def __init__(self, a, b):
        self.lin = torch.nn.Linear(a, b)

    def forward(self, x, ctx):
        return Opaque(torch.relu(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def model():
    torch.manual_seed(0)
    return Graph.somatize(Dense(WIDTH, WIDTH).named("encoder")
                          >> Dense(WIDTH, WIDTH).named("body").at("w")
                          >> Dense(WIDTH, WIDTH).named("head"))


def one_run(threads: str | None, data) -> float:
    """Seconds for STEPS split steps with a fresh worker, ``threads`` set on both sides
    (None: what somatize gives each)."""
    torch.set_num_threads(DEFAULT if threads is None else int(threads))
    saved = {name: os.environ.pop(name, None) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    try:
        worker = Worker.generic(mode="network", send=[] if __name__ == "__main__" else [__name__])
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    with worker:
        g = model()
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        trainer = Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains,
                          broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01))
        trainer.step(data[0])  # the worker is up and has the body: what is timed is training
        began = time.perf_counter()
        for batch in data:
            trainer.step(batch)
        took = time.perf_counter() - began
        trainer.close()
    return took


def main() -> None:
    torch.manual_seed(1)
    data = [(torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)) for _ in range(STEPS)]
    print(f"{STEPS} split steps, width {WIDTH}, batch {ROWS}; {CORES} cores; torch's"
          f" default here {DEFAULT} threads; {RUNS} runs of each, interleaved")
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for run in range(RUNS):
        for way, threads in WAYS.items():
            times[way].append(one_run(threads, data))
        print(f"run {run + 1:2d}: " + "  ".join(f"{way} {took[-1]:.2f}s" for way, took in times.items()),
              flush=True)
    anchor = statistics.median(times["every core"])
    print(f"{'threads':16} {'median':>9} {'slowest':>9} {'slowest/median':>15} "
          f"{'median vs every core':>21}")
    for way, took in times.items():
        middle = statistics.median(took)
        print(f"{way:16} {middle:8.3f}s {max(took):8.3f}s {max(took) / middle:14.2f}x "
              f"{middle / anchor:20.2f}x")
    shared = times["shared"]
    past = sum(t > 2 * statistics.median(shared) for t in shared)
    print(f"shared: {past} of {RUNS} runs past 2x the median (target: none)")


if __name__ == "__main__":
    main()
