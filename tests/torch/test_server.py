"""The server optimizers against Flower's strategies of the same name, driven through
their own aggregate_fit on the same client results, round after round."""

from __future__ import annotations

import pytest
import torch

from somatize.torch import FedAdagrad, FedAdam, FedAvgM, FedYogi, fedavg

flwr = pytest.importorskip("flwr")
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, \
    parameters_to_ndarrays  # noqa: E402
from flwr.server import strategy  # noqa: E402

KEYS = [("body", "w"), ("body", "b"), ("head", "out")]


def start() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"body": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g),
                     "steps": torch.tensor(0)},
            "head": {"out": torch.randn(2, 4, generator=g, dtype=torch.float64)}}


def trained(weights: dict, client: int, round: int) -> dict:
    """What a client sends back: the weights moved a client- and round-dependent way."""
    g = torch.Generator().manual_seed(1000 * round + client)
    return {node: {key: value + 0.1 * torch.randn(value.shape, generator=g,
                                                  dtype=value.dtype)
                   if value.is_floating_point() else value + 1
                   for key, value in w.items()} for node, w in weights.items()}


def arrays(export):
    return [export[n][k].numpy() for n, k in KEYS]


PAIRS = [
    (lambda: FedAvgM(), lambda p: strategy.FedAvgM(initial_parameters=p)),
    (lambda: FedAvgM(learning_rate=0.7, momentum=0.9),
     lambda p: strategy.FedAvgM(initial_parameters=p, server_learning_rate=0.7,
                                server_momentum=0.9)),
    (lambda: FedAdam(), lambda p: strategy.FedAdam(initial_parameters=p)),
    (lambda: FedAdam(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-2),
     lambda p: strategy.FedAdam(initial_parameters=p, eta=0.05, beta_1=0.8, beta_2=0.95,
                                tau=1e-2)),
    (lambda: FedYogi(), lambda p: strategy.FedYogi(initial_parameters=p)),
    (lambda: FedAdagrad(), lambda p: strategy.FedAdagrad(initial_parameters=p)),
    (lambda: FedAdagrad(eta=0.3, tau=1e-3),
     lambda p: strategy.FedAdagrad(initial_parameters=p, eta=0.3, tau=1e-3)),
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("ours, theirs", PAIRS,
                         ids=["avgm", "avgm-momentum", "adam", "adam-set", "yogi", "adagrad",
                              "adagrad-set"])
def test_each_equals_flowers_strategy_over_four_rounds(ours, theirs):
    optimizer = ours()
    flower = theirs(ndarrays_to_parameters(arrays(start())))
    weights, state = start(), None
    sizes = [30, 10, 60]
    for round in range(4):
        parts = [trained(weights, k, round) for k in range(3)]
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays(p)), n, {}))
                   for p, n in zip(parts, sizes)]
        expected, _ = flower.aggregate_fit(round + 1, results, [])
        weights, state = optimizer.step(weights, fedavg(parts, sizes), state)
        for (node, key), value in zip(KEYS, parameters_to_ndarrays(expected)):
            mine = weights[node][key]
            tolerance = 1e-12 if mine.dtype == torch.float64 else 1e-6
            torch.testing.assert_close(mine, torch.from_numpy(value).to(mine.dtype),
                                       rtol=tolerance, atol=tolerance)
        assert weights["body"]["steps"] == round + 1  # not stepped: the clients' count
        assert state["steps"] == round + 1


def test_settings_that_cannot_step_are_refused_naming_them():
    with pytest.raises(ValueError, match="momentum=1.0 is refused"):
        FedAvgM(momentum=1.0)
    with pytest.raises(ValueError, match="eta=0 is refused"):
        FedAdam(eta=0)
    with pytest.raises(ValueError, match="tau=-1 is refused"):
        FedYogi(tau=-1)
