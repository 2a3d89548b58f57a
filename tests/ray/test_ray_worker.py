"""Worker.on_ray against a real local Ray cluster: slices, values through the store,
what stays put, faults, and split training bit for bit."""

import threading
import time

import pytest
import torch
from raynets import Boom, Bump, Echo, Env, Latch, Lin, Sleep, Twice, Unlatch

from somatize import (Broker, DeclarationError, Graph, Lost, NodeError, Opaque, StateLost,
                      WireError, Worker)
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss


@pytest.fixture(scope="module")
def shared(cluster):
    """One actor for the tests that leave it standing: each one started costs seconds."""
    with Worker.on_ray(mode="network", send=["raynets"], num_cpus=1,
                       runtime_env={"env_vars": {"SOMATIZE_RAY_TEST": "shared"}}) as worker:
        yield worker


def test_a_slice_on_an_actor_answers_as_here_and_its_facts_name_the_host(shared):
    gpu = shared
    g = Graph.somatize(Echo().named("a") >> Twice().named("b").at("gpu"))
    x = torch.arange(6.0)
    seen = []
    out = g.forward(Opaque(x), broker=Broker.embedded({"gpu": gpu}), watching=seen.append)
    assert torch.equal(out, x * 2)
    far = [f for f in seen if f.get("node") == "b"]
    assert far and all(f["host"] == "gpu" for f in far)
    assert {"sent", "received"} <= {f["fact"] for f in seen if f.get("host") == "gpu"}


def test_the_runtime_env_asked_for_is_the_actors(shared):
    assert Graph.somatize(Env().at("gpu")).forward("SOMATIZE_RAY_TEST", broker={"gpu": shared}) == "shared"


def test_resources_no_node_has_are_a_wire_error_within_the_timeout_not_a_hang(on_ray):
    gpu = on_ray(resources={"tpu": 1}, timeout=2)
    began = time.monotonic()
    with pytest.raises(WireError, match=r"placed no actor asking for .*'tpu': 1.* within 2 s") as caught:
        Graph.somatize(Twice().at("gpu")).forward(1, broker={"gpu": gpu})
    assert time.monotonic() - began < 10 and caught.value.host == "gpu"
    assert "CPU=2" in str(caught.value)  # what the cluster does have


def test_a_tensor_crosses_through_the_store_both_ways_and_is_its_own_to_write(shared):
    gpu = shared
    g = Graph.somatize(Bump().at("gpu"))
    x = torch.randn(512, 1024)  # 2 MiB: well past what Ray keeps in the message
    out = g.forward(Opaque(x.clone()), broker={"gpu": gpu})
    assert torch.equal(out, x + 1)
    out.add_(1)  # what came back is writable memory of ours, not the store's
    assert torch.equal(out, x + 1 + 1)


def test_what_cannot_travel_stays_on_the_actor_and_is_lost_elsewhere(shared):
    gpu = shared
    there = Graph.somatize(Latch().named("latch").at("gpu") >> Unlatch().named("un").at("gpu"))
    assert there.forward(5, broker={"gpu": gpu}) == 5  # read where it was made: fine
    split = Graph.somatize(Latch().named("latch").at("gpu") >> Unlatch().named("un"))
    with pytest.raises(Lost) as caught:
        split.forward(5, broker={"gpu": gpu})
    assert caught.value.host == "gpu" and "'latch'" in str(caught.value)


def test_a_node_failing_on_the_actor_is_a_node_error_there_with_its_traceback(shared):
    gpu = shared
    g = Graph.somatize(Boom().named("boom").at("gpu"))
    g.provision({"gpu": gpu})  # the catalog goes ahead of the first forward
    with pytest.raises(NodeError) as caught:
        g.forward(3, broker={"gpu": gpu})
    assert caught.value.host == "gpu" and caught.value.node == "boom"
    assert "boom on 3" in str(caught.value.__cause__)


def test_an_actor_killed_mid_slice_is_a_wire_error_naming_the_host_at_once(cluster, on_ray):
    gpu = on_ray(max_restarts=0)
    g = Graph.somatize(Echo().named("echo").at("gpu") >> Sleep().named("sleep").at("gpu"))
    assert g.forward(0, broker={"gpu": gpu}) == 0
    threading.Timer(1.0, cluster.kill, args=(gpu.actor("gpu"),)).start()
    began = time.monotonic()
    with pytest.raises(WireError) as caught:
        g.forward(30, broker={"gpu": gpu})
    assert time.monotonic() - began < 15  # Ray saw it die: not the 30 s sleep
    assert caught.value.host == "gpu" and "'gpu'" in str(caught.value)
    assert "['echo', 'sleep']" in str(caught.value)


def test_close_cancels_what_is_in_flight(on_ray):
    gpu = on_ray()
    g = Graph.somatize(Sleep().named("sleep").at("gpu"))
    assert g.forward(0, broker={"gpu": gpu}) == 0
    threading.Timer(1.0, gpu.close).start()
    began = time.monotonic()
    with pytest.raises(WireError, match="closed") as caught:
        g.forward(30, broker={"gpu": gpu})
    assert time.monotonic() - began < 15 and caught.value.host == "gpu"
    with pytest.raises(WireError, match="closed"):
        g.forward(1, broker={"gpu": gpu})


def net(host=None, seed=0):
    torch.manual_seed(seed)
    body = Lin(8, 6).named("body")
    body = body.at(host) if host else body
    return Graph.somatize(Lin(8, 8).named("encoder") >> body >> Lin(6, 1, relu=False).named("head"))


def batches(n=6, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(n)]


def split_trainer(worker):
    cut = net("gpu")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return cut, Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"gpu": worker}),
                        optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))


def test_the_far_half_on_an_actor_trains_bit_for_bit(shared):
    one = net()
    whole = Trainer(one, objective=mse, optimizer=torch.optim.SGD(parameters(one), lr=0.1))
    cut, split = split_trainer(shared)
    assert [whole.step(b) for b in batches()] == [split.step(b) for b in batches()]
    here = ["encoder", "head"]
    assert all(torch.equal(a, b) for n in here for a, b in
               zip(one.implementation(n).parameters(), cut.implementation(n).parameters()))
    far, mine = split.export()["body"], whole.export()["body"]
    assert far.keys() == mine.keys() and all(torch.equal(far[k], mine[k]) for k in far)


def pipelined_run(worker, pipeline, micro=4, every=2):
    cut = net("gpu")
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(cut, objective=mse, trains=trains, micro=micro, every=every, pipeline=pipeline,
                broker=Broker.embedded({"gpu": worker}),
                optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))
    assert t._pipelines(micro) is pipeline  # on Ray too: an actor keeps its caller's order
    losses = [t.step(b) for b in batches()]
    t.update()
    here = [p.detach().clone() for n in ("encoder", "head") for p in cut.implementation(n).parameters()]
    return losses, here, t.export()["body"]


def test_a_pipelined_step_on_an_actor_is_the_unpipelined_one_bit_for_bit(shared):
    (la, ha, fa), (lb, hb, fb) = pipelined_run(shared, True), pipelined_run(shared, False)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(ha, hb))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_an_actor_restarted_mid_step_is_state_lost_not_a_wrong_answer(cluster, on_ray):
    gpu = on_ray(max_restarts=1)
    _, t = split_trainer(gpu)
    t.step(batches(1)[0])
    x, y = batches(1, seed=5)[0]
    loss = t._loss(t._forward(x), y)  # the forward half of a step...
    actor = gpu.actor("gpu")
    before = cluster.get(actor.ready.remote())["instance"]
    cluster.kill(actor, no_restart=False)  # ...Ray restarts the actor...
    restarted(cluster, actor, before)
    with pytest.raises(StateLost, match="'body'") as caught:
        t._backward(loss, 1.0)  # ...and the backward half is told what was lost there
    assert caught.value.host == "gpu"
    with pytest.raises(StateLost):  # never trained on from the client's first copy
        t.step(batches(1, seed=6)[0])


def test_two_trainers_on_one_actor_each_train_as_if_alone(shared):
    data = batches()
    _, alone = split_trainer(shared)
    lone = [alone.step(b) for b in data]
    _, a = split_trainer(shared)
    _, b = split_trainer(shared)  # alike, byte for byte: still two sessions
    both = [(a.step(x), b.step(x)) for x in data]  # interleaved, step by step
    assert [la for la, _ in both] == lone == [lb for _, lb in both]
    for t in (a, b):
        got, want = t.export()["body"], alone.export()["body"]
        assert all(torch.equal(got[k], want[k]) for k in want)


def restarted(ray, actor, before, within=60.0):
    """Waits until Ray has put a fresh actor in the killed one's place: ray.kill only
    asks, and a call made meanwhile may still reach the old process."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.ready.remote(), timeout=within)["instance"] != before:
                return
        except ray.exceptions.RayActorError:
            pass  # dying, or not back yet
        time.sleep(0.05)
    raise AssertionError(f"Ray did not restart the actor within {within} s")


def test_what_a_ray_worker_is_asked_for_is_checked_when_declared():
    with pytest.raises(DeclarationError, match="num_gpus is a number"):
        Worker.on_ray(num_gpus=-1)
    with pytest.raises(DeclarationError, match="resources is"):
        Worker.on_ray(resources={"tpu": "one"})
    with pytest.raises(DeclarationError, match="only means something with mode='network'"):
        Worker.on_ray(send=["raynets"])
    assert "num_gpus=1" in repr(Worker.on_ray(num_gpus=1))  # declaring starts nothing
