"""Nodes for the privacy tests, sent by value to the worker (network mode): a body
trainer that writes down, on the worker, every activation and gradient that arrives."""

import torch

from somatize import Node, Opaque
from somatize.torch import Split
from somatize.torch._envelope import widened


class Dense(Node):
    def __init__(self, a, b, relu=True):
        self.lin = torch.nn.Linear(a, b)
        self.relu = relu

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y.relu() if self.relu else y)

    def parameters(self):
        return list(self.lin.parameters())


class Recording(Split):
    """Split, keeping in a file on the worker what it was sent: each input as it arrived
    and each gradient it was handed, in order. What the far side could keep."""

    def __init__(self, optimizer, path, **how):
        super().__init__(optimizer, **how)
        self.path = str(path)
        self.arrived = {"inputs": [], "gradients": []}

    def entering(self, value, ctx):
        if isinstance(widened(value), torch.Tensor):
            self.arrived["inputs"].append(widened(value).detach().clone())
        return super().entering(value, ctx)

    def learn(self, signal, ctx):
        if signal is not None:
            self.arrived["gradients"].append(signal.detach().clone())
            torch.save(self.arrived, self.path)
        return super().learn(signal, ctx)
