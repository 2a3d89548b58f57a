import pickle

import pytest

from somatize import Ctx, Done, MissingForward, Node, Opaque
from somatize._node import made_with


class Scale(Node):
    def __init__(self, by, *, offset=0):
        self.by = by
        self.offset = offset

    def forward(self, x, ctx):
        return x * self.by + self.offset


class Bare(Node):
    # never calls super().__init__(): nothing may depend on it
    def __init__(self):
        self.seen = 0

    def forward(self, x, ctx):
        return x


def test_a_node_without_forward_cannot_be_made():
    class Nothing(Node):
        pass

    with pytest.raises(MissingForward, match="Nothing does not define forward") as caught:
        Nothing()
    assert isinstance(caught.value, TypeError)


def test_constructor_arguments_are_captured_without_super_init():
    node = Scale(3, offset=1)
    assert made_with(node) == ((3,), {"offset": 1})
    assert node.forward(2, Ctx()) == 7
    assert made_with(Bare()) == ((), {})


def test_pickle_keeps_state_and_arguments():
    node = pickle.loads(pickle.dumps(Scale(2, offset=5)))
    assert (node.by, node.offset) == (2, 5)
    assert made_with(node) == ((2,), {"offset": 5})


def test_plain_objects_have_no_declaration():
    class Plain:
        def forward(self, x, ctx):
            return x

    assert made_with(Plain()) is None


def test_ctx_opaque_done():
    ctx = Ctx("cuda:0")
    assert ctx.device == "cuda:0" and ctx.node is None
    assert Ctx().device is None
    marker = object()
    assert Opaque(marker).value is marker
    assert Done(marker).value is marker
    assert "Opaque(object)" == repr(Opaque(marker))


class Leaves(Node):
    """Leaves a count for after its answer, and answers the count so far."""

    def __init__(self):
        self.done = 0

    def forward(self, x, ctx):
        ctx.afterwards(lambda: setattr(self, "done", self.done + 1))
        return self.done


def test_work_left_for_afterwards_runs_at_once_where_nobody_waits_for_an_answer():
    from somatize import Graph

    node = Leaves()
    g = Graph.somatize(node.named("n"))
    assert [g.forward(0), g.forward(0)] == [1, 2]  # a graph run here: inside the call


def test_held_afterwards_keeps_work_in_order_for_its_caller_in_its_thread_only():
    import threading

    from somatize._node import held_afterwards

    ran = []
    with held_afterwards() as left:
        Ctx(None, "a").afterwards(lambda: ran.append("a"))
        other = threading.Thread(target=Ctx(None, "t").afterwards, args=(lambda: ran.append("t"),))
        other.start()
        other.join()
        with held_afterwards() as inner:
            Ctx(None, "b").afterwards(lambda: ran.append("b"))
        Ctx(None, "c").afterwards(lambda: ran.append("c"))
    assert ran == ["t"]  # another thread's work: nobody there promised to run it later
    assert [n for n, _ in left] == ["a", "c"] and [n for n, _ in inner] == ["b"]
    for _, work in left:
        work()
    Ctx(None, "d").afterwards(lambda: ran.append("d"))
    assert ran == ["t", "a", "c", "d"]
