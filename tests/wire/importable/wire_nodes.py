"""Nodes the wire tests send to workers in mode='project': the worker imports this
module from its PYTHONPATH, so it lives beside the tests and not in them."""

import os
import time

from somatize import Node, Opaque


class Clean(Node):
    def forward(self, x, ctx):
        return x.strip()


class Shout(Node):
    def forward(self, x, ctx):
        return x.upper()


class Add(Node):
    def __init__(self, n):
        self.n = n

    def forward(self, x, ctx):
        return x + self.n


class Where(Node):
    """Answers with the process it ran in, so a test can tell here from there."""

    def forward(self, x, ctx):
        return {"pid": os.getpid(), "input": x, "device": ctx.device}


class Sleep(Node):
    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return x


class Boom(Node):
    def forward(self, x, ctx):
        raise ValueError(f"boom on {x!r}")


class Handle:
    """Something with no codec: it cannot cross a wire."""

    def __init__(self, value):
        self.value = value


class Hold(Node):
    def forward(self, x, ctx):
        return Opaque(Handle(x))


class Unhold(Node):
    def forward(self, x, ctx):
        return x.value


class Join(Node):
    def forward(self, x, ctx):
        return {"order": list(x), "values": list(x.values())}


class Count(Node):
    """Keeps state between forwards: the worker's copy counts, the client's does not."""

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return self.calls


class Echo(Node):
    def forward(self, x, ctx):
        return x


class Const(Node):
    def __init__(self, value):
        self.value = value

    def forward(self, x, ctx):
        return self.value


class UnholdJoin(Node):
    def forward(self, x, ctx):
        return [x["hold"].value, x["const"]]


class Behind(Node):
    """Says what a trainer says when the activation it was asked about is gone."""

    def forward(self, x, ctx):
        from somatize._errors import OutOfStep

        raise OutOfStep(f"no activation waits for step {x}")


class Twice(Node):
    """A position: what a walk back runs (a trainer is one), doubling what arrives."""

    _soma_position = True

    def forward(self, x, ctx):
        return {"doubled": x * 2, "pid": os.getpid()} if isinstance(x, int) else {
            "doubled": x["doubled"] * 2, "pid": os.getpid()}


_taken: list = []


class Take(Node):
    """Opens files until the process may open no more, and keeps them: a node that
    leaks descriptors. Answers how many it took."""

    def forward(self, x, ctx):
        try:
            while True:
                _taken.append(open(os.devnull, "rb"))
        except OSError:
            pass
        return len(_taken)


class Untake(Node):
    """Gives back what Take took; answers how many."""

    def forward(self, x, ctx):
        count = len(_taken)
        while _taken:
            _taken.pop().close()
        return count


class Bigger(Node):
    """Answers with twice what it was given: an answer larger than the question."""

    def forward(self, x, ctx):
        return x * 2


class Interrupt(Node):
    """Raises what Ctrl-C or exit() would, from inside a node."""

    def __init__(self, kind):
        self.kind = kind

    def forward(self, x, ctx):
        raise {"interrupt": KeyboardInterrupt, "exit": SystemExit}[self.kind]("from a node")


class Later(Node):
    """Answers how many times its work ran, and leaves that work (a wait of ``seconds``,
    then a count, or a ValueError for an input of "fail") for after its answer."""

    def __init__(self, seconds=0.0):
        self.seconds, self.done = seconds, 0

    def forward(self, x, ctx):
        ctx.afterwards(lambda: self._work(x))
        return self.done

    def _work(self, x):
        time.sleep(self.seconds)
        if x == "fail":
            raise ValueError("the work after the answer failed")
        self.done += 1
