"""gather's round options against what they mean: the robust rules, the server
optimizers continued by whichever client averages (and against Flower's strategy over
the same rounds), quorum rounds with threads and with processes on a real directory,
client-level privacy with its epsilon from dp-accounting, and evaluation rounds
against Flower's weighted loss average."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import somatize
from somatize._codec import dumps
from somatize.store import Store
from somatize.torch import ClientPrivacy, FedAdam, FedAvgM, evaluate, fedavg, fedmedian, \
    gather, krum, privacy_spent

SRC = str(Path(somatize.__file__).resolve().parent.parent)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"n": {"w": torch.randn(6, generator=g), "b": torch.randn(2, generator=g,
                                                                      dtype=torch.float64),
                  "steps": torch.tensor(seed)}}


def trained(start: dict, client: int, round: int) -> dict:
    g = torch.Generator().manual_seed(100 * round + client)
    return {"n": {"w": start["n"]["w"] + 0.1 * torch.randn(6, generator=g),
                  "b": start["n"]["b"] + 0.1 * torch.randn(2, generator=g, dtype=torch.float64),
                  "steps": start["n"]["steps"] + 1}}


def together(store, parts: dict, **how) -> dict:
    """gather for each client in ``parts`` at once, in threads: what each got or raised,
    and the warnings each was given."""
    answers, told = {}, {}

    def one(k):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                answers[k] = gather(store, parts[k], mine=k, **how)
            except Exception as exc:  # noqa: BLE001 - handed to the test
                answers[k] = exc
        told[k] = [str(w.message) for w in caught]

    threads = [threading.Thread(target=one, args=(k,)) for k in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers, told


def keep_as(store, run, round, k, part, clients, size):
    """Client k's part kept as gather keeps it, by a client that then waits elsewhere."""
    store.claim(f"fed/{run}/{round}/client/{k}", store.put(dumps(part)),
                {"client": k, "clients": clients, "size": size, "by": "elsewhere"})


# -- robust rules through a round


def test_a_round_with_a_robust_rule_answers_that_rule_on_the_parts(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(5)}
    answers, _ = together(store, parts, run="r", round=0, clients=5, asking=0.01,
                          aggregate=fedmedian)
    expected = fedmedian([parts[k] for k in range(5)])
    answers2, _ = together(store, parts, run="r", round=1, clients=5, asking=0.01,
                           aggregate=lambda e, s: krum(e, s, byzantine=1, keep=2))
    picked = krum([parts[k] for k in range(5)], byzantine=1, keep=2)
    for k in range(5):
        assert torch.equal(answers[k]["n"]["w"], expected["n"]["w"])
        assert torch.equal(answers2[k]["n"]["w"], picked["n"]["w"])


# -- server optimizers: state carried by the store


def rounds_averaged_by(store, averagers, server, clients=3, sizes=(30, 10, 60)):
    """Runs len(averagers) rounds; in round r only client averagers[r] averages (the
    others' parts are kept before it asks, and they ask after it answered)."""
    start, run = weights(0), "r"
    current = start
    for round, averager in enumerate(averagers):
        parts = {k: trained(current, k, round) for k in range(clients)}
        for k in range(clients):
            if k != averager:
                keep_as(store, run, round, k, parts[k], clients, sizes[k])
        answer = gather(store, parts[averager], run=run, round=round, clients=clients,
                        mine=averager, size=sizes[averager], server=server, start=start,
                        asking=0.01, within=20)
        assert store.resolve(f"fed/r/{round}/averaging").meta["client"] == averager
        for k in range(clients):  # the others get the same answer, and average nothing
            other = gather(store, parts[k], run=run, round=round, clients=clients, mine=k,
                           size=sizes[k], server=server, start=start, within=20)
            assert all(torch.equal(other["n"][key], answer["n"][key]) for key in answer["n"])
        current = answer
    return current


@pytest.mark.parametrize("server", [FedAdam(eta=0.05), FedAvgM(learning_rate=0.8,
                                                                 momentum=0.9)],
                         ids=["adam", "avgm"])
def test_the_server_state_is_continued_by_whichever_client_averages(tmp_path, server):
    one = rounds_averaged_by(Store(tmp_path / "a", durable=False), [0, 1, 2, 0], server)
    other = rounds_averaged_by(Store(tmp_path / "b", durable=False), [2, 0, 1, 1], server)
    assert all(torch.equal(one["n"][k], other["n"][k]) for k in one["n"])
    # ...and the same four rounds with one optimizer kept in memory throughout:
    current, state = weights(0), None
    for round in range(4):
        parts = [trained(current, k, round) for k in range(3)]
        current, state = server.step(current, fedavg(parts, [30, 10, 60]), state)
    assert all(torch.equal(one["n"][k], current["n"][k]) for k in one["n"])


def test_the_server_state_equals_flowers_fedadam_over_the_same_rounds(tmp_path):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, \
        parameters_to_ndarrays
    from flwr.server.strategy import FedAdam as FlowerFedAdam

    ours = rounds_averaged_by(Store(tmp_path / "a", durable=False), [1, 2, 0],
                              FedAdam(eta=0.05))
    floats = lambda e: [e["n"]["w"].numpy(), e["n"]["b"].numpy()]  # noqa: E731
    flower = FlowerFedAdam(initial_parameters=ndarrays_to_parameters(floats(weights(0))),
                           eta=0.05)
    current = weights(0)
    for round in range(3):
        parts = [trained(current, k, round) for k in range(3)]
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(floats(p)), n, {}))
                   for p, n in zip(parts, [30, 10, 60])]
        w, b = parameters_to_ndarrays(flower.aggregate_fit(round + 1, results, [])[0])
        current = {"n": {"w": torch.from_numpy(w).float(), "b": torch.from_numpy(b),
                         "steps": parts[0]["n"]["steps"]}}
    torch.testing.assert_close(ours["n"]["w"], current["n"]["w"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["n"]["b"], current["n"]["b"], rtol=1e-12, atol=1e-12)


def test_a_first_round_with_a_server_and_no_start_is_refused_before_anything_is_kept(
        tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(ValueError, match="give them as start="):
        gather(store, weights(0), run="r", round=0, clients=2, mine=0, server=FedAdam())
    assert store.bound() == []


# -- quorum


def test_a_quorum_round_closes_without_a_straggler_who_then_takes_its_average(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(4)}
    began = time.monotonic()
    answers, told = together(store, {k: parts[k] for k in range(3)}, run="r", round=0,
                             clients=4, quorum=3, within=1.0, asking=0.05,
                             size=None)
    assert time.monotonic() - began >= 1.0  # it waited for the straggler until within=
    expected = fedavg([parts[k] for k in range(3)])
    assert all(torch.equal(answers[k]["n"]["w"], expected["n"]["w"]) for k in range(3))
    said = [m for k in range(3) for m in told[k]]
    assert len(said) == 1 and "closed at its quorum without client 3" in said[0]
    assert store.resolve("fed/r/0/average").meta["parts"] == [0, 1, 2]
    # the straggler turns up: it keeps nothing and takes the closed round's average
    with pytest.warns(UserWarning, match="closed without client 3's part"):
        late = gather(store, parts[3], run="r", round=0, clients=4, mine=3, quorum=3,
                      within=1.0)
    assert torch.equal(late["n"]["w"], expected["n"]["w"])
    assert store.resolve("fed/r/0/client/3") is None
    # a part kept after the round closed (a client that asked just before) is in no
    # average: not this round's, which stands, and the next round has names of its own
    keep_as(store, "r", 0, 3, parts[3], 4, None)
    with pytest.warns(UserWarning, match="closed without client 3's part"):
        again = gather(store, parts[3], run="r", round=0, clients=4, mine=3, quorum=3)
    assert torch.equal(again["n"]["w"], expected["n"]["w"])
    # it joins the next round, which all four make, at once (no waiting for within=)
    began = time.monotonic()
    answers, told = together(store, {k: trained(expected, k, 1) for k in range(4)}, run="r",
                             round=1, clients=4, quorum=3, within=30.0, asking=0.05)
    assert time.monotonic() - began < 10
    assert store.resolve("fed/r/1/average").meta["parts"] == [0, 1, 2, 3]
    assert not any(told.values())


def test_a_quorum_not_reached_times_out_naming_who_is_missing(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    answers, _ = together(store, {0: weights(0), 1: weights(1)}, run="r", round=0,
                          clients=4, quorum=3, within=0.5, asking=0.05, lease=0.5)
    for k in (0, 1):
        assert isinstance(answers[k], TimeoutError)
        assert "clients 2, 3 never kept a part within 0.5 s (2 of 4 did)" in str(answers[k])


def test_a_quorum_is_checked(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(ValueError, match="quorum=5 is refused"):
        gather(store, weights(0), run="r", round=0, clients=4, mine=0, quorum=5)
    with pytest.raises(ValueError, match="leave out aggregate="):
        gather(store, weights(0), run="r", round=0, clients=4, mine=0, aggregate=fedmedian,
               privacy=ClientPrivacy(clip=1.0, noise=1.0), start=weights(0))
    assert store.bound() == []


QUORUM_CLIENT = """
import json, sys, time, warnings
import torch
from somatize.store import Store
from somatize.torch import gather
where, mine, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(wait)
store = Store(where, durable=False)
weights = {"n": {"w": torch.arange(4.0) * (mine + 1)}}
said = []
for round in range(2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        average = gather(store, weights, run="q", round=round, clients=4, mine=mine,
                         size=mine + 1, quorum=3, within=[1.5, 60.0][round], asking=0.05)
    said.append([str(w.message) for w in caught])
    weights = {"n": {"w": average["n"]["w"] + 1}}
print(json.dumps({"w": average["n"]["w"].tolist(), "said": said}))
"""


@pytest.mark.slow
def test_a_quorum_round_with_processes_on_a_directory(tmp_path):
    where = tmp_path / "s"
    Store(where)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    children = [subprocess.Popen([sys.executable, "-c", QUORUM_CLIENT, str(where), str(k),
                                  "0" if k < 3 else "6"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k in range(4)]
    said = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        said.append(json.loads(out))
    store = Store(where)
    first = store.resolve("fed/q/0/average").meta
    assert first["parts"] == [0, 1, 2] and first["sizes"] == [1.0, 2.0, 3.0]
    expected = fedavg([store.recall(f"fed/q/0/client/{k}") for k in range(3)], [1, 2, 3])
    assert torch.equal(store.recall("fed/q/0/average")["n"]["w"], expected["n"]["w"])
    assert store.resolve("fed/q/0/client/3") is None  # the straggler kept nothing in round 0
    assert any("closed at its quorum without client 3" in m for s in said[:3] for m in s["said"][0])
    assert any("closed without client 3's part" in m for m in said[3]["said"][0])
    # in round 1 the straggler started from round 0's average, like the others
    assert torch.equal(store.recall("fed/q/1/client/3")["n"]["w"], expected["n"]["w"] + 1)
    assert store.resolve("fed/q/1/average").meta["parts"] == [0, 1, 2, 3]
    assert len({json.dumps(s["w"]) for s in said}) == 1


# -- client-level differential privacy


def test_privacy_clips_noises_and_counts_epsilon_with_dp_accounting(tmp_path):
    accounting = pytest.importorskip("dp_accounting")
    store = Store(tmp_path / "s", durable=False)
    start = {"n": {"w": torch.zeros(1000), "steps": torch.tensor(0)}}
    privacy = ClientPrivacy(clip=1.0, noise=0.5, delta=1e-5, seed=7, population=8)
    current = start
    for round in range(3):
        parts = {k: {"n": {"w": current["n"]["w"] + (k + 1) * 10.0, "steps": torch.tensor(1)}}
                 for k in range(4)}
        answers, _ = together(store, parts, run="p", round=round, clients=4, asking=0.01,
                              privacy=privacy, start=start)
        update = answers[0]["n"]["w"] - current["n"]["w"]
        # every update clipped to norm 1 (all point the same way): their mean is
        # 1/sqrt(1000) per weight; the noise has deviation 0.5 * 1 / 4 around it
        clipped = 1.0 / 1000 ** 0.5
        assert abs(float(update.mean()) - clipped) < 4 * 0.125 / 1000 ** 0.5
        assert abs(float(update.std()) - 0.125) < 0.02
        assert all(torch.equal(answers[k]["n"]["w"], answers[0]["n"]["w"]) for k in range(4))
        current = answers[0]
    accountant = accounting.rdp.RdpAccountant()
    accountant.compose(accounting.dp_event.PoissonSampledDpEvent(
        4 / 8, accounting.dp_event.GaussianDpEvent(0.5)), 3)
    spent = privacy_spent(store, "p")
    assert list(spent) == [0, 1, 2]
    assert spent[2] == accountant.get_epsilon(1e-5) and spent[0] < spent[1] < spent[2]


def test_privacy_noise_is_the_same_whoever_averages(tmp_path):
    privacy = ClientPrivacy(clip=0.5, noise=1.0, seed=3)
    start = weights(0)
    answers = []
    for averager, where in ((0, "a"), (1, "b")):
        store = Store(tmp_path / where, durable=False)
        keep_as(store, "r", 0, 1 - averager, trained(start, 1 - averager, 0), 2, None)
        answers.append(gather(store, trained(start, averager, 0), run="r", round=0, clients=2,
                              mine=averager, privacy=privacy, start=start, asking=0.01))
    assert torch.equal(answers[0]["n"]["w"], answers[1]["n"]["w"])
    assert not torch.equal(answers[0]["n"]["w"], fedavg([trained(start, k, 0)
                                                        for k in range(2)])["n"]["w"])


# -- evaluation rounds


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


def test_a_server_round_refuses_a_replaced_average_of_the_round_before(tmp_path):
    secret = "a-secret-every-client-of-the-run-is-given-" + "x" * 16
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(2)}
    answers, _ = together(store, parts, run="r", round=0, clients=2, asking=0.01,
                          secret=secret, server=FedAdam(), start=weights(0))
    assert all(isinstance(a, dict) for a in answers.values())
    real = store.resolve("fed/r/0/average")
    store.bind("fed/r/0/average", store.put(dumps(weights(9))), real.meta)
    with pytest.raises(somatize.StoreError, match="fed/r/0/average"):
        gather(store, parts[0], run="r", round=1, clients=2, mine=0, secret=secret,
               server=FedAdam(), start=weights(0))
    assert store.resolve("fed/r/1/client/0") is None
