"""A node for the split tests that cross a process boundary: sent by value to the
worker (network mode), since the worker cannot import the tests."""

import pathlib
import time
import uuid

import torch

from somatize import Node, Opaque
from somatize.torch import Split
from somatize.torch._envelope import carries


class Lin(Node):
    def __init__(self, a, b, relu=True):
        self.lin = torch.nn.Linear(a, b)
        self.relu = relu

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y.relu() if self.relu else y)

    def parameters(self):
        return list(self.lin.parameters())


class Drops(Lin):
    """A layer with dropout: what it computes depends on its process's random state."""

    def __init__(self, a, b, p=0.3):
        super().__init__(a, b)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, ctx):
        return Opaque(self.drop(self.lin(x)).relu())


class Norms(Lin):
    """A layer with a batch norm: its running statistics move in training mode only."""

    def __init__(self, a, b):
        super().__init__(a, b)
        self.bn = torch.nn.BatchNorm1d(b)

    def forward(self, x, ctx):
        y = self.bn(self.lin(x)).relu()
        if not self.bn.training and y.requires_grad:  # evaluated: nothing to walk back
            raise RuntimeError("evaluated with an autograd graph kept")
        return Opaque(y)

    def parameters(self):
        return [*self.lin.parameters(), *self.bn.parameters()]


class Dies(Lin):
    """A layer whose worker process ends at its ``at``-th forward, mid-step."""

    def __init__(self, a, b, at):
        super().__init__(a, b)
        self.at, self.seen = at, 0

    def forward(self, x, ctx):
        self.seen += 1
        if self.seen == self.at:
            import os

            os._exit(3)
        return super().forward(x, ctx)



LOG = []  # what a Logging trainer saw, in order, when its worker runs in this process


class Logging(Split):
    """A Split that says, in LOG, each forward ("F") and each gradient ("B") it gets."""

    def forward(self, value, ctx):
        LOG.append("B" if carries(value) else "F")
        return super().forward(value, ctx)


class Meets(Lin):
    """A layer whose forward waits, in ``folder``, until ``others`` more forwards are
    under way there at once: it passes only where slices run side by side."""

    def __init__(self, a, b, folder, others=1):
        super().__init__(a, b)
        self.folder, self.others = folder, others

    def forward(self, x, ctx):
        folder = pathlib.Path(self.folder)
        (folder / uuid.uuid4().hex).touch()
        deadline = time.monotonic() + 20
        while len(list(folder.iterdir())) <= self.others:
            if time.monotonic() > deadline:
                raise RuntimeError("no other forward ran meanwhile")
            time.sleep(0.01)
        return super().forward(x, ctx)


class Broken(Lin):
    """A layer whose forward raises, as a user's node with a bug would."""

    def forward(self, x, ctx):
        raise RuntimeError("broken on purpose")


class Forges(Lin):
    """A layer that hands on its output dressed as a narrowed tensor naming a type that
    is not a floating one, as a hostile or mismatched peer would."""

    def forward(self, x, ctx):
        from somatize.torch._envelope import NARROWED

        return {NARROWED: [Opaque(super().forward(x, ctx).value), "int64"]}


class Loud(Lin):
    """A layer whose answers reach past float16's largest value (65504)."""

    def forward(self, x, ctx):
        return Opaque(super().forward(x, ctx).value * 1e5)


class _LoudBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e9


class LoudBack(Lin):
    """A layer whose gradient for its input reaches past float16's largest value."""

    def forward(self, x, ctx):
        return Opaque(self.lin(_LoudBack.apply(x)).relu())
class Threads(Node):
    """Answers how many threads torch runs on where it runs: its process's share."""

    def forward(self, x, ctx):
        return torch.get_num_threads()
