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


def test_a_thread_that_holds_work_for_afterwards_keeps_it_in_order_and_only_its_own():
    import threading

    from somatize._node import afterwards_held_here

    ran, held = [], {}

    def holding():  # a thread of its own, as a worker's connection is
        left = afterwards_held_here()
        Ctx(None, "a").afterwards(lambda: ran.append("a"))
        Ctx(None, "b").afterwards(lambda: ran.append("b"))
        held["left"], held["again"] = list(left), afterwards_held_here() is left

    thread = threading.Thread(target=holding)
    thread.start()
    thread.join()
    assert ran == [] and [n for n, _ in held["left"]] == ["a", "b"] and held["again"]
    Ctx(None, "c").afterwards(lambda: ran.append("c"))  # this thread promised nothing
    assert ran == ["c"]
