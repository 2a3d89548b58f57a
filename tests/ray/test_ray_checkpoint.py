"""A checkpoint of a run trained partly on a Ray actor, taken up on a fresh actor: the
same channel as on the socket worker, so it goes on bit for bit, dropout there included."""

import torch
from checkpointnets import Drop
from raynets import Lin

from somatize import Broker, Graph, Worker
from somatize.torch import Split, Trainer, parameters


def trainer(worker):
    torch.manual_seed(0)
    g = Graph.somatize(Lin(4, 8).named("encoder") >> Drop(8, 8).named("body").at("gpu")
                       >> Lin(8, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains, every=2,
                broker=Broker.embedded({"gpu": worker}),
                optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2))
    t.seed(0)
    return t


def test_a_run_kept_on_one_actor_goes_on_bit_for_bit_on_a_fresh_one(cluster, tmp_path):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator))
            for _ in range(8)]
    with Worker.on_ray(mode="network", send=["raynets", "checkpointnets"], num_cpus=0) as gpu:
        t = trainer(gpu)
        t.fit(data[:5])  # every=2: the fifth step leaves a group open, and fit closes it
        t.step(data[5])  # this one stays open: its gradients are in the checkpoint
        t.checkpoint(tmp_path, "ck")
        then = [t.step(b) for b in data[6:]]
        ended = t.export()
    with Worker.on_ray(mode="network", send=["raynets", "checkpointnets"], num_cpus=0) as fresh:
        u = trainer(fresh)
        assert u.resume(tmp_path, "ck") == 6
        assert [u.step(b) for b in data[6:]] == then
        again = u.export()
    assert all(torch.equal(ended[n][k], again[n][k]) for n in ended for k in ended[n])
