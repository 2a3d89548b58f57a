"""Nodes for the Ray tests, sent to the actors by value (mode="network"): an actor
cannot import the tests."""

import os
import threading
import time

import torch

from somatize import Node, Opaque


class Lin(Node):
    def __init__(self, a, b, relu=True):
        self.lin = torch.nn.Linear(a, b)
        self.relu = relu

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y.relu() if self.relu else y)

    def parameters(self):
        return list(self.lin.parameters())


class Twice(Node):
    def forward(self, x, ctx):
        return Opaque(x * 2)


class Echo(Node):
    def forward(self, x, ctx):
        return Opaque(x) if isinstance(x, torch.Tensor) else x


class Bump(Node):
    """Adds one in place: the tensor it was handed must be its own to write."""

    def forward(self, x, ctx):
        x.add_(1)
        return Opaque(x)


class Latch(Node):
    """Answers a lock, which cannot travel: it stays where it was made."""

    def forward(self, x, ctx):
        return Opaque((threading.Lock(), x))


class Unlatch(Node):
    def forward(self, pair, ctx):
        return pair[1]


class Sleep(Node):
    """Sleeps as many seconds as it is handed."""

    def forward(self, x, ctx):
        time.sleep(x)
        return x


class Boom(Node):
    def forward(self, x, ctx):
        raise ValueError(f"boom on {x!r}")


class Env(Node):
    """What the actor's environment says for a variable."""

    def forward(self, name, ctx):
        return os.environ.get(name)
