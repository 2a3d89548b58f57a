"""``somatize.torch.module(m)``: an existing nn.Module as a node in one call, trained as
plain PyTorch trains it, its export loading straight back into ``m``; and a module used
as a node without it refused, naming it."""

import copy

import pytest
import torch
from torch import nn

from somatize import DeclarationError, Graph, Node, Opaque, Worker
from somatize.torch import Split, Trainer, module, parameters

mse = nn.functional.mse_loss


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batches(n=5):
    torch.manual_seed(1)
    return [(torch.randn(16, 6), torch.randn(16, 2)) for _ in range(n)]


def trained_by_hand(m, data):
    """The same module trained as plain PyTorch trains it: the reference."""
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = mse(m(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_module_trains_as_plain_pytorch_and_its_export_loads_back_into_it():
    m = mlp()
    reference = copy.deepcopy(m)
    g = Graph.somatize(module(m).named("net"))
    t = Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    assert [t.step(b) for b in batches()] == trained_by_hand(reference, batches())
    exported = t.export()["net"]
    assert list(exported) == list(reference.state_dict())  # m's own keys, buffers included
    fresh = mlp()
    fresh.load_state_dict(exported)  # strict: no key missing, none left over
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 reference.state_dict().values()))
    assert g.implementation("net").module is m  # the module itself, not a copy


def test_a_module_joins_other_nodes_and_its_output_crosses_as_opaque():
    class Scale(Node):
        def forward(self, x, ctx):
            assert isinstance(x, torch.Tensor)  # handed on unwrapped
            return Opaque(x * 2)

    m = mlp().eval()
    g = Graph.somatize(Scale() >> module(m).named("net") >> Scale())
    x = torch.randn(4, 6)
    assert torch.equal(g.forward(Opaque(x)), m(x * 2) * 2)


def test_a_module_on_a_worker_exports_its_own_keys_from_there():
    m, head = mlp(), nn.Linear(2, 2)
    reference = nn.Sequential(copy.deepcopy(m), copy.deepcopy(head))
    g = Graph.somatize(module(m).named("net").at("gpu") >> module(head).named("head"))
    with Worker.generic(mode="network") as worker:
        trains = {"net": Split(torch.optim.SGD, lr=0.1)}
        t = Trainer(g, objective=mse, trains=trains, workers={"gpu": worker},
                    optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
        assert [t.step(b) for b in batches()] == trained_by_hand(reference, batches())
        far = t.export()["net"]
    fresh = mlp()
    fresh.load_state_dict(far)  # what the worker trained, under m's own keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 reference[0].state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), reference[1].parameters()))


@pytest.mark.parametrize("joined", [
    lambda m: Graph.somatize(m),
    lambda m: Graph.somatize(Pass() >> m),
    lambda m: Graph.somatize(m >> Pass()),
    lambda m: Graph.somatize(Pass() | m),
    lambda m: Graph().node("net", m),
])
@pytest.mark.parametrize("m", [nn.Linear(2, 3), nn.Sequential(nn.Linear(2, 2))])
def test_a_module_used_as_a_node_as_it_is_is_refused_naming_module(joined, m):
    with pytest.raises(DeclarationError, match=rf"torch {type(m).__name__} cannot be a node.*"
                                               r"somatize\.torch\.module\(m\)"):
        joined(m)


def test_a_refused_module_leaves_the_graph_as_it_was():
    g = Graph.somatize(Pass().named("a"))
    with pytest.raises(DeclarationError, match="somatize.torch.module"):
        g.node("b", nn.Linear(2, 3))
    assert g.nodes() == ["a"]
    with pytest.raises(TypeError, match="takes a torch.nn.Module, not a type"):
        module(nn.Linear)


def test_a_module_written_as_a_node_is_still_a_node():
    class Both(Node, nn.Module):  # a Node and a module: its forward takes ctx
        def __init__(self):
            nn.Module.__init__(self)
            self.lin = nn.Linear(2, 2)

        def forward(self, x, ctx):
            return Opaque(self.lin(x))

    class TakesCtx(nn.Module):  # no Node, but a node's forward
        def forward(self, x, ctx):
            return Opaque(x + 1)

    g = Graph.somatize(Both().named("both") >> TakesCtx())
    assert g.nodes() == ["both", "takes_ctx"]


class Pass(Node):
    def forward(self, x, ctx):
        return x
