"""The Audit against plain torch: every measure of a step recomputed by hand from the
same weights and batch; the cadence; the hooks on and off; the Trainer's wiring."""

import gc
import math
import tempfile

import pytest

import torch

import torch.nn.functional as F
from trainnets import batches, graph

from somatize import DeclarationError, Graph, Node, NodeError, Opaque
from somatize._errors import NotWhole
from somatize.record import Recorder, facts
from somatize.store import Store
from somatize.torch import Trainer, parameters
from somatize.torch._architecture import architecture
from somatize.torch._audit import MEASURES, Audit

APPROX = {"rel": 1e-5, "abs": 1e-7}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/torch/conftest.py


def health(seen, step=None, where=None):
    return [f for f in seen if f["fact"] == "health" and (step is None or f["step"] == step)
            and (where is None or f["where"] == where)]


def audited(g, lr=0.05, **how):
    seen = []
    audit = how.pop("auditing", True)
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=lr),
                      watching=seen.append, auditing=audit, **how)
    return trainer, seen


def stats(t):
    return {"act_mean": t.mean().item(), "act_std": t.std(unbiased=False).item(),
            "act_zero": (t == 0).double().mean().item()}


def grad_stats(g):
    return {"grad_norm": g.norm().item(), "grad_mean": g.mean().item(),
            "grad_std": g.std(unbiased=False).item()}


def test_one_step_measured_is_what_plain_torch_computes():
    g, _, _ = graph(seed=0)
    _, twin_body, twin_head = graph(seed=0)
    trainer, seen = audited(g)
    batch = batches(1)[0]
    trainer.step(batch)

    x, y = batch
    hidden = twin_body.net(x)
    hidden.retain_grad()
    out = twin_head.out(hidden)
    out.retain_grad()
    before = [p.detach().clone() for p in twin_body.parameters()]
    F.mse_loss(out, y).backward()
    torch.optim.SGD(twin_body.parameters() + twin_head.parameters(), lr=0.05).step()
    after = list(twin_body.parameters())

    said = {f["where"]: f for f in health(seen)}
    assert list(said) == ["body", "head"]
    expected = {**stats(hidden), **grad_stats(hidden.grad), "nonfinite": 0,
                "weight_norm": math.sqrt(sum(p.norm().item() ** 2 for p in after)),
                "update_ratio": math.sqrt(sum((a - b).norm().item() ** 2 for a, b in zip(after, before)))
                / math.sqrt(sum(b.norm().item() ** 2 for b in before)),
                "update_norm": math.sqrt(sum((a - b).norm().item() ** 2 for a, b in zip(after, before)))}
    for name, value in expected.items():
        assert said["body"][name] == pytest.approx(value, **APPROX), name
    assert said["body"]["step"] == 1
    assert said["head"]["grad_norm"] == pytest.approx(out.grad.norm().item(), **APPROX)
    assert "act_saturated" not in said["body"]  # a Linear's output is not bounded
    assert set(said["body"]) - {"fact", "where", "step"} <= set(MEASURES)
    assert "act_hist" in said["body"] and len(said["body"]["act_hist"]["counts"]) == 32
    assert sum(said["body"]["act_hist"]["counts"]) == hidden.numel()


def test_inside_keys_modules_by_path_and_measures_them_as_hooks_see_them():
    g, _, _ = graph(seed=1)
    trainer, seen = audited(g, auditing=Audit(inside=True))
    x, y = batches(1)[0]
    trainer.step((x, y))
    said = {f["where"]: f for f in health(seen)}
    assert list(said) == ["body", "body.net.0", "body.net.1", "body.net.2", "head", "head.out"]
    _, twin, _ = graph(seed=1)  # the weights before the step, to recompute from the batch
    relu = twin.net[1](twin.net[0](x))
    assert said["body.net.1"]["act_zero"] == pytest.approx(stats(relu)["act_zero"], **APPROX)
    assert "weight_norm" not in said["body.net.1"]  # a ReLU holds nothing
    assert said["body.net.2"]["act_mean"] == pytest.approx(said["body"]["act_mean"], **APPROX)


def test_inside_takes_paths_a_depth_or_what_architecture_answers_and_refuses_the_unknown():
    g, _, _ = graph()
    assert Audit(inside=["body.net.0"]).watch(g).wheres == ["body", "body.net.0", "head"]
    g2, _, _ = graph()
    assert Audit(inside=architecture(g2)).watch(g2).wheres == Audit(inside=0).watch(graph()[0]).wheres
    g3, body, _ = graph()
    assert Audit(inside=True, most=1).watch(g3).wheres == ["body", "body.net.0", "head", "head.out"]
    g4, body, _ = graph()
    with pytest.raises(DeclarationError, match="body.net.7.*architecture"):
        Audit(inside=["body.net.7"]).watch(g4)
    with pytest.raises(DeclarationError, match="'tail'.*'body', 'head'"):
        Audit(inside={"tail": ["x"]}).watch(g4)
    assert "forward" not in body.__dict__ and not body.net[0]._forward_hooks  # refused, untouched


def test_measured_every_n_steps_the_first_included_and_histograms_every_snapshot():
    g, _, _ = graph()
    trainer, seen = audited(g, auditing=Audit(every=3, snapshot=2))
    for batch in batches(8):
        trainer.step(batch)
    steps = sorted({f["step"] for f in health(seen)})
    assert steps == [1, 4, 7]
    with_hist = sorted({f["step"] for f in health(seen) if "act_hist" in f})
    assert with_hist == [1, 7]  # measured steps 0 and 2 of three


class Keeps(Node):
    """Keeps what it produced, to see whether anything was hooked onto it."""

    def __init__(self):
        self.layer = torch.nn.Linear(8, 1)
        self.kept = []

    def forward(self, x, ctx):
        out = self.layer(x)
        self.kept.append(out)
        return Opaque(out)

    def parameters(self):
        return list(self.layer.parameters())


def test_an_unmeasured_step_hooks_nothing_onto_what_was_produced():
    node = Keeps()
    g = Graph.somatize(node.named("only"))
    trainer, _ = audited(g, auditing=Audit(every=2))
    for batch in batches(2):
        trainer.step(batch)
    measured, unmeasured = node.kept
    assert measured._backward_hooks and not unmeasured._backward_hooks


def test_micro_pieces_pool_into_the_whole_batchs_numbers():
    g1, _, _ = graph(seed=3)
    g2, _, _ = graph(seed=3)
    whole, seen_whole = audited(g1)
    cut, seen_cut = audited(g2, micro=3)
    batch = batches(1, rows=12)[0]
    whole.step(batch)
    cut.step(batch)
    for a, b in zip(health(seen_whole), health(seen_cut)):
        for name in ("act_mean", "act_std", "act_zero", "grad_norm", "grad_mean", "grad_std",
                     "update_ratio"):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-7), (a["where"], name)


def test_a_group_of_steps_says_update_ratio_only_where_the_update_happened():
    g, _, _ = graph()
    trainer, seen = audited(g, every=2)
    for batch in batches(4):
        trainer.step(batch)
    body = {f["step"]: f for f in health(seen, where="body")}
    assert [("update_ratio" in body[s]) for s in (1, 2, 3, 4)] == [False, True, False, True]


class Poisoned(Node):
    def __init__(self):
        self.layer = torch.nn.Linear(8, 4)

    def forward(self, x, ctx):
        out = self.layer(x)
        return Opaque(out * torch.tensor([1.0, 1.0, float("nan"), 1.0]))

    def parameters(self):
        return list(self.layer.parameters())


class Mean(Node):
    def forward(self, x, ctx):
        return Opaque(x.mean(dim=1, keepdim=True))


def test_nan_and_inf_are_counted_in_what_was_produced_and_what_came_back():
    g = Graph.somatize(Poisoned().named("bad") >> Mean().named("mean"))
    trainer, seen = audited(g)
    x, y = batches(1, rows=5)[0]
    trainer.step((x, y))
    bad = health(seen, where="bad")[0]
    # five NaNs produced; the loss is NaN, so every gradient value that came back is too
    assert bad["nonfinite"] == 5 + 20
    assert math.isnan(bad["act_mean"])


class Squash(Node):
    def __init__(self, how):
        self.layer = torch.nn.Linear(8, 6)
        self.how = how

    def forward(self, x, ctx):
        return Opaque(self.how(self.layer(x) * 4))

    def parameters(self):
        return list(self.layer.parameters())


@pytest.mark.parametrize("how, low, high", [
    (torch.sigmoid, 0.0, 1.0), (torch.tanh, -1.0, 1.0),
    (lambda t: F.hardtanh(t, -2.0, 3.0), -2.0, 3.0), (F.relu6, 0.0, 6.0)])
def test_saturation_is_read_off_the_function_that_made_the_output(how, low, high):
    node = Squash(how)
    g = Graph.somatize(node.named("squash") >> Mean().named("mean"))
    x, y = batches(1)[0]
    expected = how(node.layer(x) * 4).detach()
    margin = 0.01 * (high - low)
    share = ((expected <= low + margin) | (expected >= high - margin)).double().mean().item()
    trainer, seen = audited(g)
    trainer.step((x, y))
    assert health(seen, where="squash")[0]["act_saturated"] == pytest.approx(share)
    assert "act_saturated" not in health(seen, where="mean")[0]


def at_bounds(t, low=-1.0, high=1.0):
    """The share of ``t`` within 1% of the range from either bound, as torch counts it."""
    margin = 0.01 * (high - low)
    return ((t <= low + margin) | (t >= high - margin)).double().mean().item()


class Recur(Node):
    """A recurrent layer over x (N, 8) read as 8 steps of 1, inputs x 100 so that some
    of its states saturate; answers ``pick`` of what the layer answered."""

    scale = 100.0

    def __init__(self, layer, pick):
        self.rnn = layer
        self.pick = pick

    def forward(self, x, ctx):
        return Opaque(self.pick(self.rnn(x.reshape(-1, 8, 1) * self.scale)))

    def parameters(self):
        return list(self.rnn.parameters())


RECURRENT = {
    "gru h_n[-1]": (lambda: torch.nn.GRU(1, 6, batch_first=True), lambda o: o[1][-1], True),
    "gru (out, h_n)": (lambda: torch.nn.GRU(1, 6, batch_first=True), lambda o: o, True),
    "lstm out[:, -1]": (lambda: torch.nn.LSTM(1, 6, batch_first=True), lambda o: o[0][:, -1], True),
    "lstm h_n[-1]": (lambda: torch.nn.LSTM(1, 6, batch_first=True), lambda o: o[1][0][-1], True),
    "lstm c_n[-1]": (lambda: torch.nn.LSTM(1, 6, batch_first=True), lambda o: o[1][1][-1], False),
    "projected lstm": (lambda: torch.nn.LSTM(1, 6, batch_first=True, proj_size=3),
                       lambda o: o[1][0][-1], False),
    "tanh rnn": (lambda: torch.nn.RNN(1, 6, batch_first=True), lambda o: o[1][-1], True),
    "relu rnn": (lambda: torch.nn.RNN(1, 6, batch_first=True, nonlinearity="relu"),
                 lambda o: o[1][-1], False),
}


class Tail(Node):
    """Whatever comes in, one number per row: a loss can be taken of it."""

    def forward(self, x, ctx):
        parts = x if isinstance(x, tuple) else (x,)
        return Opaque(sum(p.flatten(1).mean(dim=1, keepdim=True) for p in parts))


@pytest.mark.filterwarnings("ignore:LSTM with projections")
@pytest.mark.parametrize("case", RECURRENT)
def test_a_recurrent_layers_hidden_states_are_bounded_and_an_lstms_cell_state_is_not(case):
    make, pick, bounded = RECURRENT[case]
    torch.manual_seed(0)
    node = Recur(make(), pick)
    g = Graph.somatize(node.named("rec") >> Tail().named("tail"))
    x, y = batches(1)[0]
    with torch.no_grad():
        answered = pick(node.rnn(x.reshape(-1, 8, 1) * node.scale))
    parts = answered if isinstance(answered, tuple) else (answered,)
    share = sum(at_bounds(p) * p.numel() for p in parts) / sum(p.numel() for p in parts)
    trainer, seen = audited(g)
    trainer.step((x, y))
    said = health(seen, where="rec")[0]
    if bounded:
        assert 0.0 < share < 1.0  # the case says something
        assert said["act_saturated"] == pytest.approx(share)
    else:
        assert "act_saturated" not in said


class Module(Node):
    """A Linear, times ``scale``, then ``act`` (a module, or a function)."""

    def __init__(self, act, scale=4.0):
        self.layer = torch.nn.Linear(8, 6)
        self.act = act
        self.scale = scale

    def forward(self, x, ctx):
        return Opaque(self.act(self.layer(x) * self.scale))

    def parameters(self):
        return list(self.layer.parameters())


def gate_share(node, x):
    """The share of a GLU's gate within 1% of 0 or 1."""
    with torch.no_grad():
        gate = (node.layer(x) * 4).chunk(2, dim=-1)[1]
    return at_bounds(torch.sigmoid(gate), 0.0, 1.0)


@pytest.mark.parametrize("make, expected", [
    (lambda: Module(torch.nn.Softsign(), scale=100.0),
     lambda n, x: at_bounds(n.act(n.layer(x) * 100))),
    (lambda: Module(torch.nn.Hardtanh(-0.5, 0.5)),
     lambda n, x: at_bounds(n.act(n.layer(x) * 4), -0.5, 0.5)),
    (lambda: Module(lambda t: t.clamp(-1.0, 2.0)),
     lambda n, x: at_bounds((n.layer(x) * 4).clamp(-1.0, 2.0), -1.0, 2.0)),
    (lambda: Module(torch.nn.GLU()), gate_share),
    (lambda: Module(F.glu), gate_share),
    (lambda: Module(lambda t: torch.sigmoid(t)[:, :4]),
     lambda n, x: at_bounds(torch.sigmoid(n.layer(x) * 4)[:, :4], 0.0, 1.0)),
])
def test_saturation_is_read_wherever_the_output_is_bounded(make, expected):
    torch.manual_seed(0)
    node = make()
    g = Graph.somatize(node.named("squash") >> Tail().named("tail"))
    x, y = batches(1)[0]
    with torch.no_grad():
        share = expected(node, x)
    assert 0.0 < share < 1.0
    trainer, seen = audited(g)
    trainer.step((x, y))
    assert health(seen, where="squash")[0]["act_saturated"] == pytest.approx(share)
    assert "act_saturated" not in health(seen, where="tail")[0]


def test_a_recurrent_module_watched_inside_a_node_is_bounded_by_its_own_states():
    torch.manual_seed(0)
    node = Recur(torch.nn.GRU(1, 6, batch_first=True), lambda o: o[1][-1] @ torch.ones(6, 3))
    g = Graph.somatize(node.named("rec") >> Tail().named("tail"))
    x, y = batches(1)[0]
    with torch.no_grad():
        out, h = node.rnn(x.reshape(-1, 8, 1) * node.scale)
    share = (at_bounds(out) * out.numel() + at_bounds(h) * h.numel()) / (out.numel() + h.numel())
    trainer, seen = audited(g, auditing=Audit(inside=["rec.rnn"]))
    trainer.step((x, y))
    assert "act_saturated" not in health(seen, where="rec")[0]  # a linear map of the state
    assert health(seen, where="rec.rnn")[0]["act_saturated"] == pytest.approx(share)


class Channels(Node):
    """A 4-channel (N, C, L) output whose first ``dead`` channels are always zero."""

    def __init__(self, dead):
        self.layer = torch.nn.Linear(8, 12)
        self.mask = torch.ones(1, 4, 1)
        self.mask[:, :dead] = 0

    def forward(self, x, ctx):
        return Opaque(self.layer(x).reshape(-1, 4, 3) * self.mask)

    def parameters(self):
        return list(self.layer.parameters())


class Flat(Node):
    def forward(self, x, ctx):
        return Opaque(x.flatten(1).sum(dim=1, keepdim=True))


def test_dead_channels_are_those_zero_through_the_whole_window_per_group_too():
    g = Graph.somatize(Channels(dead=3).named("conv") >> Flat().named("flat"))
    audit = Audit(window=3, groups={"conv": {"low": [0, 1], "high": range(2, 4)}})
    trainer, seen = audited(g, auditing=audit)
    for batch in batches(4):
        trainer.step(batch)
    conv = [f.get("dead_channels") for f in health(seen, where="conv")]
    assert conv == [None, None, {"low": 2, "high": 1}, {"low": 2, "high": 1}]
    assert health(seen, where="conv")[-1]["channels"] == {"low": 2, "high": 2}  # out of
    assert all("dead_channels" not in f for f in health(seen, where="flat"))  # not tracked

    g2 = Graph.somatize(Channels(dead=1).named("conv") >> Flat().named("flat"))
    trainer2, seen2 = audited(g2, auditing=Audit(window=2, channels=True))
    for batch in batches(2):
        trainer2.step(batch)
    assert [f.get("dead_channels") for f in health(seen2, where="conv")] == [None, 1]
    assert health(seen2, where="conv")[-1]["channels"] == 4


class Sparse(Node):
    """(N, 3, L): channel 0 only ever negative, channel 1 zero but for one value in a
    batch, channel 2 always zero: only channel 2 is dead."""

    def __init__(self):
        self.layer = torch.nn.Linear(8, 6)

    def forward(self, x, ctx):
        out = self.layer(x).reshape(-1, 3, 2)
        mask = torch.zeros(1, 3, 2)
        mask[:, 0] = 1
        one = torch.zeros_like(out)
        one[-1, 1, 1] = 1
        return Opaque(-out.abs() * mask - 1 * mask + out * one)

    def parameters(self):
        return list(self.layer.parameters())


def test_a_channel_fires_when_any_value_in_it_is_not_zero_negative_or_alone():
    g = Graph.somatize(Sparse().named("conv") >> Flat().named("flat"))
    trainer, seen = audited(g, auditing=Audit(window=2, channels=True))
    for batch in batches(3):
        trainer.step(batch)
    assert [f.get("dead_channels") for f in health(seen, where="conv")] == [None, 1, 1]


def test_a_group_naming_a_channel_that_is_not_there_is_refused_saying_how_many_there_are():
    g = Graph.somatize(Channels(dead=0).named("conv") >> Flat().named("flat"))
    trainer, _ = audited(g, auditing=Audit(groups={"conv": {"far": [9]}}))
    with pytest.raises(DeclarationError, match="channel 9.*4 channels"):
        trainer.step(batches(1)[0])


def test_release_leaves_no_hook_behind_and_watching_twice_counts_once():
    g, body, head = graph()
    audit = Audit(inside=True)
    audit.watch(g)
    audit.watch(g)  # the same graph again: nothing more
    assert len(body.__dict__["forward"].places) == 1
    assert len(body.net[0]._forward_hooks) == 1
    optimizer = torch.optim.SGD(parameters(g), lr=0.1)
    x, y = batches(1)[0]
    F.mse_loss(g.forward(Opaque(x)), y).backward()
    optimizer.step()
    once = audit.observed(g)
    assert sorted(f["where"] for f in once) == sorted({f["where"] for f in once})
    audit.release()
    audit.release()  # twice is fine
    assert "forward" not in body.__dict__ and "forward" not in head.__dict__
    assert not any(m._forward_hooks for m in [*body.net.modules(), head.out])
    out = g.forward(Opaque(x))
    assert not out._backward_hooks  # the graph runs unwatched
    with pytest.raises(DeclarationError, match="does not watch"):
        audit.observed(g)


def test_two_trainers_on_one_graph_each_count_only_their_own_steps():
    g, body, _ = graph(seed=4)
    first, seen_first = audited(g, lr=0.0)
    second, seen_second = audited(g, lr=0.0)
    assert len(body.__dict__["forward"].places) == 2
    mine, theirs = batches(1, seed=5)[0], batches(1, seed=6)[0]
    for _ in range(3):
        first.step(mine)
        second.step((theirs[0] * 10, theirs[1]))
    alone_g, _, _ = graph(seed=4)
    alone, seen_alone = audited(alone_g, lr=0.0)
    alone.step(mine)
    reference = health(seen_alone, where="body")[0]
    for fact in health(seen_first, where="body"):
        for name in ("act_mean", "act_std", "grad_norm", "grad_std"):
            assert fact[name] == pytest.approx(reference[name], **APPROX)
    assert [f["step"] for f in health(seen_first, where="body")] == [1, 2, 3]
    theirs_said = health(seen_second, where="body")
    assert [f["step"] for f in theirs_said] == [1, 2, 3]
    assert theirs_said[0]["act_std"] > 2 * reference["act_std"]  # its own, larger inputs
    first.close()
    assert len(body.__dict__["forward"].places) == 1
    second.close()
    assert "forward" not in body.__dict__


def test_close_takes_the_hooks_off_a_step_after_it_puts_them_back_and_collection_does_too():
    g, body, _ = graph()
    trainer, seen = audited(g)
    trainer.step(batches(1)[0])
    trainer.close()
    assert "forward" not in body.__dict__
    trainer.step(batches(1)[0])
    assert "forward" in body.__dict__ and [f["step"] for f in health(seen, where="body")] == [1, 2]
    del trainer
    gc.collect()
    assert "forward" not in body.__dict__


def test_health_facts_land_in_the_record_of_their_forward_after_loss_and_updated():
    store = Store(tempfile.mkdtemp())
    g, _, _ = graph()
    recorder = Recorder(store, run="audited")
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                      watching=recorder, auditing=Audit(every=2))
    for batch in batches(3):
        trainer.step(batch)
    recorder.flush()
    first = [f["fact"] for f in facts(store, "audited", 0)]
    assert first[-4:] == ["updated", "loss", "health", "health"]
    assert "health" not in [f["fact"] for f in facts(store, "audited", 1)]
    assert [f["where"] for f in facts(store, "audited", 2) if f["fact"] == "health"] == ["body", "head"]


def test_what_auditing_is_given_is_checked_before_anything_changes():
    g, body, _ = graph(body=lambda b: b.frozen())
    sgd = torch.optim.SGD(parameters(g, without=["body"]), lr=0.1)
    with pytest.raises(TypeError, match="auditing= is True or an Audit"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd, watching=print, auditing="yes")
    with pytest.raises(DeclarationError, match="watching= is empty"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd, auditing=True)
    with pytest.raises(DeclarationError, match="no module at 'nope'"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd, watching=print,
                auditing=Audit(inside=["body.nope"]))
    assert all(p.requires_grad for p in body.parameters())  # not frozen: nothing changed
    assert "forward" not in body.__dict__
    shared = Audit()
    holder = Trainer(g, objective=F.mse_loss, optimizer=sgd, watching=print, auditing=shared)
    with pytest.raises(DeclarationError, match="already used by another Trainer"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd, watching=print, auditing=shared)
    other, _, _ = graph()
    with pytest.raises(DeclarationError, match="watches another graph"):
        Trainer(other, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(other), lr=0.1),
                watching=print, auditing=shared)
    holder.close()  # then it is free again
    Trainer(other, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(other), lr=0.1),
            watching=print, auditing=shared)


@pytest.mark.parametrize("how", [{"every": 0}, {"snapshot": 1.5}, {"window": True},
                                 {"most": -1}])
def test_the_audits_numbers_are_whole_numbers_from_one(how):
    with pytest.raises(DeclarationError, match=f"{next(iter(how))}="):
        Audit(**how)


def test_an_audit_refuses_a_count_as_a_trainer_does():
    with pytest.raises(NotWhole, match="Audit: every=0; every is a whole number from 1 up"):
        Audit(every=0)
    with pytest.raises(NotWhole, match="Trainer: every=0; every is a whole number from 1 up"):
        Trainer(graph()[0], objective=F.mse_loss, every=0)


def test_groups_are_checked_when_made_and_when_watched():
    with pytest.raises(TypeError, match="groups="):
        Audit(groups=["conv"])
    with pytest.raises(DeclarationError, match="channel numbers from 0"):
        Audit(groups={"conv": {"a": [-1]}})
    g, _, _ = graph()
    with pytest.raises(DeclarationError, match="'conv', which this Audit does not watch"):
        Audit(groups={"conv": {"a": [0]}}).watch(g)


def test_a_node_failing_under_the_audit_fails_as_it_would_without_it():
    class Boom(Node):
        def forward(self, x, ctx):
            raise RuntimeError("no")

    g = Graph.somatize(Keeps().named("keeps") >> Boom().named("boom"))
    trainer, _ = audited(g)
    with pytest.raises(NodeError, match="'boom'"):
        trainer.step(batches(1)[0])


class Wide(Node):
    """A layer far larger than the Audit's sample, so its weights are read by sample."""

    def __init__(self):
        self.layer = torch.nn.Linear(8, 4096)
        self.out = torch.nn.Linear(4096, 1)

    def forward(self, x, ctx):
        return Opaque(self.out(torch.relu(self.layer(x))))

    def parameters(self):
        return [*self.layer.parameters(), *self.out.parameters()]


def test_a_large_tensors_weights_are_read_off_a_sample_within_a_few_percent(monkeypatch):
    said = {}
    for sampled in (None, Audit.sampled):
        monkeypatch.setattr(Audit, "sampled", sampled)
        torch.manual_seed(7)
        g = Graph.somatize(Wide().named("wide"))
        seen = []
        trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(g), lr=1e-3),
                          watching=seen.append, auditing=True)
        for batch in batches(5):
            trainer.step(batch)
        said[sampled] = health(seen, where="wide")
    for exact, sampled in zip(said[None], said[Audit.sampled]):
        assert sampled["update_ratio"] == pytest.approx(exact["update_ratio"], rel=0.05)
        assert sampled["weight_norm"] == pytest.approx(exact["weight_norm"], rel=0.02)
        assert sampled["act_mean"] == exact["act_mean"]  # only the weights are sampled


class Mixed(Node):
    """Weights of two dtypes, and more of them than one row of the Audit's buffer holds
    when nothing is sampled: the buffers' layout read back tensor by tensor."""

    def __init__(self):
        self.layer = torch.nn.Linear(8, 700)  # 5,600 weights: two rows of 4,096
        self.out = torch.nn.Linear(700, 1).double()

    def forward(self, x, ctx):
        return Opaque(self.out(torch.relu(self.layer(x)).double()).float())

    def parameters(self):
        return [*self.layer.parameters(), *self.out.parameters()]


def squared(tensors):
    return sum(t.double().norm().item() ** 2 for t in tensors)


def weights_said(node, before):
    """What plain torch says of ``node``'s weights now, against ``before``."""
    after = [p.detach().clone() for p in node.parameters()]
    step = squared(a - b for a, b in zip(after, before))
    return {"weight_norm": math.sqrt(squared(after)), "update_norm": math.sqrt(step),
            "update_ratio": math.sqrt(step / squared(before))}


@pytest.mark.parametrize("sampled", [None, 8192])
def test_weights_of_every_dtype_and_size_are_what_plain_torch_computes(monkeypatch, sampled):
    # None: rows of 4,096, which the largest tensor spans two of; 8,192: nothing is
    # sampled and every tensor is one row
    monkeypatch.setattr(Audit, "sampled", sampled)
    torch.manual_seed(3)
    node = Mixed()
    g = Graph.somatize(node.named("mixed"))
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(g), lr=1e-2),
                      watching=seen.append, auditing=True)
    for step, batch in enumerate(batches(3), 1):
        before = [p.detach().clone() for p in node.parameters()]
        trainer.step(batch)
        said = health(seen, step=step, where="mixed")[0]
        for name, value in weights_said(node, before).items():
            assert said[name] == pytest.approx(value, rel=1e-5), (step, name)


def test_weights_swapped_between_steps_are_read_where_they_now_are(monkeypatch):
    monkeypatch.setattr(Audit, "sampled", None)  # every entry, so the numbers are exact
    torch.manual_seed(4)
    node = Mixed()
    g = Graph.somatize(node.named("mixed"))
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                      watching=seen.append, auditing=True)
    data = batches(2)
    trainer.step(data[0])
    for p in node.layer.parameters():  # the same Parameters over new storage, as .to() does
        p.data = torch.randn_like(p)
    before = [p.detach().clone() for p in node.parameters()]
    trainer.step(data[1])
    said = health(seen, step=2, where="mixed")[0]
    for name, value in weights_said(node, before).items():
        assert said[name] == pytest.approx(value, rel=1e-5), name


def test_histograms_count_every_finite_value_between_their_edges():
    g, _, _ = graph(seed=2)
    trainer, seen = audited(g)
    trainer.step(batches(1, rows=20)[0])
    body = health(seen, where="body")[0]
    for name in ("act_hist", "grad_hist"):
        counts, edges = body[name]["counts"], body[name]["edges"]
        assert len(counts) == 32 and len(edges) == 33 and sum(counts) == 20 * 16
        assert edges == sorted(edges) and edges[0] < edges[-1]


@pytest.mark.cuda
def test_on_a_gpu_a_measured_step_syncs_with_the_host_once_more_than_any_other():
    import warnings

    g, body, head = graph(seed=0)
    body.net.cuda()
    head.out.cuda()
    trainer, seen = audited(g, auditing=Audit(every=2))
    data = [(x.cuda(), y.cuda()) for x, y in batches(8)]
    for batch in data[:4]:  # warm: what goes to the device once has gone
        trainer.step(batch)

    def syncs(batch):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    measured, plain = syncs(data[4]), syncs(data[5])  # step 5 is measured, 6 is not
    assert health(seen, step=5) and not health(seen, step=6)
    assert measured - plain <= 1, (measured, plain)  # one read-back, of every number
    said = health(seen, step=5, where="body")[0]
    assert said["nonfinite"] == 0 and math.isfinite(said["act_mean"])


# -- the anchor of benchmarks/audit.py ------------------------------------------------------
def audited_beside(bench, contender):
    """Three steps of audit.py's Trainer audited, and of the same Trainer beside it with
    the benchmark's ``contender`` hooks instead: what each said."""
    ours, said = bench.trainer(32, 64, 5, Audit(every=1))
    theirs, told = bench.trainer(32, 64, 5, None, getattr(bench, contender), 1)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = (torch.randn(16, 32, generator=generator),
                 torch.randint(0, 5, (16,), generator=generator))
        ours.step(batch)
        theirs.step(batch)
    return said, told


def test_the_benchmarks_by_hand_anchor_says_what_the_audit_says(benchmark_file):
    """benchmarks/audit.py compares the Audit's cost with the same numbers written in
    plain torch hooks; that comparison means something only if they are the same
    numbers, step after step."""
    said, told = audited_beside(benchmark_file("audit"), "ByHand")
    a = [f for f in said if f["fact"] == "health"]
    b = [f for f in told if f["fact"] == "health"]
    assert [f["where"] for f in a] == [f["where"] for f in b] == ["body", "head"] * 3
    for mine, theirs in zip(a, b):
        for key in ("act_mean", "act_std", "act_zero", "grad_norm", "grad_mean", "grad_std",
                    "weight_norm", "update_norm", "update_ratio"):
            # no tensor here is larger than the Audit's sample (4096 entries): every
            # weight is read whole on both sides, so every number agrees closely
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-9), (mine["where"], key)
        assert mine["nonfinite"] == theirs["nonfinite"] == 0


def test_the_benchmarks_bare_reductions_read_the_weights_the_audit_reads(benchmark_file):
    """audit.py's ``Kernels`` stands for the Audit's reductions without its machinery;
    it is that only if it reads the same weights, step after step."""
    said, told = audited_beside(benchmark_file("audit"), "Kernels")
    audited = [f for f in said if f["fact"] == "health"]
    read = [weights for f in told if f["fact"] == "kernels" for weights in f["weights"]]
    assert len(audited) == len(read) == 6
    for mine, theirs in zip(audited, read):
        for key in ("weight_norm", "update_norm", "update_ratio"):
            assert mine[key] == theirs[key], (mine["where"], key)
