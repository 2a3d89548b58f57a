"""Tensor nodes for workers in mode='project'; importing it registers the tensor codec."""

import torch

import somatize.torch  # noqa: F401  (the codec, on whichever side imports this)
from somatize import Node, Opaque


class Double(Node):
    def forward(self, x, ctx):
        return Opaque(x * 2)


class Linear(Node):
    def __init__(self, features):
        torch.manual_seed(0)
        self.net = torch.nn.Linear(features, features)

    def forward(self, x, ctx):
        with torch.no_grad():
            return Opaque(self.net(x))


class Stats(Node):
    def forward(self, x, ctx):
        return {name: float(t.sum()) for name, t in x.items()}


class Same(Node):
    def forward(self, x, ctx):
        return Opaque(x)
