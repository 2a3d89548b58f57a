"""A shared trainer on Ray (``Worker.on_ray(name=...)``): clients that name one actor
reach the same one, and train one body there at the same time, exactly."""

import threading
import uuid

import pytest
import torch
from raynets import Lin

from somatize import Broker, Graph, Worker
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss


def client(name, key, seed):
    torch.manual_seed(seed)
    encoder = Lin(8, 8)
    torch.manual_seed(7)
    body = Lin(8, 6)
    torch.manual_seed(seed + 100)
    head = Lin(6, 1, relu=False)
    g = Graph.somatize(encoder.named("encoder") >> body.named("body").at("server")
                       >> head.named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=0.1, shared=key)}
    place = Worker.on_ray(mode="network", send=["raynets"], num_cpus=0, name=name)
    return place, Trainer(g, objective=mse, trains=trains,
                          broker=Broker.embedded({"server": place}),
                          optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))


@pytest.mark.slow
def test_clients_naming_one_actor_share_its_trainer(cluster):
    import ray

    name, key = "shared-" + uuid.uuid4().hex[:8], uuid.uuid4().hex
    made = [client(name, key, seed) for seed in range(3)]
    try:
        generator = torch.Generator().manual_seed(0)
        data = [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
                for _ in range(4)]
        failures = []

        def run(trainer):
            try:
                for batch in data:
                    trainer.step(batch)
            except BaseException as exc:  # said below
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for _, t in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        said = [t.shared_order("body") for _, t in made]
        # one actor, one trainer: every client sees the same order, holding all of them
        assert all(s["order"] == said[0]["order"] for s in said)
        assert {c for c, _ in said[0]["order"]} == {s["you"] for s in said}
        assert [e for _, e in said[0]["order"]].count("update") == 12
        bodies = [t.export()["body"] for _, t in made]
        assert all(torch.equal(b["lin.weight"], bodies[0]["lin.weight"]) for b in bodies)
    finally:
        for place, trainer in made:
            trainer.close()
            place.close()
        ray.kill(ray.get_actor(name, namespace="somatize"))
