"""The Learning hole on its own: envelopes, groups, pickling, the two positions."""

import ast
import inspect
import pickle
import textwrap

import pytest
import torch

from somatize import Ctx, Node, Opaque
from somatize.torch import Learning, OutOfStep, Split, envelope, gradient
from somatize.torch._envelope import carries
from somatize.torch._learning import Enters


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
    assert copied.seat.built is None  # never built before it travelled
    assert copied.seat.node is copied_node  # one pickle keeps who trains whom
    built = copied.optimizer
    assert built is copied.optimizer and isinstance(built, torch.optim.SGD)
    assert built.param_groups[0]["lr"] == 0.5
    held = {id(p) for p in built.param_groups[0]["params"]}
    assert held == {id(p) for p in copied_node.parameters()}


def test_a_technique_that_names_its_own_group_wins():
    assert Split(torch.optim.SGD, lr=0.1, every=5).accumulating(2).seat.every == 5
    assert Split(torch.optim.SGD, lr=0.1).accumulating(2).seat.every == 2
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


# -- the class a technique subclasses stays small --------------------------------------
MOST_PUBLIC = 15  # what a technique's author sees on the class it subclasses (issue 44)


def test_the_class_a_technique_subclasses_has_at_most_fifteen_public_names():
    public = sorted(n for n in dir(Learning) if not n.startswith("_"))
    assert len(public) <= MOST_PUBLIC, (len(public), public)
    # what the reference page documents for a technique's author is all still there
    for name in ("learn", "training", "optimizer", "opens", "closes", "waiting", "done",
                 "held", "given", "of", "beside", "accumulating", "entering", "forward"):
        assert name in public, name


def _techniques():
    """Learning and every technique somatize itself ships that subclasses it."""
    found, todo = [], [Learning]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("somatize."):
            found.append(cls)
        todo += cls.__subclasses__()
    return found


def _underscore_reads(source, inherited=()):
    """Each ``x._name`` in ``source`` where ``x`` is not ``self`` (or ``cls``): another
    object's own (dunders aside); and each ``self._name`` among ``inherited``, the
    class's it subclasses, which are the library's and not the technique's."""
    def private(node):
        return (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not (node.attr.startswith("__") and node.attr.endswith("__")))

    def own(node):
        return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
    return [f"{ast.unparse(node)} (line {node.lineno})" for node in ast.walk(ast.parse(source))
            if private(node) and (not own(node) or node.attr in inherited)]


def test_no_technique_reads_another_objects_underscores():
    """A technique reaches the library through public methods (its seat's, here)."""
    techniques = _techniques()
    assert Split in techniques
    reads = [f"{cls.__qualname__}: {read}" for cls in techniques
             for read in _underscore_reads(textwrap.dedent(inspect.getsource(cls)),
                                           () if cls is Learning else vars(Learning))]
    assert not reads, reads


def test_the_underscore_check_sees_a_read_of_another_objects_underscore():
    """The control: the check flags the reads Split made before it had a seat (the
    base class's ``_audit`` and ``_group``), another object's, and not its own."""
    source = ("def learn(self, signal, ctx):\n"
              "    if self._audit is None and self._group is None:\n"
              "        self._step()\n"
              "    return self.seat._given\n")
    assert sorted(_underscore_reads(source, {"_audit": None, "_group": None})) == [
        "self._audit (line 2)", "self._group (line 2)", "self.seat._given (line 4)"]
