"""Federated training with no coordinator: N clients, each a process of its own with
its own shard of the data, averaging every round through a store they all reach.

    python examples/federated.py                               # 4 processes, a folder
    python examples/federated.py --via submitit                # submitit, on this machine
    python examples/federated.py --via slurm --store /shared/fed --partition gpu
    python examples/federated.py --via ray                     # Ray tasks, a fresh local cluster
    python examples/federated.py --via ray --ray-address head:6379 --store /shared/fed
    python examples/federated.py --endpoint http://127.0.0.1:9000 --bucket fed

Nobody is in charge. A client trains for a few steps, hands its weights to
``gather`` and gets the round's average back; ``gather`` keeps the client's part in
the store, and whichever client finds the round complete claims the averaging and
writes it. There is no server to keep alive, no port, no protocol: processes on one
machine share a folder, machines on a cluster share a mounted folder or a bucket.

On a cluster the one line that changes is the executor's (see ``executor``):
``submitit.LocalExecutor(folder=...)`` becomes ``submitit.AutoExecutor(folder=...,
cluster="slurm")``, which ``--via slurm`` picks. The store then has to be one every
node reaches: ``--store`` on a shared filesystem, or ``--endpoint``/``--bucket``.

Every client keeps a checkpoint in the store after each round. ``--resume`` (with the
same ``--run``) has each client take its checkpoint up and go on from the next round;
a Slurm job that is preempted is requeued by submitit as the same client resuming.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time

import torch

from somatize import Graph, Node, Opaque
from somatize.store import Store
from somatize.torch import Trainer, parameters
from somatize.torch import gather

INPUTS, WIDTH, BATCH = 8, 16, 16


class Body(Node):
    def __init__(self):
        self.net = torch.nn.Sequential(torch.nn.Linear(INPUTS, WIDTH), torch.nn.Tanh(),
                                       torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self):
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x, ctx):
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def shard(mine: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``mine``'s data: one truth for everybody, inputs drawn around a centre of
    its own (no two clients see the same part of the space), and more rows for later
    clients, so the sizes weigh something."""
    truth = torch.Generator().manual_seed(seed)
    weights = torch.randn(INPUTS, 1, generator=truth)
    local = torch.Generator().manual_seed(seed * 1000 + mine + 1)
    x = torch.randn(48 * (mine + 1), INPUTS, generator=local) + 0.5 * mine
    y = torch.tanh(x @ weights / 4) + 0.05 * torch.randn(len(x), 1, generator=local)
    return x, y


def client(store: Store, mine: int, clients: int, rounds: int, steps: int, run: str,
           seed: int, asking: float, resume: bool = False) -> dict:
    """One client: trains on its shard, and averages with the others every round.

    After each round it keeps a checkpoint of itself in the store; with ``resume`` a
    client that finds one takes it up and goes on from the next round (its batch
    sampler, which is its own, walked past the steps already taken)."""
    torch.manual_seed(seed)  # every client starts from the same weights, as FedAvg does
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    x, y = shard(mine, seed)
    order = torch.Generator().manual_seed(seed + mine)
    losses, done, kept = [], 0, f"fed/{run}/checkpoint/{mine}"
    if resume and store.resolve(kept) is not None:
        done = trainer.resume(store, kept) // steps  # rounds this client had finished
        for _ in range(done * steps):
            torch.randint(len(x), (BATCH,), generator=order)
        losses = store.recall(f"fed/{run}/losses/{mine}")[:done]
        print(f"client {mine} resumed after round {done - 1}", flush=True)
    for round in range(done, rounds):
        taken = []
        for _ in range(steps):
            rows = torch.randint(len(x), (BATCH,), generator=order)
            taken.append(trainer.step((x[rows], y[rows])))
        average = gather(store, trainer.export(), run=run, round=round, clients=clients,
                         mine=mine, size=len(x), asking=asking)
        trainer.load(average)
        losses.append(sum(taken) / len(taken))
        store.keep(f"fed/{run}/losses/{mine}", losses)  # first: a checkpoint finds them
        trainer.checkpoint(store, kept)  # a restarted client goes on from here
    store.keep(f"fed/{run}/final/{mine}", trainer.export(), {"client": mine})
    return {"client": mine, "size": len(x), "losses": losses}


def executor(via: str, folder: str, partition: str | None):
    """Where submitit runs the clients. On a cluster, this is the line that changes."""
    import submitit

    if via == "slurm":
        runs_them = submitit.AutoExecutor(folder=folder, cluster="slurm")
        runs_them.update_parameters(slurm_partition=partition, cpus_per_task=2)
    else:
        runs_them = submitit.LocalExecutor(folder=folder)
    runs_them.update_parameters(timeout_min=30)
    return runs_them


class Requeued:
    """A client as submitit runs it: preempted or out of time on Slurm, submitit asks
    ``checkpoint`` what to requeue, and the answer is the same client told to resume."""

    def __call__(self, *job):
        return client(*job)

    def checkpoint(self, *job):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *job[:-1], True)  # resume=True


def run_clients(via: str, jobs: list[tuple], folder: str, partition: str | None) -> list[dict]:
    """Starts every client at once (they wait for each other) and collects what they say."""
    if via == "processes":
        # spawn, not fork: each client is a fresh interpreter, as it would be elsewhere.
        with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
            return pool.starmap(client, jobs)
    if via == "ray":
        return on_ray(jobs, folder)
    submitted = [executor(via, folder, partition).submit(Requeued(), *job) for job in jobs]
    return [job.result() for job in submitted]


def on_ray(jobs: list[tuple], address: str | None) -> list[dict]:
    """Every client a Ray task on the cluster at ``address`` (a fresh local one if None).

    The clients wait for each other every round, so all of them must run at once:
    each asks for its share of the cluster's CPUs, at most one."""
    import ray

    ray.init(address=address or "local", include_dashboard=False, logging_level="ERROR")
    try:
        share = min(1.0, ray.cluster_resources().get("CPU", 1.0) / len(jobs))
        task = ray.remote(client).options(num_cpus=share, max_retries=0)
        return ray.get([task.remote(*job) for job in jobs])
    finally:
        ray.shutdown()


def opened(args: argparse.Namespace) -> Store:
    if args.bucket:
        return Store.on_bucket(args.endpoint, args.bucket, prefix=args.prefix)
    return Store(args.store or tempfile.mkdtemp(prefix="federated-"))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = arguments()
    args = parser.parse_args(argv)
    if bool(args.endpoint) != bool(args.bucket):
        parser.error("--endpoint and --bucket go together")
    if args.via == "slurm" and not (args.store or args.bucket):
        parser.error("--via slurm needs a store every node reaches: --store on a shared "
                     "filesystem, or --endpoint and --bucket")
    store = opened(args)
    run = args.run or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    print(f"{args.clients} clients x {args.rounds} rounds via {args.via}, run {run!r} in "
          f"{store.where}")
    if args.resume and not args.run:
        parser.error("--resume goes on with a run already started: name it with --run")
    jobs = [(store, k, args.clients, args.rounds, args.steps, run, args.seed, args.asking,
             args.resume) for k in range(args.clients)]
    logs = args.logs or os.path.join("submitit-logs", run)  # one run's, not every run's
    said = run_clients(args.via, jobs, args.ray_address if args.via == "ray" else logs,
                       args.partition)
    print("round " + " ".join(f"client {k} ({s['size']:>3} rows)" for k, s in enumerate(said)))
    for round in range(args.rounds):
        print(f"{round:5d} " + " ".join(f"{s['losses'][round]:20.4f}" for s in said))
    finals = [store.recall(f"fed/{run}/final/{k}") for k in range(args.clients)]
    same = all(torch.equal(finals[0][node][key], final[node][key])
               for final in finals[1:] for node in final for key in final[node])
    print(f"every client ends with the same weights: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)
    return said


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--via", choices=("processes", "submitit", "slurm", "ray"),
                        default="processes")
    parser.add_argument("--ray-address", help="with --via ray: the cluster's address (default: "
                        "a fresh local one); then --store or --bucket must be one every node "
                        "reaches")
    parser.add_argument("--store", help="a folder every client reaches (default: a new "
                        "temporary one)")
    parser.add_argument("--endpoint", help="an S3 endpoint, with --bucket, instead of a folder")
    parser.add_argument("--bucket")
    parser.add_argument("--prefix", default="")
    parser.add_argument("--run", help="the run's name (default: the time and this pid)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--asking", type=float, default=0.2,
                        help="seconds between looks at the store")
    parser.add_argument("--logs", help="submitit's folder for its logs and pickles "
                        "(default: submitit-logs/RUN here, a folder per run)")
    parser.add_argument("--partition", help="the Slurm partition, with --via slurm")
    parser.add_argument("--resume", action="store_true",
                        help="take up each client's checkpoint of run --run, if it has one, "
                             "and go on from the round after it")
    return parser


if __name__ == "__main__":
    main()
