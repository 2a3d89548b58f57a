import json
import pickle

import pytest

from somatize import CycleError, DeclarationError, Graph, Node


class Add(Node):
    def __init__(self, n=1):
        self.n = n

    def forward(self, x, ctx):
        return x + self.n


class Sum(Node):
    def forward(self, x, ctx):
        return sum(x.values())


def by_hand():
    g = Graph()
    a = g.node(Add(1))
    b = g.node("b", Add(10))
    c = g.node(Add(100))
    s = g.node(Sum())
    g.edge(a, b)
    g.edge(a, c)
    g.edge(b, s)
    g.edge(c, s)
    return g


def test_by_hand_graph_runs_and_answers_queries():
    g = by_hand()
    assert g.nodes() == ["add", "b", "add_2", "sum"]
    assert g.edges() == [("add", "b"), ("add", "add_2"), ("b", "sum"), ("add_2", "sum")]
    assert g.predecessors("sum") == ["b", "add_2"]
    assert g.successors("add") == ["b", "add_2"]
    assert g.roots() == ["add"] and g.leaves() == ["sum"]
    assert g.topological_sort() == ["add", "b", "add_2", "sum"]
    assert g.forward(0) == (1 + 10) + (1 + 100)


def test_queries_return_copies():
    g = by_hand()
    g.predecessors("sum").append("x")
    g.nodes().clear()
    assert g.predecessors("sum") == ["b", "add_2"] and len(g.nodes()) == 4


def test_unknown_ids_are_named_with_the_known_ones():
    g = by_hand()
    with pytest.raises(DeclarationError, match="no node 'nope'; its nodes are 'add', 'b'"):
        g.edge("add", "nope")
    for method in (g.predecessors, g.successors):
        with pytest.raises(DeclarationError):
            method("nope")
    with pytest.raises(DeclarationError):
        g.place("nope", "cpu")


def test_an_edge_closing_a_cycle_names_the_cycle_and_changes_nothing():
    g = by_hand()
    before = g.edges()
    with pytest.raises(CycleError) as caught:
        g.edge("sum", "add")
    assert caught.value.path == ["add", "b", "sum", "add"]
    assert "add -> b -> sum -> add" in str(caught.value)
    assert g.edges() == before
    with pytest.raises(CycleError, match="b -> b"):
        g.edge("b", "b")


def test_duplicate_edges_and_ids_are_refused():
    g = by_hand()
    with pytest.raises(DeclarationError, match="already feeds"):
        g.edge("add", "b")
    with pytest.raises(DeclarationError, match="already has a node 'b'"):
        g.node("b", Add())
    with pytest.raises(DeclarationError, match="for an expression use Graph.somatize"):
        g.node(Add() >> Add())
    with pytest.raises(TypeError):
        g.node()


def test_placement_and_hosts():
    g = by_hand()
    g.place("b", "cuda:1")
    g.place("add", "cpu")
    g.place_at("sum", "w1")
    assert g.devices() == {"add": "cpu", "b": "cuda:1"}  # declaration order, not call order
    assert g.hosts() == {"sum": "w1"}
    with pytest.raises(DeclarationError):
        g.place("b", "tpu")
    with pytest.raises(DeclarationError):
        g.place_at("b", "has space")
    assert g.devices() == {"add": "cpu", "b": "cuda:1"}


def test_cache_freeze_mapped():
    g = by_hand()
    g.cache("b", "v2")
    g.cache("add")
    g.freeze("add", "sha256:" + "0" * 64)
    g.mapped("add_2")
    assert g.cached() == {"add": None, "b": "v2"}
    assert g.frozen() == {"add": "sha256:" + "0" * 64}
    assert g.mapped_nodes() == ["add_2"]
    with pytest.raises(DeclarationError):
        g.cache("b", 3)


def test_declarations_identities_fingerprints_implementation():
    g = by_hand()
    decl = g.declarations()
    assert set(decl) == {"add", "b", "add_2", "sum"}
    assert all(d.startswith("sha256:") and len(d) == 71 for d in decl.values())
    # same class, different construction: two answers
    assert decl["add"] != decl["add_2"]
    assert Graph.somatize(Add(1)).declarations()["add"] == decl["add"]
    g.declared_as("sum", {"version": 2})
    assert g.declarations()["sum"] != decl["sum"]
    g.declared_as("sum", "sha256:" + "a" * 64)
    assert g.declarations()["sum"] == "sha256:" + "a" * 64
    with pytest.raises(DeclarationError, match="cannot be written down"):
        g.declared_as("sum", object())
    assert g.identities()["add"] == f"{Add.__module__}.Add"
    g.written_as("b", "1.4.2")
    assert g.fingerprints() == {"b": "1.4.2"}
    assert isinstance(g.implementation("b"), Add) and g.implementation("zzz") is None


def test_unwritable_declarations_are_passed_over():
    g = Graph.somatize(Add(object()))
    assert g.declarations() == {}


def test_plan_and_plan_json():
    g = by_hand()
    assert repr(g.plan()) == "Seq[add, Wave[b, add_2], sum]"
    assert json.loads(g.plan_json()) == {"Seq": [
        {"Node": "add"}, {"Wave": [{"Node": "b"}, {"Node": "add_2"}]}, {"Node": "sum"}]}


def test_a_graph_pickles_without_its_compiled_form():
    g = by_hand()
    g.forward(0)
    assert "program" in g.data().memo
    again = pickle.loads(pickle.dumps(g))
    assert "program" not in again.data().memo and again.forward(0) == g.forward(0)


def test_changes_after_a_forward_are_seen():
    g = by_hand()
    assert g.forward(0) == 112
    extra = g.node("extra", Add(1000))
    g.edge("sum", extra)
    assert g.forward(0) == 1112


@pytest.mark.parametrize("bad", ["body\x1fin", "body\nin", "\t"])
def test_an_id_with_a_control_character_is_refused(bad):
    """Control characters are what the library's own ids (``generated``) are made with,
    so a user's id that holds one could be mistaken for one of them."""
    with pytest.raises(DeclarationError, match="without control characters"):
        Graph.somatize(Add(1).named(bad))
    with pytest.raises(DeclarationError, match="without control characters"):
        Graph().node(bad, Add(1))


def test_a_node_trained_away_has_its_graph_refuse_to_run_through_a_broker():
    g = Graph.somatize(Add(1).named("a") >> Add(2).named("b"))
    assert g.forward(1, broker={}) == 4  # nothing said yet: it runs
    with pytest.raises(DeclarationError, match="'nope'"):
        g.trained_away("nope", "never said")
    g.trained_away("b", "node 'b' learns elsewhere; ask whoever trains it")
    with pytest.raises(DeclarationError, match="node 'b' learns elsewhere"):
        g.forward(1, broker={})
    with pytest.raises(DeclarationError, match="learns elsewhere"):  # the mark travels
        pickle.loads(pickle.dumps(g)).forward(1, broker={})
