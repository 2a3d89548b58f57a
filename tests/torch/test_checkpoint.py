"""Checkpoints (somatize.torch._checkpoint): a run killed mid-way and taken up in a fresh
process (onto a fresh worker) ends bit for bit where the run never interrupted, and never
checkpointed, ends; refusals change nothing."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from resumable import trained
from resumenets import Lin, Noise
from trainnets import Body, Head, batches, graph

from somatize import Broker, CorruptObject, DeclarationError, Graph, StoreError, Worker
from somatize._codec import dumps, loads
from somatize.store import DirectoryBackend, Store
from somatize.torch import Split, Trainer, parameters
from somatize.torch._checkpoint import learning_state, restore_learning

HERE = Path(__file__).parent


def _script(*args):
    """The run, started in a fresh process (finish it with ``.communicate()``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    return subprocess.Popen([sys.executable, str(HERE / "resumable.py"), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ended(proc):
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("mode", ["local", "split"])
def test_a_run_killed_at_step_25_resumes_bit_for_bit(tmp_path, mode):
    killed = _script(tmp_path / "run", tmp_path / "never.pt", mode, "--kill-at", 25)
    # meanwhile the run as the user means it: never interrupted, and never checkpointed
    trained(tmp_path / "whole", tmp_path / "whole.pt", mode, keeping=False)
    code, err = _ended(killed)
    assert code == -9, err  # SIGKILL: nothing was tidied up
    assert not (tmp_path / "never.pt").exists()
    again = _script(tmp_path / "run", tmp_path / "again.pt", mode, "--resume")
    code, err = _ended(again)
    assert code == 0, err
    ref, got = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "again.pt")
    assert got["resumed_at"] == 20  # the last checkpoint before the kill
    assert got["losses"] == ref["losses"][20:]  # steps 21..40, each the same loss
    assert ref["weights"].keys() == got["weights"].keys() == {"encoder", "body", "head"}
    for node, kept in ref["weights"].items():
        for key, value in kept.items():
            assert torch.equal(value, got["weights"][node][key]), (node, key)


def adam_trainer(seed=0, lr=1e-2, **options):
    g, body, head = graph(seed=seed)
    return Trainer(g, objective=F.mse_loss,
                   optimizer=torch.optim.Adam(parameters(g), lr=lr), **options), g


def everything(t):
    """What a refusal must leave as it was: weights, the optimizer's state, the steps."""
    state = t._optimizer.state_dict()["state"]
    return (t.export(), {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                             for n, v in s.items()} for k, s in state.items()}, t._steps)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_in_process_goes_on_as_the_run_that_was_kept(tmp_path):
    store, data = Store(tmp_path), batches(8)
    t, g = adam_trainer(every=3)
    for b in data[:4]:
        t.step(b)
    digest = t.checkpoint(store, "ck")  # inside a group: one step of three taken
    assert store.resolve("ck").digest == digest and store.resolve("ck").meta["steps"] == 4
    then = [t.step(b) for b in data[4:]]
    u, h = adam_trainer(seed=5, every=3)  # other weights, to be overwritten
    assert u.resume(store, "ck") == 4
    assert [u.step(b) for b in data[4:]] == then
    assert same(u.export(), t.export())


def test_fit_after_resume_skips_what_was_taken_even_across_epochs(tmp_path):
    store, data = Store(tmp_path), batches(4)
    t, _ = adam_trainer()
    whole = t.fit(data, epochs=3)
    u, _ = adam_trainer()
    u.fit(data, epochs=2, checkpoint=(store, "ck"))  # 8 steps, kept at the end
    v, _ = adam_trainer()
    assert v.resume(store, "ck") == 8
    rest = v.fit(data, epochs=3)
    assert rest.history == whole.history[8:]
    assert same(v.export(), t.export())
    w, _ = adam_trainer()
    w.resume(store, "ck")
    assert w.fit(data, epochs=2).history == []  # every step taken already: none, no update
    assert w._steps == 8 and same(w.export(), u.export())


def test_a_checkpoint_of_another_graph_is_refused_and_changes_nothing(tmp_path):
    store = Store(tmp_path)
    t, _ = adam_trainer()
    t.fit(batches(3))
    t.checkpoint(store, "ck")
    torch.manual_seed(0)
    other = Graph.somatize(Body().named("body") >> Head().named("top"))
    u = Trainer(other, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(other)))
    u.fit(batches(2))
    before = everything(u)
    with pytest.raises(DeclarationError, match=r"another set of nodes.*'head'.*'top'"):
        u.resume(store, "ck")
    assert same(everything(u), before)

    class Wider(Body):
        pass

    torch.manual_seed(0)
    recast = Graph.somatize(Wider().named("body") >> Head().named("head"))
    v = Trainer(recast, objective=F.mse_loss, optimizer=torch.optim.Adam(parameters(recast)))
    with pytest.raises(DeclarationError, match="node 'body' was a Body and is a .*Wider here"):
        v.resume(store, "ck")


def test_a_checkpoint_of_another_optimizer_layout_is_refused_and_changes_nothing(tmp_path):
    store = Store(tmp_path)
    t, g = adam_trainer()
    t.fit(batches(3))
    t.checkpoint(store, "ck")
    g2, body, head = graph(seed=0)
    sgd = Trainer(g2, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g2), lr=0.1))
    with pytest.raises(DeclarationError, match="as a Adam, and this run's is a SGD"):
        sgd.resume(store, "ck")
    g3, body, head = graph(seed=0)
    groups = torch.optim.Adam([{"params": body.parameters()}, {"params": head.parameters()}])
    split = Trainer(g3, objective=F.mse_loss, optimizer=groups)
    split.fit(batches(2))
    before = everything(split)
    with pytest.raises(DeclarationError, match="had 1 parameter group.*has 2 now"):
        split.resume(store, "ck")
    assert same(everything(split), before)
    g4, body, head = graph(seed=0)
    fewer = Trainer(g4, objective=F.mse_loss, optimizer=torch.optim.Adam(head.parameters()))
    with pytest.warns(UserWarning):  # the body is trained by nobody: said, not refused
        fewer.fit(batches(2))
    before = everything(fewer)
    with pytest.raises(DeclarationError, match=r"group 0 holds body/net.0.weight.*no more"):
        fewer.resume(store, "ck")
    assert same(everything(fewer), before)


def test_another_set_of_trained_nodes_is_refused_naming_it(tmp_path):
    store = Store(tmp_path)
    g, body, head = graph(seed=0)
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(g, objective=F.mse_loss, trains=trains,
                optimizer=torch.optim.Adam(parameters(g, without=trains)))
    t.fit(batches(3))
    t.checkpoint(store, "ck")
    u, _ = adam_trainer()
    with pytest.raises(DeclarationError, match=r"another set of trained nodes.*'body'"):
        u.resume(store, "ck")


def test_a_learning_keeps_and_restores_its_own_state(tmp_path):
    g, body, head = graph(seed=0)
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(g, objective=F.mse_loss, trains=trains,
                optimizer=torch.optim.Adam(parameters(g, without=trains)))
    t.fit(batches(3))
    state = learning_state(trains["body"])
    assert state["type"] == "Split" and state["taken"] == 0
    assert state["optimizer"]["type"] == "Adam" and len(state["optimizer"]["state"]) == 4
    kept = {k: v["exp_avg"].clone() for k, v in state["optimizer"]["state"].items()}
    t.fit(batches(2, seed=3))  # moves on; restoring brings the moments back
    restore_learning(trains["body"], state)
    now = learning_state(trains["body"])["optimizer"]["state"]
    assert all(torch.equal(now[k]["exp_avg"], kept[k]) for k in kept)
    sgd = Split(torch.optim.SGD, lr=0.1).of(body)
    with pytest.raises(DeclarationError, match="as a Adam.*is a SGD"):
        restore_learning(sgd, state)
    assert sgd.seat.built is None and sgd.seat.standing == (0, 0)  # refused: nothing taken, nothing built


class Failing(DirectoryBackend):
    """A directory whose disk fills up after ``left`` more objects."""

    left = 10**9

    def write_object(self, hexdigest, data):
        if self.left <= 0:
            raise OSError(28, "No space left on device")
        self.left -= 1
        super().write_object(hexdigest, data)


def test_a_checkpoint_is_whole_or_absent(tmp_path):
    backend = Failing(tmp_path, False)
    store = Store.over(backend)
    t, _ = adam_trainer()
    t.fit(batches(3))
    first = t.checkpoint(store, "ck")
    t.fit(batches(2, seed=4))
    backend.left = 1  # the disk fills in the middle of the next one: its manifest is lost
    with pytest.raises(StoreError, match="No space left"):
        t.checkpoint(store, "ck")
    assert store.resolve("ck").digest == first  # still the whole one before
    u, _ = adam_trainer()
    assert u.resume(store, "ck") == 3


def test_a_corrupt_part_is_refused_on_resume_and_changes_nothing(tmp_path):
    store = Store(tmp_path)
    t, g = adam_trainer()
    t.fit(batches(3))
    t.checkpoint(store, "ck")
    manifest = store.get(store.resolve("ck").digest)
    part = loads(manifest)["here"]
    path = Path(store.backend.object_at(part[7:]))
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    u, g2 = adam_trainer(seed=3)
    u.fit(batches(1))
    before = everything(u)
    with pytest.raises(CorruptObject):
        u.resume(store, "ck")
    assert same(everything(u), before)


@pytest.mark.parametrize("spoil, says", [
    (lambda m: m.pop("counters"), "'counters' is missing from the checkpoint 'ck'"),
    (lambda m: m["counters"].pop("taken"), "'taken' is missing from .* counters"),
    (lambda m: m["identity"].update(edges=3), "identity holds 'edges' as int"),
    (lambda m: m["random"].clear(), "lack this process's"),
])
def test_a_hand_edited_manifest_is_refused_naming_what_it_lacks(tmp_path, spoil, says):
    store = Store(tmp_path)
    t, _ = adam_trainer()
    t.fit(batches(3))
    t.checkpoint(store, "ck")
    manifest = loads(store.get(store.resolve("ck").digest))
    spoil(manifest)
    store.bind("ck", store.put(dumps(manifest)), {"checkpoint": manifest["format"], "steps": 3})
    u, _ = adam_trainer(seed=3)
    u.fit(batches(1))
    before = everything(u)
    with pytest.raises(StoreError, match=says):
        u.resume(store, "ck")
    assert same(everything(u), before)


def test_what_fit_is_told_about_checkpoints_is_checked_first(tmp_path):
    t, _ = adam_trainer()
    with pytest.raises(DeclarationError, match="checkpoint_every"):
        t.fit(batches(2), checkpoint_every=10)
    with pytest.raises(TypeError, match=r"\(store, name\)"):
        t.fit(batches(2), checkpoint=Store(tmp_path))
    with pytest.raises(StoreError, match="no checkpoint is kept under 'nope'"):
        t.resume(Store(tmp_path), "nope")
    assert t._steps == 0


# -- the example: a federated run taken up again, and what submitit requeues

ROOT = HERE.parent.parent


def example(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    return subprocess.run([sys.executable, str(ROOT / "examples" / "federated.py"), *args,
                           "--clients", "1", "--steps", "3", "--asking", "0.05"],
                          env=env, capture_output=True, text=True, timeout=240)


def federated_example():
    spec = importlib.util.spec_from_file_location("federated_example",
                                                  ROOT / "examples" / "federated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_federated_example_goes_on_with_resume(tmp_path, capsys):
    store = tmp_path / "s"
    module = federated_example()
    first = module.client(Store(store), 0, 1, 1, 3, "demo", 0, 0.05)  # round 0, here
    again = example("--rounds", "2", "--store", str(store), "--run", "demo", "--resume")
    assert again.returncode == 0, again.stderr
    assert "client 0 resumed after round 0" in again.stdout
    assert "every client ends with the same weights: yes" in again.stdout
    rounds = [line.split() for line in again.stdout.splitlines() if line.startswith("    ")]
    assert len(rounds) == 2 and float(rounds[0][1]) == pytest.approx(first["losses"][0], abs=1e-4)
    with pytest.raises(SystemExit):
        module.main(["--store", str(store), "--resume"])
    assert "--resume goes on with a run already started" in capsys.readouterr().err


def test_a_preempted_client_is_requeued_by_submitit_as_resuming():
    submitit = pytest.importorskip("submitit")
    module = federated_example()
    job = ("store", 0, 2, 3, 4, "demo", 0, 0.1, False)
    requeued = module.Requeued().checkpoint(*job)
    assert isinstance(requeued, submitit.helpers.DelayedSubmission)
    assert isinstance(requeued.function, module.Requeued)
    assert requeued.args == job[:-1] + (True,)  # the same client, now resuming


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["resumenets"]) as w:
        yield w


def test_a_checkpoint_a_worker_refuses_changes_nothing_here_or_there(tmp_path, worker):
    def split(technique):
        torch.manual_seed(0)
        g = Graph.somatize(Lin(4, 8).named("encoder") >> Lin(8, 8).named("body").at("gpu")
                           >> Lin(8, 1, relu=False).named("head"))
        trains = {"body": Split(technique, lr=1e-2)}
        return Trainer(g, objective=F.mse_loss, trains=trains,
                       broker=Broker.embedded({"gpu": worker}),
                       optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2))

    data = [(torch.randn(5, 4), torch.randn(5, 1)) for _ in range(3)]
    adam = split(torch.optim.Adam)
    adam.fit(data)
    adam.checkpoint(tmp_path, "ck")
    sgd = split(torch.optim.SGD)
    sgd.fit(data[:2])
    before = everything(sgd)  # the body's weights asked of the worker, too
    with pytest.raises(DeclarationError, match=r"as a Adam.*SGD.*trainer of 'body' on host "
                                               r"'gpu'.*nothing was resumed"):
        sgd.resume(tmp_path, "ck")
    assert same(everything(sgd), before)
    assert sgd.fit(data).history  # and it trains on, as it was


def test_the_random_state_of_a_worker_nobody_trains_on_is_kept_too(tmp_path, worker):
    torch.manual_seed(0)
    g = Graph.somatize(Noise().named("noise").at("gpu") >> Lin(4, 1).named("head"))
    t = Trainer(g, objective=F.mse_loss, broker=Broker.embedded({"gpu": worker}),
                optimizer=torch.optim.Adam(parameters(g), lr=1e-2))
    data = [(torch.randn(5, 4), torch.randn(5, 1)) for _ in range(3)]
    t.seed(3)
    t.fit(data)
    t.checkpoint(tmp_path, "ck")
    then = [t.step(b) for b in data]
    assert t.resume(tmp_path, "ck") == 3
    assert [t.step(b) for b in data] == then  # the worker's noise drawn again, the same
    t.resume(tmp_path, "ck")
    torch.manual_seed(123)  # nothing here draws: the same again...
    assert [t.step(b) for b in data] == then
    t.resume(tmp_path, "ck")
    t.seed(4)  # ...while the worker's draw changes it, so it was the worker's kept
    assert [t.step(b) for b in data] != then


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the job's process in /proc")
def test_a_client_preempted_under_submitit_is_requeued_and_goes_on(tmp_path):
    submitit = pytest.importorskip("submitit")
    cloudpickle = pytest.importorskip("cloudpickle")
    module = federated_example()
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)  # the job's process cannot import it
    store = Store(tmp_path / "s")
    job = (store, 0, 1, 10, 40, "demo", 0, 0.05, False)  # one client, 10 rounds of 40 steps
    runs = submitit.LocalExecutor(folder=tmp_path / "logs")
    runs.update_parameters(timeout_min=5)
    running = runs.submit(module.Requeued(), *job)
    for _ in range(3000):  # preempted once its first round is kept
        if store.resolve("fed/demo/checkpoint/0") is not None:
            break
        time.sleep(0.01)
    # What Slurm does before it preempts: submitit's signal, to the job's own process
    # (submitit's local controller, the process it knows, does not pass it on).
    controller = running._process.pid
    task = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    os.kill(int(task[0]), submitit.JobEnvironment._usr_sig())
    try:
        said = running.result()
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]
    assert "client 0 resumed after round" in running.stdout(), running.stdout() + running.stderr()
    whole = module.client(Store(tmp_path / "t"), *job[1:])  # never interrupted, here
    assert said["losses"] == whole["losses"]
    ended = store.recall("fed/demo/final/0")
    again = Store(tmp_path / "t").recall("fed/demo/final/0")
    assert all(torch.equal(ended[n][k], again[n][k]) for n in ended for k in ended[n])


class Crash(Exception):
    pass


def test_a_shuffling_dataloader_with_its_own_generator_resumes_mid_epoch(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    rows = batches(1, rows=24)[0]
    loader = lambda: DataLoader(TensorDataset(*rows), batch_size=6, shuffle=True,  # noqa: E731
                                generator=torch.Generator().manual_seed(5))
    t, _ = adam_trainer()
    whole = t.fit(loader(), epochs=3).history  # 4 batches an epoch, 12 steps

    def crash(fact):
        if fact["fact"] == "loss" and crash.seen == 6:
            raise Crash("the machine went away")
        crash.seen += fact["fact"] == "loss"
    crash.seen = 0
    u, _ = adam_trainer(watching=crash)
    with pytest.raises(Crash):
        u.fit(loader(), epochs=3, checkpoint=(tmp_path, "ck"), checkpoint_every=5)
    v, _ = adam_trainer()
    assert v.resume(tmp_path, "ck") == 5  # in the second epoch, its first batch taken
    assert v.fit(loader(), epochs=3).history == whole[5:]  # the order drawn as it was
    assert same(v.export(), t.export())
