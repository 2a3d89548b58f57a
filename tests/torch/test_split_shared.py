"""Many clients, one server half (``Split(..., shared=key)``, somatize.torch._shared),
against real worker processes: every run is compared with one process replaying, in
plain torch with one body, the order the worker says it took — losses ``==``, weights
``torch.equal`` — with clients taking turns (relay) and stepping at the same time."""

import copy
import os
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from splitnets import Lin, Meets

from somatize import Broker, DeclarationError, Graph, Worker
from somatize.torch import OutOfStep, Split, Trainer, parameters

mse = torch.nn.functional.mse_loss
RATES = {torch.optim.SGD: 0.1, torch.optim.Adam: 1e-2}
OPTIMIZERS = pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam],
                                     ids=["sgd", "adam"])


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["splitnets"]) as w:
        yield w


class Client:
    """One data holder: its encoder and head here, the shared body on the worker, its
    own connection to it, and copies of where it started, for the replay."""

    def __init__(self, worker, key, optimizer, seed, body_seed, width=6, relu=True, micro=1,
                 every=1, own=None, steps=5, objective=mse):
        torch.manual_seed(seed)
        encoder, head = Lin(8, 8), None
        torch.manual_seed(body_seed)
        body = Lin(8, width) if relu else Lin(8, width, relu=False)
        torch.manual_seed(seed + 100)
        head = Lin(width, 1, relu=False)
        self.start = {"encoder": copy.deepcopy(encoder.lin), "body": copy.deepcopy(body.lin),
                      "head": copy.deepcopy(head.lin)}
        g = Graph.somatize(encoder.named("encoder") >> body.named("body").at("gpu")
                           >> head.named("head"))
        lr = RATES[optimizer]
        trains = {"body": Split(optimizer, lr=lr, shared=key)}
        if own is None:  # a connection of its own, unless handed one to share
            own = Worker.at("%s:%d" % worker.address("gpu"), mode="network",
                            send=["splitnets"], token=worker.token)
        self.trainer = Trainer(g, objective=objective, trains=trains,
                               broker=Broker.embedded({"gpu": own}),
                               optimizer=optimizer(parameters(g, without=trains), lr=lr),
                               micro=micro, every=every)
        self.data = batches(steps, seed=seed)
        self.losses = []

    def step(self, k):
        self.losses.append(self.trainer.step(self.data[k % len(self.data)]))


def batches(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
            for _ in range(n)]


def replay(clients, said, optimizer, first):
    """The same training in one process, with one body (``first``'s start), in the order
    the worker said: what each client's losses and weights would be."""
    lr = RATES[optimizer]
    body = copy.deepcopy(clients[first].start["body"])
    body_opt = optimizer(body.parameters(), lr=lr)
    by_label = {c.label: c for c in clients}
    mine = {}
    for c in clients:
        encoder, head = copy.deepcopy(c.start["encoder"]), copy.deepcopy(c.start["head"])
        mine[c.label] = {"encoder": encoder, "head": head, "taken": 0, "losses": [],
                         "opt": optimizer(list(encoder.parameters()) + list(head.parameters()),
                                          lr=lr), "flight": [], "due": None}
    for label, event in said:
        me, c = mine[label], by_label[label]
        if event == "forward":
            x, y = c.data[me["taken"] % len(c.data)]
            me["taken"] += 1
            h = me["encoder"](x).relu()
            leaf = h.detach().requires_grad_()
            me["flight"].append((y, h, leaf, body(leaf).relu()))
        elif event == "gradient":
            y, h, leaf, out = me["flight"].pop(0)
            seam = out.detach().requires_grad_()
            loss = mse(me["head"](seam), y)
            me["opt"].zero_grad()
            loss.backward()
            for p in body.parameters():
                p.grad = None
            out.backward(seam.grad)
            me["due"] = [p.grad for p in body.parameters()]
            for p in body.parameters():
                p.grad = None
            h.backward(leaf.grad)
            me["opt"].step()
            me["losses"].append(loss.item())
        elif event == "update":
            for p, g in zip(body.parameters(), me["due"]):
                p.grad = g
            body_opt.step()
            for p in body.parameters():
                p.grad = None
        else:
            raise AssertionError(f"an event the replay does not know: {event}")
    return body, mine


def checked_against_replay(clients, optimizer, first):
    said = clients[0].trainer.shared_order("body")
    for c in clients:
        c.label = c.trainer.shared_order("body")["you"]
    events = [tuple(e) for e in said["order"]]
    assert said["logged"] == len(events) and "dropped" not in {e for _, e in events}
    body, mine = replay(clients, events, optimizer, first)
    for c in clients:
        assert c.losses == mine[c.label]["losses"]
        weights = c.trainer.export()
        for name, module in (("encoder", mine[c.label]["encoder"]),
                             ("head", mine[c.label]["head"]), ("body", body)):
            for key, value in module.state_dict().items():
                assert torch.equal(weights[name]["lin." + key], value), (c.label, name, key)
    return events


@OPTIMIZERS
def test_a_relay_of_three_clients_is_one_body_trained_in_turn(worker, optimizer):
    key = uuid.uuid4().hex
    # each brings a body of its own; the first to arrive provides the shared one
    clients = [Client(worker, key, optimizer, seed=s, body_seed=10 + s) for s in range(3)]
    for _ in range(2):  # twice round, five steps each
        for c in clients:
            for k in range(5):
                c.step(k)
    events = checked_against_replay(clients, optimizer, first=0)
    assert len(events) == 3 * 2 * 5 * 3  # forward, gradient, update: nothing ever waited
    for c in clients:
        c.trainer.close()


def at_once(calls, timeout=120):
    """Runs each call on a thread of its own, all started together; asserts that none
    raised and all ended."""
    ready = threading.Barrier(len(calls))
    failures = []

    def run(call):
        try:
            ready.wait()
            call()
        except BaseException as exc:  # said below, with the others'
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads)


def concurrently(clients, steps):
    at_once([lambda c=c: [c.step(k) for k in range(steps)] for c in clients])


def interleaved(events):
    """Whether some client's forward fell between another's forward and gradient."""
    open_ = set()
    for label, event in events:
        if event == "forward":
            if open_ - {label}:
                return True
            open_.add(label)
        elif event == "gradient":
            open_.discard(label)
    return False


@OPTIMIZERS
def test_three_clients_stepping_at_once_are_the_replay_of_the_order_taken(worker, optimizer):
    key = uuid.uuid4().hex
    clients = [Client(worker, key, optimizer, seed=s, body_seed=7) for s in range(3)]
    concurrently(clients, steps=5)
    checked_against_replay(clients, optimizer, first=0)  # one body start for all
    for c in clients:
        c.trainer.close()


@pytest.mark.slow
def test_clients_as_threads_on_one_worker_object_share_a_body_at_once(worker):
    # one Worker object, so one client process's connection: each shared session must
    # be carried apart, or a gradient queues behind a forward that waits for it
    own = Worker.at("%s:%d" % worker.address("gpu"), mode="network", send=["splitnets"],
                    token=worker.token)
    with own:
        for repeat in range(10):
            key = uuid.uuid4().hex
            optimizer = (torch.optim.SGD, torch.optim.Adam)[repeat % 2]
            clients = [Client(worker, key, optimizer, seed=s, body_seed=7, own=own, steps=30)
                       for s in range(3)]
            at_once([lambda c=c: [c.step(k) for k in range(30)] for c in clients], timeout=60)
            checked_against_replay(clients, optimizer, first=0)
            for c in clients:
                c.trainer.close()


@pytest.mark.slow
def test_twenty_concurrent_runs_never_crash_never_mix(worker):
    mixed = 0
    for repeat in range(20):
        key = uuid.uuid4().hex
        optimizer = (torch.optim.SGD, torch.optim.Adam)[repeat % 2]
        clients = [Client(worker, key, optimizer, seed=s, body_seed=7) for s in range(3)]
        concurrently(clients, steps=5)
        events = checked_against_replay(clients, optimizer, first=0)
        mixed += interleaved(events)
        for c in clients:
            c.trainer.close()
    assert mixed, "no run interleaved the clients, so nothing here was tested at the same time"


def test_trainers_not_shared_run_side_by_side_on_one_worker(worker, tmp_path):
    """Two sessions whose trainers share nothing never wait for each other there: each
    body's forward waits for the other's to be under way at the same time."""
    def trainer():
        g = Graph.somatize(Lin(8, 8).named("encoder") >> Meets(8, 8, str(tmp_path)).named("body")
                           .at("gpu") >> Lin(8, 1, relu=False).named("head"))
        own = Worker.at("%s:%d" % worker.address("gpu"), mode="network", send=["splitnets"],
                        token=worker.token)
        trains = {"body": Split(torch.optim.SGD, lr=0.1)}
        return Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"gpu": own}),
                       optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    trainers = [trainer(), trainer()]
    try:
        at_once([lambda t=t: t.step(batches(1, seed=0)[0]) for t in trainers], timeout=60)
    finally:
        for t in trainers:
            t.close()


def test_a_client_unlike_the_shared_trainer_is_refused_naming_both(worker):
    key = uuid.uuid4().hex
    first = Client(worker, key, torch.optim.SGD, seed=0, body_seed=7)
    first.step(0)
    other = Client(worker, key, torch.optim.SGD, seed=1, body_seed=7, width=5)
    with pytest.raises(DeclarationError) as caught:
        other.step(0)
    said = str(caught.value)
    assert "float32[6, 8]" in said and "float32[5, 8]" in said and repr(key) in said
    also = Client(worker, key, torch.optim.Adam, seed=2, body_seed=7)
    with pytest.raises(DeclarationError, match="Adam"):
        also.step(0)
    # and the refusals changed nothing: the first trains on as if alone
    first.step(1)
    events = checked_against_replay([first], torch.optim.SGD, first=0)
    assert len(events) == 6


def test_a_client_whose_node_computes_otherwise_is_refused_naming_both(worker):
    # the same class, shapes and optimizer: only what the node was built with differs
    key = uuid.uuid4().hex
    first = Client(worker, key, torch.optim.SGD, seed=0, body_seed=7)
    first.step(0)
    other = Client(worker, key, torch.optim.SGD, seed=1, body_seed=7, relu=False)
    with pytest.raises(DeclarationError, match="computes one function") as caught:
        other.step(0)
    said = str(caught.value)
    assert "splitnets.Lin(8, 6)" in said and "splitnets.Lin(8, 6, relu=False)" in said
    first.step(1)  # and the first trains on as if alone
    assert len(checked_against_replay([first], torch.optim.SGD, first=0)) == 6


def test_a_client_cutting_its_steps_into_pieces_joins_at_the_same_cadence(worker):
    key = uuid.uuid4().hex
    first = Client(worker, key, torch.optim.SGD, seed=0, body_seed=7)
    first.step(0)
    pieces = Client(worker, key, torch.optim.SGD, seed=1, body_seed=7, micro=2)
    pieces.step(0)  # one update a step, as the first's
    slower = Client(worker, key, torch.optim.SGD, seed=2, body_seed=7, micro=2, every=2)
    with pytest.raises(DeclarationError, match="an update every 2 of the Trainer's steps"):
        slower.step(0)
    said = [e for _, e in pieces.trainer.shared_order("body")["order"]]
    assert said.count("update") == 2


def test_a_client_that_stalls_mid_step_is_dropped_after_the_workers_patience():
    argv = [sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0", "--quiet",
            "--shared-patience", "1"]
    key = uuid.uuid4().hex
    stall, inside = threading.Event(), threading.Event()

    def slowly(out, y):  # once told to, mid-step for four seconds, its gradient owed
        if stall.is_set():
            inside.set()
            time.sleep(4)
        return mse(out, y)

    with Worker.spawn(argv, mode="network", send=["splitnets"]) as small:
        stalling = Client(small, key, torch.optim.SGD, seed=0, body_seed=7, objective=slowly)
        steady = Client(small, key, torch.optim.SGD, seed=1, body_seed=7)
        stalling.step(0)
        steady.step(0)
        stall.set()
        failed = []
        thread = threading.Thread(target=lambda: failed.append(_raised(stalling.step, 1)))
        thread.start()
        assert inside.wait(30)
        began = time.monotonic()
        for k in range(1, 4):  # the second waits on the stalled client: a second, not four
            steady.step(k)
        waited = time.monotonic() - began
        thread.join(30)
    assert 1 <= waited < 3.5, waited
    assert isinstance(failed[0], OutOfStep)
    assert "waited 1 s" in str(failed[0]) and "--shared-patience" in str(failed[0])


def _raised(call, *args):
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001  (handed back to be looked at)
        return exc
    return None


def rss(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc for memory")
def test_shared_trainers_nobody_trains_stay_within_the_workers_sessions(tmp_path):
    token = "shared-memory-" + "5" * 20
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0",
                             "--quiet", "--max-sessions", "4", "--log", str(log)],
                            # one malloc arena: each connection's thread would otherwise
                            # keep an arena of its own, and what it freed, in the RSS
                            env={**os.environ, "SOMATIZE_TOKEN": token, "MALLOC_ARENA_MAX": "1"},
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        addr = proc.stdout.readline().split()[-1]

        def run():  # a closed run of its own key, whose body and Adam hold about 12 MiB
            g = Graph.somatize(Lin(8, 1024).named("encoder") >> Lin(1024, 1024).named("body")
                               .at("gpu") >> Lin(1024, 1, relu=False).named("head"))
            trains = {"body": Split(torch.optim.Adam, lr=1e-3, shared=uuid.uuid4().hex)}
            with Worker.at(addr, mode="network", send=["splitnets"], token=token) as w:
                t = Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"gpu": w}),
                            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
                x, y = batches(1, seed=0)[0]
                t.step((x, y))
                t.close()

        for _ in range(8):  # past the four the worker may hold, and its allocator warm
            run()
        held = rss(proc.pid)
        for _ in range(12):  # kept, they would grow it by 144 MiB
            run()
        grown = rss(proc.pid) - held
        # of 20 shared trainers nobody trains any more, the worker holds 4 at most
        assert log.read_text().count("to keep within 4 sessions (--max-sessions)") >= 16
        assert grown < 100 << 20, f"the worker grew by {grown >> 20} MiB over 12 closed runs"
    finally:
        proc.kill()
        proc.wait()


def test_predicting_through_a_body_others_train_is_refused_and_changes_nothing(worker):
    key = uuid.uuid4().hex
    first = Client(worker, key, torch.optim.SGD, seed=0, body_seed=7)
    other = Client(worker, key, torch.optim.SGD, seed=1, body_seed=7)
    first.step(0)
    other.step(0)
    with pytest.raises(DeclarationError, match=r"shared=.* by 1 other client"):
        first.trainer.predict(first.data[0][0])
    first.step(1)  # both train on, as if nobody had asked
    other.step(1)
    checked_against_replay([first, other], torch.optim.SGD, first=0)


def test_a_shared_trainer_that_runs_here_warns_and_trains_alone():
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 8).named("encoder") >> Lin(8, 6).named("body")
                       >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1, shared="body")}
    with pytest.warns(UserWarning, match=r"'body' is trained shared='body' and runs here"):
        t = Trainer(g, objective=mse, trains=trains,
                    optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    x, y = batches(1, seed=0)[0]
    assert t.step((x, y)) > t.step((x, y))  # it trains, as any Split here does


@pytest.mark.parametrize("key", ["", 3])
def test_a_key_is_a_non_empty_str(key):
    with pytest.raises(TypeError, match="non-empty str"):
        Split(torch.optim.SGD, lr=0.1, shared=key)


# -- the example: the paradigms, each with real client processes and one worker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "split_clients.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["relay", "parallel", "splitfed"])
def test_the_example_trains_every_paradigm(mode):
    src = str(EXAMPLE.parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--clients", "2", "--mode", mode,
                           "--steps", "40"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:6].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1], done.stdout
    for r in rows:
        first, last, accuracy, out, back = float(r[2]), float(r[4]), float(r[5]), r[6], r[7]
        assert last < first and accuracy > 0.3, done.stdout  # it learnt: chance is 0.1
        # an activation of 32 x 48 float32 each way at the least, and its gradient
        assert int(out) > 2 * 32 * 48 * 4 and int(back) > 2 * 32 * 48 * 4, done.stdout
    if mode == "splitfed":  # one average, so one model, whichever client holds it
        assert rows[0][5] == rows[1][5], done.stdout


# -- a shared trainer's state belongs to the share ----------------------------------------
def test_a_resume_leaves_a_shared_body_others_train_as_it_is_and_names_them(worker, tmp_path):
    key = f"resumed-{uuid.uuid4().hex[:8]}"
    a = Client(worker, key, torch.optim.SGD, seed=1, body_seed=0)
    b = Client(worker, key, torch.optim.SGD, seed=2, body_seed=0)
    for k in range(2):
        a.step(k)
        b.step(k)
    a.trainer.checkpoint(tmp_path, "a")
    a.step(2)
    b.step(2)
    before = b.trainer.export()["body"]
    said = b.trainer.shared_order("body")["you"]
    with pytest.warns(UserWarning, match=rf"'body'.*shared={key!r}.*other clients' sessions "
                                         rf"train it there now \({said}\).*left them as they are"):
        a.trainer.resume(tmp_path, "a")
    after = b.trainer.export()["body"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # not rolled back
    a.step(3)  # and both train on it as before
    b.step(3)
    a.trainer.close()
    b.trainer.close()


def test_a_resume_restores_a_shared_body_that_was_let_go(worker, tmp_path):
    key = f"regained-{uuid.uuid4().hex[:8]}"
    a = Client(worker, key, torch.optim.Adam, seed=1, body_seed=0)
    for k in range(2):
        a.step(k)
    a.trainer.checkpoint(tmp_path, "a")
    then = [a.trainer.step(a.data[k]) for k in (2, 3)]
    a.trainer.close()  # its session let go: nobody trains the body now
    again = Client(worker, key, torch.optim.Adam, seed=1, body_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nobody else trains it: restored without a word
        assert again.trainer.resume(tmp_path, "a") == 2
    assert [again.trainer.step(again.data[k]) for k in (2, 3)] == then
    again.trainer.close()
