"""What auditing a training run costs: ``Trainer(auditing=...)`` side by side with the
same run unaudited.

Four Trainers over four copies of one net (the same weights, the same Adam, the same
batches, one thread): unaudited, audited every step, audited every 16 steps, and a
second unaudited one — the control, which says how far apart two identical contenders
come out on this machine. Each has the same list watcher, since an audit needs one to
say anything; what is compared is the audit alone. They are interleaved in blocks
within one run, the order rotating, in blocks of about 30 ms (on a shared machine a
burst of other work then falls on one block rather than on one contender's whole
share), and the figure per step is the median over blocks.
Each block is timed twice: by the wall clock, and by this thread's CPU time, which a
machine shared with other work disturbs less (whatever else runs there is not billed
to whichever contender it happened to interrupt).

    python benchmarks/audit.py
    python benchmarks/audit.py --steady-malloc

On a CPU, glibc's malloc gives memory back to the system and takes it again as its
thresholds move with what was freed last; a step of this net can then fault in about
2 MB of fresh pages (some 480 faults, over a millisecond here) or none, depending on
the allocations before it, whichever contender it belongs to. ``--steady-malloc`` runs
the same comparison with glibc's thresholds fixed (``MALLOC_MMAP_THRESHOLD_`` 64 MiB,
``MALLOC_TRIM_THRESHOLD_`` 128 MiB) for every contender alike: no page faults per step,
so what is compared is the work of each, and it prints the faults per step it saw.

Targets (issue 9), on an MLP 256 -> 512 -> 512 -> 10 at batch 128: at most 1.10x
audited every step, at most 1.02x every 16 steps. The anchor is Cockpit (Schneider et
al., NeurIPS 2021), whose cheapest configuration is reported to cost about 1.5x when
it tracks every step and about 1.0x at every 16th; it is quoted, not run here (it
needs BackPACK and a loss of its own). A tiny net (8 -> 16 -> 1, batch 16) shows the
fixed cost per measured step, which no net is small enough to hide.

The plain anchor, run: ``ByHand``, the same numbers per node (activation mean, spread,
zeros and non-finite; gradient norm, mean and spread; weight and update norms;
histograms every 50th measured step) written with plain torch hooks the obvious way.
It is what the Audit's care saves over writing it by hand. Beside it, ``OnePass``:
one sum of each watched output and gradient, read back once a step, the least that
looks at every value the diagnosis reads (and says nothing): the part of the cost
that belongs to the job, not to the Audit. Between the two, ``Kernels``: the very
reductions the Audit runs (its mean, distance and zero count of each output, its sums
of each gradient, its sampled weights), bare, read back once a step: the Audit less
this is the cost of its own machinery, and this less one sum is what reading each
value more than once costs.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F

from somatize import Graph, Node, Opaque
from somatize.torch import Trainer, parameters
from somatize.torch._audit import Audit
from somatize.torch._measures import Held, Place, Sink

from _bench import block, steps_per_second

BLOCKS = 120
BLOCK_SECONDS = 0.03  # short blocks: a burst of other work falls on one block, not on one contender
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


class ByHand:
    """What an Audit says of each node every ``every`` steps, written by hand in plain
    torch the way a user would: a forward hook on each node's module and a hook on its
    output's gradient, the optimizer's own step hooks for a copy of every weight before
    and the norms after, one ``item()`` per number, histograms every ``snapshot``-th
    measured step. The anchor of what the numbers cost without the Audit's care."""

    def __init__(self, modules: dict[str, torch.nn.Module], optimizer: Any, said: list,
                 every: int, snapshot: int = 50):
        self.modules, self.said, self.every, self.snapshot = modules, said, every, snapshot
        self.step = self.measured = 0
        self.seen: dict[str, dict[str, Any]] = {}
        self.was: dict[str, list[torch.Tensor]] = {}
        for name, module in modules.items():
            module.register_forward_hook(functools.partial(self.forward, name))
        optimizer.register_step_pre_hook(self.before)
        optimizer.register_step_post_hook(self.after)

    def _on(self) -> bool:
        return self.step % self.every == 0

    def _hist(self) -> bool:
        return self.measured % self.snapshot == 0

    def forward(self, name: str, module: Any, args: Any, out: torch.Tensor) -> None:
        if not self._on():
            return
        x = out.detach()
        seen = self.seen[name] = {
            "act_mean": x.mean().item(), "act_std": x.std(correction=0).item(),
            "act_zero": (x == 0).float().mean().item(),
            "nonfinite": int((~torch.isfinite(x)).sum().item())}
        if self._hist():
            seen["act_hist"] = torch.histc(x, 32).tolist()
        out.register_hook(functools.partial(self.gradient, name))

    def gradient(self, name: str, g: torch.Tensor) -> None:
        seen = self.seen[name]
        seen.update(grad_norm=g.norm().item(), grad_mean=g.mean().item(),
                    grad_std=g.std(correction=0).item())
        seen["nonfinite"] += int((~torch.isfinite(g)).sum().item())
        if self._hist():
            seen["grad_hist"] = torch.histc(g, 32).tolist()

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on():
            self.was = {name: [p.detach().clone() for p in module.parameters()]
                        for name, module in self.modules.items()}

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on():
            for name, module in self.modules.items():
                now = [p.detach() for p in module.parameters()]
                norm = sum(p.norm().item() ** 2 for p in now) ** 0.5
                old = sum(p.norm().item() ** 2 for p in self.was[name]) ** 0.5
                update = sum((p - w).norm().item() ** 2 for p, w in zip(now, self.was[name])) ** 0.5
                self.said.append({"fact": "health", "where": name, "step": self.step,
                                  **self.seen.pop(name, {}), "weight_norm": norm,
                                  "update_norm": update, "update_ratio": update / old})
            self.measured += 1
        self.step += 1


class OnePass(ByHand):
    """The floor of looking at every watched value: one sum of each node's output and
    of its gradient, read back together once a step, nothing else."""

    def forward(self, name: str, module: Any, args: Any, out: torch.Tensor) -> None:
        if self._on():
            self.seen[name] = [out.detach().sum()]
            out.register_hook(functools.partial(self.gradient, name))

    def gradient(self, name: str, g: torch.Tensor) -> None:
        self.seen[name].append(g.sum())

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        pass

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on() and self.seen:
            sums = torch.stack([s for sums in self.seen.values() for s in sums]).tolist()
            self.said.append({"fact": "sums", "step": self.step, "sums": sums})
            self.seen = {}
        self.step += 1


class Kernels(ByHand):
    """The reductions an Audit runs, run bare: per output its mean, its distance from
    the mean and its count of values not zero (with the CPU's one read-back that
    spares counting non-finite values); per gradient its sum and sum of squares (the
    same); the weights before and after through the Audit's own sampled buffer
    (``Held``); everything read back once a step. No facts, no pooling, no checks, no
    histograms: what the Audit's numbers cost with none of its bookkeeping, so the
    Audit less this is what its own machinery costs."""

    def __init__(self, modules: dict[str, torch.nn.Module], optimizer: Any, said: list,
                 every: int, snapshot: int = 50):
        super().__init__(modules, optimizer, said, every, snapshot)
        self.held = Held([Place(None, name, name, m, list(m.parameters()))
                          for name, m in modules.items()], Audit.sampled)
        self.parts: list[torch.Tensor] = []
        self.taken: Any = None

    def forward(self, name: str, module: Any, args: Any, out: torch.Tensor) -> None:
        if self._on():
            flat = out.detach().reshape(-1)
            mean, sign = flat.mean(), flat.sign()
            self.parts += [mean, torch.dist(flat, mean), torch.dot(sign, sign)]
            mean.item()
            out.register_hook(self.gradient_of)

    def gradient_of(self, g: torch.Tensor) -> None:
        flat = g.reshape(-1)
        total = flat.sum()
        self.parts += [total, torch.dot(flat, flat)]
        total.item()

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on():
            self.taken = self.held.taken()

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._on() and self.parts:
            sink = Sink()
            sink.add(self.parts)
            weights = self.held.measured(sink, self.taken)
            sink.read()
            self.said.append({"fact": "kernels", "step": self.step,
                              "weights": [weights(at) for at in range(len(self.modules))]})
            self.parts = []
        self.step += 1


def trainer(inputs: int, width: int, outputs: int, auditing: Any,
            by_hand: type[ByHand] | None = None, every: int = 1) -> tuple[Trainer, list]:
    torch.manual_seed(0)
    body, head = Body(inputs, width), Head(width, outputs)
    g = Graph.somatize(body.named("body") >> head.named("head"))
    said: list = []
    optimizer = torch.optim.Adam(parameters(g), lr=1e-3)
    if by_hand is not None:
        by_hand({"body": body.net, "head": head.out}, optimizer, said, every=every)
    return Trainer(g, objective=F.cross_entropy if outputs > 1 else F.mse_loss,
                   optimizer=optimizer, watching=said.append, auditing=auditing), said


def case(inputs: int, width: int, outputs: int, rows: int) -> dict[str, tuple[float, float]]:
    """Median seconds per step of each contender: (wall clock, CPU time)."""
    contenders = {"unaudited": (None, None, 1), "every step": (Audit(every=1), None, 1),
                  "every 16": (Audit(every=16), None, 16),
                  "by hand, every step": (None, ByHand, 1), "by hand, every 16": (None, ByHand, 16),
                  "one sum, every step": (None, OnePass, 1),
                  "kernels, every step": (None, Kernels, 1), "control": (None, None, 1)}
    made = {name: trainer(inputs, width, outputs, *how) for name, how in contenders.items()}
    generator = torch.Generator().manual_seed(1)
    target = (lambda: torch.randint(0, outputs, (rows,), generator=generator)) if outputs > 1 \
        else (lambda: torch.randn(rows, 1, generator=generator))
    data = [(torch.randn(rows, inputs, generator=generator), target()) for _ in range(32)]

    def stepper(name):
        t, said = made[name]

        def step(batch):
            said.clear()
            t.step(batch)
            STEPPED[0] += 1
        return step

    steps = {name: stepper(name) for name in made}
    for step in steps.values():  # every contender warm before any is timed
        steps_per_second(step, data)
    per_block = max(4, int(BLOCK_SECONDS / steps_per_second(steps["unaudited"], data)))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(BLOCKS):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            times[name].append(block(steps[name], data, per_block))
    return {name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
            for name, ts in times.items()}


STEPPED = [0]  # steps taken, by every contender, for the faults per step
STEADY = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}


def main() -> None:
    if "--steady-malloc" in sys.argv and any(os.environ.get(k) != v for k, v in STEADY.items()):
        # glibc reads these when a process starts: start this one again with them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY})
    torch.set_num_threads(1)
    steady = "--steady-malloc" in sys.argv
    print(f"audit overhead, median over {BLOCKS} interleaved blocks, one thread, "
          f"torch {torch.__version__}, glibc malloc "
          f"{'thresholds fixed (--steady-malloc)' if steady else 'as it comes'}")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for label, shape, targets in (("MLP 256-512-512-10, batch 128", (256, 512, 10, 128),
                                   {"every step": 1.10, "every 16": 1.02}),
                                  ("tiny 8-16-1, batch 16", (8, 16, 1, 16), {})):
        measured = case(*shape)
        wall, cpu = measured["unaudited"]
        print(f"\n{label}: unaudited {wall * 1e3:.3f} ms/step (CPU {cpu * 1e3:.3f})")
        print(f"  {'':19} {'wall ms':>8} {'ratio':>7}   {'CPU ms':>8} {'ratio':>7}")
        for name in ("every step", "by hand, every step", "kernels, every step",
                     "one sum, every step", "every 16", "by hand, every 16", "control"):
            w, c = measured[name]
            target = f"target <= {targets[name]:.2f}x" if name in targets else ""
            anchor = f"Cockpit cheapest ~{COCKPIT[name]:.1f}x" if name in COCKPIT else \
                "noise floor" if name == "control" else "each value read once" \
                if name.startswith("one sum") else "the Audit's reductions, bare" \
                if name.startswith("kernels") else "plain torch hooks, same numbers"
            print(f"  {name:19} {w * 1e3:8.3f} {w / wall:6.3f}x   {c * 1e3:8.3f} {c / cpu:6.3f}x   "
                  f"{target:16} ({anchor})")
        for every in ("every step", "every 16"):
            ours, plain = (measured[name][1] - cpu for name in (every, f"by hand, {every}"))
            line = (f"  added CPU per step, {every}: Audit {ours * 1e6:.0f} us, "
                    f"by hand {plain * 1e6:.0f} us")
            if every == "every step":
                bare = measured["kernels, every step"][1] - cpu
                floor = measured["one sum, every step"][1] - cpu
                line += (f", its reductions bare {bare * 1e6:.0f} us, one sum of each watched "
                         f"value {floor * 1e6:.0f} us")
            print(line)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"\npage faults per step, every contender: {faults / STEPPED[0]:.1f}")


if __name__ == "__main__":
    main()
