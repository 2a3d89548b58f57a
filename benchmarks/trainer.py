"""``Trainer.step`` side by side with the hand-written torch loop it replaces.

The same MLP (64 -> width -> width -> 1, as a Body node and a Head node), the same
Adam, the same batches, one thread. The two are interleaved in blocks within one run,
alternating which goes first, so drift in the machine lands on both; the figure per
step is the median over blocks. The hand-written loop is the anchor: nothing that
walks a graph can be cheaper than calling the modules directly.

    python benchmarks/trainer.py

At width 256, batch 256 the target is at most 1.05x. At width 32, batch 64 the step
is small enough that the ratio shows the fixed cost per step (the walk, the Opaque
wrapping, the checks); the next row adds a watcher, which is the price of the facts,
and the last puts the hand-written loop against a copy of itself: the noise floor.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from somatize import Graph, Node, Opaque
from somatize.torch import Trainer, parameters

from _bench import block, steps_per_second

INPUTS = 64
BLOCKS = 25


class Body(Node):
    def __init__(self, width):
        self.net = torch.nn.Sequential(torch.nn.Linear(INPUTS, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU())

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self, width):
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def case(width: int, rows: int, watched: bool, control: bool = False) -> tuple[float, float]:
    """Median seconds per step: (hand-written loop, Trainer.step). ``control`` puts a
    second copy of the hand-written loop where the Trainer would be, which says how
    far apart two identical contenders come out on this machine."""
    torch.manual_seed(0)
    body, head = Body(width), Head(width)
    g = Graph.somatize(body.named("body") >> head.named("head"))
    seen: list = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(g), lr=1e-3),
                      watching=seen.append if watched else None)
    torch.manual_seed(0)
    hand_body, hand_head = Body(width).net, Head(width).out
    hand_optimizer = torch.optim.Adam([*hand_body.parameters(), *hand_head.parameters()], lr=1e-3)
    data = [(torch.randn(rows, INPUTS), torch.randn(rows, 1)) for _ in range(16)]

    def by_hand(batch):
        x, y = batch
        hand_optimizer.zero_grad()
        loss = F.mse_loss(hand_head(hand_body(x)), y)
        loss.backward()
        hand_optimizer.step()
        return loss.item()

    def by_trainer(batch):
        seen.clear()
        return trainer.step(batch)

    if control:
        torch.manual_seed(0)
        other_body, other_head = Body(width).net, Head(width).out
        other = torch.optim.Adam([*other_body.parameters(), *other_head.parameters()], lr=1e-3)

        def by_trainer(batch):  # noqa: F811  the control stands where the Trainer would
            x, y = batch
            other.zero_grad()
            loss = F.mse_loss(other_head(other_body(x)), y)
            loss.backward()
            other.step()
            return loss.item()

    steps = max(5, int(0.15 / steps_per_second(by_hand, data)))  # about 0.15 s per block
    hand, ours = [], []
    for round_ in range(BLOCKS):
        first, second = (by_hand, by_trainer) if round_ % 2 else (by_trainer, by_hand)
        a, b = block(first, data, steps)[0], block(second, data, steps)[0]
        (hand.append(a), ours.append(b)) if first is by_hand else (ours.append(a), hand.append(b))
    return statistics.median(hand), statistics.median(ours)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, Adam, MSE, {BLOCKS} interleaved blocks")
    print(f"{'case':<40}{'by hand':>12}{'Trainer':>12}{'overhead':>12}{'ratio':>8}")
    for label, width, rows, watched, control in [
        ("64->256->256->1, batch 256", 256, 256, False, False),
        ("64->32->32->1, batch 64", 32, 64, False, False),
        ("64->32->32->1, batch 64, watched", 32, 64, True, False),
        ("control: by hand vs by hand, width 32", 32, 64, False, True),
    ]:
        hand, ours = case(width, rows, watched, control)
        print(f"{label:<40}{hand * 1e6:>10.1f}us{ours * 1e6:>10.1f}us"
              f"{(ours - hand) * 1e6:>10.1f}us{ours / hand:>7.3f}x")
    print("target: at most 1.05x on the first row")


if __name__ == "__main__":
    main()
