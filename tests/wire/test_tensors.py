"""Tensors across the wire: bytes through the codec, never lists of floats."""

import pytest

torch = pytest.importorskip("torch")
import wire_helpers  # noqa: F401  (the workers' modules, on the path)
from wire_torch_nodes import Double, Linear, Same, Stats

import somatize.torch  # noqa: F401  (registers the tensor codec here)
from somatize import Broker, Graph, Node, Opaque, Worker


class Scale(Node):  # defined here: it reaches a worker only by value
    def __init__(self):
        self.factor = torch.tensor([3.0])

    def forward(self, x, ctx):
        return Opaque(x * self.factor)


@pytest.fixture(scope="module")
def worker():
    with Worker.generic() as w:
        yield w


def test_a_tensor_crosses_bit_for_bit(worker):
    x = torch.randn(1000, 257)
    out = Graph.somatize(Same().at("w1")).forward(Opaque(x), broker={"w1": worker})
    assert out.dtype == x.dtype and out.shape == x.shape and torch.equal(out, x)


def test_large_tensors_cross_again_and_again_and_what_is_kept_stays_intact(worker):
    g = Graph.somatize(Double().at("w1"))
    kept = []
    for step in range(3):  # past 4 MiB a buffer is mapped, then received into again
        x = torch.full((2_000_000,), float(step))
        kept.append(g.forward(Opaque(x), broker={"w1": worker}))
    for step, out in enumerate(kept):
        assert torch.equal(out, torch.full((2_000_000,), 2.0 * step))


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4),
    lambda: torch.randn(5, dtype=torch.float64),
    lambda: torch.randn(4, 4).to(torch.bfloat16),
    lambda: torch.tensor([True, False]),
    lambda: torch.tensor(2.5),
    lambda: torch.empty(0, 3),
    lambda: torch.randn(6, 4).t(),  # not contiguous
])
def test_dtypes_and_shapes_survive(worker, make):
    x = make()
    out = Graph.somatize(Same().at("w1")).forward(Opaque(x), broker={"w1": worker})
    assert out.dtype == x.dtype and out.shape == x.shape and torch.equal(out, x)


def test_a_tensor_costs_its_bytes_and_a_small_header_each_way(worker):
    x = torch.randn(256, 1024)
    facts = []
    Graph.somatize(Same().at("w1")).forward(Opaque(x), broker={"w1": worker}, watching=facts.append)
    payload = x.numel() * 4
    sent = next(f for f in facts if f["fact"] == "sent")["bytes"]
    received = next(f for f in facts if f["fact"] == "received")["bytes"]
    assert payload < sent < payload + 256 and payload < received < payload + 256, (sent, received)


def test_a_module_on_a_worker_computes_what_it_computes_here(worker):
    here = Linear(16)
    x = torch.randn(8, 16)
    out = Graph.somatize(Linear(16).at("w1") >> Double()).forward(Opaque(x), broker={"w1": worker})
    with torch.no_grad():
        assert torch.equal(out, here.net(x) * 2)


def test_tensors_fan_in_across_hosts(worker):
    with Worker.generic() as other:
        g = Graph.somatize((Double().at("w1") | Double().at("w2")) >> Stats().at("w1"))
        out = g.forward(Opaque(torch.ones(10)), broker=Broker.embedded({"w1": worker, "w2": other}))
    assert out == {"double": 20.0, "double_2": 20.0}


def test_a_stretch_of_tensor_nodes_is_one_trip_with_the_tensors_live_between(worker):
    facts = []
    g = Graph.somatize((Double() >> Same() >> Double()).at("w1"))
    out = g.forward(Opaque(torch.ones(3)), broker={"w1": worker}, watching=facts.append)
    assert torch.equal(out, torch.full((3,), 4.0))
    assert [f["fact"] for f in facts].count("sent") == 1


def test_network_mode_sends_a_tensor_holding_node_by_value():
    with Worker.generic(mode="network", send=[__name__]) as w:
        out = Graph.somatize(Scale().at("w1")).forward(Opaque(torch.ones(2)), broker={"w1": w})
    assert torch.equal(out, torch.full((2,), 3.0))
