"""A worker under attack, measured: what a peer without the token can take from it.

Five measurements against a real ``python -m somatize.worker`` on loopback, each with
a legitimate client beside the attack and an anchor in the same run:

1. the handshake's cost per connection (a forward on a fresh connection against one
   on a kept connection; anchor: a raw TCP connect and round trip to the same port);
2. peers dribbling a valid hello one byte every 2 s at a worker with ``--timeout 5``:
   when each is dropped, and how many forwards a client made meanwhile;
3. 1,500 idle connections: the worker's threads before and with them, and a forward;
4. ``ulimit -n 64`` and 80 idle connections: the worker's CPU over 5 s, and a forward;
5. the same limit with a node that took every descriptor and 20 connections waiting:
   the CPU, and whether the client it holds is still served.

Linux only (it reads ``/proc``). It measures whatever somatize is on the path, so the
same script gives a before and an after: ``PYTHONPATH=OLD/src python benchmarks/wire_safety.py``.

    python benchmarks/wire_safety.py      # --quick for fewer repetitions; 1 3 for those two
"""

from __future__ import annotations

import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import threading
import time

import somatize
from somatize import Graph, Node, Worker
from somatize.wire import protocol

from _bench import cpu_seconds

QUICK = "--quick" in sys.argv
TOKEN = "a-token-for-the-safety-benchmark-0123456789"


class Upper(Node):
    def forward(self, x, ctx):
        return x.upper()


_taken: list = []


class Take(Node):
    """Opens files until none can be opened, and keeps them (a node leaking descriptors)."""

    def forward(self, x, ctx):
        try:
            while True:
                _taken.append(open(os.devnull, "rb"))
        except OSError:
            return len(_taken)


class Standing:
    def __init__(self, *args: str, files: int | None = None):
        limit = None if files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files)))
        env = dict(os.environ, SOMATIZE_TOKEN=TOKEN)
        self.proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0",
                                      *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, preexec_fn=limit)
        self.addr = self.proc.stdout.readline().decode().split()[-1]
        self.port = int(self.addr.rsplit(":", 1)[1])

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


UPPER = Graph.somatize(Upper().at("w1"))


def forward(addr: str, said: str = "ok", timeout: float = 10.0) -> float | None:
    """Seconds a forward on a fresh connection took, or None if it failed."""
    began = time.perf_counter()
    try:
        with Worker.at(addr, token=TOKEN, timeout=timeout, mode="network") as w:
            assert UPPER.forward(said, broker={"w1": w}) == said.upper()
    except Exception:
        return None
    return time.perf_counter() - began


def hello() -> bytes:
    pieces = protocol.encode("hello", {"v": protocol.VERSION, "n": os.urandom(32), "t": 5.0})
    return b"".join(bytes(p) for p in pieces)


def handshake_cost() -> None:
    worker = Standing()
    repeat = 30 if QUICK else 200
    forward(worker.addr)  # the catalog is there from now on
    fresh = statistics.median(forward(worker.addr) for _ in range(repeat))
    with Worker.at(worker.addr, token=TOKEN, mode="network") as w:
        UPPER.forward("x", broker={"w1": w})
        kept = []
        for _ in range(repeat):
            began = time.perf_counter()
            UPPER.forward("x", broker={"w1": w})
            kept.append(time.perf_counter() - began)
    raw = []
    for _ in range(repeat):
        began = time.perf_counter()
        with worker.connect() as sock:
            sock.sendall(hello())
            sock.recv(4096)
        raw.append(time.perf_counter() - began)
    worker.stop()
    kdf = ""
    if hasattr(protocol, "derive_key"):
        began = time.perf_counter()
        protocol.derive_key(b"x" * 43, os.urandom(16))
        kdf = f"; deriving the key (once per process and worker): {(time.perf_counter() - began) * 1e3:.1f} ms"
    kept_median = statistics.median(kept)
    print(f"1. handshake: a forward on a fresh connection {fresh * 1e3:.2f} ms, on a kept one "
          f"{kept_median * 1e3:.2f} ms: {(fresh - kept_median) * 1e3:.2f} ms per connection "
          f"(anchor: TCP connect + hello + answer {statistics.median(raw) * 1e3:.2f} ms){kdf}")


def dribbling(count: int = 10, every: float = 2.0, watch: float = 12.0) -> None:
    worker = Standing("--timeout", "5")
    data = hello()
    socks = [worker.connect() for _ in range(count)]
    began = time.monotonic()
    lasted: dict[int, float] = {}
    served: list[float | None] = []

    def serve() -> None:  # a client beside them, a forward a second
        while time.monotonic() - began < watch - 1 and len(lasted) < count:
            served.append(forward(worker.addr))
            time.sleep(1.0)

    client = threading.Thread(target=serve)
    client.start()
    tick, at = 0.05, 0
    while time.monotonic() - began < watch and len(lasted) < count:
        due = time.monotonic() - began >= at * every  # a byte each `every` s, a look each tick
        for i, sock in enumerate(socks):
            if i in lasted:
                continue
            gone = False
            if select.select([sock], [], [], 0)[0]:
                try:
                    gone = sock.recv(4096) == b""
                except OSError:
                    gone = True
            if not gone and due:
                try:
                    sock.send(data[at % len(data):at % len(data) + 1])
                except OSError:
                    gone = True
            if gone:
                lasted[i] = time.monotonic() - began
        at += due
        time.sleep(tick)
    client.join()
    worker.stop()
    times = sorted(lasted.values())
    said = (f"all dropped, after {times[0]:.1f} to {times[-1]:.1f} s" if len(times) == count
            else f"{len(times)} dropped, {count - len(times)} still held after {watch:.0f} s")
    ok = [s for s in served if s is not None]
    print(f"2. {count} peers dribbling a hello, a byte every {every:g} s, --timeout 5: {said}; "
          f"meanwhile {len(ok)} of {len(served)} forwards served "
          f"(median {statistics.median(ok) * 1e3 if ok else float('nan'):.1f} ms)")


def idle(count: int = 1500) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 200)), hard))
    worker = Standing()
    forward(worker.addr)
    before = worker.threads()
    began = time.monotonic()
    socks = [worker.connect() for _ in range(count)]
    opened = time.monotonic() - began
    time.sleep(1.0)
    held = worker.threads()
    took = forward(worker.addr)
    worker.stop()
    for sock in socks:
        sock.close()
    print(f"3. {count} idle connections (opened in {opened:.1f} s): the worker's threads "
          f"{before} before, {held} with them; a forward then "
          f"{'failed' if took is None else f'took {took * 1e3:.1f} ms'}")


def out_of_descriptors(count: int = 80, seconds: float = 5.0) -> None:
    worker = Standing(files=64)
    forward(worker.addr)
    socks = [worker.connect() for _ in range(count)]
    time.sleep(0.5)
    cpu, began = worker.cpu(), time.monotonic()
    took = forward(worker.addr, timeout=seconds)
    time.sleep(max(0.0, seconds - (time.monotonic() - began)))
    used = (worker.cpu() - cpu) / (time.monotonic() - began)
    worker.stop()
    for sock in socks:
        sock.close()
    print(f"4. ulimit -n 64, {count} idle connections: the worker used {used:.0%} of a core "
          f"over {seconds:g} s; a new client's forward "
          f"{'failed (timed out)' if took is None else f'took {took * 1e3:.1f} ms'}")


def taken_descriptors(seconds: float = 5.0) -> None:
    worker = Standing(files=64)
    with Worker.at(worker.addr, token=TOKEN, mode="network", timeout=10) as held:
        took = Graph.somatize(Take().at("w1")).forward(None, broker={"w1": held})
        socks = [worker.connect() for _ in range(20)]
        time.sleep(0.5)
        cpu, began = worker.cpu(), time.monotonic()
        g, served = Graph.somatize(Upper().at("w1")), 0
        while time.monotonic() - began < seconds:
            try:
                served += g.forward("x", broker={"w1": held}) == "X"
            except Exception:
                pass
            time.sleep(0.5)
        used = (worker.cpu() - cpu) / (time.monotonic() - began)
    worker.stop()
    for sock in socks:
        sock.close()
    print(f"5. ulimit -n 64, a node took the {took} descriptors left, 20 connections waiting: "
          f"the worker used {used:.0%} of a core over {seconds:g} s; the client it holds was "
          f"served {served} of {int(seconds / 0.5)} forwards")


def main() -> None:
    print(f"somatize from {os.path.dirname(somatize.__file__)}, wire protocol {protocol.VERSION}")
    chosen = {int(a) for a in sys.argv[1:] if a.isdigit()} or {1, 2, 3, 4, 5}
    for number, measure in enumerate((handshake_cost, dribbling, idle, out_of_descriptors,
                                      taken_descriptors), 1):
        if number in chosen:
            measure()


if __name__ == "__main__":
    main()
