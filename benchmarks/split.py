"""Split training with the far half on a worker, side by side with its anchors.

Encoder (here) >> Body (on a worker, trained by Split) >> Head (here), against:

- the same model trained in one piece by the same Trainer (the limit: no wire);
- the same split written with ``torch.distributed.rpc`` + distributed autograd +
  ``DistributedOptimizer`` (TensorPipe, CPU), the anchor a user would otherwise write.

At two sizes: one with ~10 ms of compute per step (target: split at most 1.2x the
one-piece step) and a tiny one, whose difference is the fixed cost of a split step
(two round trips: the forward stage and the walk back). Every process runs torch on
one thread, so the comparison is of the machinery and not of who got more cores.

    python benchmarks/split.py            # --quick for fewer steps
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

from _bench import cycled, median

QUICK = "--quick" in sys.argv
STEPS = 30 if QUICK else 100
SIZES = {"~10 ms/step": (512, 256), "tiny": (16, 8)}  # width, batch


class Dense(Node):
    def __init__(self, a, b):
        self.lin = torch.nn.Linear(a, b)

    def forward(self, x, ctx):
        return Opaque(torch.relu(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def model(width, host=None):
    torch.manual_seed(0)
    body = Dense(width, width).named("body")
    body = body.at(host) if host else body
    return Graph.somatize(Dense(width, width).named("encoder") >> body
                          >> Dense(width, width).named("head"))


def batch(width, rows):
    return torch.randn(rows, width), torch.randn(rows, width)


def pipeline_numbers(width, rows, worker, micro=4):
    """The split step with ``micro`` pieces, one after another and overlapped."""
    mse = torch.nn.functional.mse_loss
    data = [batch(width, rows) for _ in range(STEPS)]
    trainers = {}
    for pipe in (False, True):
        cut = model(width, "w")
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        try:
            trainers[pipe] = Trainer(cut, objective=mse, trains=trains, micro=micro, pipeline=pipe,
                                     broker=Broker.embedded({"w": worker}),
                                     optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
        except TypeError:  # a somatize from before pipelining: no figure
            return float("nan"), float("nan")
    times = {False: [], True: []}
    for block in range(4):
        for pipe, trainer in trainers.items():
            times[pipe].append(median(cycled(trainer.step, data), STEPS // 4, warm=5))
    return min(times[False]), min(times[True])


def somatize_numbers(width, rows, worker):
    mse = torch.nn.functional.mse_loss
    data = [batch(width, rows) for _ in range(STEPS)]
    whole = model(width)
    one = Trainer(whole, objective=mse, optimizer=torch.optim.SGD(parameters(whole), lr=0.01))
    cut = model(width, "w")
    trains = {"body": Split(torch.optim.SGD, lr=0.01)}
    split = Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                    optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
    # Interleaved in blocks, so both see the same machine.
    ones, splits = [], []
    for block in range(4):
        ones.append(median(cycled(one.step, data), STEPS // 4, warm=5))
        splits.append(median(cycled(split.step, data), STEPS // 4, warm=5))
    return min(ones), min(splits)


# -- the anchor: torch.distributed.rpc with distributed autograd -----------------------------
class RemoteBody(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin(x))

    def parameter_rrefs(self):
        from torch.distributed.rpc import RRef

        return [RRef(p) for p in self.parameters()]


def rpc_worker(port):
    from torch.distributed import rpc

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rpc.init_rpc("worker", rank=1, world_size=2)
    rpc.shutdown()


def rpc_numbers():
    try:
        import torch.distributed.autograd as dist_autograd
        from torch.distributed import rpc
        from torch.distributed.optim import DistributedOptimizer
    except ImportError:
        return {}
    if not rpc.is_available():
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    child = subprocess.Popen([sys.executable, __file__, "--rpc-worker", port])
    rpc.init_rpc("client", rank=0, world_size=2)
    out = {}
    try:
        for name, (width, rows) in SIZES.items():
            torch.manual_seed(0)
            encoder, head = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
            body = rpc.remote("worker", RemoteBody, args=(width,))
            params = [rpc.RRef(p) for p in [*encoder.parameters(), *head.parameters()]]
            params += body.rpc_sync().parameter_rrefs()
            optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
            data = [batch(width, rows) for _ in range(STEPS)]

            def step(b):
                x, y = b
                with dist_autograd.context() as context:
                    h = torch.relu(encoder(x))
                    h = body.rpc_sync().forward(h)
                    loss = torch.nn.functional.mse_loss(torch.relu(head(h)), y)
                    dist_autograd.backward(context, [loss])
                    optimizer.step(context)
                return loss.item()

            out[name] = min(median(cycled(step, data), STEPS // 4, warm=5) for _ in range(4))
    finally:
        rpc.shutdown()
        child.wait(30)
    return out


def main():
    torch.set_num_threads(1)
    with Worker.generic(mode="network", send=[]) as worker:
        ours = {name: somatize_numbers(width, rows, worker) for name, (width, rows) in SIZES.items()}
        piped = pipeline_numbers(*SIZES["~10 ms/step"], worker)
    anchor = rpc_numbers() if "--no-rpc" not in sys.argv else {}
    print(f"split training, far half on a worker on loopback; median step of {STEPS // 4} "
          "(best of 4 interleaved blocks), 1 thread per process")
    print(f"{'size':14}{'one piece':>12}{'split':>12}{'split/one':>11}{'torch rpc':>12}"
          f"{'split/rpc':>11}")
    for name, (one, split) in ours.items():
        rpc = anchor.get(name, float("nan"))
        print(f"{name:14}{one * 1e3:10.2f}ms{split * 1e3:10.2f}ms{split / one:10.2f}x"
              f"{rpc * 1e3:10.2f}ms{split / rpc:10.2f}x")
    one, split = ours["tiny"]
    print(f"fixed cost of a split step (tiny model): {(split - one) * 1e6:.0f} µs")
    plain, overlapped = piped
    print(f"split step, micro=4 (~10 ms/step): one piece after another {plain * 1e3:.2f}ms, "
          f"pipelined {overlapped * 1e3:.2f}ms, pipelined/unpipelined {overlapped / plain:.2f}x, "
          f"pipelined/split micro=1 {overlapped / ours['~10 ms/step'][1]:.2f}x")
    print("targets: split/one <= 1.2x and split/rpc <= 0.8x at ~10 ms/step; fixed cost "
          "<= 500 µs; pipelined micro=4 <= 0.8x unpipelined")


if __name__ == "__main__":
    if "--rpc-worker" in sys.argv:
        rpc_worker(sys.argv[sys.argv.index("--rpc-worker") + 1])
    else:
        main()
