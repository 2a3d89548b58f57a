"""The Learning hole on its own: envelopes, groups, pickling, the two positions."""

import pickle

import pytest
import torch

from somatize import Ctx, Node, Opaque
from somatize.torch import Learning, OutOfStep, Split, envelope, gradient
from somatize.torch._learning import Enters, carries


class Lin(Node):
    def __init__(self):
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, ctx):
        return Opaque(self.lin(x))

    def parameters(self):
        return list(self.lin.parameters())


def test_an_envelope_is_one_reserved_key_and_a_cheap_check():
    g = torch.ones(2)
    e = envelope(g, closing=True)
    assert list(e) == ["__soma_envelope__"] and carries(e)
    assert torch.equal(gradient(e), g)
    assert not carries({"x": 1}) and not carries({}) and not carries([e])
    assert gradient({"x": 1}) is None and gradient(3) is None
    assert gradient(envelope(None)) is None


def test_gradient_sums_a_map_of_envelopes_and_moves_it():
    fan = {"a": envelope(torch.ones(2)), "b": envelope(None), "c": envelope(2 * torch.ones(2))}
    assert torch.equal(gradient(fan), 3 * torch.ones(2))
    assert gradient(fan, device="cpu").device.type == "cpu"
    assert gradient({"a": envelope(None)}) is None


def test_a_learning_survives_pickle_and_builds_its_optimizer_where_it_lands():
    node = Lin()
    split = Split(torch.optim.SGD, lr=0.5).of(node)
    enters, itself = split.beside()
    assert itself is split and isinstance(enters, Enters) and enters.learning is split
    copied_node, copied = pickle.loads(pickle.dumps((node, split)))
    assert copied._built is None  # never built before it travelled
    assert copied._node is copied_node  # one pickle keeps who trains whom
    built = copied.optimizer
    assert built is copied.optimizer and isinstance(built, torch.optim.SGD)
    assert built.param_groups[0]["lr"] == 0.5
    held = {id(p) for p in built.param_groups[0]["params"]}
    assert held == {id(p) for p in copied_node.parameters()}


def test_a_technique_that_names_its_own_group_wins():
    assert Split(torch.optim.SGD, lr=0.1, every=5).accumulating(2)._every == 5
    assert Split(torch.optim.SGD, lr=0.1).accumulating(2)._every == 2
    with pytest.raises(ValueError):
        Split(torch.optim.SGD, every=0)
    with pytest.raises(TypeError):
        Split("sgd")


def test_a_gradient_without_its_activation_is_out_of_step():
    split = Split(torch.optim.SGD, lr=0.1).of(Lin())
    with pytest.raises(OutOfStep, match="activation is not here"):
        split.forward(envelope(torch.ones(4, 2)), Ctx())


def test_one_learning_step_by_hand():
    node = Lin()
    split = Split(torch.optim.SGD, lr=0.1).of(node)
    before = [p.detach().clone() for p in node.parameters()]
    x = torch.randn(4, 3)
    leaf = split.entering(x, Ctx())
    assert type(leaf) is Opaque and leaf.value.requires_grad and not x.requires_grad
    out = split.forward(node.forward(leaf.value, Ctx()).value, Ctx())
    assert type(out) is Opaque and not out.value.requires_grad  # let go of
    answer = split.forward(envelope(torch.ones(4, 2)), Ctx())
    back = gradient(answer)
    assert back.shape == (4, 3) and torch.allclose(back, before[0].sum(0).expand(4, 3))
    assert not all(torch.equal(a, b) for a, b in zip(before, node.parameters()))
    assert split.held is None and split.given is None


def test_held_and_given_are_this_steps_activation_and_leaf_and_read_only():
    node = Lin()
    split = Split(torch.optim.SGD, lr=0.1).of(node)
    assert split.held is None and split.given is None  # between steps
    leaf = split.entering(torch.randn(4, 3), Ctx()).value
    assert split.given is leaf
    made = node.forward(leaf, Ctx()).value
    split.forward(made, Ctx())
    assert split.held is made
    with pytest.raises(AttributeError):
        split.held = None
    with pytest.raises(AttributeError):
        split.given = None
    split.forward(envelope(torch.ones(4, 2)), Ctx())
    assert split.held is None and split.given is None


def test_learn_is_the_hole():
    class Nothing(Learning):
        pass

    with pytest.raises(NotImplementedError, match="does not say how it learns"):
        Nothing(torch.optim.SGD).of(Lin()).learn(None, Ctx())
