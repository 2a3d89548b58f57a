"""Worker.on_ray against a real local Ray cluster: what only Ray has (placing by
resources, a runtime env, an actor killed or restarted, cancelling). What every
transport promises is test_ray_transport, the contract run against an actor."""

import threading
import time

import pytest
import torch
from raynets import Echo, Env, Lin, Sleep, Twice

from somatize import Broker, DeclarationError, Graph, StateLost, WireError, Worker
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss


@pytest.fixture(scope="module")
def shared(cluster):
    """One actor for the tests that leave it standing: each one started costs seconds."""
    with Worker.on_ray(mode="network", send=["raynets"], num_cpus=1,
                       runtime_env={"env_vars": {"SOMATIZE_RAY_TEST": "shared"}}) as worker:
        yield worker


def test_the_runtime_env_asked_for_is_the_actors(shared):
    assert Graph.somatize(Env().at("gpu")).forward("SOMATIZE_RAY_TEST", broker={"gpu": shared}) == "shared"


def test_resources_no_node_has_are_a_wire_error_within_the_timeout_not_a_hang(on_ray):
    gpu = on_ray(resources={"tpu": 1}, timeout=2)
    began = time.monotonic()
    with pytest.raises(WireError, match=r"placed no actor asking for .*'tpu': 1.* within 2 s") as caught:
        Graph.somatize(Twice().at("gpu")).forward(1, broker={"gpu": gpu})
    assert time.monotonic() - began < 10 and caught.value.host == "gpu"
    assert "CPU=2" in str(caught.value)  # what the cluster does have


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
