"""The small nets the torch tests train: the notebook's Body >> Head, and batches."""

import torch

from somatize import Graph, Node, Opaque


class Body(Node):
    def __init__(self, width=16, inputs=8):
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self, width=16):
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def graph(seed=0, width=16, body=lambda b: b, head=lambda h: h):
    """Body >> Head with weights drawn from ``seed``; ``body``/``head`` add modifiers."""
    torch.manual_seed(seed)
    b, h = Body(width), Head(width)
    return Graph.somatize(body(b.named("body")) >> head(h.named("head"))), b, h


def batches(count, rows=12, seed=1):
    generator = torch.Generator().manual_seed(seed)
    truth = torch.randn(8, 1, generator=generator)
    out = []
    for _ in range(count):
        x = torch.randn(rows, 8, generator=generator)
        out.append((x, x @ truth + 0.1 * torch.randn(rows, 1, generator=generator)))
    return out


def weights(*modules):
    return [p.detach().clone() for m in modules for p in m.parameters()]


def facts(seen, name, node=None):
    return [f for f in seen if f["fact"] == name and (node is None or f.get("node") == node)]
