"""A node for the checkpoint test on Ray, sent by value to the actor: a linear layer
with dropout, so that the actor's random state matters."""

import torch

from somatize import Node, Opaque


class Drop(Node):
    def __init__(self, a, b, p=0.25):
        self.lin = torch.nn.Linear(a, b)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, ctx):
        return Opaque(self.drop(self.lin(x)).relu())

    def parameters(self):
        return list(self.lin.parameters())
