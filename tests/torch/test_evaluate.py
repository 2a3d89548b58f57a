"""Evaluation rounds against Flower's weighted average of the clients' metrics."""

from __future__ import annotations

import threading

import pytest

from somatize.store import Store
from somatize.torch import evaluate


def test_an_evaluation_round_is_flowers_weighted_average_of_the_clients_metrics(tmp_path):
    weighted_loss_avg = pytest.importorskip("flwr.server.strategy.aggregate").weighted_loss_avg
    store = Store(tmp_path / "s", durable=False)
    measured = {0: (0.9, 0.5, 120), 1: (0.4, 0.8, 30), 2: (0.25, 0.95, 7)}
    answers = {}

    def one(k):
        loss, accuracy, rows = measured[k]
        answers[k] = evaluate(store, {"loss": loss, "accuracy": accuracy}, run="r", round=2,
                              clients=3, mine=k, rows=rows, asking=0.01)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    loss = weighted_loss_avg([(rows, loss) for loss, _, rows in measured.values()])
    accuracy = weighted_loss_avg([(rows, acc) for _, acc, rows in measured.values()])
    for k in range(3):
        assert answers[k]["loss"] == pytest.approx(loss, rel=1e-12)
        assert answers[k]["accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert store.resolve("fed/r/evaluate/2/average") is not None
    with pytest.raises(ValueError, match="rows=0 is refused"):
        evaluate(store, {"loss": 1.0}, run="r", round=3, clients=1, mine=0, rows=0)
