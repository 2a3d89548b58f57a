"""Nodes the transport contract sends to a host: by value (mode='network',
send=['transport_nodes']), so any transport's host can run them without importing the
tests."""

import os

from somatize import Node, Opaque


class Twice(Node):
    def forward(self, x, ctx):
        return Opaque(x * 2) if hasattr(x, "shape") else x * 2


class Count(Node):
    """Keeps state between forwards: the host's copy counts, the client's does not."""

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return self.calls


class Boom(Node):
    def forward(self, x, ctx):
        raise ValueError(f"boom on {x!r}")


class Handle:
    """Something with no codec: it cannot cross to another host."""

    def __init__(self, value):
        self.value = value


class Hold(Node):
    def forward(self, x, ctx):
        return Opaque(Handle(x))


class Unhold(Node):
    def forward(self, x, ctx):
        return x.value


class Pid(Node):
    def forward(self, x, ctx):
        return os.getpid()


class Lin(Node):
    """A dense layer for split training, its tensors wrapped to cross an edge."""

    def __init__(self, a, b, relu=True):
        import torch

        self.lin = torch.nn.Linear(a, b)
        self.relu = relu

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y.relu() if self.relu else y)

    def parameters(self):
        return list(self.lin.parameters())


class Later(Node):
    """Answers how many times its work ran, and leaves that work (a count; a
    ValueError for an input of "fail", SystemExit for "exit", KeyboardInterrupt for
    "interrupt") for after its answer."""

    def __init__(self):
        self.done = 0

    def forward(self, x, ctx):
        ctx.afterwards(lambda: self._work(x))
        return self.done

    def _work(self, x):
        if x == "fail":
            raise ValueError("the work after the answer failed")
        if x == "exit":
            raise SystemExit("the work after the answer exited")
        if x == "interrupt":
            raise KeyboardInterrupt("the work after the answer was interrupted")
        self.done += 1
