"""What somatize costs on a GPU, side by side with plain torch there.

1. ``Trainer.step`` against the hand-written loop on the same device (an MLP 1024 ->
   2048 -> 2048 -> 10, batch 512, Adam), interleaved blocks, the device synchronised
   at the end of each (target: at most 1.05x).
2. The Audit at every step against the same Trainer unaudited (target: at most
   1.10x), and how often a measured step waits for the device, counted with torch's
   sync debug mode against an unmeasured one (target: one more, the read-back).
3. The tensor codec from a CUDA tensor of 64 MiB to the bytes a wire sends, against
   ``tensor.cpu()`` alone (the copy to the host any writer pays; target: at most 1.5x).

Without a CUDA device it says so and exits cleanly.

    python benchmarks/gpu.py
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from somatize import Graph, Node, Opaque
from somatize._codec import dumps
from somatize.torch import Trainer, parameters
from somatize.torch._audit import Audit

BLOCKS = 11


class Body(Node):
    def __init__(self):
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                       torch.nn.Linear(2048, 2048), torch.nn.ReLU()).cuda()

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self):
        self.out = torch.nn.Linear(2048, 10).cuda()

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def made(auditing=None):
    torch.manual_seed(0)
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    said: list = []
    trainer = Trainer(g, objective=F.cross_entropy, watching=said.append, auditing=auditing,
                      optimizer=torch.optim.Adam(parameters(g), lr=1e-3))

    def step(batch):
        said.clear()
        return trainer.step(batch)
    return step


def by_hand():
    torch.manual_seed(0)
    body, head = Body().net, Head().out
    optimizer = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=1e-3)

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(head(body(x)), y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def timed(contenders: dict, data: list, steps: int) -> dict[str, float]:
    """Median seconds per step of each, over interleaved blocks."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for step in contenders.values():
        for batch in data[:3]:
            step(batch)
    for round_ in range(BLOCKS):
        names = list(contenders)
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(steps):
                contenders[name](data[i % len(data)])
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def syncs(step, batch) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> int:
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}); nothing to measure")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(512, 1024, generator=generator).cuda(),
             torch.randint(0, 10, (512,), generator=generator).cuda()) for _ in range(16)]

    found = timed({"by hand": by_hand(), "Trainer": made()}, data, 50)
    hand, ours = found["by hand"], found["Trainer"]
    print(f"1. step: by hand {hand * 1e3:.3f} ms   Trainer {ours * 1e3:.3f} ms   "
          f"{ours / hand:.3f}x (target <= 1.05)")

    every = Audit(every=2)
    audited = made(auditing=every)
    found = timed({"unaudited": made(), "audited": made(auditing=Audit(every=1))}, data, 50)
    for batch in data[:4]:
        audited(batch)
    measured, plain = syncs(audited, data[4]), syncs(audited, data[5])
    print(f"2. audit at every step: unaudited {found['unaudited'] * 1e3:.3f} ms   audited "
          f"{found['audited'] * 1e3:.3f} ms   {found['audited'] / found['unaudited']:.3f}x "
          f"(target <= 1.10);  host syncs: measured step {measured}, unmeasured {plain} "
          f"(target: one more)")

    tensor = torch.randn(16 << 20, device="cuda")  # 64 MiB of float32
    dumps(tensor)
    copies, writes = [], []
    for _ in range(BLOCKS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        tensor.cpu()
        copies.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dumps(tensor)
        writes.append(time.perf_counter() - start)
    copy, write = statistics.median(copies), statistics.median(writes)
    print(f"3. 64 MiB CUDA tensor to wire bytes: {64 / 1024 / write:.2f} GB/s   tensor.cpu() "
          f"{64 / 1024 / copy:.2f} GB/s   {write / copy:.2f}x its time (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
