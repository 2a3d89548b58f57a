"""parameters, freeze and the weights a node holds, asked by duck."""

import json

import pytest
import torch
from trainnets import Body, Head, graph

from somatize import DeclarationError, Graph, Node, Opaque
from somatize.torch import freeze, parameters
from somatize.torch._weights import snapshot, weights_digest


class Tokenizer(Node):
    def forward(self, x, ctx):
        return Opaque(x)


class Sharing(Node):
    """Says it has the parameters of a module another node holds too."""

    def __init__(self, module):
        self.module = module

    def forward(self, x, ctx):
        return Opaque(self.module(x))

    def parameters(self):
        return list(self.module.parameters())


def test_parameters_in_node_order_once_each_skipping_nodes_without_any():
    shared = torch.nn.Linear(4, 4)
    first, second = Sharing(shared), Sharing(shared)
    own = Head(4)
    g = Graph.somatize(Tokenizer() >> first.named("a") >> second.named("b") >> own.named("c"))
    found = parameters(g)
    assert [id(p) for p in found] == [id(shared.weight), id(shared.bias),
                                      id(own.out.weight), id(own.out.bias)]


def test_without_leaves_nodes_out_and_refuses_a_name_that_is_not_a_node():
    g, body, head = graph()
    assert [id(p) for p in parameters(g, without=["body"])] == [id(p) for p in head.parameters()]
    assert parameters(g, without={"body": object(), "head": object()}) == []
    with pytest.raises(DeclarationError, match=r"'bdy'.*'body', 'head'"):
        parameters(g, without=["bdy"])
    with pytest.raises(TypeError, match=r"without=\['body'\]"):
        parameters(g, without="body")


def test_parameters_that_are_not_tensors_are_refused_naming_the_node():
    class Liar(Node):
        def forward(self, x, ctx):
            return x

        def parameters(self):
            return [1.0]

    with pytest.raises(TypeError, match="'liar'.*float"):
        parameters(Graph.somatize(Liar()))


def test_freeze_with_ids_declares_the_weights_digest_and_makes_it_true():
    g, body, head = graph()
    freeze(g, "body")
    state = g.frozen()["body"]
    assert state == weights_digest(body, "body") and state.startswith("sha256:")
    assert all(not p.requires_grad for p in body.parameters())
    assert all(p.requires_grad for p in head.parameters())
    assert "head" not in g.frozen()
    assert not body.net.training and head.out.training


def test_two_checkpoints_are_two_states_and_equal_weights_one():
    g1, body1, _ = graph(seed=0)
    g2, _, _ = graph(seed=0)
    g3, _, _ = graph(seed=7)
    for g in (g1, g2, g3):
        freeze(g, "body")
    assert g1.frozen()["body"] == g2.frozen()["body"] != g3.frozen()["body"]
    with torch.no_grad():
        body1.net[0].bias[0] += 1e-3
    freeze(g1, "body")
    assert g1.frozen()["body"] != g2.frozen()["body"]


def test_the_frozen_state_is_in_the_key_of_what_is_cached_below(tmp_path):
    def key(seed):
        g, _, _ = graph(seed=seed, body=lambda b: b.frozen().cached())
        freeze(g)
        return json.loads(g.foreseen_json(Opaque(torch.ones(2, 8)), store=tmp_path))["keys"]["body"]

    assert key(0) == key(0) != key(1)


def test_freeze_without_ids_obeys_what_the_expression_declared():
    g, body, head = graph(body=lambda b: b.frozen())
    assert g.frozen() == {"body": None}
    freeze(g)
    assert g.frozen() == {"body": weights_digest(body, "body")}
    assert all(not p.requires_grad for p in body.parameters())
    assert all(p.requires_grad for p in head.parameters())


def test_freeze_puts_what_would_still_move_into_eval_mode():
    class Normed(Node):
        def __init__(self):
            self.norm = torch.nn.BatchNorm1d(3)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x, ctx):
            return Opaque(self.drop(self.norm(x)))

    node = Normed()
    g = Graph.somatize(node.named("n").frozen())
    freeze(g)
    before = node.norm.running_mean.clone()
    x = Opaque(torch.randn(6, 3) * 5 + 2)
    first, second = g.forward(x), g.forward(x)
    assert torch.equal(first, second)
    assert torch.equal(node.norm.running_mean, before)


def test_a_refused_freeze_changes_nothing():
    g, body, _ = graph()
    with pytest.raises(DeclarationError, match="'nope'"):
        freeze(g, "body", "nope")
    assert g.frozen() == {}
    assert all(p.requires_grad for p in body.parameters())


def test_freeze_reaches_modules_a_node_does_not_list_in_parameters():
    class Partial(Node):
        def __init__(self):
            self.said = torch.nn.Linear(2, 2)
            self.unsaid = torch.nn.Linear(2, 2)

        def forward(self, x, ctx):
            return Opaque(self.unsaid(self.said(x)))

        def parameters(self):
            return list(self.said.parameters())

    node = Partial()
    freeze(Graph.somatize(node.named("p")), "p")
    assert not any(p.requires_grad for p in [*node.said.parameters(), *node.unsaid.parameters()])


def test_weights_are_asked_by_state_dict_then_by_module_attributes():
    class AModule(Node, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.lin = torch.nn.Linear(2, 3)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x, ctx):
            return Opaque(self.lin(x))

    class Holder(Node):
        def __init__(self):
            self.blocks = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)]
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.norm = torch.nn.BatchNorm1d(3)

        def forward(self, x, ctx):
            return Opaque(x)

    class Bare(Node):
        def __init__(self):
            self.kept = [torch.nn.Parameter(torch.zeros(2))]

        def forward(self, x, ctx):
            return x

        def parameters(self):
            return self.kept

    g = Graph.somatize(AModule().named("m") >> Holder().named("h") >> Bare().named("b")
                       >> Tokenizer().named("t"))
    taken = snapshot(g)
    assert sorted(taken) == ["b", "h", "m"]
    assert list(taken["m"]) == ["count", "lin.weight", "lin.bias"]  # state_dict order
    assert list(taken["h"]) == ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                                "blocks.1.bias", "norm.weight", "norm.bias", "norm.running_mean",
                                "norm.running_var", "norm.num_batches_tracked", "scale"]
    assert list(taken["b"]) == ["parameters.0"]
    live = g.implementation("m").lin.weight
    assert not taken["m"]["lin.weight"].requires_grad
    assert taken["m"]["lin.weight"].data_ptr() != live.data_ptr()
    assert torch.equal(taken["m"]["lin.weight"], live)


def test_body_and_head_export_by_their_module_attributes():
    g, body, head = graph()
    assert isinstance(body, Body) and isinstance(head, Head)
    assert {n: list(k) for n, k in snapshot(g).items()} == {
        "body": ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"],
        "head": ["out.weight", "out.bias"],
    }
