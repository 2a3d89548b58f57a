import pytest

from somatize import (DeclarationError, Done, EdgeError, Graph, Node, NodeError, Opaque)


class Const(Node):
    def __init__(self, value):
        self.value = value

    def forward(self, x, ctx):
        return self.value


class Echo(Node):
    def forward(self, x, ctx):
        return x


class Wrap(Node):
    def forward(self, x, ctx):
        return Opaque({"inner": x, "obj": object()})


class Peek(Node):
    def forward(self, x, ctx):
        assert not isinstance(x, Opaque)
        return sorted(x)


class Boom(Node):
    def forward(self, x, ctx):
        raise ZeroDivisionError("no")


class Add(Node):
    def __init__(self, n):
        self.n = n

    def forward(self, x, ctx):
        return x + self.n


class Device(Node):
    def forward(self, x, ctx):
        return [ctx.device, ctx.node]


def test_fan_in_is_a_map_keyed_by_predecessor_in_edge_order():
    g = Graph.somatize((Const(1).named("one") | Const(2).named("two")) >> Echo())
    assert g.forward() == {"one": 1, "two": 2}
    assert list(g.forward()) == ["one", "two"]


def test_every_root_gets_the_input_and_several_leaves_answer_a_map():
    g = Graph.somatize(Echo().named("a") | Echo().named("b"))
    assert g.forward(5) == {"a": 5, "b": 5}


def test_opaque_is_unwrapped_below_and_at_the_output():
    g = Graph.somatize(Wrap() >> Peek())
    assert g.forward(3) == ["inner", "obj"]
    out = Graph.somatize(Wrap()).forward(3)
    assert out["inner"] == 3 and type(out["obj"]) is object


def test_done_is_unwrapped_like_a_plain_return():
    class Finished(Node):
        def forward(self, x, ctx):
            return Done(Opaque(x + 1))

    assert Graph.somatize(Finished() >> Echo()).forward(1) == 2


def test_an_object_at_an_edge_is_refused_naming_node_and_answers():
    class Leaky(Node):
        def forward(self, x, ctx):
            return {1, 2}

    g = Graph.somatize(Echo() >> Leaky() >> Echo())
    with pytest.raises(EdgeError) as caught:
        g.forward(1)
    message = str(caught.value)
    assert "node 'leaky' returned a builtins.set" in message
    assert "Opaque(...)" in message and "convert it to data" in message


def test_the_input_is_checked_too():
    g = Graph.somatize(Echo())
    with pytest.raises(EdgeError, match="the input was given a builtins.object"):
        g.forward(object())
    assert g.forward(Opaque(5)) == 5
    assert g.forward() is None


def test_subclasses_of_data_cross():
    from collections import namedtuple

    Point = namedtuple("Point", "x y")
    assert Graph.somatize(Echo()).forward(Point(1, 2)) == (1, 2)


def test_a_node_exception_is_re_raised_naming_the_node():
    g = Graph.somatize(Const(1) >> Boom() >> Echo())
    with pytest.raises(NodeError) as caught:
        g.forward()
    error = caught.value
    assert error.node == "boom" and error.kind == "ZeroDivisionError"
    assert "node 'boom' (Boom) raised ZeroDivisionError: no" in str(error)
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert isinstance(error, ValueError)


def test_facts_in_order_with_integer_microseconds():
    seen = []
    g = Graph.somatize(Const(1) >> Echo())
    g.forward(watching=seen.append)
    assert [f["fact"] for f in seen] == ["began", "ran", "ran", "finished"]
    assert [f.get("node") for f in seen[1:3]] == ["const", "echo"]
    for fact in seen[1:]:
        for key in ("began_us", "took_us"):
            if key in fact:
                assert isinstance(fact[key], int) and fact[key] >= 0
    assert seen[1]["began_us"] <= seen[2]["began_us"] <= seen[3]["took_us"]
    assert isinstance(seen[0]["at_us"], int)


def test_several_watchers_and_stamping():
    first, second = [], []
    g = Graph.somatize(Const(1) >> Echo())
    g.forward(watching=[first.append, second.append], stamping={"epoch": "3"})
    assert first == second and len(first) == 4
    assert all(f["epoch"] == "3" for f in first)
    with pytest.raises(TypeError, match="callables"):
        g.forward(watching=[1])


def test_a_failing_node_is_a_fact_then_the_forward_finishes():
    seen = []
    g = Graph.somatize(Const(1) >> Boom())
    with pytest.raises(NodeError):
        g.forward(watching=seen.append)
    assert [f["fact"] for f in seen] == ["began", "ran", "failed", "finished"]
    assert seen[2] == {"fact": "failed", "node": "boom", "error": "ZeroDivisionError: no"}
    assert seen[3]["failed"] is True


def test_ctx_carries_device_and_id():
    g = Graph.somatize(Device().on("cuda:1").named("d") >> Device())
    assert g.forward() == [None, "device"]
    assert Graph.somatize(Device().on("cuda:1").named("d")).forward() == ["cuda:1", "d"]


def test_a_mapped_node_answers_item_for_item():
    class Double(Node):
        def forward(self, xs, ctx):
            return [x * 2 for x in xs]

    class Short(Node):
        def forward(self, xs, ctx):
            return xs[:-1]

    assert Graph.somatize(Double().mapped()).forward([1, 2, 3]) == [2, 4, 6]
    with pytest.raises(EdgeError, match="handed 3 items it answered with 2 items"):
        Graph.somatize(Short().mapped()).forward([1, 2, 3])
    with pytest.raises(EdgeError, match="takes a list, but was handed a dict"):
        Graph.somatize(Double().mapped()).forward({"a": 1})


def test_part_of_a_graph_with_given_values():
    from somatize._engine import Pass

    g = Graph.somatize(Add(1).named("a") >> Add(10).named("b") >> Add(100).named("c"))
    pieces = Pass()
    assert pieces.run(g, 0, nodes=["b", "c"], given={"a": 5}) == 115
    assert pieces.run(g, 0, nodes=["a", "b"]) == 11
    assert pieces.run(g, 0, want=["a", "c"]) == {"a": 1, "c": 111}
    with pytest.raises(DeclarationError, match="reads 'a', which it does not run"):
        pieces.run(g, 0, nodes=["b"])


def test_a_forward_in_pieces_is_one_forward_in_the_record():
    from somatize._engine import Pass

    g = Graph.somatize(Add(1).named("a") >> Add(10).named("b"))
    seen = []
    with Pass(seen.append, {"epoch": "3"}, opening={"step": 7}) as one:
        a = one.run(g, 0, nodes=["a"])
        assert one.run(g, nodes=["b"], given={"a": a}) == 11
    kinds = [f["fact"] for f in seen]
    assert kinds == ["began", "ran", "ran", "finished"]
    assert seen[0]["step"] == 7 and all(f["epoch"] == "3" for f in seen)
    assert "failed" not in seen[-1]
    seen.clear()
    with pytest.raises(DeclarationError), Pass(seen.append) as one:
        one.run(g, 0, nodes=["b"])
    assert seen[-1]["fact"] == "finished" and seen[-1]["failed"] is True


def test_a_host_without_a_broker_is_refused_before_anything_runs():
    ran = []

    class Mark(Node):
        def forward(self, x, ctx):
            ran.append(1)
            return x

    g = Graph.somatize(Mark() >> Echo().at("w1"))
    with pytest.raises(DeclarationError, match="host 'w1' and no broker"):
        g.forward(1)
    assert ran == []


def test_a_walk_decided_once_runs_again_with_new_values_and_a_changed_graph_decides_anew():
    from somatize._engine import Pass, compiled

    g = Graph.somatize(Add(1).named("a") >> Add(10).named("b") >> Add(100).named("c"))
    walk = compiled(g.data(), ["b", "c"], ("a",), None, False)
    assert compiled(g.data(), ("b", "c"), ("a",), None, False) is walk  # found, not made again
    one = Pass()
    assert [walk.run(one, None, [v], None, None) for v in (0, 5)] == [110, 115]
    assert one.run(g, 0, nodes=["b", "c"], given={"a": 7}) == 117  # the same walk, by name
    with pytest.raises(DeclarationError, match="reads 'a', which it does not run"):
        compiled(g.data(), ["b", "c"], (), None, False)
    g.freeze("c", "sha256:" + "0" * 64)  # a new data form: its walks are its own
    assert compiled(g.data(), ["b", "c"], ("a",), None, False) is not walk


def test_a_walk_back_over_no_nodes_answers_nothing():
    from somatize._engine import Pass

    g = Graph.somatize(Echo())
    assert Pass().back(g, [], {}, []) == {}  # found by the fuzz test of a worker's frames
    assert Pass().back(g, ["echo"], {"echo": 3}, ["echo"]) == {"echo": 3}
