"""Split training with the far half on a real worker process: bit for bit, and the
trainer's weights read back from where they are (a restart: test_split_sessions)."""

import contextlib
import traceback

import pytest
import torch
from splitnets import Broken, Forges, Lin

from somatize import Broker, DeclarationError, Graph, NodeError, StateLost, Worker
from somatize.torch import NoGradient, Split, Trainer, architecture, parameters
from somatize.torch._one_piece import InOnePiece
from somatize.torch._staged import StagedDriver

mse = torch.nn.functional.mse_loss


def net(host=None, seed=0):
    torch.manual_seed(seed)
    body = Lin(8, 6).named("body")
    body = body.at(host) if host else body
    return Graph.somatize(Lin(8, 8).named("encoder") >> body >> Lin(6, 1, relu=False).named("head"))


def batches(n=10, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(n)]


def weights(g, nodes):
    return [p.detach().clone() for n in nodes for p in g.implementation(n).parameters()]


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["splitnets"]) as w:
        yield w


# The worker steps its optimizer after answering (Ctx.afterwards): Adam's step is the
# costlier one to move, and what export reads back must be the weights after it.
@pytest.mark.parametrize("every,optimizer", [(1, torch.optim.SGD), (3, torch.optim.SGD),
                                             (1, torch.optim.Adam), (3, torch.optim.Adam)])
def test_the_far_half_on_a_worker_trains_bit_for_bit(worker, every, optimizer):
    one = net()
    whole = Trainer(one, objective=mse, every=every,
                    optimizer=optimizer(parameters(one), lr=0.1))
    cut = net("gpu")
    trains = {"body": Split(optimizer, lr=0.1)}
    split = Trainer(cut, objective=mse, every=every, trains=trains,
                    optimizer=optimizer(parameters(cut, without=trains), lr=0.1),
                    broker=Broker.embedded({"gpu": worker}))
    assert [whole.step(b) for b in batches()] == [split.step(b) for b in batches()]
    here = ["encoder", "head"]
    assert all(torch.equal(a, b) for a, b in zip(weights(one, here), weights(cut, here)))
    # the body here never learnt: its weights are on the worker...
    assert all(torch.equal(a, b) for a, b in zip(weights(net(), ["body"]), weights(cut, ["body"])))
    # ...and read back from there they are the same as trained in one piece
    far = split.export()["body"]
    mine = whole.export()["body"]
    assert far.keys() == mine.keys() and all(torch.equal(far[k], mine[k]) for k in far)


def test_a_node_trained_on_a_worker_is_audited_through_its_trainer(worker):
    cut = net("gpu")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    seen = []
    t = Trainer(cut, objective=mse, trains=trains, auditing=True, watching=seen.append,
                optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1),
                broker=Broker.embedded({"gpu": worker}))
    for b in batches(3):
        t.step(b)
    health = [f for f in seen if f["fact"] == "health"]
    far = [f for f in health if f["where"] == "body"]
    assert [f["step"] for f in far] == [1, 2, 3]
    assert all(f["host"] == "gpu" for f in far)
    assert all(k in far[-1] for k in ("act_mean", "act_zero", "grad_norm", "weight_norm",
                                      "update_ratio"))
    assert far[-1]["grad_norm"] > 0 and far[-1]["update_ratio"] > 0
    here = {f["where"] for f in health if "host" not in f}
    assert here == {"encoder", "head"}  # hooked here; body measured over there only
    t.close()


def test_driven_in_stages_only_when_something_is_trained_where_it_runs(worker):
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 8).named("encoder") >> Lin(8, 6).named("far").at("gpu")
                       >> Lin(6, 1, relu=False).named("head"))
    broker = Broker.embedded({"gpu": worker})
    g.freeze("encoder")  # nothing could reach it back through a slice nobody trains
    plain = Trainer(g, objective=mse, broker=broker,
                    optimizer=torch.optim.SGD(parameters(g, without=["far", "encoder"]), lr=0.1))
    assert isinstance(plain._driver, InOnePiece)  # a slice elsewhere, trained by nobody: one plain step
    head = [p.detach().clone() for p in g.implementation("head").parameters()]
    for b in batches(3):
        plain.step(b)
    assert not torch.equal(head[0], g.implementation("head").lin.weight)
    cut = net("gpu")
    trained = Trainer(cut, objective=mse, broker=broker,
                      trains={"body": Split(torch.optim.SGD, lr=0.1)},
                      optimizer=torch.optim.SGD(parameters(cut, without=["body"]), lr=0.1))
    assert isinstance(trained._driver, StagedDriver)


def test_workers_is_the_pages_spelling_of_a_broker(worker):
    runs = []
    for how in ({"broker": Broker.embedded({"gpu": worker})}, {"workers": {"gpu": worker}}):
        cut = net("gpu")
        trains = {"body": Split(torch.optim.SGD, lr=0.1)}
        t = Trainer(cut, objective=mse, trains=trains, **how,
                    optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))
        runs.append([t.step(b) for b in batches(4)])
    assert runs[0] == runs[1]
    with pytest.raises(DeclarationError, match="both broker= and workers="):
        Trainer(net("gpu"), objective=mse, optimizer=torch.optim.SGD(parameters(net()), lr=0.1),
                broker=Broker.embedded({"gpu": worker}), workers={"gpu": worker})
    with pytest.raises(TypeError, match="workers= maps host names to Workers"):
        Trainer(net("gpu"), objective=mse, workers=[worker],
                optimizer=torch.optim.SGD(parameters(net()), lr=0.1))


def split_trainer(worker):
    cut = net("gpu")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return Trainer(cut, objective=mse, trains=trains, workers={"gpu": worker},
                   optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))


def same(a, b):
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def test_load_mirrors_export_through_the_worker_and_training_continues_bit_for_bit(worker):
    t = split_trainer(worker)
    data = batches(10)
    for b in data[:5]:
        t.step(b)
    taken = t.export()
    first = [t.step(b) for b in data[5:]]
    assert not same(t.export(), taken)
    t.load(taken)
    assert same(t.export(), taken)  # the body's weights went back to the worker's trainer
    assert [t.step(b) for b in data[5:]] == first


@pytest.mark.parametrize("spoil, says", [
    ("body", r"'body', 'lin.weight'.*\(3, 8\).*on host 'gpu'.*nothing was loaded"),
    ("head", r"'head', 'lin.weight'.*\(3, 6\)"),
])
def test_a_load_refused_on_either_side_changes_nothing_on_both(worker, spoil, says):
    t = split_trainer(worker)
    t.step(batches(1)[0])
    before = t.export()
    wrong = {n: {k: v + 1 for k, v in w.items()} for n, w in before.items()}
    wrong[spoil]["lin.weight"] = torch.zeros(3, wrong[spoil]["lin.weight"].shape[1])
    with pytest.raises(DeclarationError, match=says):
        t.load(wrong)
    assert same(t.export(), before)


# -- errors name the user's ids, never the ids the driver makes beside a trained node ----
def said_once(error, phrase):
    """The whole traceback of ``error`` as printed (causes, the worker's included), with
    ``phrase`` said in it exactly once and no made id anywhere."""
    printed = "".join(traceback.format_exception(error))
    assert "\x1f" not in printed and "\\x1f" not in printed, printed
    assert printed.count(phrase) == 1, printed
    return printed


@pytest.mark.parametrize("where", ["here", "on a worker"])
def test_a_trained_node_that_raises_is_named_by_its_own_id(capfd, where):
    torch.manual_seed(0)
    body = Broken(8, 6).named("body")
    g = Graph.somatize(Lin(8, 8).named("encoder") >> (body if where == "here" else body.at("gpu"))
                       >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    # a worker of its own, started while its log is captured
    with (Worker.generic(mode="network", send=["splitnets"]) if where != "here"
          else contextlib.nullcontext()) as worker:
        t = Trainer(g, objective=mse, trains=trains, workers={"gpu": worker} if worker else None,
                    optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
        with pytest.raises(NodeError) as caught:
            t.step(batches(1)[0])
    error = caught.value
    assert (error.node, error.kind) == ("body", "RuntimeError")
    assert error.host == (None if where == "here" else "gpu")
    said_once(error, "node 'body' (Broken) raised RuntimeError: broken on purpose")
    logged = capfd.readouterr().err  # the worker's own log names it so too
    assert "\x1f" not in logged and "\\x1f" not in logged
    if where == "on a worker":
        assert "slice ['body'] failed" in logged


def test_the_layers_of_a_node_trained_on_a_worker_are_recorded_as_in_one_piece(worker):
    """The graph fact lists what each node holds, the one on the worker included (its
    object here has the same modules): what ``architecture`` says of the net in one piece."""
    seen = []
    cut = net("gpu")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    split = Trainer(cut, objective=mse, trains=trains, watching=seen.append,
                    optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1),
                    broker=Broker.embedded({"gpu": worker}))
    split.step(batches(1)[0])
    split.close()
    said = [f for f in seen if f["fact"] == "graph"][0]["inside"]
    assert said == {node: [[path, what] for path, what in parts]
                    for node, parts in architecture(net()).items()}
    assert [what["cls"] for _, what in said["body"]] == ["Linear"]


def test_a_forged_narrowed_type_is_refused_naming_the_node_it_was_handed_to(worker):
    torch.manual_seed(0)
    g = Graph.somatize(Forges(8, 8).named("encoder") >> Lin(8, 6).named("body").at("gpu")
                       >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, trains=trains, workers={"gpu": worker},
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    with pytest.raises(NodeError, match="not a floating torch dtype") as caught:
        t.step(batches(1)[0])
    assert (caught.value.node, caught.value.host, caught.value.kind) == ("body", "gpu", "TypeError")
    said_once(caught.value, "node 'body' (Enters) raised TypeError")


def test_a_node_on_a_worker_left_out_of_trains_is_told_to_get_a_trainer_there(worker):
    """Its parameters in the optimizer here get no gradient, since its backward runs on
    the worker: the message names the node and its host, and says how to train it."""
    g = net("w")
    trainer = Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                      broker=Broker.embedded({"w": worker}))
    with pytest.raises(NoGradient) as refused:
        trainer.fit(batches(2))
    said = str(refused.value)
    assert "'body' runs on 'w'" in said and "trains={'body': Split(" in said
    assert "parameters(g, without=trains)" in said and "does not reach the loss" not in said


def test_export_after_the_workers_with_block_is_state_lost_not_a_port_to_start():
    """The worker's `with` block ended: its trainer's weights are gone, and the message
    says so and when to ask, rather than how to start a worker at its old port."""
    g = net("w")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    with Worker.generic(mode="network", send=["splitnets"]) as worker:
        trainer = Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
        trainer.fit(batches(2))
    with pytest.raises(StateLost) as lost:
        trainer.export()
    said = str(lost.value)
    assert "host 'w'" in said and "closed" in said and "inside the `with` block" in said
    assert "listening" not in said and "python -m somatize.worker" not in said
