"""What was trained, used (somatize.torch._predicting, through Trainer.predict, evaluate
and fit(validate=...)): against the same model trained in one piece and run as PyTorch
users run it, model.eval() and torch.no_grad(), with the trained body on a real worker
process, a batch norm's running statistics and a dropout's random state included."""

import copy

import pytest
import torch
from splitnets import Drops, Lin, Norms
from structnets import Encoder, Masked, MaskedHead

from somatize import Broker, DeclarationError, Graph, NodeError, Opaque, Worker
from somatize.store import Store
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["splitnets", "structnets"]) as w:
        yield w


def net(body, host="gpu"):
    torch.manual_seed(0)
    return Graph.somatize(Lin(8, 8).named("encoder") >> body.named("body").at(host)
                          >> Lin(6, 1, relu=False).named("head"))


def split(worker, body=None, watching=None):
    g = net(body or Norms(8, 6))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return g, Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"gpu": worker}),
                      watching=watching,
                      optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))


class Whole(torch.nn.Module):
    """The same network as one PyTorch model, from the graph's first weights."""

    def __init__(self, g):
        super().__init__()
        self.encoder = copy.deepcopy(g.implementation("encoder").lin)
        body = g.implementation("body")
        self.lin = copy.deepcopy(body.lin)
        self.bn = copy.deepcopy(getattr(body, "bn", torch.nn.Identity()))
        self.head = copy.deepcopy(g.implementation("head").lin)

    def forward(self, x):
        return self.head(self.bn(self.lin(self.encoder(x).relu())).relu())


def batches(n, rows=16, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=generator), torch.randn(rows, 1, generator=generator))
            for _ in range(n)]


def whole_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = mse(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.item()


def test_predict_is_the_whole_model_under_eval_and_no_grad(worker):
    g, t = split(worker)
    model = Whole(g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    assert [t.step(b) for b in data[:3]] == [whole_step(model, optimizer, b) for b in data[:3]]
    x = data[3][0]
    before = t.export()
    predicted = t.predict(x)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    model.train()
    assert torch.equal(predicted, expected) and not predicted.requires_grad
    assert torch.equal(t.predict(x), predicted)  # twice: nothing moved in between
    after = t.export()  # the running statistics on the worker did not move
    assert all(torch.equal(before["body"][k], after["body"][k]) for k in before["body"])
    assert not torch.equal(after["body"]["bn.running_mean"], torch.zeros(6))  # they did train
    # train mode is back here and there: the next step uses the batch's statistics again
    assert g.implementation("encoder").lin.training
    assert t.step(data[3]) == whole_step(model, optimizer, data[3])


def test_evaluating_between_steps_changes_nothing_that_follows(worker):
    data, held_out = batches(6), batches(2, rows=16, seed=7) + batches(1, rows=5, seed=8)
    _, evaluated = split(worker, Drops(8, 6))
    _, never = split(worker, Drops(8, 6))
    evaluated.seed(3)
    never.seed(3)
    losses, said = [], []
    for batch in data:
        losses.append(evaluated.step(batch))
        said.append(evaluated.evaluate(held_out, {"mae": lambda o, y: (o - y).abs().mean()}))
    assert losses == [never.step(b) for b in data]
    ours, theirs = evaluated.export(), never.export()
    assert all(torch.equal(ours[n][k], theirs[n][k]) for n in ours for k in ours[n])
    # the last evaluation is the trained model's, in one piece, rows weighing each batch
    model = Whole(net(Drops(8, 6)))
    model.encoder.load_state_dict({k.removeprefix("lin."): v for k, v in ours["encoder"].items()})
    model.lin.load_state_dict({k.removeprefix("lin."): v for k, v in ours["body"].items()})
    model.head.load_state_dict({k.removeprefix("lin."): v for k, v in ours["head"].items()})
    model.eval()
    with torch.no_grad():
        loss = sum(mse(model(x), y).item() * len(y) for x, y in held_out) / 37
        mae = sum((model(x) - y).abs().mean().item() * len(y) for x, y in held_out) / 37
    assert said[-1] == {"loss": loss, "mae": mae}


def test_fit_validates_each_epoch_keeps_the_best_and_stops_without_patience(worker, tmp_path):
    data, held_out = batches(4), batches(2, seed=9)
    heard = []  # the facts a Recorder would hear
    _, t = split(worker, watching=heard.append)
    result = t.fit(data, epochs=30, validate=held_out, patience=2,
                   checkpoint=(tmp_path, "run/ckpt"))
    losses = [v["loss"] for v in result.validation]
    assert result.best_epoch == losses.index(min(losses))
    assert len(losses) == result.best_epoch + 3 < 30  # two epochs no better, then it stopped
    assert len(result.history) == 4 * len(losses)
    assert [f["loss"] for f in heard if f.get("fact") == "evaluated"] == losses
    _, again = split(worker)  # the best epoch, taken up on the worker again
    assert again.resume(tmp_path, "run/ckpt/best") == 4 * (result.best_epoch + 1)
    assert again.evaluate(held_out) == result.validation[result.best_epoch]


def test_the_best_epoch_outlives_a_resume(worker, tmp_path):
    data, held_out = batches(4), batches(2, seed=9)
    same = {"same": lambda out, y: 0.0}  # every epoch ties: only the first is the best
    _, t = split(worker)
    t.fit(data, epochs=2, validate=held_out, metrics=same, best="same",
          checkpoint=(tmp_path, "run/ckpt"))
    kept = Store(tmp_path).resolve("run/ckpt/best").digest
    _, again = split(worker)
    assert again.resume(tmp_path, "run/ckpt") == 8
    result = again.fit(data, epochs=4, validate=held_out, metrics=same, best="same",
                       checkpoint=(tmp_path, "run/ckpt"))
    assert len(result.validation) == 2 and result.best_epoch is None  # none beat the run's
    assert Store(tmp_path).resolve("run/ckpt/best").digest == kept


def test_the_graph_itself_refuses_once_its_body_learns_on_a_worker(worker):
    g, t = split(worker)
    x = batches(1)[0][0]
    t.step(batches(1)[0])
    with pytest.raises(DeclarationError, match=r"'body'.*'gpu'.*Trainer\.predict"):
        g.forward(x, broker=Broker.embedded({"gpu": worker}))


def test_predict_here_is_eval_and_no_grad_and_puts_train_mode_back():
    torch.manual_seed(0)
    g = Graph.somatize(Norms(8, 6).named("body") >> Lin(6, 1, relu=False).named("head"))
    t = Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    body, head = g.implementation("body"), g.implementation("head")
    data = batches(3)
    for batch in data:
        t.step(batch)
    body.lin.eval()  # kept in eval mode on purpose: put back as it was
    x = data[0][0]
    predicted = t.predict(x)
    with torch.no_grad():
        body.bn.eval()
        expected = head.lin(body.bn(body.lin(x)).relu())
        body.bn.train()
    assert torch.equal(predicted, expected)
    assert body.bn.training and not body.lin.training and head.lin.training
    with pytest.raises(NodeError, match="'body'"):
        t.predict("not a tensor")
    assert body.bn.training and head.lin.training  # after an error too


def test_an_evaluation_is_recorded_shown_and_exported(worker, tmp_path):
    import os
    import subprocess
    import sys

    from somatize.record import Recorder, export_tensorboard
    from somatize.store import Store

    store = Store(tmp_path / "store")
    recorder = Recorder(store, run="fit")
    _, t = split(worker, watching=recorder)
    result = t.fit(batches(3), epochs=2, validate=batches(2, seed=9),
                   metrics={"mae": lambda o, y: (o - y).abs().mean()})
    recorder.close()
    src = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["somatize"].__file__)))
    shown = subprocess.run([sys.executable, "-m", "somatize", "show", str(tmp_path / "store"),
                            "fit"], capture_output=True, text=True, timeout=120, check=True,
                           env={**os.environ, "PYTHONPATH": src}).stdout.splitlines()
    at = shown.index("evaluated:")
    assert shown[at + 1].split() == ["after", "step", "rows", "loss", "mae"]
    rows = [line.split() for line in shown[at + 3:]]
    assert [r[:2] for r in rows] == [["3", "32"], ["6", "32"]]
    assert [float(r[2]) for r in rows] == pytest.approx([v["loss"] for v in result.validation],
                                                        rel=1e-5)  # printed to 6 digits
    pytest.importorskip("tensorboard", reason="tensorboard is the trackers extra's")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    export_tensorboard(store, "fit", tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb" / "fit"), size_guidance={"scalars": 0})
    events.Reload()
    said = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"] if tag.startswith("validation/")}
    assert said == {"validation/loss": [(3, pytest.approx(result.validation[0]["loss"])),
                                        (6, pytest.approx(result.validation[1]["loss"]))],
                    "validation/mae": [(3, pytest.approx(result.validation[0]["mae"])),
                                       (6, pytest.approx(result.validation[1]["mae"]))]}


def test_fit_refuses_what_cannot_validate_before_the_first_step():
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 1, relu=False).named("head"))
    t = Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    data, before = batches(2), t.export()
    with pytest.raises(TypeError, match="validate=.*walked again"):
        t.fit(data, epochs=2, validate=iter(batches(1)))
    with pytest.raises(DeclarationError, match="best='accuracy'.*'mae'"):
        t.fit(data, validate=data, metrics={"mae": lambda o, y: (o - y).abs().mean()},
              best="accuracy")
    with pytest.raises(DeclarationError, match="no validate="):
        t.fit(data, patience=2)
    with pytest.raises(DeclarationError, match="'loss'"):
        t.evaluate(data, {"loss": mse})
    assert torch.equal(t.export()["head"]["lin.weight"], before["head"]["lin.weight"])  # no step


def test_a_body_nobody_trains_on_a_worker_is_evaluated_there_too(worker):
    """No trainer there: the graph's own session on the worker is put in eval mode. Its
    batch norm's statistics moved in the training forward, as in the model in one piece."""
    g = net(Norms(8, 6))
    t = Trainer(g, objective=mse, broker=Broker.embedded({"gpu": worker}),
                optimizer=torch.optim.SGD(parameters(g, without=["encoder", "body"]), lr=0.1))
    model = Whole(g)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    data = batches(3)
    assert [t.step(b) for b in data[:2]] == [whole_step(model, optimizer, b) for b in data[:2]]
    model.eval()
    with torch.no_grad():
        expected = model(data[2][0])
    model.train()
    assert torch.equal(t.predict(data[2][0]), expected)
    assert t.step(data[2]) == whole_step(model, optimizer, data[2])  # train mode is back there


@pytest.mark.parametrize("shape", ["tuple", "dict"])
def test_a_structure_out_of_a_worker_is_predicted_as_in_one_piece(worker, shape):
    """A body on a worker that hands on (activation, integer mask): predicted, it is
    the graph in one piece trained alike, run under torch.no_grad()."""
    def net(host):
        torch.manual_seed(0)
        body = Masked(8, 6, shape).named("body")
        return Graph.somatize(Encoder(8, 8).named("encoder") >> (body.at(host) if host else body)
                              >> MaskedHead(6, 1).named("head"))

    one, cut = net(None), net("gpu")
    whole = Trainer(one, objective=mse, optimizer=torch.optim.SGD(parameters(one), lr=0.1))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    split = Trainer(cut, objective=mse, trains=trains, workers={"gpu": worker},
                    optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))
    data = batches(3)
    assert [whole.step(b) for b in data] == [split.step(b) for b in data]
    x = data[0][0]
    with torch.no_grad():
        expected = one.forward(Opaque(x))
    assert torch.equal(split.predict(x), expected)
    assert split.step(data[1]) == whole.step(data[1])  # nothing it owed was disturbed
