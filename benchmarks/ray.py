"""Worker.on_ray side by side with a bare Ray actor and with the socket worker.

Four measurements, each against its anchors in the same run, on one local cluster:

1. a tiny remote forward (one small str there and back) through ``Worker.on_ray``
   vs a bare ``ray.get(actor.echo.remote(x))`` (target: at most 1.5x) and vs the
   socket worker (``Worker.generic``);
2. a 64 MB float32 tensor there and back through a remote identity node on Ray vs
   the socket wire and vs a bare Ray round trip of the same tensor (target: at least
   the bare Ray throughput);
3. a split training step on the ~10 ms model of ``benchmarks/split.py`` with the
   body on a Ray actor vs on the socket worker;
4. that step in four pieces, one after another and pipelined, on each.

    python benchmarks/ray.py            # add --quick for fewer repetitions
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# This file is called ray.py: its folder must not stand first on the path when Ray is
# imported, or it would import itself. It goes back last, for _bench.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import ray  # noqa: E402
import torch  # noqa: E402

import somatize.torch  # noqa: E402,F401  (the tensor codec)
from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

sys.path.append(HERE)
from _bench import cycled, median  # noqa: E402
from split import model, pipeline_numbers  # noqa: E402  (the ~10 ms model, the same one)

QUICK = "--quick" in sys.argv
TINY = 100 if QUICK else 500
BIG = 3 if QUICK else 8
STEPS = 30 if QUICK else 100
MB64 = 64 << 20


class Same(Node):
    def forward(self, x, ctx):
        return Opaque(x) if isinstance(x, torch.Tensor) else x


@ray.remote(num_cpus=0)
class Bare:
    def echo(self, x):
        return x


def interleaved(contenders: dict, repeat: int, warm: int = 3) -> dict:
    """The best of four blocks' medians for each contender, blocks taken in turn, so
    that every one sees the same machine."""
    got: dict = {name: [] for name in contenders}
    for _ in range(4):
        for name, fn in contenders.items():
            got[name].append(median(fn, max(3, repeat // 4), warm=warm))
    return {name: min(times) for name, times in got.items()}


def tiny_and_big(on_ray, socket_worker, bare):
    g = {name: Graph.somatize(Same().at("w")) for name in ("ray", "socket")}
    brokers = {"ray": Broker.embedded({"w": on_ray}), "socket": Broker.embedded({"w": socket_worker})}
    word = "hello, world"
    tiny = interleaved({
        "bare ray": lambda: ray.get(bare.echo.remote(word)),
        "on_ray": lambda: g["ray"].forward(word, broker=brokers["ray"]),
        "socket": lambda: g["socket"].forward(word, broker=brokers["socket"]),
    }, TINY)
    x = torch.randn(MB64 // 4)
    assert torch.equal(g["ray"].forward(Opaque(x), broker=brokers["ray"]), x)
    big = interleaved({
        "bare ray": lambda: ray.get(bare.echo.remote(x)),
        "bare ray (numpy)": lambda: ray.get(bare.echo.remote(x.numpy())),
        "on_ray": lambda: g["ray"].forward(Opaque(x), broker=brokers["ray"]),
        "socket": lambda: g["socket"].forward(Opaque(x), broker=brokers["socket"]),
    }, BIG * 4, warm=1)
    return tiny, big


def split_step(on_ray, socket_worker):
    width, rows = 512, 256
    mse = torch.nn.functional.mse_loss
    data = [(torch.randn(rows, width), torch.randn(rows, width)) for _ in range(STEPS)]
    steps = {}
    for name, worker in (("ray", on_ray), ("socket", socket_worker)):
        cut = model(width, "w")
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        trainer = Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
        steps[name] = cycled(trainer.step, data)
    whole = model(width)
    one = Trainer(whole, objective=mse, optimizer=torch.optim.SGD(parameters(whole), lr=0.01))
    steps["one piece"] = cycled(one.step, data)
    return interleaved(steps, STEPS, warm=5)


def main():
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    bare = Bare.remote()
    ray.get(bare.echo.remote(0))
    with Worker.on_ray(mode="network", send=["split"], num_cpus=0) as on_ray, \
            Worker.generic(mode="network", send=["split"]) as socket_worker:
        tiny, big = tiny_and_big(on_ray, socket_worker, bare)
        split = split_step(on_ray, socket_worker)
        piped = {name: pipeline_numbers(512, 256, worker)
                 for name, worker in (("ray", on_ray), ("socket", socket_worker))}
    ray.shutdown()
    print(f"1. tiny remote forward (a str there and back), median of {TINY // 4} "
          "(best of 4 interleaved blocks)")
    for name, took in tiny.items():
        print(f"   {name:18}{took * 1e6:10.0f} µs{took / tiny['bare ray']:8.2f}x bare ray")
    print("   target: on_ray <= 1.5x bare ray")
    print(f"2. 64 MB float32 tensor there and back (128 MB moved), median of {BIG}")
    for name, took in big.items():
        print(f"   {name:18}{took * 1e3:10.1f} ms{2 * MB64 / took / 1e9:8.2f} GB/s"
              f"{big['bare ray'] / took:8.2f}x bare ray's throughput")
    print("   target: on_ray >= bare ray's throughput (a torch tensor, as a user sends it)")
    print(f"3. split step, ~10 ms model (512 wide, 256 rows), median of {STEPS // 4}")
    for name, took in split.items():
        print(f"   {name:18}{took * 1e3:10.2f} ms{took / split['one piece']:8.2f}x one piece"
              f"{took / split['socket']:8.2f}x socket")
    print("4. the same step in micro=4 pieces, one after another and pipelined")
    for name, (plain, overlapped) in piped.items():
        print(f"   {name:18}{plain * 1e3:10.2f} ms{overlapped * 1e3:10.2f} ms pipelined"
              f"{overlapped / plain:8.2f}x")


if __name__ == "__main__":
    main()
