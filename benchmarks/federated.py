"""Federated averaging and rounds, side by side with their anchors.

1. ``fedavg`` of 10 exports of 25M float32 parameters each (25 tensors of 1M in 5
   nodes), weighted by sizes, against a numpy loop doing the same weighted average
   (``total += x * n`` per array, then ``/ sum(n)``) and, where installed, Flower's own
   ``aggregate``. Target: at least as fast as the numpy loop, and no more than one
   extra export in memory. Each contestant runs in a fresh process that builds the
   exports first, so the peak RSS it adds is its own (``ru_maxrss`` after, minus
   before); the answer is one export, so the last column is what it took beyond that.
2. ``gather`` noticing a completed round: four client processes, the last of which
   joins 0.3 s late; the time from its part being kept (the ``when`` of its record)
   to the last of the others returning, at ``asking=0.1``, on a folder and (where
   moto is installed) on a bucket. Target: under 0.5 s. Anchor: flwr_serverless asks
   its shared folder every 3 s, so it notices 1.5 s late on average and 3 s at worst.

    python benchmarks/federated.py

Needs about 2.5 GB of memory.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

EXPORTS, NODES, KEYS, PER = 10, 5, 5, 1_000_000  # 25M parameters per export
ONE_EXPORT_MB = NODES * KEYS * PER * 4 / 2**20


def exports():
    import torch

    generator = torch.Generator().manual_seed(0)
    made = [{f"node{n}": {f"w{k}": torch.randn(PER, generator=generator) for k in range(KEYS)}
             for n in range(NODES)} for _ in range(EXPORTS)]
    return made, [100 * (i + 1) for i in range(EXPORTS)]


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def contestant(name: str, threads: int, answer) -> None:
    """Runs in a fresh process: builds the exports, averages them, says time and memory."""
    import torch

    torch.set_num_threads(threads)
    made, sizes = exports()
    if name == "fedavg":
        from somatize.torch._federated import fedavg

        def average():
            return fedavg(made, sizes)
    elif name == "numpy loop":
        arrays = [[weights[k].numpy() for weights in e.values() for k in weights] for e in made]

        def average():
            totals = [a * sizes[0] for a in arrays[0]]
            for export, size in zip(arrays[1:], sizes[1:]):
                for total, a in zip(totals, export):
                    total += a * size
            whole = sum(sizes)
            return [total / whole for total in totals]
    else:
        from flwr.server.strategy.aggregate import aggregate

        arrays = [[weights[k].numpy() for weights in e.values() for k in weights] for e in made]

        def average():
            return aggregate(list(zip(arrays, sizes)))

    before = peak_mb()
    began = time.perf_counter()
    result = average()
    first = time.perf_counter() - began
    added = peak_mb() - before
    del result
    times = [first]
    for _ in range(2):
        began = time.perf_counter()
        average()
        times.append(time.perf_counter() - began)
    answer.send((min(times), added))


def averaging() -> None:
    context = multiprocessing.get_context("spawn")
    rows = [("fedavg", 1), ("numpy loop", 1), ("fedavg", os.cpu_count() or 1)]
    try:
        import flwr.server.strategy.aggregate  # noqa: F401

        rows.append(("flwr aggregate", 1))
    except ImportError:
        print("   (flwr is not installed: its aggregate is left out)")
    results = {}
    for name, threads in rows:
        mine, theirs = context.Pipe()
        child = context.Process(target=contestant, args=(name, threads, theirs))
        child.start()
        results[name, threads] = mine.recv()
        child.join()
    numpy_time = results["numpy loop", 1][0]
    print(f"1. fedavg, {EXPORTS} exports x 25M float32 ({ONE_EXPORT_MB:.0f} MB each)")
    print(f"   {'':26}{'seconds':>9}{'vs numpy':>10}{'peak added':>12}{'beyond the answer':>19}")
    for (name, threads), (took, added) in results.items():
        print(f"   {name + f' ({threads} thread' + ('s' if threads > 1 else '') + ')':26}"
              f"{took:9.3f}{numpy_time / took:9.2f}x{added:9.0f} MB"
              f"{added - ONE_EXPORT_MB:10.0f} MB ({added / ONE_EXPORT_MB - 1:.2f} x)")
    print("   target: fedavg at least as fast as the numpy loop (>= 1.00x), and nothing but "
          "the answer added (one export)")


def client(where, bucket, mine, clients, rounds, late, answer) -> None:
    import torch

    from somatize.store import Store
    from somatize.torch._federated import gather

    store = Store.on_bucket(where, bucket) if bucket else Store(where, durable=False)
    weights = {"net": {"w": torch.full((100_000,), float(mine))}}
    returned = []
    for round in range(rounds):
        if mine == clients - 1:
            time.sleep(late)
        gather(store, weights, run="bench", round=round, clients=clients, mine=mine,
               asking=0.1, within=60)
        returned.append(time.time())
    answer.send(returned)


def noticing(where: str, bucket: str | None, label: str) -> None:
    from somatize.store import Store

    clients, rounds = 4, 5
    context = multiprocessing.get_context("spawn")
    pipes, children = [], []
    for mine in range(clients):
        ours, theirs = context.Pipe()
        child = context.Process(target=client,
                                args=(where, bucket, mine, clients, rounds, 0.3, theirs))
        child.start()
        pipes.append(ours)
        children.append(child)
    returned = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join()
    store = Store.on_bucket(where, bucket) if bucket else Store(where)
    lags = [max(returned[k][r] for k in range(clients - 1))
            - store.resolve(f"fed/bench/{r}/client/{clients - 1}").when for r in range(rounds)]
    print(f"   {label:10} median {statistics.median(lags):.3f} s   worst {max(lags):.3f} s   "
          f"(anchor: flwr_serverless 1.5 s on average, 3 s at worst; target < 0.5 s)")


def moto():
    """A moto S3 server on a free loopback port, or None if moto is not installed."""
    try:
        import boto3
        import moto.server  # noqa: F401
    except ImportError:
        return None, None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(200):
        try:
            client.create_bucket(Bucket="bench")
            return server, endpoint
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    server.kill()
    return None, None


def main() -> None:
    averaging()
    print("2. gather: the last client's part kept -> every other client has the average")
    with tempfile.TemporaryDirectory() as where:
        noticing(os.path.join(where, "store"), None, "folder")
    server, endpoint = moto()
    if server is None:
        print("   (moto is not installed: the bucket is left out)")
        return
    try:
        noticing(endpoint, "bench", "bucket")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
