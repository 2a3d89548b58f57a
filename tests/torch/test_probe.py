"""probe: the Audit's measures at initialisation, and nothing about the graph changed."""

import tempfile

import pytest
import torch
from trainnets import graph

from somatize import Graph, Node, Opaque
from somatize.health import seen
from somatize.health._rules import findings_of
from somatize.record import Recorder, facts
from somatize.store import Store
from somatize.torch import freeze, parameters
from somatize.torch._probe import probe


class Stack(Node):
    """Tanh layers, optionally scaled at birth, with a batch norm in front."""

    def __init__(self, depth=6, scale=1.0):
        torch.manual_seed(0)
        layers = [torch.nn.BatchNorm1d(8)]
        for _ in range(depth):
            layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers)
        with torch.no_grad():
            for p in self.net.parameters():
                if p.dim() > 1:
                    p.mul_(scale)

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Out(Node):
    def __init__(self):
        self.layer = torch.nn.Linear(8, 2)

    def forward(self, x, ctx):
        return Opaque(self.layer(x))

    def parameters(self):
        return list(self.layer.parameters())


def stack(scale=1.0):
    return Graph.somatize(Stack(scale=scale).named("stack") >> Out().named("out"))


def example():
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(3))


def test_probe_answers_the_audits_keys_and_changes_nothing():
    g = stack()
    weights = [p.detach().clone() for p in parameters(g)]
    norm = g.implementation("stack").net[0]
    statistics = (norm.running_mean.clone(), norm.num_batches_tracked.clone())
    for p in parameters(g):
        p.grad = torch.full_like(p, 7.0)
    generator_state = torch.random.get_rng_state()
    answer = probe(g, example())
    assert list(answer)[:3] == ["stack", "stack.net.0", "stack.net.1"]
    assert "out.layer" in answer and len(answer) == 2 + 13 + 1
    assert all(torch.equal(a, b) for a, b in zip(weights, parameters(g)))
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in parameters(g))
    assert torch.equal(norm.running_mean, statistics[0])
    assert torch.equal(norm.num_batches_tracked, statistics[1])
    assert torch.equal(torch.random.get_rng_state(), generator_state)
    assert answer["stack.net.2"]["act_saturated"] >= 0.0  # a Tanh, known by its class
    assert "update_ratio" not in answer["stack"]  # nothing was stepped
    assert probe(g, example()) == answer  # the same directions every time


def test_the_probe_sees_at_birth_what_a_run_would_find_later():
    healthy, crushed = probe(stack(), example()), probe(stack(scale=0.01), example())
    ratio = crushed["stack.net.1"]["grad_norm"] / crushed["out"]["grad_norm"]
    assert ratio < 1e-3 < healthy["stack.net.1"]["grad_norm"] / healthy["out"]["grad_norm"]


def test_through_a_recorder_it_is_step_0_of_the_run_and_diagnosable_from_the_store():
    store = Store(tempfile.mkdtemp())
    recorder = Recorder(store, run="born")
    answer = probe(stack(scale=0.01), example(), depth=0, watching=recorder)
    recorder.flush()
    assert seen(store, "born", step=0) == answer
    said = [f["fact"] for f in facts(store, "born", 0)]
    assert said[0] == "began" and "finished" in said and said[-1] == "health"
    found = findings_of([f for f in facts(store, "born", 0) if f["fact"] == "health"])
    assert {(f.where, f.what) for f in found} >= {("stack.net.1", "vanishing")}


def test_a_graph_with_nothing_to_differentiate_still_gets_its_activations_measured():
    g, _, _ = graph()
    freeze(g, "body", "head")
    answer = probe(g, torch.randn(4, 8))
    assert "act_mean" in answer["body"] and "grad_norm" not in answer["body"]


def test_a_call_that_cannot_be_answered_is_refused_naming_the_argument():
    g = stack()
    with pytest.raises(ValueError, match="probes=0"):
        probe(g, example(), probes=0)
    with pytest.raises(ValueError, match="depth=-1"):
        probe(g, example(), depth=-1)
    with pytest.raises(TypeError, match="somatize Graph"):
        probe(torch.nn.Linear(2, 2), example())
    assert "forward" not in g.implementation("stack").__dict__
