"""Pipelined split steps: the pieces of a step overlap with a worker's, and the losses
and weights are the unpipelined run's, bit for bit, on a worker in this process and in
another one; a worker that dies mid-pipeline is an error naming its host."""

import threading

import pytest
import torch
from splitnets import LOG, Dies, Lin, Logging

from somatize import Broker, Graph, WireError, Worker
from somatize.torch import Split, Trainer, parameters
from somatize._node import Ctx
from somatize.torch._envelope import envelope
from somatize.torch._learning import Enters
from somatize.wire.log import say
from somatize.wire.server import Server

mse = torch.nn.functional.mse_loss
TOKEN = "pipeline-" + "5" * 24


def net(host, body=None, seed=0):
    torch.manual_seed(seed)
    body = (body or Lin(8, 6)).named("body").at(host)
    return Graph.somatize(Lin(8, 8).named("encoder") >> body >> Lin(6, 1, relu=False).named("head"))


def batches(n=6, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(n)]


def trainer(worker, pipeline, micro=4, every=2, body=None):
    g = net("gpu", body)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, micro=micro, every=every, trains=trains, pipeline=pipeline,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                broker=Broker.embedded({"gpu": worker}))
    return g, t


def run(worker, pipeline, **kw):
    g, t = trainer(worker, pipeline, **kw)
    assert t._pipelines(kw.get("micro", 4)) is pipeline
    losses = [t.step(b) for b in batches()]
    t.update()
    here = [p.detach().clone() for n in ("encoder", "head") for p in g.implementation(n).parameters()]
    return losses, here, t.export()["body"]


def same(a, b):
    (la, ha, fa), (lb, hb, fb) = a, b
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(ha, hb))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.fixture(scope="module")
def quiet():
    """A worker in this process says its everyday lines on this process's stderr, where
    its threads' lines, written once a test's capture is over, land in pytest's own
    output; they are left out here, as `--quiet` leaves them out of a worker's."""
    said, say.routine_too = say.routine_too, False
    yield
    say.routine_too = said


@pytest.fixture(scope="module")
def in_process(quiet):
    """A worker serving on a thread of this process, over a real socket."""
    server = Server("127.0.0.1", 0, token=TOKEN.encode())
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    with Worker.at(server.address, token=TOKEN) as worker:
        yield worker
    server.stop()
    thread.join(10)


@pytest.fixture(scope="module")
def spawned():
    with Worker.generic(mode="network", send=["splitnets"]) as worker:
        yield worker


@pytest.mark.parametrize("micro,every", [(4, 2), (3, 1)])
def test_pipelined_equals_one_piece_after_another_on_a_worker_here(in_process, micro, every):
    same(run(in_process, False, micro=micro, every=every),
         run(in_process, True, micro=micro, every=every))


def test_pipelined_equals_one_piece_after_another_on_a_worker_process(spawned):
    same(run(spawned, False), run(spawned, True))


def test_the_worker_runs_every_forward_of_a_step_before_its_first_backward(in_process):
    g = net("gpu")
    trains = {"body": Logging(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, micro=4, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                broker=Broker.embedded({"gpu": in_process}))
    LOG.clear()
    t.step(batches(1)[0])
    assert LOG == ["F"] * 4 + ["B"] * 4  # the trainer the worker unpickled, in this process
    LOG.clear()
    Trainer(g, objective=mse, micro=4, trains={"body": Logging(torch.optim.SGD, lr=0.1)},
            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1), pipeline=False,
            broker=Broker.embedded({"gpu": in_process})).step(batches(1)[0])
    assert LOG == ["F", "B"] * 4


def test_a_trainer_that_updates_inside_a_step_is_not_pipelined(in_process):
    g = net("gpu")
    trains = {"body": Split(torch.optim.SGD, every=1, lr=0.1)}  # a step of its own each piece
    t = Trainer(g, objective=mse, micro=4, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                broker=Broker.embedded({"gpu": in_process}))
    assert not t._pipelines(4)
    t.step(batches(1)[0])


def test_a_worker_dying_mid_pipeline_is_an_error_naming_its_host():
    with Worker.generic(mode="network", send=["splitnets"], timeout=20) as worker:
        g, t = trainer(worker, True, micro=4, body=Dies(8, 6, at=3))
        with pytest.raises(WireError, match="host 'gpu'"):
            t.step(batches(1)[0])


def test_a_gradient_goes_to_the_forward_it_is_for_and_leftovers_are_let_go_of():
    lin = torch.nn.Linear(2, 2)
    learning = Split(torch.optim.SGD, lr=0.1).of(lin).accumulating(9)  # no update here
    enters, ctx = Enters(learning), Ctx(None, "body")

    def forward(k):
        x = enters.forward(torch.full((1, 2), float(k)), ctx).value
        learning.forward(lin(x), ctx)
        return x
    stale = [forward(k) for k in range(3)]  # a step that failed after three forwards
    given = [forward(k) for k in (10, 11)]
    learning.forward(envelope(torch.ones(1, 2), behind=1), ctx)  # for given[0]
    assert given[0].grad is not None
    assert all(x.grad is None for x in stale + given[1:])
    learning.forward(envelope(torch.ones(1, 2)), ctx)  # behind=0: the newest, given[1]
    assert given[1].grad is not None and learning.held is None



def test_two_workers_each_training_a_stage_are_pipelined_bit_for_bit(in_process):
    server = Server("127.0.0.1", 0, token=TOKEN.encode())
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with Worker.at(server.address, token=TOKEN) as other:
            runs = []
            for pipeline in (False, True):
                torch.manual_seed(0)
                g = Graph.somatize(Lin(8, 8).named("encoder") >> Lin(8, 8).named("b1").at("w1")
                                   >> Lin(8, 8).named("mid") >> Lin(8, 6).named("b2").at("w2")
                                   >> Lin(6, 1, relu=False).named("head"))
                trains = {"b1": Split(torch.optim.SGD, lr=0.1), "b2": Split(torch.optim.SGD, lr=0.1)}
                t = Trainer(g, objective=mse, micro=4, every=2, trains=trains, pipeline=pipeline,
                            optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                            broker=Broker.embedded({"w1": in_process, "w2": other}))
                assert t._pipelines(4) is pipeline
                losses = [t.step(b) for b in batches(5)]
                t.update()
                runs.append((losses, t.export()))
            (la, wa), (lb, wb) = runs
            assert la == lb
            assert all(torch.equal(wa[n][k], wb[n][k]) for n in wa for k in wa[n])
    finally:
        server.stop()
        thread.join(10)
