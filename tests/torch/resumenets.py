"""Nodes for the checkpoint tests, sent by value to a worker (it cannot import the tests):
a linear layer, with dropout where asked, so that what is random matters."""

import torch

from somatize import Node, Opaque


class Lin(Node):
    def __init__(self, a, b, drop=0.0, relu=True):
        self.lin = torch.nn.Linear(a, b)
        self.drop = torch.nn.Dropout(drop)
        self.relu = relu

    def forward(self, x, ctx):
        y = self.drop(self.lin(x))
        return Opaque(y.relu() if self.relu else y)

    def parameters(self):
        return list(self.lin.parameters())


class Noise(Node):
    """Adds noise drawn from the process's generator: no weights, only random state."""

    def forward(self, x, ctx):
        return Opaque(x + 0.1 * torch.randn_like(x))
