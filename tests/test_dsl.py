import pytest

from somatize import DeclarationError, Graph, Node
from somatize._dsl import snake_case


class A(Node):
    def forward(self, x, ctx):
        return x


class B(A):
    pass


class C(A):
    pass


class MyHead(A):
    pass


def test_snake_case_ids():
    assert snake_case("Body") == "body"
    assert snake_case("MyHead") == "my_head"
    assert snake_case("HTTPFetch") == "http_fetch"
    assert snake_case("Layer2Norm") == "layer2_norm"


def test_chain_and_side_by_side():
    g = Graph.somatize(A() >> (B() | C()) >> MyHead())
    assert g.nodes() == ["a", "b", "c", "my_head"]
    assert g.edges() == [("a", "b"), ("a", "c"), ("b", "my_head"), ("c", "my_head")]
    assert g.roots() == ["a"] and g.leaves() == ["my_head"]


def test_side_by_side_then_side_by_side_connects_every_pair():
    g = Graph.somatize((A() | B()) >> (C() | MyHead()))
    assert sorted(g.edges()) == [("a", "c"), ("a", "my_head"), ("b", "c"), ("b", "my_head")]


def test_repeats_are_numbered_in_expression_order():
    g = Graph.somatize(A() >> A() >> (A() | B()))
    assert g.nodes() == ["a", "a_2", "a_3", "b"]


def test_a_default_id_never_takes_a_chosen_one():
    g = Graph.somatize(A() >> A().named("a") >> A())
    assert g.nodes() == ["a_2", "a", "a_3"]


def test_duplicate_named_ids_are_refused_naming_both():
    with pytest.raises(DeclarationError, match="two nodes are named 'x': a A and a B"):
        Graph.somatize(A().named("x") >> B().named("x"))


def test_named_on_a_composite_is_refused():
    with pytest.raises(DeclarationError, match="composite of 2 nodes"):
        (A() >> B()).named("pair")
    with pytest.raises(DeclarationError):
        A().named("")


def test_innermost_wins_for_on_and_at():
    g = Graph.somatize((A().on("cuda:0") >> B()).on("cuda:1"))
    assert g.devices() == {"a": "cuda:0", "b": "cuda:1"}
    g = Graph.somatize((A().at("w1") >> B()).at("w2") >> C())
    assert g.hosts() == {"a": "w1", "b": "w2"}
    # on and at are independent of each other, in either order
    g = Graph.somatize(A().on("cuda:0").at("w1") >> B().at("w1").on("cpu"))
    assert g.devices() == {"a": "cuda:0", "b": "cpu"}
    assert g.hosts() == {"a": "w1", "b": "w1"}


def test_modifiers_on_a_composite_reach_every_node():
    g = Graph.somatize((A() >> B().cached("inner")).cached("outer").frozen().mapped())
    assert g.cached() == {"a": "outer", "b": "inner"}
    assert g.frozen() == {"a": None, "b": None}
    assert g.mapped_nodes() == ["a", "b"]


def test_named_keeps_modifiers_said_before_it():
    g = Graph.somatize(A().on("cuda:0").cached().named("first") >> B())
    assert g.nodes() == ["first", "b"]
    assert g.devices() == {"first": "cuda:0"} and g.cached() == {"first": None}


def test_invalid_device_is_refused_when_materialized():
    piece = A().on("gpu:0")  # declared fine...
    with pytest.raises(DeclarationError, match="'gpu:0', which is not a device"):
        Graph.somatize(piece)  # ...refused here
    for bad in ("cuda:-1", "cuda:x", "CUDA", "cuda:01", ""):
        with pytest.raises(DeclarationError):
            Graph.somatize(A().on(bad))
    for good in ("cpu", "cuda", "cuda:0", "cuda:12", "mps", "xpu:1", "meta"):
        assert Graph.somatize(A().on(good)).devices() == {"a": good}


def test_invalid_host_is_refused():
    with pytest.raises(DeclarationError, match="not a host name"):
        Graph.somatize(A().at("node3:7000"))
    with pytest.raises(DeclarationError):
        A().at(3)


def test_a_bare_object_is_refused_with_what_to_do():
    with pytest.raises(DeclarationError, match="a int cannot be part of a graph"):
        A() >> 3
    with pytest.raises(DeclarationError, match="instantiate it: B()"):
        A() >> B


def test_plain_objects_with_forward_are_nodes():
    class Plain:
        def forward(self, x, ctx):
            return x + 1

    g = Graph.somatize(A() >> Plain())
    assert g.nodes() == ["a", "plain"]
    assert g.forward(1) == 2


def test_long_chains_build_quickly():
    piece = A()
    for _ in range(2000):
        piece = piece >> A()
    g = Graph.somatize(piece)
    assert len(g.nodes()) == 2001 and g.nodes()[-1] == "a_2001"


def test_one_object_twice_in_an_expression_is_said_to_share_its_state():
    a, b = A(), B()
    with pytest.warns(UserWarning, match=r"nodes 'a' and 'a_2' are one A object.*share its weights"
                                         r".*make two objects") as said:
        g = Graph.somatize(a >> b >> a)
    assert said[0].filename == __file__  # pointed at the user's line, not ours
    assert g.nodes() == ["a", "b", "a_2"] and g.implementation("a") is g.implementation("a_2")


def test_two_objects_of_one_class_are_two_nodes_without_a_word(recwarn):
    Graph.somatize(A() >> B() >> A())
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_one_object_named_the_same_twice_is_refused_saying_why_and_both_ways_out():
    a = A()
    with pytest.raises(DeclarationError, match=r"same A object is used twice.*named 'x' both times"
                                               r".*two objects.*name of its own"):
        Graph.somatize(a.named("x") >> B() >> a.named("x"))
