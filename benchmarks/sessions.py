"""What owning a Trainer's state on a worker costs: a checkpoint, and the memory held.

The ~10 ms MLP of ``benchmarks/split.py`` with its body on a worker trained by
``Split(Adam)``, against the same run with no checkpoint at all:

- **a checkpoint's cost**: the median of (keep one, then step) less the median step,
  and whether the losses after it are ``==`` those of the run never checkpointed (a
  checkpoint must change nothing that follows; before sessions it put the worker's
  body back at its first weights, and the next step re-sent the whole catalog);
- **a worker's memory** (its resident set, from ``/proc``) with 1, 8 and 32 sessions of
  that model held side by side, each a Trainer that took one step (so Adam's moments
  are built there), against the worker with none.

    python benchmarks/sessions.py            # --quick for fewer repeats
    python benchmarks/sessions.py --checkpoint-only   # against a somatize without sessions
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

from _bench import cycled, median
from split import batch, model

QUICK = "--quick" in sys.argv
ONLY_CHECKPOINT = "--checkpoint-only" in sys.argv  # for a somatize without sessions
STEPS = 20 if QUICK else 40
KEEPS = 5 if QUICK else 12
WIDTH, ROWS = 512, 256
HELD = (1, 8, 32)


def standing() -> tuple[subprocess.Popen, str, str]:
    """A worker started as on another machine, so its process can be measured."""
    token = secrets.token_hex(16)
    env = dict(os.environ, SOMATIZE_TOKEN=token, PYTHONPATH=os.pathsep.join(sys.path))
    bound = [] if ONLY_CHECKPOINT else ["--max-sessions", "64"]
    proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen",
                             "127.0.0.1:0", "--quiet", *bound], env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    return proc, proc.stdout.readline().split()[-1], token


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def trainer(worker: Worker) -> Trainer:
    g = model(WIDTH, "w")
    trains = {"body": Split(torch.optim.Adam, lr=1e-3)}
    return Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains,
                   broker=Broker.embedded({"w": worker}),
                   optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-3))


def checkpoint_cost(worker: Worker, folder: str) -> dict:
    torch.manual_seed(1)
    data = [batch(WIDTH, ROWS) for _ in range(8)]
    plain, kept = trainer(worker), trainer(worker)
    step = median(cycled(plain.step, data), STEPS, warm=3)
    at = iter(range(10**9))

    def keep_then_step():
        kept.checkpoint(folder, f"ck{next(at)}")
        return kept.step(data[0])
    both = median(keep_then_step, KEEPS, warm=1)
    # The user's question: does a checkpoint change what follows?
    torch.manual_seed(2)
    fresh = [batch(WIDTH, ROWS) for _ in range(6)]
    a, b = trainer(worker), trainer(worker)
    never = [a.step(x) for x in fresh]
    checked = []
    for k, x in enumerate(fresh):
        b.checkpoint(folder, f"same{k}")
        checked.append(b.step(x))
    return {"step": step, "keep": both - step, "same": checked == never}


def memory(worker: Worker, pid: int) -> dict:
    empty = resident_mb(pid)
    held, trainers = {}, []
    x = batch(WIDTH, ROWS)
    for count in HELD:
        while len(trainers) < count:
            t = trainer(worker)
            t.step(x)
            trainers.append(t)
        held[count] = resident_mb(pid)
    return {"empty": empty, **held}


def main() -> None:
    torch.set_num_threads(1)
    proc, address, token = standing()
    try:
        with tempfile.TemporaryDirectory() as folder, \
                Worker.at(address, mode="network", send=["split"], token=token) as worker:
            cost = checkpoint_cost(worker, folder)
        print(f"~10 ms model, Split(Adam) on a worker: step {cost['step'] * 1e3:.1f} ms; "
              f"a checkpoint (keep, then the next step) costs {cost['keep'] * 1e3:.1f} ms "
              f"= {cost['keep'] / cost['step']:.2f} steps")
        print(f"losses after a checkpoint == the run never checkpointed: {cost['same']}")
    finally:
        proc.kill()
        proc.wait()
    if ONLY_CHECKPOINT:
        return
    proc, address, token = standing()
    try:
        with Worker.at(address, mode="network", send=["split"], token=token) as worker:
            held = memory(worker, proc.pid)
        body = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
        print(f"worker resident memory: {held['empty']:.0f} MB holding no session; the "
              f"first session also loads torch. The body is {body:.2f} MB of float32: with "
              f"its gradient and Adam's two moments, {4 * body:.1f} MB a session at least")
        first = held[HELD[0]]
        for count in HELD:
            more = (held[count] - first) / (count - 1) if count > 1 else 0.0
            print(f"  {count:2d} session(s) held: {held[count]:.0f} MB"
                  + (f" ({more:.1f} MB for each session past the first)" if count > 1 else ""))
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
