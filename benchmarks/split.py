"""Split training with the far half on a worker, side by side with its anchors.

Encoder (here) >> Body (on a worker, trained by Split) >> Head (here), against:

- the same model trained in one piece by the same Trainer (the limit: no wire);
- the same split written with ``torch.distributed.rpc`` + distributed autograd +
  ``DistributedOptimizer`` (TensorPipe, CPU), the anchor a user would otherwise write;
- the same split in plain torch over one raw TCP socket to a process holding the body
  (``plain``: the tensors' bytes behind a length, nothing else said, the body's
  optimizer stepping there once the gradient it owes has gone, as a somatize worker
  steps): the floor of a split step, since whatever a split must do (two round trips,
  three backward calls, an optimizer on each side) it does, and nothing more. Its
  losses are checked ``==`` to somatize's.

At two sizes: one with ~10 ms of compute per step (target: split at most 1.15x the
one-piece step) and a tiny one, whose difference is the fixed cost of a split step
(two round trips: the forward stage and the walk back; target: at most 400 µs). The
plain split's own figures are printed beside both: where plain torch over a raw
socket already misses a target on this machine, the machine sets that floor, not us.
Every process runs torch on one thread, so the comparison is of the machinery and not
of who got more cores.

``--link 10ms,100mbit`` puts the worker behind a slow link (``link.py``, a proxy in a
process of its own) and torch rpc's TensorPipe connections behind the same link, and
prints every figure beside its floor: the link's round trips and the time it takes to
carry the activations and gradients that must cross it.

    python benchmarks/split.py            # --quick for fewer steps
    python benchmarks/split.py --quick --link 2ms,100mbit
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

from _bench import cycled, median
from link import LinkProcess, parse

QUICK = "--quick" in sys.argv
LINK = sys.argv[sys.argv.index("--link") + 1] if "--link" in sys.argv else None
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


# -- the floor: the same split in plain torch over one raw socket -------------------------
PLAIN = r"""
import socket, struct, sys, torch
torch.set_num_threads(1)
L = struct.Struct("<Q")
width, rows = int(sys.argv[1]), int(sys.argv[2])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def fill(n):
    buf = bytearray(n); view = memoryview(buf); got = 0
    while got < n:
        k = c.recv_into(view[got:])
        if not k:
            sys.exit(0)
        got += k
    return buf
def tensor(buf):
    return torch.frombuffer(buf, dtype=torch.float32).view(rows, width)
size = rows * width * 4
body = torch.nn.Linear(width, width)
for p in body.parameters():
    p.data.copy_(torch.frombuffer(fill(p.numel() * 4), dtype=torch.float32).view(p.shape))
opt = torch.optim.SGD(body.parameters(), lr=0.01)
while True:
    got = fill(size)  # mark: worker read slice
    x = tensor(got).requires_grad_()  # mark: worker walks
    y = torch.relu(body(x))
    out = y.detach().numpy().data  # mark: worker walked, worker sends done
    c.sendall(out)  # mark: worker sent done
    got = fill(size)  # mark: worker read slice
    g = tensor(got)  # mark: worker walks
    opt.zero_grad()
    y.backward(g)
    out = x.grad.numpy().data  # mark: worker walked, worker sends done
    c.sendall(out)  # mark: worker sent done
    opt.step()  # after what the client waits for, as a somatize worker steps
"""


class PlainSplit:
    """The split of ``model(width)`` in plain torch: encoder and head here, the body in a
    process of its own, reached over one socket (through the link, if there is one).
    ``server`` is the body's program (``timeline.py`` runs one that marks its moments,
    at the lines of ``PLAIN`` that say ``# mark:``)."""

    server = PLAIN

    def __init__(self, width, rows):
        g = model(width)
        self.encoder, body, self.head = (g.implementation(n).lin for n in ("encoder", "body", "head"))
        self.optimizer = torch.optim.SGD([*self.encoder.parameters(), *self.head.parameters()], lr=0.01)
        self.proc = subprocess.Popen([sys.executable, "-c", self.server, str(width), str(rows)],
                                     stdout=subprocess.PIPE)
        port = int(self.proc.stdout.readline())
        self.link = LinkProcess(LINK, ("127.0.0.1", port)) if LINK else None
        where = self.link.address if self.link else ("127.0.0.1", port)
        self.sock = socket.create_connection(where)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for p in body.parameters():
            self.sock.sendall(p.detach().numpy().data)
        self.shape, self.size = (rows, width), rows * width * 4

    def _fill(self):
        buf = bytearray(self.size)
        view, got = memoryview(buf), 0
        while got < self.size:
            n = self.sock.recv_into(view[got:])
            if not n:  # rather than wait forever on a socket that has closed
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                raise ConnectionError(f"the plain body's process closed its socket "
                                      f"(its exit code: {self.proc.returncode})")
            got += n
        return buf

    def _tensor(self):
        return torch.frombuffer(self._fill(), dtype=torch.float32).view(self.shape)

    def _send(self, tensor):
        self.sock.sendall(tensor.numpy().data)

    def step(self, b):
        x, y = b
        self.optimizer.zero_grad()
        h = torch.relu(self.encoder(x))
        self._send(h.detach())
        made = self._tensor().requires_grad_()
        loss = torch.nn.functional.mse_loss(torch.relu(self.head(made)), y)
        loss.backward()
        self._send(made.grad)
        h.backward(self._tensor())
        self.optimizer.step()
        return loss.item()

    def close(self):
        self.sock.close()
        self.proc.wait(10)
        if self.link:
            self.link.close()


def somatize_numbers(width, rows, worker):
    mse = torch.nn.functional.mse_loss
    data = [batch(width, rows) for _ in range(STEPS)]
    whole = model(width)
    one = Trainer(whole, objective=mse, optimizer=torch.optim.SGD(parameters(whole), lr=0.01))
    cut = model(width, "w")
    trains = {"body": Split(torch.optim.SGD, lr=0.01)}
    split = Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                    optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
    cut = model(width, "w")
    seeded = Trainer(cut, objective=mse, trains={"body": Split(torch.optim.SGD, lr=0.01)},
                     broker=Broker.embedded({"w": worker}),
                     optimizer=torch.optim.SGD(parameters(cut, without=["body"]), lr=0.01))
    seeded.seed(0)  # its session owns a random state there: the path that may swap
    plain = PlainSplit(width, rows)
    try:
        check = data[:3]
        assert [plain.step(b) for b in check] == [split.step(b) for b in check], \
            "the plain split and somatize's trained differently"
        # Interleaved in blocks, so all of them see the same machine.
        ones, splits, plains, owns = [], [], [], []
        for block in range(4):
            ones.append(median(cycled(one.step, data), STEPS // 4, warm=5))
            splits.append(median(cycled(split.step, data), STEPS // 4, warm=5))
            plains.append(median(cycled(plain.step, data), STEPS // 4, warm=5))
            owns.append(median(cycled(seeded.step, data), STEPS // 4, warm=5))
    finally:
        plain.close()
    SEEDED[width] = min(owns)
    return min(ones), min(splits), min(plains)


SEEDED: dict[int, float] = {}  # the seeded split's step, by width


def swap_cost(times=2000):
    """What putting one session's random state in place of another's costs (one read
    and one set of torch's, Python's and numpy's generators), where this somatize swaps."""
    try:
        from somatize.torch._random import put, taken
    except ImportError:
        return None
    import time

    state = taken()
    began = time.perf_counter()
    for _ in range(times):
        put(state)
        state = taken()
    return (time.perf_counter() - began) / times


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
    rpc.init_rpc("worker", rank=1, world_size=2, rpc_backend_options=rpc_options(port))
    rpc.shutdown()


def rpc_options(port):
    """TensorPipe's options: its defaults on loopback, or behind the link only sockets.

    By default TensorPipe moves tensors between two processes of one machine through
    shared memory or cross-memory attach, which no link would carry; behind the link
    it is held to its socket transport (``uv``) and channel (``basic``), as it would
    be between two machines, and meets its peer through a store that hands each
    side the link's address for the other."""
    from torch.distributed import rpc

    if LINK is None:
        return None
    os.environ["TP_SOCKET_IFNAME"] = "lo"  # listen on loopback, where the link reaches
    _linked_rendezvous()
    return rpc.TensorPipeRpcBackendOptions(init_method=f"linked://127.0.0.1:{port}",
                                           _transports=["uv"], _channels=["basic"])


_LINKED: list = []  # the stores and links behind rpc: pybind needs the Python side alive


def _passed(name):
    return lambda self, *args: getattr(self.inner, name)(*args)


def _linked_rendezvous():
    import torch.distributed as dist

    class Linked(dist.Store):
        """The rendezvous store, but on the client each TensorPipe listener's address
        (``…/addrs/<name>``) is swapped for a link to it: the one it publishes for
        itself (so the worker's calls back, the gradients, cross it too) and the one
        it reads for the worker."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.links = {}  # a listener read twice is still reached through one link

        def _through(self, url):
            if url not in self.links:
                host, _, port = url.decode().removeprefix("uv://").rpartition(":")
                link = LinkProcess(LINK, (host, int(port)), own_address=True)
                _LINKED.append(link)
                self.links[url] = f"uv://{link.address[0]}:{link.address[1]}".encode()
            return self.links[url]

        def set(self, key, value):
            mine = key.endswith("/addrs/client")
            return self.inner.set(key, self._through(value) if mine else value)

        def get(self, key):
            value = self.inner.get(key)
            return self._through(value) if key.endswith("/addrs/worker") else value

        def has_extended_api(self):
            return True

    # Every other call goes to the store as it is; each is named on the class, since
    # pybind looks for a Python override there, never through __getattr__.
    for name in ("add", "append", "check", "compare_set", "delete_key", "multi_get",
                 "multi_set", "num_keys", "set_timeout", "wait"):
        setattr(Linked, name, _passed(name))

    def handler(url, **kwargs):
        where = urlparse(url)
        asked = parse_qs(where.query)
        rank, size = int(asked["rank"][0]), int(asked["world_size"][0])
        store = dist.TCPStore(where.hostname, where.port, size, rank == 0, timedelta(seconds=60))
        store = Linked(store) if rank == 0 else store
        _LINKED.append(store)
        yield store, rank, size

    dist.register_rendezvous_handler("linked", handler)


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
    linked = ["--link", LINK] if LINK else []
    child = subprocess.Popen([sys.executable, __file__, "--rpc-worker", port, *linked])
    rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=rpc_options(port))
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
        while _LINKED:
            link = _LINKED.pop()
            if isinstance(link, LinkProcess):
                link.close()
    return out


@contextlib.contextmanager
def reached(worker):
    """The worker as the split step reaches it: itself, or through the link to it."""
    if LINK is None:
        yield worker
        return
    with LinkProcess(LINK, worker.address("w")) as link:
        far = Worker.at(f"{link.address[0]}:{link.address[1]}", mode="network", token=worker.token)
        try:
            yield far
        finally:
            far.close()


def main():
    torch.set_num_threads(1)
    with Worker.generic(mode="network", send=[]) as worker, reached(worker) as far:
        ours = {name: somatize_numbers(width, rows, far) for name, (width, rows) in SIZES.items()}
        piped = {name: pipeline_numbers(width, rows, far) for name, (width, rows) in SIZES.items()
                 if LINK or name == "~10 ms/step"}
    anchor = rpc_numbers() if "--no-rpc" not in sys.argv else {}
    if LINK:
        return print_linked(ours, piped, anchor)
    print(f"split training, far half on a worker on loopback; median step of {STEPS // 4} "
          "(best of 4 interleaved blocks), 1 thread per process")
    print(f"{'size':14}{'one piece':>12}{'split':>12}{'split/one':>11}{'plain':>12}"
          f"{'split/plain':>13}{'torch rpc':>12}{'split/rpc':>11}")
    for name, (one, split, bare) in ours.items():
        rpc = anchor.get(name)  # none with --no-rpc: said so, rather than printed as nan
        against = f"{rpc * 1e3:10.2f}ms{split / rpc:10.2f}x" if rpc else f"{'skipped':>12}{'':11}"
        print(f"{name:14}{one * 1e3:10.2f}ms{split * 1e3:10.2f}ms{split / one:10.2f}x"
              f"{bare * 1e3:10.2f}ms{split / bare:12.2f}x{against}")
    one, split, bare = ours["tiny"]
    print(f"fixed cost of a split step (tiny model): {(split - one) * 1e6:.0f} µs over one piece; "
          f"plain torch over a raw socket pays {(bare - one) * 1e6:.0f} µs, so ours is "
          f"{(split - bare) * 1e6:.0f} µs of somatize")
    plain, overlapped = piped["~10 ms/step"]
    print(f"split step, micro=4 (~10 ms/step): one piece after another {plain * 1e3:.2f}ms, "
          f"pipelined {overlapped * 1e3:.2f}ms, pipelined/unpipelined {overlapped / plain:.2f}x, "
          f"pipelined/split micro=1 {overlapped / ours['~10 ms/step'][1]:.2f}x")
    for name, (width, _) in SIZES.items():
        split = ours[name][1]
        print(f"split step whose session owns its random state (seeded), {name}: "
              f"{SEEDED[width] * 1e3:.2f}ms, seeded/split {SEEDED[width] / split:.2f}x")
    swap = swap_cost()
    if swap is not None:
        print(f"one swap of a session's random state (paid only when another session's "
              f"slice ran in between): {swap * 1e6:.1f} µs")
    one, _, bare = ours["~10 ms/step"]
    print(f"targets: split/one <= 1.15x at ~10 ms/step (plain/one here: {bare / one:.2f}x); "
          "fixed cost <= 400 µs; pipelined micro=4 <= 1.1x split micro=1 and never slower "
          "than unpipelined")


def floors(width, rows, micro=4):
    """What the link alone costs a step at least: one activation's bytes, and the floor
    of a split step, of ``micro`` pieces one after another, and of them pipelined.

    A split step crosses the link in two round trips (the forward stage, the walk
    back) and carries four tensors of the body's width, each waiting on the one
    before: the activation in, the body's output back, its gradient in and the
    gradient of the activation back, so 2 RTT + 4 x bytes / rate. Pieces one after
    another make 2 RTT each over the same bytes. Pipelined, the two directions carry
    at once (the link is full duplex, as a real one is), so the floor is the larger
    of one piece's chain (2 RTT + its 4 tensors) and the busier direction's two
    tensors of the whole batch plus the round trip of the last gradient."""
    delay, rate = parse(LINK)
    size = rows * width * 4  # float32; the wire's own framing is left out
    each = size / rate if rate else 0.0
    return (size, 4 * delay + 4 * each, micro * 4 * delay + 4 * each,
            max(4 * delay + 4 * each / micro, 2 * delay + 2 * each))


def print_linked(ours, piped, anchor):
    delay, rate = parse(LINK)
    print(f"split training behind the link {LINK} (one-way delay {delay * 1e3:g} ms, "
          f"{'unbounded' if rate is None else f'{rate * 8 / 1e6:g} Mbit/s'} each way; a proxy "
          f"process on loopback); median step of {STEPS // 4} (best of 4 interleaved blocks), "
          "1 thread per process")
    print("floor: 2 RTT + 4 x (one activation's bytes) / rate, what a split step must spend on "
          "the link; /floor+one also counts the one-piece step's compute, which a step in "
          "sequence cannot hide")
    for name, (width, rows) in SIZES.items():
        size, floor, floor_micro, floor_piped = floors(width, rows)
        one, split, bare = ours[name]
        plain, overlapped = piped[name]
        print(f"\n{name}: batch {rows} x width {width}, one activation {size / 1024:g} KiB; "
              f"floor {floor * 1e3:.2f} ms; micro=4 one after another (8 RTT + the same bytes) "
              f"{floor_micro * 1e3:.2f} ms, pipelined (both directions at once) "
              f"{floor_piped * 1e3:.2f} ms")
        print(f"  {'':34}{'step':>10}{'floor':>10}{'/floor':>9}{'/floor+one':>12}")
        rows_out = [("one piece (no link)", one, None),
                    ("split", split, floor),
                    ("plain torch over a raw socket", bare, floor),
                    ("split micro=4, one after another", plain, floor_micro),
                    ("split micro=4, pipelined", overlapped, floor_piped),
                    ("torch rpc through the same link", anchor.get(name), floor)]
        for label, took, bound in rows_out:
            if took is None:  # torch rpc, with --no-rpc
                print(f"  {label:34}{'skipped':>10}")
                continue
            if bound is None:
                print(f"  {label:34}{took * 1e3:8.2f}ms{'':10}{'':9}{'':12}")
                continue
            print(f"  {label:34}{took * 1e3:8.2f}ms{bound * 1e3:8.2f}ms{took / bound:8.2f}x"
                  f"{took / (bound + one):11.2f}x")
    print("\ntorch rpc: TensorPipe held to its socket transport and channel (uv, basic) so its "
          "tensors cross the link, as between machines; its step also pays for "
          "DistributedOptimizer.step, a round trip more than the floor. Each side's listener "
          "is reached through a link of its own that also rewrites the address TensorPipe "
          "names in its handshake, so the connections it opens next cross it too. The Gloo "
          "group rpc "
          "opens for its start-up, and the rendezvous store, stay off the link: neither "
          "carries a step.")


if __name__ == "__main__":
    if "--rpc-worker" in sys.argv:
        rpc_worker(sys.argv[sys.argv.index("--rpc-worker") + 1])
    else:
        main()
