"""The Trainer against the hand-written loop it replaces: the same arithmetic."""

import pytest
import torch
import torch.nn.functional as F
from trainnets import batches, facts, graph, weights

from somatize import Graph, Node, Opaque
from somatize.torch import NoGradient, Result, Trainer, architecture, freeze, parameters

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/torch/conftest.py


def sgd(g, lr=0.05):
    return torch.optim.SGD(parameters(g), lr=lr)


def side_by_side(trainer, by_hand, hand_body, hand_head, data):
    """The Trainer's losses and a hand-written loop's over the same batches."""
    ours, theirs = [], []
    for x, y in data:
        ours.append(trainer.step((x, y)))
        by_hand.zero_grad()
        loss = F.mse_loss(hand_head.out(hand_body.net(x)), y)
        loss.backward()
        by_hand.step()
        theirs.append(loss.item())
    return ours, theirs


def test_step_is_the_hand_written_loop_bit_for_bit():
    g, body, head = graph(seed=0)
    _, hand_body, hand_head = graph(seed=0)
    trainer = Trainer(g, objective=F.mse_loss,
                      optimizer=torch.optim.Adam(parameters(g), lr=1e-2))
    by_hand = torch.optim.Adam([*hand_body.parameters(), *hand_head.parameters()], lr=1e-2)
    ours, theirs = side_by_side(trainer, by_hand, hand_body, hand_head, batches(10))
    assert ours == theirs
    assert len(set(ours)) == 10  # it trained: ten different losses
    for mine, hand in zip(weights(body.net, head.out), weights(hand_body.net, hand_head.out)):
        assert torch.equal(mine, hand)


def test_every_four_is_one_step_over_the_four_batches_together():
    g, body, head = graph(seed=0)
    _, whole_body, whole_head = graph(seed=0)
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), every=4, watching=seen.append)
    whole = torch.optim.SGD([*whole_body.parameters(), *whole_head.parameters()], lr=0.05)
    data = batches(8)
    for x, y in data:
        trainer.step((x, y))
    for group in (data[:4], data[4:]):
        whole.zero_grad()
        x, y = torch.cat([x for x, _ in group]), torch.cat([y for _, y in group])
        F.mse_loss(whole_head.out(whole_body.net(x)), y).backward()
        whole.step()
    assert len(facts(seen, "loss")) == 8
    assert len(facts(seen, "updated")) == 2
    for mine, theirs in zip(weights(body.net, head.out), weights(whole_body.net, whole_head.out)):
        torch.testing.assert_close(mine, theirs)
    untouched, _, _ = graph(seed=0)
    assert not torch.equal(weights(body.net)[0], weights(untouched.implementation("body").net)[0])


def test_the_facts_of_a_step_come_after_its_forwards_and_update_before_loss():
    g, _, _ = graph()
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), every=2,
                      watching=[seen.append, lambda fact: None])
    for batch in batches(2):
        trainer.step(batch)
    said = [f["fact"] for f in seen]
    assert said == ["graph", "began", "ran", "ran", "finished", "loss",
                    "began", "ran", "ran", "finished", "updated", "loss"]
    assert seen[0]["graph"]["edges"] == [["body", "head"]]  # said once, before it all
    assert all(isinstance(f["value"], float) for f in facts(seen, "loss"))


def test_the_graph_fact_says_what_each_node_holds_as_architecture_lists_it():
    """Read from the module trees, with no forward: the drawing a report makes from the
    record alone is the one ``architecture(g)`` gives."""
    g, _, _ = graph()
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), watching=seen.append)
    trainer.step(batches(1)[0])
    said = facts(seen, "graph")
    assert len(said) == 1 and [f["fact"] for f in seen[:2]] == ["graph", "began"]
    assert said[0]["inside"] == {node: [[path, what] for path, what in parts]
                                 for node, parts in architecture(g).items()}
    assert [path for path, _ in said[0]["inside"]["body"]] == ["net.0", "net.1", "net.2"]
    assert said[0]["inside"]["body"][0][1]["shape_in"] is None  # nothing ran to be seen


def test_a_graph_that_holds_no_modules_says_no_layers():
    class Scale(Node):
        def __init__(self, tensor):
            self.w = tensor

        def forward(self, x, ctx):
            return Opaque(x * self.w)

        def parameters(self):
            return [self.w]

    class Plain(Node):
        def forward(self, x, ctx):
            return Opaque(x.sum(1, keepdim=True))

    said = []
    for held in (torch.ones(1, requires_grad=True), torch.nn.Parameter(torch.ones(1))):
        seen = []
        g = Graph.somatize(Plain().named("plain") >> Scale(held).named("scale"))
        Trainer(g, objective=F.mse_loss, optimizer=sgd(g), watching=seen.append).step(batches(1)[0])
        said.append(facts(seen, "graph")[0])
    assert "inside" not in said[0]  # a bare tensor is no layer; nothing to open
    assert list(said[1]["inside"]) == ["scale"]  # a Parameter is; the plain node has none


@pytest.mark.parametrize("micro, rows", [(2, 12), (3, 10), (4, 6)])
def test_micro_is_the_arithmetic_of_the_whole_batch(micro, rows):
    g, body, head = graph(seed=0)
    _, whole_body, whole_head = graph(seed=0)
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), micro=micro,
                      watching=seen.append)
    whole = torch.optim.SGD([*whole_body.parameters(), *whole_head.parameters()], lr=0.05)
    for x, y in batches(3, rows=rows):
        loss = trainer.step((x, y))
        whole.zero_grad()
        expected = F.mse_loss(whole_head.out(whole_body.net(x)), y)
        expected.backward()
        whole.step()
        assert loss == pytest.approx(expected.item(), rel=1e-6)
    pieces = len(torch.chunk(torch.empty(rows), micro))
    assert len(facts(seen, "began")) == 3 * pieces
    for mine, theirs in zip(weights(body.net, head.out), weights(whole_body.net, whole_head.out)):
        torch.testing.assert_close(mine, theirs)


def test_every_and_micro_multiply():
    g, body, head = graph(seed=0)
    _, whole_body, whole_head = graph(seed=0)
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), every=2, micro=2,
                      watching=seen.append)
    whole = torch.optim.SGD([*whole_body.parameters(), *whole_head.parameters()], lr=0.05)
    data = batches(4, rows=10)
    for batch in data:
        trainer.step(batch)
    for group in (data[:2], data[2:]):
        whole.zero_grad()
        x, y = torch.cat([x for x, _ in group]), torch.cat([y for _, y in group])
        F.mse_loss(whole_head.out(whole_body.net(x)), y).backward()
        whole.step()
    assert len(facts(seen, "began")) == 8 and len(facts(seen, "updated")) == 2
    for mine, theirs in zip(weights(body.net, head.out), weights(whole_body.net, whole_head.out)):
        torch.testing.assert_close(mine, theirs)


def test_micro_cuts_dicts_of_tensors_and_refuses_rows_that_disagree():
    class Pair(Node):
        def __init__(self):
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, ctx):
            return Opaque(self.lin(x["a"] + x["b"]))

        def parameters(self):
            return list(self.lin.parameters())

    g = Graph.somatize(Pair())
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), micro=2)
    x, y = batches(1)[0]
    assert isinstance(trainer.step(({"a": x, "b": x}, y)), float)
    with pytest.raises(ValueError, match="12 rows and the target 5"):
        trainer.step(({"a": x, "b": x}, y[:5]))
    with pytest.raises(TypeError, match="holds a str"):
        trainer.step((["words"], y))


def test_update_applies_an_open_group_and_says_when_there_is_none():
    g, body, _ = graph()
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), every=4, watching=seen.append)
    assert trainer.update() is False and facts(seen, "updated") == []
    before = weights(body.net)
    trainer.step(batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body.net)))
    assert trainer.update() is True
    assert len(facts(seen, "updated")) == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(body.net)))
    assert trainer.update() is False


def test_fit_steps_every_batch_of_every_epoch_and_closes_the_last_group():
    g, _, _ = graph()
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g), every=4, watching=seen.append)
    result = trainer.fit(batches(5), epochs=2)
    assert isinstance(result, Result) and len(result.history) == 10
    assert result.loss == result.history[-1] == facts(seen, "loss")[-1]["value"]
    assert len(facts(seen, "updated")) == 3  # 4 + 4 + the last 2, closed by fit
    assert Result([]).loss is None


def test_export_is_a_snapshot_the_next_step_does_not_move():
    g, body, _ = graph()
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g))
    data = batches(2)
    trainer.step(data[0])
    taken = trainer.export()
    kept = {n: {k: t.clone() for k, t in keyed.items()} for n, keyed in taken.items()}
    trainer.step(data[1])
    assert not torch.equal(taken["body"]["net.0.weight"], body.net[0].weight)
    for node, keyed in kept.items():
        for key, tensor in keyed.items():
            assert torch.equal(taken[node][key], tensor)
            assert not taken[node][key].requires_grad


def test_load_restores_an_export_exactly():
    g, body, head = graph(seed=0)
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g))
    start = trainer.export()
    for batch in batches(3):
        trainer.step(batch)
    trainer.load(start)
    restored = [*start["body"].values(), *start["head"].values()]
    assert all(torch.equal(a, b) for a, b in zip(weights(body.net, head.out), restored))
    assert all(p.requires_grad for p in body.net.parameters())


def test_load_of_a_wrong_shape_changes_nothing_and_names_node_key_and_shapes():
    g, body, head = graph(seed=0)
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g))
    other, _, _ = graph(seed=3)
    weights_elsewhere = Trainer(other, objective=F.mse_loss, optimizer=sgd(other)).export()
    weights_elsewhere["head"]["out.weight"] = torch.zeros(1, 17)
    before = weights(body.net, head.out)
    with pytest.raises(ValueError, match=r"'head', 'out.weight'.*\(1, 17\).*\(1, 16\)"):
        trainer.load(weights_elsewhere)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body.net, head.out)))


@pytest.mark.parametrize("spoil, says", [
    (lambda w: w["head"].update({"out.weight": w["head"]["out.weight"].double()}), "float64"),
    (lambda w: w["head"].pop("out.bias"), "lack 'out.bias'"),
    (lambda w: w["head"].update({"out.extra": torch.zeros(1)}), "have 'out.extra'"),
    (lambda w: w.update({"tail": {}}), "node 'tail'"),
])
def test_load_refuses_anything_that_does_not_fit_before_copying(spoil, says):
    g, body, head = graph(seed=0)
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g))
    given = graph(seed=5)[0]
    given = {n: dict(k) for n, k in Trainer(given, objective=F.mse_loss,
                                              optimizer=sgd(given)).export().items()}
    spoil(given)
    before = weights(body.net, head.out)
    with pytest.raises(ValueError, match=says):
        trainer.load(given)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body.net, head.out)))


def test_loading_a_frozen_node_moves_its_state_with_its_weights():
    g, body, head = graph(seed=0, body=lambda b: b.frozen())
    trainer = Trainer(g, objective=F.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g, without=g.frozen()), lr=0.1))
    state = g.frozen()["body"]
    other = graph(seed=9)[0]
    trainer.load({"body": {k: v.detach() for k, v in other.implementation("body").net.state_dict(
        prefix="net.").items()}})
    assert g.frozen()["body"] not in (None, state)
    assert not any(p.requires_grad for p in body.net.parameters())


def test_a_frozen_cached_prefix_runs_once_per_batch_under_a_store(tmp_path):
    g, body, head = graph(body=lambda b: b.frozen().cached())
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, store=str(tmp_path), watching=seen.append,
                      optimizer=torch.optim.SGD(parameters(g, without=["body"]), lr=0.05))
    frozen_body, head_before = weights(body.net), weights(head.out)
    trainer.fit(batches(3), epochs=2)
    said = [(f["fact"], f.get("node")) for f in seen if f["fact"] in ("ran", "kept", "recalled")]
    first = [("ran", "body"), ("kept", "body"), ("ran", "head")]
    after = [("recalled", "body"), ("ran", "head")]
    assert said == first * 3 + after * 3
    assert all(torch.equal(a, b) for a, b in zip(frozen_body, weights(body.net)))
    assert not all(torch.equal(a, b) for a, b in zip(head_before, weights(head.out)))


def test_a_loss_that_cannot_hand_gradients_back_is_refused():
    g, _, _ = graph()
    batch = batches(1)[0]
    for objective, says in [(lambda out, y: F.mse_loss(out, y).item(), "answered a float"),
                            (lambda out, y: (out - y) ** 2, r"shape \(12, 1\)"),
                            (lambda out, y: F.mse_loss(out.detach(), y), "does not depend")]:
        trainer = Trainer(g, objective=objective, optimizer=sgd(g))
        with pytest.raises(NoGradient, match=says):
            trainer.step(batch)


def test_parameters_that_never_get_a_gradient_are_named_at_the_first_update():
    class Cut(Node):
        def __init__(self):
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, ctx):
            return Opaque(self.lin(x).detach())

        def parameters(self):
            return list(self.lin.parameters())

    class Top(Node):
        def __init__(self):
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, ctx):
            return Opaque(self.lin(x))

        def parameters(self):
            return list(self.lin.parameters())

    g = Graph.somatize(Cut().named("cut") >> Top().named("top"))
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(g))
    with pytest.raises(NoGradient, match="node\\(s\\) 'cut'"):
        trainer.step(batches(1)[0])


def test_training_leaves_the_graph_as_it_was_declared():
    g, _, _ = graph()
    shape = (g.nodes(), g.edges(), g.plan_json(), g.devices(), g.hosts(), g.cached())
    Trainer(g, objective=F.mse_loss, optimizer=sgd(g)).fit(batches(2))
    assert (g.nodes(), g.edges(), g.plan_json(), g.devices(), g.hosts(), g.cached()) == shape
    assert g.frozen() == {}


def test_freeze_is_obeyed_before_the_first_step():
    g, body, _ = graph(body=lambda b: b.frozen())
    assert all(p.requires_grad for p in body.net.parameters())
    Trainer(g, objective=F.mse_loss,
            optimizer=torch.optim.SGD(parameters(g, without=g.frozen()), lr=0.1))
    assert not any(p.requires_grad for p in body.net.parameters())
    assert g.frozen()["body"].startswith("sha256:")
    freeze(g)  # idempotent: the same weights, the same state


@pytest.mark.cuda
def test_on_a_gpu_a_step_is_the_hand_written_loop_there():
    g, body, head = graph(seed=0)
    _, hand_body, hand_head = graph(seed=0)
    for module in (body.net, head.out, hand_body.net, hand_head.out):
        module.cuda()
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(g), lr=1e-2))
    by_hand = torch.optim.Adam([*hand_body.parameters(), *hand_head.parameters()], lr=1e-2)
    data = [(x.cuda(), y.cuda()) for x, y in batches(10)]
    ours, theirs = side_by_side(trainer, by_hand, hand_body, hand_head, data)
    assert ours == theirs and len(set(ours)) == 10  # the same kernels, in the same order
    for mine, hand in zip(weights(body.net, head.out), weights(hand_body.net, hand_head.out)):
        assert mine.is_cuda and torch.equal(mine, hand)
