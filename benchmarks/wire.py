"""The wire, side by side with raw loopback sockets and torch.distributed.rpc.

Four measurements, each against its anchors in the same run, every server in a
process of its own:

1. a tiny remote forward (one small str there and back) vs a raw TCP echo of a
   message of similar size (one ``recv`` and one ``sendall`` into a small buffer), in
   interleaved blocks, with each side's CPU per round trip; and vs ``rpc_sync`` of a
   trivial function;
2. a 64 MB float32 tensor through a remote identity node vs a raw socket moving
   64 MB each way, and vs ``rpc_sync`` sending the same tensor (TensorPipe, CPU);
3. bytes on the wire per activation element, from the wire's own ``sent`` and
   ``received`` facts.

4. one wave of tiny remote nodes over 1, 4 and 16 hosts (a worker process each), vs
   one host's round trip.

    python benchmarks/wire.py            # add --quick for fewer repetitions
    python benchmarks/wire.py --fan-out  # only the wave over many hosts
    python benchmarks/wire.py --tiny     # only the tiny round trip beside the echo

On a virtual machine most of a tiny round trip's wall time can be the wake-up of a
process on another core, for the echo as much as for us: on the 2-core VM this was
measured on, the echo took 55 µs spread over two cores and 18.5 µs with both
processes on one. ``taskset -c 0 python benchmarks/wire.py --tiny`` puts every
process on one core, where a round trip's wall time is the CPU both sides spend on it.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import time

import torch

import somatize.torch  # noqa: F401  (the tensor codec)
from somatize import Graph, Node, Opaque, Worker

from _bench import cpu_seconds, median

QUICK = "--quick" in sys.argv
TINY = 300 if QUICK else 2000
BIG = 3 if QUICK else 8
MB64 = 64 << 20
_LENGTH = struct.Struct("<Q")


class Same(Node):
    def forward(self, x, ctx):
        return Opaque(x) if isinstance(x, torch.Tensor) else x


# -- raw sockets --------------------------------------------------------------------
ECHO = r"""
import socket, struct, sys
L = struct.Struct("<Q")
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 16)  # what a small message needs; grown only for a larger one
view = memoryview(buf)
def fill(v):
    got = 0
    while got < len(v):
        n = c.recv_into(v[got:])
        if not n:
            sys.exit(0)
        got += n
while True:
    fill(view[:8])
    (size,) = L.unpack_from(buf)
    if 8 + size > len(buf):
        buf = bytearray(8 + size)
        view = memoryview(buf)
    fill(view[8:8 + size])
    c.sendall(view[:8 + size])
"""


class RawEcho:
    """A length-prefixed echo server in another process: the physical limit."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.back = bytearray(1 << 16)

    def round_trip(self, payload: memoryview) -> None:
        self.sock.sendmsg([_LENGTH.pack(len(payload)), payload])
        if len(payload) + 8 > len(self.back):
            self.back = bytearray(len(payload) + 8)
        view = memoryview(self.back)[: len(payload) + 8]
        got = 0
        while got < len(view):
            got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(5)


# -- torch.distributed.rpc -------------------------------------------------------------
def trivial(x):
    return x


def rpc_worker(port: str) -> None:
    from torch.distributed import rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rpc.init_rpc("worker", rank=1, world_size=2)
    rpc.shutdown()


def rpc_numbers(payload: torch.Tensor) -> tuple[float, float] | None:
    try:
        from torch.distributed import rpc
    except ImportError:
        return None
    if not rpc.is_available():
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    child = subprocess.Popen([sys.executable, __file__, "--rpc-worker", port])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rpc.init_rpc("client", rank=0, world_size=2)
    try:
        tiny = median(lambda: rpc.rpc_sync("worker", trivial, args=("hello" * 20,)), TINY)
        big = median(lambda: rpc.rpc_sync("worker", trivial, args=(payload,)), BIG)
    finally:
        rpc.shutdown()
        child.wait(30)
    return tiny, big


# -- a tensor codec that does not copy ----------------------------------------------
def zero_copy_codec() -> None:
    """Registers, in this process, a tensor codec writing the same bytes as the shipped
    one without its two copies: ``dump`` answers with the header and the tensor's own
    memory (sent back to back, received as one buffer), and ``load`` views the buffer
    the wire received, which is its to keep. What the wire does when the codec lets it."""
    import json

    from somatize import codec
    from somatize.torch import _codec as shipped

    def dump(tensor):
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return shipped.dump(tensor)
        size = tensor.numel() * 4
        header = json.dumps({"t": {"data_offsets": [0, size], "dtype": "F32",
                                   "shape": list(tensor.shape)}},
                            separators=(",", ":"), sort_keys=True).encode()
        header += b" " * (-(len(header) + 8) % 16)
        return (_LENGTH.pack(len(header)) + header, memoryview(tensor.detach().numpy()).cast("B"))

    def load(blob):
        if isinstance(blob, bytes) or memoryview(blob).readonly:
            return shipped.load(blob)
        dtype, shape, start, size = shipped._header(blob)
        return torch.frombuffer(blob, dtype=torch.uint8, offset=start, count=size).view(dtype).view(shape)

    codec(shipped.KIND, torch.Tensor, dump=dump, load=load)


def zero_copy_worker() -> None:
    from somatize.worker import main as worker_main

    zero_copy_codec()
    sys.exit(worker_main(["--listen", "127.0.0.1:0"]))


# -- the tiny round trip, beside the echo ---------------------------------------------
def far_cpu(pid: int) -> float | None:
    """``cpu_seconds`` of process ``pid``, or None where ``/proc`` no longer says."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return None


def worker_process() -> tuple[subprocess.Popen, Worker]:
    """A worker process started here (so its CPU can be read), and the Worker reaching it."""
    token = secrets.token_hex(16)
    proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0",
                             "--quiet"], stdout=subprocess.PIPE,
                            env={**os.environ, "SOMATIZE_TOKEN": token})
    line = proc.stdout.readline().decode()
    address = re.search(r"listening on (\S+)", line)
    if address is None:
        proc.kill()
        raise RuntimeError(f"the worker first said {line!r}")
    return proc, Worker.at(address.group(1), mode="network", token=token)


def tiny_numbers(rounds: int = 5) -> dict[str, dict[str, float]]:
    """A tiny remote forward and the raw echo of a message of its size, in interleaved
    blocks: per round trip, the wall time, this process's CPU and the far process's
    CPU (medians over the blocks). What the forward costs beyond the echo on each side
    is the wire's and the engine's own work per message."""
    echo = RawEcho()
    proc, worker = worker_process()
    g = Graph.somatize(Same().at("w1"))
    broker = {"w1": worker}
    message = memoryview(b"x" * 160)  # about what the tiny forward puts on the wire
    contenders = {"echo": (lambda: echo.round_trip(message), echo.proc.pid),
                  "somatize": (lambda: g.forward("hello" * 20, broker=broker), proc.pid)}
    seen: dict[str, dict[str, list[float]]] = {name: {"wall": [], "here": [], "there": []}
                                               for name in contenders}
    counts = {}
    try:
        for name, (fn, _) in contenders.items():  # warm, and sized so a block lasts a
            began = time.perf_counter()           # while: CPU time is read in 10 ms ticks
            for _ in range(50):
                fn()
            counts[name] = max(200, int((0.1 if QUICK else 0.4) * 50 / (time.perf_counter() - began)))
        for _ in range(rounds):
            for name, (fn, pid) in contenders.items():
                count = counts[name]
                wall, here, there = time.perf_counter(), time.process_time(), far_cpu(pid)
                for _ in range(count):
                    fn()
                after = far_cpu(pid)
                seen[name]["wall"].append((time.perf_counter() - wall) / count)
                seen[name]["here"].append((time.process_time() - here) / count)
                seen[name]["there"].append(float("nan") if after is None else (after - there) / count)
    finally:
        echo.close()
        worker.close()
        proc.terminate()
        proc.wait(10)
    return {name: {k: statistics.median(v) for k, v in kinds.items()} for name, kinds in seen.items()}


# -- somatize ------------------------------------------------------------------------
def zero_copy_numbers(payload: torch.Tensor) -> float:
    zero_copy_codec()
    with Worker.spawn([sys.executable, __file__, "--zero-copy-worker"], mode="network") as worker:
        g = Graph.somatize(Same().at("w1"))
        assert torch.equal(g.forward(Opaque(payload), broker={"w1": worker}), payload)
        return median(lambda: g.forward(Opaque(payload), broker={"w1": worker}), BIG)


def somatize_numbers(payload: torch.Tensor) -> dict[str, float]:
    with Worker.generic(mode="network") as worker:
        broker = {"w1": worker}
        g = Graph.somatize(Same().at("w1"))
        assert torch.equal(g.forward(Opaque(payload), broker=broker), payload)
        big = median(lambda: g.forward(Opaque(payload), broker=broker), BIG)
        facts: list[dict] = []
        small = torch.ones(1000)
        g.forward(Opaque(small), broker=broker, watching=facts.append)
        g.forward(Opaque(payload), broker=broker, watching=facts.append)
    sizes = [f["bytes"] for f in facts if f["fact"] in ("sent", "received")]
    return {"big": big, "small_out": sizes[0], "small_back": sizes[1],
            "big_out": sizes[2], "big_back": sizes[3]}


def fan_out_numbers(counts: tuple[int, ...] = (1, 4, 16)) -> dict[int, float]:
    """One wave of tiny remote nodes, one per host, each host a worker process of its
    own: seconds per forward for each number of hosts."""
    workers = [Worker.generic(mode="network") for _ in range(max(counts))]
    try:
        out = {}
        for count in counts:
            wave = Same().named("n0").at("w0")
            for i in range(1, count):
                wave = wave | Same().named(f"n{i}").at(f"w{i}")
            g = Graph.somatize(wave)
            broker = {f"w{i}": workers[i] for i in range(count)}
            g.forward("hello" * 20, broker=broker)
            wall = median(lambda: g.forward("hello" * 20, broker=broker), TINY // 4)
            began = time.process_time()
            for _ in range(TINY // 4):
                g.forward("hello" * 20, broker=broker)
            out[count] = (wall, (time.process_time() - began) / (TINY // 4))
        return out
    finally:
        for worker in workers:
            worker.close()


def main() -> None:
    if "--fan-out" in sys.argv:  # only the wave over many hosts
        return print_fan_out(fan_out_numbers())
    tiny = tiny_numbers()
    if "--tiny" in sys.argv:
        return print_tiny(tiny)
    payload = torch.randn(MB64 // 4)
    raw = RawEcho()
    big_message = memoryview(payload.numpy()).cast("B")
    raw_big = median(lambda: raw.round_trip(big_message), BIG)
    raw.close()
    ours = somatize_numbers(payload)
    rpc = rpc_numbers(payload)
    fans = fan_out_numbers()
    zero_copy = zero_copy_numbers(payload)  # last: it replaces this process's tensor codec

    print(f"{'':44}{'somatize':>12}{'raw echo':>12}{'ratio':>8}{'torch rpc':>12}{'ratio':>8}")
    rpc_tiny, rpc_big = rpc if rpc else (float("nan"), float("nan"))
    ours_tiny, raw_tiny = tiny["somatize"]["wall"], tiny["echo"]["wall"]
    print(f"{'tiny forward round trip (us)':44}{ours_tiny * 1e6:12.1f}{raw_tiny * 1e6:12.1f}"
          f"{ours_tiny / raw_tiny:8.2f}x{rpc_tiny * 1e6:11.1f}{ours_tiny / rpc_tiny:8.2f}x")
    print_tiny(tiny)
    gbps = lambda seconds: 2 * MB64 / seconds / 1e9
    print(f"{'64 MB float32 there and back (GB/s)':44}{gbps(ours['big']):12.2f}{gbps(raw_big):12.2f}"
          f"{gbps(ours['big']) / gbps(raw_big):8.0%} {gbps(rpc_big):11.2f}"
          f"{gbps(ours['big']) / gbps(rpc_big):8.2f}x")
    print(f"{'64 MB float32 there and back (ms)':44}{ours['big'] * 1e3:12.1f}{raw_big * 1e3:12.1f}"
          f"{'':8} {rpc_big * 1e3:11.1f}")
    print(f"{'  the same, with a zero-copy tensor codec (GB/s)':44}{gbps(zero_copy):12.2f}"
          f"{gbps(raw_big):12.2f}{gbps(zero_copy) / gbps(raw_big):8.0%} {gbps(rpc_big):11.2f}"
          f"{gbps(zero_copy) / gbps(rpc_big):8.2f}x")
    for label, n, out, back in (("1000 float32", 1000, ours["small_out"], ours["small_back"]),
                                ("16M float32 (64 MB)", MB64 // 4, ours["big_out"], ours["big_back"])):
        print(f"bytes on the wire, {label}: out {out} = 4 x {n} + {out - 4 * n}, "
              f"back {back} = 4 x {n} + {back - 4 * n}  ({(out + back) / (2 * n):.6f} bytes/element)")
    print_fan_out(fans)


def print_tiny(tiny: dict[str, dict[str, float]]) -> None:
    print("  target: the tiny round trip <= 50 us, beside an echo of one recv and one sendall")
    print(f"  {'per round trip, interleaved (us)':42}{'wall':>10}{'CPU here':>10}{'CPU there':>10}")
    for label, name in (("raw echo (one recv, one sendall)", "echo"), ("somatize remote forward", "somatize")):
        t = tiny[name]
        print(f"  {label:42}{t['wall'] * 1e6:10.1f}{t['here'] * 1e6:10.1f}{t['there'] * 1e6:10.1f}")
    print(f"  {'somatize beyond the echo':42}" + "".join(
        f"{(tiny['somatize'][k] - tiny['echo'][k]) * 1e6:10.1f}" for k in ("wall", "here", "there")))


def print_fan_out(fans: dict[int, tuple[float, float]]) -> None:
    one = fans[1][0]
    print("one wave of tiny remote nodes, one per host (a worker process each), vs one host's "
          "round trip (and this process's CPU per wave, which the machine's load moves less):")
    for count, (seconds, cpu) in fans.items():
        print(f"  {count:2d} host{'s' if count > 1 else ' '}: {seconds * 1e6:8.1f} us  "
              f"{seconds / one:6.2f}x   client CPU {cpu * 1e6:7.1f} us")
    print("target: 16 hosts <= 12x one host's round trip")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rpc-worker":
        rpc_worker(sys.argv[2])
    elif sys.argv[1:] == ["--zero-copy-worker"]:
        zero_copy_worker()
    else:
        main()
