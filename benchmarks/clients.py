"""Many clients, one server half: what a shared trainer serves as clients are added.

N = 1, 2, 4 client processes train the ~10 ms model of ``split.py`` (Encoder here >>
Body on one worker >> Head here) in parallel split learning: one body on the worker,
``Split(SGD, lr=0.01, shared=key)``, each client its own encoder and head. Printed for
each N, in one run: the server half's updates per second (every client's steps, over
the time from the first client's start to the last client's end), that rate over
one client's, and each client's median step time.

Behind a link (``--link``, default ``10ms``: 20 ms round trips, ``link.py`` in a
process of its own) a client spends most of a step waiting for the wire, which is
what several clients fill: the target is 4 clients at least 2.5x the updates per
second of one. On loopback (``--link none``) the step is compute, and how far N
clients scale is how many cores there are for them.

    python benchmarks/clients.py                  # --quick for fewer steps
    python benchmarks/clients.py --link 2ms,100mbit
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
import uuid

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

from link import LinkProcess  # noqa: E402
from split import SIZES, batch, model  # noqa: E402

QUICK = "--quick" in sys.argv
LINK = sys.argv[sys.argv.index("--link") + 1] if "--link" in sys.argv else "10ms"
STEPS = 15 if QUICK else 40
WARM = 3
CLIENTS = (1, 2, 4)


def client(mine: int, key: str, where: tuple, token: str, start, results) -> None:
    """One client process: warms up, waits for the others, then times its steps."""
    torch.set_num_threads(1)
    width, rows = SIZES["~10 ms/step"]
    g = model(width, "w")
    trains = {"body": Split(torch.optim.SGD, lr=0.01, shared=key)}
    worker = Worker.at("%s:%d" % where, mode="network", send=["split"], token=token)
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains,
                      broker=Broker.embedded({"w": worker}),
                      optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01))
    torch.manual_seed(mine)
    data = [batch(width, rows) for _ in range(4)]
    for k in range(WARM):
        trainer.step(data[k % 4])
    start.wait()
    began, steps = time.perf_counter(), []
    for k in range(STEPS):
        at = time.perf_counter()
        trainer.step(data[k % 4])
        steps.append(time.perf_counter() - at)
    ended = time.perf_counter()
    trainer.close()
    worker.close()
    results.put({"client": mine, "began": began, "ended": ended, "steps": steps})


def served(n: int, where: tuple, token: str) -> dict:
    """N clients on one shared body at once: the updates per second the body took."""
    spawn = multiprocessing.get_context("spawn")
    start, results, key = spawn.Barrier(n), spawn.Queue(), uuid.uuid4().hex
    processes = [spawn.Process(target=client, args=(k, key, where, token, start, results))
                 for k in range(n)]
    for p in processes:
        p.start()
    said = [results.get(timeout=600) for _ in processes]
    for p in processes:
        p.join()
    wall = max(s["ended"] for s in said) - min(s["began"] for s in said)
    return {"rate": n * STEPS / wall,
            "step": [statistics.median(s["steps"]) for s in sorted(said, key=lambda s: s["client"])]}


def main() -> None:
    spec = None if LINK == "none" else LINK
    with Worker.generic(mode="network") as worker:
        token = worker.token.decode()
        if spec is None:
            table = {n: served(n, worker.address("w"), token) for n in CLIENTS}
        else:
            with LinkProcess(spec, worker.address("w")) as link:
                table = {n: served(n, link.address, token) for n in CLIENTS}
    where = f"behind a {spec} link" if spec else "on loopback"
    print(f"parallel split learning, one shared body on a worker {where}; ~10 ms model, "
          f"{STEPS} timed steps per client, 1 torch thread per process, "
          f"{os.cpu_count()} cores")
    print(f"{'clients':>8}{'updates/s':>12}{'vs one':>9}   client step medians (ms)")
    one = table[1]["rate"]
    for n, row in table.items():
        steps = " ".join(f"{s * 1e3:6.1f}" for s in row["step"])
        print(f"{n:8d}{row['rate']:12.1f}{row['rate'] / one:8.2f}x   {steps}")
    print("target: behind a link with latency, 4 clients >= 2.5x the updates/s of one")


if __name__ == "__main__":
    main()
