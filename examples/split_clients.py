"""Split learning as its field runs it: several data holders, one server half.

Every client is a process of its own holding a shard of scikit-learn's digits. Its
encoder and its head (so its labels) stay with it; the body in between runs on one
worker, which every client reaches. Nothing but activations and their gradients
crosses the wire: this is the U-shaped split, labels never leave the client.

    python examples/split_clients.py --clients 3 --mode relay
    python examples/split_clients.py --clients 4 --mode parallel --steps 200
    python examples/split_clients.py --clients 3 --mode splitfed --rounds 4

The modes are the paradigms as their papers name them:

- ``relay`` (vanilla split learning, Gupta & Raskar): the clients take turns on one
  shared body, each handing its encoder and head on to the next when its turn ends.
- ``parallel`` (parallel split learning): the clients step at the same time on one
  shared body, each keeping its own encoder and head. The worker applies their
  updates one at a time, and each gradient goes through its own client's activation.
- ``splitfed`` (SplitFed, Thapa et al.): each client trains a body of its own on the
  worker, and every round the clients average their encoders, heads and bodies
  through ``gather`` (a folder they all reach, no coordinator). Each body keeps its
  optimizer's state from round to round, as the worker holds it in the client's
  session and averaging only loads weights.

One shared body is one line: ``Split(Adam, lr=..., shared="body")``; SplitFed is the
same ``Split`` without ``shared``. Each client prints its accuracy on the held-out
digits and what crossed the wire per step, each way.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.store import Store  # noqa: E402
from somatize.torch import Split, Trainer, gather, parameters  # noqa: E402

WIDTH, BATCH, LR = 48, 32, 3e-3


class Dense(Node):
    """A layer; ``last`` leaves out the ReLU (the head's logits)."""

    def __init__(self, a, b, last=False):
        self.lin = torch.nn.Linear(a, b)
        self.last = last

    def forward(self, x, ctx):
        y = self.lin(x)
        return Opaque(y if self.last else torch.relu(y))

    def parameters(self):
        return list(self.lin.parameters())


def model(seed: int) -> Graph:
    """Encoder here, body on the worker (host ``server``), head here."""
    torch.manual_seed(seed)
    return Graph.somatize(Dense(64, WIDTH).named("encoder")
                          >> Dense(WIDTH, WIDTH).named("body").at("server")
                          >> Dense(WIDTH, 10, last=True).named("head"))


def digits(clients: int, seed: int):
    """The digits, scaled to [0, 1]: a shard per client and a held-out test set."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    shards = [train[k::clients] for k in range(clients)]
    return [(x[s], y[s]) for s in shards], (x[test], y[test])


def right(out, y):
    """The share of rows whose largest logit is their digit."""
    return (out.argmax(1) == y).float().mean()


def accuracy(trainer: Trainer, test, shared: bool) -> float:
    """What a client's model gets right on the held-out digits, read by ``evaluate``.
    A body other clients may still be training is not put in eval mode under them:
    the model is built again in one piece here, with the client's exported weights."""
    if not shared:
        return trainer.evaluate([test], metrics={"accuracy": right})["accuracy"]
    g = Graph.somatize(Dense(64, WIDTH).named("encoder") >> Dense(WIDTH, WIDTH).named("body")
                       >> Dense(WIDTH, 10, last=True).named("head"))
    copy = Trainer(g, objective=torch.nn.functional.cross_entropy,
                   optimizer=torch.optim.SGD(parameters(g), lr=0.0))
    copy.load(trainer.export())
    return copy.evaluate([test], metrics={"accuracy": right})["accuracy"]


def client(mine: int, args: argparse.Namespace, where: tuple, token: str, turns, halves,
           store_path: str) -> dict:
    """One data holder: trains on its shard as its mode says and reports."""
    torch.set_num_threads(1)
    shards, test = digits(args.clients, args.seed)
    x, y = shards[mine]
    g = model(args.seed + (mine if args.mode == "parallel" else 0))
    worker = Worker.at("%s:%d" % where, mode="network", send=[__name__], token=token)
    trains = {"body": Split(torch.optim.Adam, lr=LR,
                            shared=None if args.mode == "splitfed" else "body")}
    trainer = Trainer(g, objective=torch.nn.functional.cross_entropy, trains=trains,
                      broker=Broker.embedded({"server": worker}),
                      optimizer=torch.optim.Adam(parameters(g, without=trains), lr=LR))
    order = torch.Generator().manual_seed(args.seed * 100 + mine)
    crossed = {"sent": 0, "received": 0}
    losses, steps, took = [], 0, 0.0

    def step():
        nonlocal steps, took
        rows = torch.randint(len(x), (BATCH,), generator=order)
        before, began = worker.traffic(), time.perf_counter()
        losses.append(trainer.step((x[rows], y[rows])))
        after = worker.traffic()
        if steps:  # the first step also brings the catalog (and connects): not a step's
            took += time.perf_counter() - began
            for way in crossed:
                crossed[way] += after[way] - before[way]
        steps += 1

    per_round = args.steps // args.rounds
    for round in range(args.rounds):
        if args.mode == "relay":
            turns[mine].wait()  # my turn: the client before me handed over
            turns[mine].clear()
            if round or mine:
                trainer.load(torch.load(io.BytesIO(halves.get())))  # the halves it left
        for _ in range(per_round):
            step()
        if args.mode == "relay":
            weights, handed = trainer.export(), io.BytesIO()
            # as bytes: a tensor put on a queue as it is would be shared memory, which
            # is gone once this process is
            torch.save({n: weights[n] for n in ("encoder", "head")}, handed)
            halves.put(handed.getvalue())
            turns[(mine + 1) % args.clients].set()
        elif args.mode == "splitfed":
            average = gather(Store(store_path), trainer.export(), run="splitfed", round=round,
                             clients=args.clients, mine=mine, size=len(x), asking=0.05)
            trainer.load(average)
    if args.mode == "relay" and mine == args.clients - 1:
        halves.get()  # the last client's halves, handed to nobody
    read = accuracy(trainer, test, shared=args.mode != "splitfed")
    trainer.close()
    worker.close()
    counted = max(steps - 1, 1)
    return {"client": mine, "rows": len(x), "accuracy": read,
            "first": sum(losses[:5]) / 5, "last": sum(losses[-5:]) / 5,
            "out": crossed["sent"] / counted, "back": crossed["received"] / counted,
            "step_ms": took / counted * 1e3}


def reporting(results, mine: int, *job) -> None:
    """A client's process: what it reports, or what stopped it, goes on ``results``."""
    try:
        results.put(client(mine, *job))
    except BaseException as exc:  # said by the parent, which waits for every client
        results.put({"client": mine, "error": f"{type(exc).__name__}: {exc}"})
        raise


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--mode", choices=("relay", "parallel", "splitfed"), default="parallel")
    parser.add_argument("--steps", type=int, default=120, help="steps each client takes")
    parser.add_argument("--rounds", type=int, default=2,
                        help="turns round the clients (relay), averagings (splitfed)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = arguments().parse_args(argv)
    if args.steps < args.rounds or args.clients < 1:
        raise SystemExit("--steps must be at least --rounds, and --clients at least 1")
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters, as elsewhere
    turns = [spawn.Event() for _ in range(args.clients)]
    turns[0].set()
    halves = spawn.Queue()
    print(f"{args.clients} clients, {args.mode}, {args.steps} steps each, one worker")
    with Worker.generic(mode="network", send=[__name__]) as server, \
            tempfile.TemporaryDirectory(prefix="splitfed-") as folder:
        where = server.address("server")
        began = time.perf_counter()
        results = spawn.Queue()
        clients = [spawn.Process(target=reporting, args=(results, k, args, where,
                                                         server.token.decode(), turns, halves,
                                                         folder)) for k in range(args.clients)]
        for process in clients:
            process.start()
        said = sorted((results.get(timeout=600) for _ in clients), key=lambda s: s["client"])
        for process in clients:
            process.join()
        took = time.perf_counter() - began
    failed = [s for s in said if "error" in s]
    if failed:
        raise SystemExit("\n".join(f"client {s['client']} failed: {s['error']}" for s in failed))
    print("client  rows  loss first -> last  accuracy  out B/step  back B/step  step ms")
    for s in said:
        print(f"{s['client']:6d}  {s['rows']:4d}  {s['first']:10.3f} -> {s['last']:.3f}  "
              f"{s['accuracy']:8.3f}  {s['out']:10.0f}  {s['back']:11.0f}  {s['step_ms']:7.2f}")
    mean = sum(s["accuracy"] for s in said) / len(said)
    print(f"mean accuracy {mean:.3f}; {args.clients * args.steps} steps in {took:.1f} s")
    return said


if __name__ == "__main__":
    main()
