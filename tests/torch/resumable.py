"""A training run that keeps checkpoints, for the checkpoint tests to kill and take up.

``python resumable.py STORE OUT MODE [--kill-at N] [--resume]`` trains 40 steps (4 epochs
of 10 batches) keeping a checkpoint every 10, and writes the final weights to OUT.
``--kill-at N`` sends itself SIGKILL as step N ends, as a preempted job dies; ``--resume``
takes up the checkpoint first and makes the very same fit call. MODE ``local`` trains
with Adam and dropout here; ``split`` also trains a dropout body on a real worker with
Split(Adam), every=3 so that a checkpoint falls inside an open group. The objective
draws from Python's ``random`` and numpy, so every generator a run uses matters.
"""

import argparse
import os
import random
import signal
import sys
import time

import numpy
import torch
from resumenets import Lin

from somatize import Broker, Graph, Worker
from somatize.store import Store
from somatize.torch import Split, Trainer, parameters

STEPS, EVERY = 40, 10


def objective(output, target):
    wobble = 1 + 0.01 * random.random() + 0.01 * float(numpy.random.rand())
    return torch.nn.functional.mse_loss(output, target) * wobble


def build(mode, broker):
    torch.manual_seed(0)
    far = mode == "split"
    body = Lin(8, 8, drop=0.25).named("body")
    g = Graph.somatize(Lin(4, 8, drop=0.25).named("encoder") >> (body.at("gpu") if far else body)
                       >> Lin(8, 1, relu=False).named("head"))
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)} if far else {}
    return g, trains


def batches():
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator))
            for _ in range(STEPS // 4)]


def written(store, steps):
    """Waits (a few seconds at most) for the checkpoint of ``steps``, which fit writes on
    a thread, so that the kill always finds the same one kept."""
    kept = Store(store)
    for _ in range(500):
        bound = kept.resolve("run/ckpt")
        if bound is not None and bound.meta["steps"] == steps:
            return
        time.sleep(0.01)


def run(store, out, mode, kill_at, resume, broker=None, keeping=True):
    g, trains = build(mode, broker)
    taken = []

    def watch(fact):
        if fact.get("fact") == "loss":
            taken.append(fact["value"])
            if kill_at and len(taken) + started == kill_at:
                written(store, kill_at - kill_at % EVERY)
                os.kill(os.getpid(), signal.SIGKILL)

    t = Trainer(g, objective=objective, trains=trains, broker=broker, watching=watch,
                every=3 if mode == "split" else 1,
                optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2))
    t.seed(0)  # here and on the worker, whose process starts from a state of its own
    started = t.resume(store, "run/ckpt") if resume else 0
    kept = {"checkpoint": (store, "run/ckpt"), "checkpoint_every": EVERY} if keeping else {}
    result = t.fit(batches(), epochs=4, **kept)
    torch.save({"weights": t.export(), "resumed_at": started, "losses": result.history}, out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("out")
    parser.add_argument("mode", choices=["local", "split"])
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    trained(args.store, args.out, args.mode, args.kill_at, args.resume)
    return 0


def trained(store, out, mode, kill_at=0, resume=False, keeping=True):
    """The whole run, with a worker of its own where the mode has one; one thread, as
    the sums of a matrix product may be added in another order on several.
    ``keeping=False`` is the run that never keeps a checkpoint, to compare with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if mode == "split":
            with Worker.generic(mode="network", send=["resumenets"]) as worker:
                run(store, out, mode, kill_at, resume, Broker.embedded({"gpu": worker}),
                    keeping)
        else:
            run(store, out, mode, kill_at, resume, keeping=keeping)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
