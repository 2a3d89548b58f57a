"""What auditing a training run costs: ``Trainer(auditing=...)`` side by side with the
same run unaudited.

Four Trainers over four copies of one net (the same weights, the same Adam, the same
batches, one thread): unaudited, audited every step, audited every 16 steps, and a
second unaudited one — the control, which says how far apart two identical contenders
come out on this machine. Each has the same list watcher, since an audit needs one to
say anything; what is compared is the audit alone. They are interleaved in blocks
within one run, the order rotating, and the figure per step is the median over blocks.
Each block is timed twice: by the wall clock, and by this thread's CPU time, which a
machine shared with other work disturbs less (whatever else runs there is not billed
to whichever contender it happened to interrupt).

    python benchmarks/audit.py

Targets (issue 9), on an MLP 256 -> 512 -> 512 -> 10 at batch 128: at most 1.10x
audited every step, at most 1.02x every 16 steps. The anchor is Cockpit (Schneider et
al., NeurIPS 2021), whose cheapest configuration is reported to cost about 1.5x when
it tracks every step and about 1.0x at every 16th; it is quoted, not run here (it
needs BackPACK and a loss of its own). A tiny net (8 -> 16 -> 1, batch 16) shows the
fixed cost per measured step, which no net is small enough to hide.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from somatize import Graph, Node, Opaque
from somatize.torch import Trainer, parameters
from somatize.torch._audit import Audit

from _bench import block, steps_per_second

BLOCKS = 15
COCKPIT = {"every step": 1.5, "every 16": 1.0}


class Body(Node):
    def __init__(self, inputs: int, width: int):
        self.net = torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU())

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self, width: int, outputs: int):
        self.out = torch.nn.Linear(width, outputs)

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def trainer(inputs: int, width: int, outputs: int, auditing) -> tuple[Trainer, list]:
    torch.manual_seed(0)
    g = Graph.somatize(Body(inputs, width).named("body") >> Head(width, outputs).named("head"))
    said: list = []
    return Trainer(g, objective=F.cross_entropy if outputs > 1 else F.mse_loss,
                   optimizer=torch.optim.Adam(parameters(g), lr=1e-3), watching=said.append,
                   auditing=auditing), said


def case(inputs: int, width: int, outputs: int, rows: int) -> dict[str, tuple[float, float]]:
    """Median seconds per step of each contender: (wall clock, CPU time)."""
    contenders = {"unaudited": None, "every step": Audit(every=1), "every 16": Audit(every=16),
                  "control": None}
    made = {name: trainer(inputs, width, outputs, auditing) for name, auditing in contenders.items()}
    generator = torch.Generator().manual_seed(1)
    target = (lambda: torch.randint(0, outputs, (rows,), generator=generator)) if outputs > 1 \
        else (lambda: torch.randn(rows, 1, generator=generator))
    data = [(torch.randn(rows, inputs, generator=generator), target()) for _ in range(32)]

    def stepper(name):
        t, said = made[name]

        def step(batch):
            said.clear()
            t.step(batch)
        return step

    steps = {name: stepper(name) for name in made}
    per_block = max(32, 32 * int(0.25 / (steps_per_second(steps["unaudited"], data) * 32) + 1))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(BLOCKS):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            times[name].append(block(steps[name], data, per_block))
    return {name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
            for name, ts in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    print(f"audit overhead, median over {BLOCKS} interleaved blocks, one thread, "
          f"torch {torch.__version__}")
    for label, shape, targets in (("MLP 256-512-512-10, batch 128", (256, 512, 10, 128),
                                   {"every step": 1.10, "every 16": 1.02}),
                                  ("tiny 8-16-1, batch 16", (8, 16, 1, 16), {})):
        measured = case(*shape)
        wall, cpu = measured["unaudited"]
        print(f"\n{label}: unaudited {wall * 1e3:.3f} ms/step (CPU {cpu * 1e3:.3f})")
        print(f"  {'':11} {'wall ms':>8} {'ratio':>7}   {'CPU ms':>8} {'ratio':>7}")
        for name in ("every step", "every 16", "control"):
            w, c = measured[name]
            target = f"target <= {targets[name]:.2f}x" if name in targets else ""
            anchor = f"Cockpit cheapest ~{COCKPIT[name]:.1f}x" if name in COCKPIT else "noise floor"
            print(f"  {name:11} {w * 1e3:8.3f} {w / wall:6.3f}x   {c * 1e3:8.3f} {c / cpu:6.3f}x   "
                  f"{target:16} ({anchor})")


if __name__ == "__main__":
    main()
