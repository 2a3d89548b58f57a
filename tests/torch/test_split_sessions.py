"""What a Trainer trains on a worker is its own (somatize.wire's sessions, seen from
somatize.torch): a checkpoint changes nothing that follows, two Trainers on one worker
each train as if alone, and a worker that restarted is said, never made good from the
client's first copy. Every run is compared with the run the user means: one that never
checkpointed, one trained alone, one never interrupted."""

import os
import subprocess
import sys

import pytest
import torch
from splitnets import Lin

from somatize import Broker, DeclarationError, Graph, Opaque, StateLost, Worker
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss
TOKEN = "split-sessions-" + "7" * 20
RATES = {torch.optim.SGD: 0.1, torch.optim.Adam: 1e-2}


def net(host="gpu", seed=0, width=6):
    torch.manual_seed(seed)
    return Graph.somatize(Lin(8, 8).named("encoder") >> Lin(8, width).named("body").at(host)
                          >> Lin(width, 1, relu=False).named("head"))


def trainer(worker, optimizer=torch.optim.SGD, seed=0, width=6):
    g = net(seed=seed, width=width)
    lr = RATES[optimizer]
    trains = {"body": Split(optimizer, lr=lr)}
    return Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"gpu": worker}),
                   optimizer=optimizer(parameters(g, without=trains), lr=lr))


def batches(n, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
            for _ in range(n)]


def equal(a, b):
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["splitnets"]) as w:
        yield w


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_a_checkpointed_fit_is_the_fit_never_checkpointed(worker, tmp_path, optimizer):
    data = batches(10)
    never = trainer(worker, optimizer)
    kept = trainer(worker, optimizer)
    plain = never.fit(data, epochs=4)  # 40 steps
    checked = kept.fit(data, epochs=4, checkpoint=(tmp_path, "run/ckpt"), checkpoint_every=5)
    assert checked.history == plain.history and len(plain.history) == 40
    assert equal(kept.export(), never.export())
    # and what was trained over there moved: the body is not at its first weights
    first = {k: v for k, v in zip(("lin.weight", "lin.bias"), net().implementation("body").parameters())}
    assert not torch.equal(kept.export()["body"]["lin.weight"], first["lin.weight"])


@pytest.mark.parametrize("width", [6, 5], ids=["alike", "different"])
def test_two_trainers_on_one_worker_each_train_as_if_alone(worker, width):
    data = batches(6)
    alone_a, alone_b = trainer(worker, torch.optim.Adam), trainer(worker, torch.optim.Adam,
                                                                   seed=0, width=width)
    lone_a = [alone_a.step(b) for b in data]
    lone_b = [alone_b.step(b) for b in reversed(data)]
    a, b = trainer(worker, torch.optim.Adam), trainer(worker, torch.optim.Adam, width=width)
    both_a, both_b = [], []
    for x, y in zip(data, reversed(data)):  # interleaved, step by step
        both_a.append(a.step(x))
        both_b.append(b.step(y))
    assert both_a == lone_a and both_b == lone_b
    assert equal(a.export(), alone_a.export()) and equal(b.export(), alone_b.export())


def _standing(port=0):
    """A worker started from the command line, as on another machine."""
    env = dict(os.environ, SOMATIZE_TOKEN=TOKEN, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen",
                             f"127.0.0.1:{port}", "--quiet"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    return proc, line.split()[-1]


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_a_restarted_worker_is_said_and_a_resume_goes_on_as_if_never_interrupted(
        worker, tmp_path, optimizer):
    data = batches(8)
    never = trainer(worker, optimizer)
    uninterrupted = [never.step(b) for b in data]
    proc, addr = _standing()
    try:
        with Worker.at(addr, mode="network", send=["splitnets"], token=TOKEN) as gpu:
            t = trainer(gpu, optimizer)
            assert [t.step(b) for b in data[:3]] == uninterrupted[:3]
            t.checkpoint(tmp_path, "ck")
            assert [t.step(b) for b in data[3:5]] == uninterrupted[3:5]
            proc.kill()
            proc.wait(5)
            proc, _ = _standing(int(addr.rsplit(":", 1)[1]))  # the same address, a new process
            with pytest.raises(StateLost, match="restarted") as caught:
                t.step(data[5])
            assert caught.value.host == "gpu" and caught.value.nodes == ["body"]
            assert "'body'" in str(caught.value) and "resume" in str(caught.value)
            with pytest.raises(StateLost):  # said again, never trained on from the first copy
                t.step(data[5])
            assert t.resume(tmp_path, "ck") == 3
            assert [t.step(b) for b in data[3:]] == uninterrupted[3:]
            assert equal(t.export(), never.export())
    finally:
        proc.kill()
        proc.wait(5)


def test_a_worker_restarted_mid_step_is_said_at_the_backward(tmp_path):
    proc, addr = _standing()
    try:
        with Worker.at(addr, mode="network", send=["splitnets"], token=TOKEN) as gpu:
            t = trainer(gpu)
            t.step(batches(1)[0])
            x, y = batches(1, seed=5)[0]
            loss = t._loss(t._forward(x), y)  # the forward half of a step...
            proc.kill()
            proc.wait(5)
            proc, _ = _standing(int(addr.rsplit(":", 1)[1]))  # ...a restart...
            with pytest.raises(StateLost, match="'body'"):
                t._backward(loss, 1.0)  # ...and the backward half is told, naming the node
    finally:
        proc.kill()
        proc.wait(5)


def test_a_closed_trainer_lets_go_of_its_session_there(worker):
    t = trainer(worker)
    t.step(batches(1)[0])
    kept = t.export()
    t.close()
    with pytest.raises(StateLost, match="its owner closed it"):
        t.step(batches(1)[0])
    other = trainer(worker)  # the worker serves on, for everybody else
    assert other.step(batches(1)[0]) > 0
    assert kept["body"].keys() == {"lin.weight", "lin.bias"}


def test_a_trainer_closed_after_its_connection_dropped_still_ends_its_session(tmp_path):
    log = tmp_path / "worker.log"
    with Worker.generic(mode="network", send=["splitnets"], log=log) as w:
        t = trainer(w)
        t.step(batches(1)[0])
        w.link.close()  # the connection is gone; the session outlives it
        t.close()
        said = log.read_text()
        assert "closed by its owner" in said, said[-2000:]
        with pytest.raises(StateLost, match="its owner closed it"):
            t.step(batches(1)[0])


def test_a_trainer_closed_where_its_worker_is_gone_warns_and_trains_no_more():
    w = Worker.generic(mode="network", send=["splitnets"])
    t = trainer(w)
    t.step(batches(1)[0])
    w.close()  # the worker process ends with it
    with pytest.warns(RuntimeWarning, match="could not be told to end session"):
        t.close()
    with pytest.raises(StateLost, match="its owner closed it"):  # said here, nothing dialled
        t.step(batches(1)[0])


def test_a_scripts_class_is_named_by_the_users_id_not_a_made_one():
    class Body(Lin):
        pass

    Body.__module__ = "__main__"  # as a class defined in the script that is run
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 8).named("encoder") >> Body(8, 6).named("body").at("gpu")
                       >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, trains=trains, workers={"gpu": Worker.at("127.0.0.1:9")},
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    with pytest.raises(DeclarationError, match="node 'body' is a .*Body defined in __main__") as caught:
        t.step(batches(1)[0])  # refused while packing: nothing is dialled
    assert "\x1f" not in str(caught.value) and "mode='network'" in str(caught.value)


def test_a_flood_of_sessions_that_keep_nothing_never_evicts_a_trainer(worker):
    data = batches(3)
    alone = trainer(worker)
    lone = [alone.step(b) for b in data]
    argv = [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", "--quiet",
            "--max-sessions", "2"]
    with Worker.spawn(argv, mode="network", send=["splitnets"]) as small:
        t = trainer(small)
        losses = [t.step(data[0])]
        for seed in range(6):  # plain graphs on the full worker, each a session of its own
            net(seed=seed).forward(Opaque(data[0][0]), broker={"gpu": small})
        losses += [t.step(b) for b in data[1:]]
    assert losses == lone


# -- a session's verbs: what its owner asks besides a step ------------------------------
def dropping(worker, seed=0):
    from splitnets import Drops

    torch.manual_seed(seed)
    g = Graph.somatize(Lin(8, 8).named("encoder") >> Drops(8, 6).named("body").at("gpu")
                       >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"gpu": worker}),
                   optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))


def spawned(most):
    argv = [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", "--quiet",
            "--max-sessions", str(most)]
    return Worker.spawn(argv, mode="network", send=["splitnets"])


def test_a_checkpoint_on_a_full_worker_keeps_its_trainer(tmp_path):
    """--max-sessions 1: the trainer's session is the only one the worker may hold, and
    a checkpoint's verbs (the trainer's state, the session's random state) open none."""
    data = batches(4)
    with spawned(1) as full:
        never = dropping(full)
        never.seed(7)
        plain = never.fit(data, epochs=2).history
        trained = never.export()
        never.close()
        kept = dropping(full)
        kept.seed(7)
        checked = kept.fit(data, epochs=2, checkpoint=(tmp_path, "ck"), checkpoint_every=3)
        assert checked.history == plain and len(plain) == 8
        assert equal(kept.export(), trained)
        assert kept.resume(tmp_path, "ck") == 8  # the resume's verbs open none either
        kept.close()


def test_another_clients_seed_and_resume_leave_my_dropout_as_it_was_alone(tmp_path):
    """A worker's random state is each session's own: the run with dropout there is
    the run alone, step for step, while another client seeds, resumes and trains on
    the same worker between my steps (a real worker process)."""
    data = batches(6)
    with spawned(8) as shared:
        alone = dropping(shared)
        alone.seed(3)
        lone = [alone.step(b) for b in data]
        alone.close()
    with spawned(8) as shared:
        mine, theirs = dropping(shared), dropping(shared, seed=1)
        mine.seed(3)
        theirs.seed(11)
        theirs.step(data[0])
        theirs.checkpoint(tmp_path, "theirs")
        mixed = []
        for k, b in enumerate(data):
            mixed.append(mine.step(b))
            theirs.seed(100 + k)  # each of these moves the other's generators, and never mine
            theirs.step(b)
            theirs.resume(tmp_path, "theirs")
            theirs.step(b)
    assert mixed == lone


def test_a_session_before_its_first_step_is_seeded_where_its_step_will_run(tmp_path):
    """seed() before any step provisions the trainer's own session, which its steps
    then run in: the same losses as seeding after a first step would not give."""
    data = batches(3)
    with spawned(1) as full:
        a = dropping(full)
        a.seed(5)
        first = [a.step(b) for b in data]
        a.close()
        b = dropping(full)
        b.seed(5)
        assert [b.step(x) for x in data] == first
        b.close()
