"""FedProx's proximal term against the same loss written out in plain PyTorch, as
Flower's FedProx example writes it on the client."""

import pytest
import torch
import torch.nn.functional as F
from trainnets import batches, graph

from somatize.torch import Trainer, fedprox, parameters

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/torch/conftest.py


def test_the_trainer_with_fedprox_is_the_hand_written_proximal_loop_bit_for_bit():
    g, _, _ = graph(seed=0)
    _, body, head = graph(seed=0)
    objective = fedprox(F.mse_loss, g, mu=0.5)
    trainer = Trainer(g, objective=objective,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05))
    by_hand = list(body.net.parameters()) + list(head.out.parameters())
    optimizer = torch.optim.SGD(by_hand, lr=0.05)
    for round in range(2):
        start = [p.detach().clone() for p in by_hand]
        if round:
            objective.restart()  # the round's start: the weights as they are now
        for x, y in batches(3, seed=round + 1):
            ours = trainer.step((x, y))
            optimizer.zero_grad()
            proximal = sum(torch.square((p - s).norm(2)) for p, s in zip(by_hand, start))
            loss = F.mse_loss(head.out(body.net(x)), y) + 0.5 / 2 * proximal
            loss.backward()
            optimizer.step()
            assert ours == loss.item()
    assert all(torch.equal(a, b) for a, b in zip(parameters(g), by_hand))


def test_the_proximal_term_pulls_the_weights_towards_the_start():
    drift = {}
    for mu in (0.0, 5.0):
        g, _, _ = graph(seed=0)
        start = [p.detach().clone() for p in parameters(g)]
        trainer = Trainer(g, objective=fedprox(F.mse_loss, g, mu=mu),
                          optimizer=torch.optim.SGD(parameters(g), lr=0.05))
        for batch in batches(20):
            trainer.step(batch)
        drift[mu] = sum(float((p.detach() - s).norm()) for p, s in zip(parameters(g), start))
    assert drift[5.0] < 0.8 * drift[0.0]


def test_what_cannot_be_a_proximal_objective_is_refused():
    g, _, _ = graph(seed=0)
    with pytest.raises(ValueError, match="mu=-1 is refused"):
        fedprox(F.mse_loss, g, mu=-1)
    with pytest.raises(TypeError, match="objective is a str"):
        fedprox("mse", g, mu=0.1)
