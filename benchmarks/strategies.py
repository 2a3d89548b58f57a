"""Federated strategies on scikit-learn's digits, ours through a real directory store
beside Flower's strategy objects on the same partitions, in the same run.

Clients are threads of this process (as Flower simulates them) and train the same
small MLP with the same seeds on both sides, so a row's two accuracies differ only by
what the strategy does with the parts. Ours go through ``gather`` on a directory
store; Flower's are its own strategy objects (``FedAvg``, ``FedProx``, ``FedAdam``,
``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``Bulyan``,
``DifferentialPrivacyServerSideFixedClipping``) driven through ``aggregate_fit``.

1. Pathological non-IID (2 classes per client, 10 clients): FedAvg, FedProx, FedAdam,
   accuracy per round; then with 30% stragglers each round (ours: ``quorum=7``, the
   three stragglers turn up after the round closed; Flower: the seven results only).
2. 20% of 15 IID clients send sign-flipped, x10 updates: FedAvg vs median, trimmed
   mean, Krum, Bulyan, final accuracy beside the clean FedAvg run.
3. DP-FedAvg at epsilon 1, 3, 8 (delta 1e-5, dp-accounting's RDP) beside no DP, 100
   clients (the noise on the mean shrinks with the clients; with 10 it drowns the model).
4. Seconds per round at 10 and 100 clients: ours (threads, a directory store, one
   reader per process) beside Flower's own simulation on Ray (2 CPUs, one per client
   actor; the first round, which starts Ray, left out) training the same clients, and
   beside Flower's FedAvg driven in one loop with no transport at all, the least a
   round can cost. ``--quick`` leaves Ray out and shows the issue's 0.43 s and 4.00 s.

    python benchmarks/strategies.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
# benchmarks/ray.py would stand in for Ray, which Flower's simulation imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent / "src"))

from somatize.store import Store  # noqa: E402
from somatize.torch import ClientPrivacy, FedAdam, bulyan, fedmedian, fedtrimmedavg, gather, \
    krum, noise_for  # noqa: E402

HIDDEN, LR, BATCH = 32, 0.3, 16


# -- data and the client's training --------------------------------------------------------
def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def pathological(train, clients: int, classes: int = 2):
    """Sorted by label, cut in clients * classes shards, ``classes`` shards each."""
    x, y = train
    order = torch.argsort(y, stable=True)
    shards = torch.tensor_split(order, clients * classes)
    pick = np.random.default_rng(1).permutation(clients * classes)
    return [(x[torch.cat([shards[s] for s in pick[k::clients]])],
             y[torch.cat([shards[s] for s in pick[k::clients]])]) for k in range(clients)]


def iid(train, clients: int):
    x, y = train
    return [(x[part], y[part]) for part in torch.tensor_split(torch.arange(len(y)), clients)]


def model_weights(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, 10))
    return {"mlp": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def forward(w: dict, x: torch.Tensor) -> torch.Tensor:
    m = w["mlp"]
    return torch.relu(x @ m["0.weight"].T + m["0.bias"]) @ m["2.weight"].T + m["2.bias"]


def train(start: dict, data, seed: int, mu: float = 0.0, epochs: int = 2) -> dict:
    """Plain SGD from ``start`` on the client's rows; with ``mu``, FedProx's term."""
    w = {"mlp": {k: v.clone().requires_grad_(True) for k, v in start["mlp"].items()}}
    x, y = data
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for rows in torch.randperm(len(y), generator=g).split(BATCH):
            loss = torch.nn.functional.cross_entropy(forward(w, x[rows]), y[rows])
            if mu:
                loss = loss + mu / 2 * sum((w["mlp"][k] - start["mlp"][k]).pow(2).sum()
                                           for k in w["mlp"])
            grads = torch.autograd.grad(loss, list(w["mlp"].values()))
            with torch.no_grad():
                for v, grad in zip(w["mlp"].values(), grads):
                    v -= LR * grad
    return {"mlp": {k: v.detach() for k, v in w["mlp"].items()}}


def flipped(start: dict, trained: dict) -> dict:
    return {"mlp": {k: start["mlp"][k] - 10 * (v - start["mlp"][k])
                    for k, v in trained["mlp"].items()}}


def accuracy(w: dict, test) -> float:
    x, y = test
    with torch.no_grad():
        return float((forward(w, x).argmax(1) == y).float().mean())


# -- one strategy, both ways ------------------------------------------------------------------
def arrays(w: dict) -> list:
    return [v.numpy() for v in w["mlp"].values()]


def from_arrays(values, like: dict) -> dict:
    return {"mlp": {k: torch.from_numpy(np.asarray(v, dtype=np.float32)).clone()
                    for k, v in zip(like["mlp"], values)}}


def parts_of(current, clients, round, mu, attackers):
    parts = {}
    for k, data in enumerate(clients):
        part = train(current, data, seed=1000 * round + k, mu=mu)
        parts[k] = flipped(current, part) if k in attackers else part
    return parts


def ours(clients, test, rounds, *, where, run, mu=0.0, stragglers=0.0, attackers=(),
         within=0.6, threads_train=False, **how) -> list[float]:
    """Rounds through gather, each client a thread; answers accuracy per round. The
    parts are trained first, so that a quorum's ``within`` counts from one moment for
    every client, unless ``threads_train``: then each thread trains its own."""
    store, start = Store(where, durable=False), model_weights()
    current, accuracies, n = start, [], len(clients)
    late_count = int(round_half(stragglers * n))
    for round in range(rounds):
        late = set(np.random.default_rng(round).permutation(n)[:late_count].tolist())
        parts = {} if threads_train else parts_of(current, clients, round, mu, attackers)
        answers = {}

        def one(k, current=current, round=round, late=late, parts=parts):
            part = parts[k] if parts else train(current, clients[k], seed=1000 * round + k,
                                                mu=mu)
            if k in late:  # it turns up once the round closed, and takes its average
                while store.resolve(f"fed/{run}/{round}/average") is None:
                    time.sleep(0.01)
            answers[k] = gather(store, part, run=run, round=round, clients=n, mine=k,
                                size=len(clients[k][1]), start=start, asking=0.05,
                                within=within if late else 60.0,
                                quorum=n - late_count if late else None, **how)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        current = answers[0]
        accuracies.append(accuracy(current, test))
    return accuracies


def round_half(x: float) -> float:
    return float(np.floor(x + 0.5))


def flower(clients, test, rounds, strategy, *, mu=0.0, stragglers=0.0, attackers=(),
           uniform=False, dp=False) -> list[float]:
    """The same rounds through one of Flower's strategy objects."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, \
        parameters_to_ndarrays

    current, accuracies, n = model_weights(), [], len(clients)
    late_count = int(round_half(stragglers * n))
    for round in range(rounds):
        parts = parts_of(current, clients, round, mu, attackers)
        late = set(np.random.default_rng(round).permutation(n)[:late_count].tolist())
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays(parts[k])),
                                 1 if uniform else len(clients[k][1]), {}))
                   for k in range(n) if k not in late]
        if dp:
            strategy.current_round_params = arrays(current)  # what configure_fit sets
        params, _ = strategy.aggregate_fit(round + 1, results, [])
        current = from_arrays(parameters_to_ndarrays(params), current)
        accuracies.append(accuracy(current, test))
    return accuracies


def initial():
    from flwr.common import ndarrays_to_parameters

    return ndarrays_to_parameters(arrays(model_weights()))


# -- the tables -----------------------------------------------------------------------------------
def non_iid(train_set, test, rounds, folder):
    from flwr.server import strategy as fl

    clients = pathological(train_set, 10)
    adam = {"eta": 0.03, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
    rows = [
        ("FedAvg", {}, lambda: fl.FedAvg(), 0.0),
        ("FedProx mu=0.1", {}, lambda: fl.FedProx(proximal_mu=0.1), 0.1),
        ("FedAdam", {"server": FedAdam(**adam)},
         lambda: fl.FedAdam(initial_parameters=initial(), **adam), 0.0),
    ]
    for stragglers in (0.0, 0.3):
        print(f"\n1. pathological non-IID, 10 clients x 2 classes, {rounds} rounds"
              + (", 30% stragglers each round (quorum=7)" if stragglers else "")
              + ": accuracy per round, ours / Flower")
        for name, how, theirs, mu in rows:
            a = ours(clients, test, rounds, where=f"{folder}/n{stragglers}{name[:6]}",
                     run="r", mu=mu, stragglers=stragglers, **how)
            b = flower(clients, test, rounds, theirs(), mu=mu, stragglers=stragglers)
            shown = "  ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(a, b))
            print(f"   {name:16} {shown}")
            print(f"   {'':16} largest difference {max(abs(x - y) for x, y in zip(a, b)):.4f}")


def byzantine(train_set, test, rounds, folder):
    from flwr.server import strategy as fl
    from flwr.server.strategy.aggregate import aggregate_krum

    clients, f = iid(train_set, 15), 3
    attackers = {0, 5, 10}
    rows = [
        ("FedAvg (clean)", {}, lambda: fl.FedAvg(), ()),
        ("FedAvg", {}, lambda: fl.FedAvg(), attackers),
        ("median", {"aggregate": fedmedian}, lambda: fl.FedMedian(), attackers),
        ("trimmed 0.2", {"aggregate": lambda e, s: fedtrimmedavg(e, s, beta=0.2)},
         lambda: fl.FedTrimmedAvg(beta=0.2), attackers),
        ("Krum", {"aggregate": lambda e, s: krum(e, s, byzantine=f)},
         lambda: fl.Krum(num_malicious_clients=f), attackers),
        ("multi-Krum 6", {"aggregate": lambda e, s: krum(e, s, byzantine=f, keep=6)},
         lambda: fl.Krum(num_malicious_clients=f, num_clients_to_keep=6), attackers),
        ("Bulyan", {"aggregate": lambda e, s: bulyan(e, s, byzantine=f)},
         lambda: fl.Bulyan(num_malicious_clients=f, to_keep=0,
                           first_aggregation_rule=aggregate_krum), attackers),
    ]
    print(f"\n2. 3 of 15 IID clients sign-flipped x10, {rounds} rounds: final accuracy, "
          "ours / Flower")
    for name, how, theirs, bad in rows:
        a = ours(clients, test, rounds, where=f"{folder}/b{name[:8]}", run="r",
                 attackers=bad, **how)
        b = flower(clients, test, rounds, theirs(), attackers=bad)
        print(f"   {name:16} {a[-1]:.3f} / {b[-1]:.3f}")


def private(train_set, test, rounds, folder):
    from flwr.server import strategy as fl

    clients, clip = iid(train_set, 100), 1.0
    print(f"\n3. DP-FedAvg, 100 IID clients, all in every round, clip {clip}, {rounds} rounds, "
          "delta 1e-5: final accuracy, ours / Flower (its noise is its own draw)")
    a = ours(clients, test, rounds, where=f"{folder}/p-none", run="r")
    b = flower(clients, test, rounds, fl.FedAvg(), uniform=True)
    print(f"   {'no DP':16} {a[-1]:.3f} / {b[-1]:.3f}")
    for epsilon in (1.0, 3.0, 8.0):
        noise = noise_for(epsilon, 1e-5, rounds)
        privacy = ClientPrivacy(clip=clip, noise=noise, delta=1e-5, seed=0)
        a = ours(clients, test, rounds, where=f"{folder}/p{epsilon}", run="r",
                 privacy=privacy)
        dp = fl.DifferentialPrivacyServerSideFixedClipping(
            fl.FedAvg(), noise_multiplier=noise, clipping_norm=clip, num_sampled_clients=100)
        b = flower(clients, test, rounds, dp, uniform=True, dp=True)
        spent = Store(f"{folder}/p{epsilon}").resolve(f"fed/r/{rounds - 1}/average")
        print(f"   eps {epsilon:<4g} z={noise:<6.2f} {a[-1]:.3f} / {b[-1]:.3f}   "
              f"(recorded eps {spent.meta['privacy']['epsilon']:.3f})")


def simulated(clients, rounds) -> list[float]:
    """Seconds of each round of Flower's own simulation (Ray, its FedAvg) training the
    same clients the same way; the first round, which starts Ray's actors, left out."""
    import os

    from flwr.client import NumPyClient
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation

    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"),
                                                os.environ.get("PYTHONPATH", "")])
    like, began = model_weights(), []

    class Client(NumPyClient):
        def __init__(self, k):
            self.k = k

        def fit(self, parameters, config):
            torch.set_num_threads(1)
            part = train(from_arrays(parameters, like), clients[self.k], seed=self.k)
            return arrays(part), len(clients[self.k][1]), {}

    class Timed(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            began.append(time.perf_counter())
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            if failures or len(results) != len(clients):
                raise RuntimeError(f"Flower's round {server_round}: {len(results)} results, "
                                   f"{len(failures)} failures: {failures[:1]}")
            return super().aggregate_fit(server_round, results, failures)

    count = len(clients)
    strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=count,
                     min_available_clients=count, initial_parameters=initial())
    start_simulation(client_fn=lambda context: Client(
                         int(context.node_config["partition-id"])).to_client(),
                     num_clients=count, config=ServerConfig(num_rounds=rounds + 1),
                     strategy=strategy, client_resources={"num_cpus": 1},
                     ray_init_args={"num_cpus": 2, "include_dashboard": False,
                                    "log_to_driver": False})
    began.append(time.perf_counter())
    return [b - a for a, b in zip(began[1:], began[2:])]


def seconds(train_set, test, rounds, folder, simulate):
    from flwr.server import strategy as fl

    print(f"\n4. seconds per round (median of {rounds}), 2 local epochs, FedAvg; ours: "
          "clients as threads through a directory store")
    print(f"   {'clients':>8}{'ours':>8}{'Flower sim (Ray)':>18}{'ratio':>8}"
          f"{'no transport':>14}{'beyond it: ours / Flower sim':>32}")
    for count, issue in ((10, 0.43), (100, 4.00)):
        clients = iid(train_set, count)
        times_ours, times_direct = [], []
        for r in range(rounds):
            began = time.perf_counter()
            ours(clients, test, 1, where=f"{folder}/t{count}-{r}", run="r", threads_train=True)
            times_ours.append(time.perf_counter() - began)
            began = time.perf_counter()
            flower(clients, test, 1, fl.FedAvg())
            times_direct.append(time.perf_counter() - began)
        mine = statistics.median(times_ours)
        if simulate:
            sim, said = statistics.median(simulated(clients, rounds)), ""
        else:
            sim, said = issue, " (the issue's, not measured: --quick)"
        direct = statistics.median(times_direct)
        print(f"   {count:>8}{mine:8.3f}{sim:18.3f}{mine / sim:7.2f}x{direct:14.3f}"
              f"{mine - direct:15.3f} / {sim - direct:.3f} = "
              f"{(mine - direct) / (sim - direct):.2f}x{said}")
    print("   target: ours <= 0.25x Flower's simulation per round. 'no transport' is the same "
          "training and FedAvg in one loop: what any round costs; 'beyond it' is the "
          "transport's own cost")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="few rounds: under a minute")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import flwr.common.logger  # noqa: F401 - its handler is set up on import; quiet it after

    logging.getLogger("flwr").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    train_set, test = digits()
    rounds = 3 if args.quick else 20
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        non_iid(train_set, test, rounds, folder)
        byzantine(train_set, test, rounds, folder)
        private(train_set, test, rounds, folder)
        seconds(train_set, test, 3 if args.quick else 5, folder, simulate=not args.quick)
    print(f"\n(took {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
