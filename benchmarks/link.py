"""A slow link on loopback: a TCP proxy that adds a one-way delay and a rate.

What a benchmark puts between a client and its worker to see a step behind a real
link (``10ms,100mbit``) on one machine, without root or a kernel module (no
``tc netem``). Each accepted connection is forwarded to one target, both ways; in
each direction every chunk read is given the time the link would take to carry it
(the direction is busy for ``len / rate`` after the previous chunk's turn ends) and
then the one-way delay, and is written out when that time comes, in order. So a
round trip costs ``2 × delay`` and a message of ``n`` bytes ``n / rate`` more, each way.

A peer that names its own address to the other side mid-stream (TensorPipe does, so
the other side opens more connections straight to it) would slip past the link;
``own_address=True`` rewrites that address to the link's own in what the target sends
at the start of each connection, where such handshakes are.

The proxy is plain threads and sockets, so it shares the GIL of the process it runs
in; a benchmark that must not be perturbed runs it as a child (``serve``). It stops
when closed, after ``lifetime_s`` in any case, and a child also when its parent dies.

    python benchmarks/link.py 10ms,100mbit      # measures an echo through it
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import socket
import struct
import subprocess
import sys
import threading
import time

__all__ = ["Link", "LinkProcess", "parse"]

_CHUNK = 1 << 16
# Chunks in flight per direction before the reader waits: bounds the memory a fast
# sender can pile up (16 MB), as a real link's window would.
_IN_FLIGHT = 256
# How far into a connection the target's own address is looked for (own_address):
# handshakes come first, and tensors after them are left untouched.
_HANDSHAKE = 1 << 16
_DELAY_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse(spec: str) -> tuple[float, float | None]:
    """``"10ms,100mbit"`` as (one-way delay in seconds, rate in bytes per second);
    a spec without a rate (``"2ms"``) has rate ``None``, a link of unbounded rate."""
    delay, rate = None, None
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zµ]+)", part)
        if match and match.group(2) in _DELAY_UNITS and delay is None:
            delay = float(match.group(1)) * _DELAY_UNITS[match.group(2)]
        elif match and match.group(2) in _RATE_UNITS and rate is None:
            rate = float(match.group(1)) * _RATE_UNITS[match.group(2)] / 8
        else:
            raise ValueError(f"a link is spelled like '10ms,100mbit', '2ms' or '20ms,1gbit' "
                             f"(delay in us/ms/s, rate in bit/kbit/mbit/gbit), not {spec!r}")
    if delay is None:
        raise ValueError(f"the link {spec!r} names no delay; write '0ms,{spec}' for none")
    if rate is not None and rate <= 0:
        raise ValueError(f"the link {spec!r} has no rate to carry anything at")
    return delay, rate


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Direction:
    """One way of one connection: a reader that stamps each chunk with when it
    arrives at the far end, and a writer that hands it over then."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay: float,
                 rate: float | None, stop: threading.Event, swap: tuple[bytes, bytes] | None = None):
        self.source, self.sink, self.delay, self.rate, self.stop = source, sink, delay, rate, stop
        self.swap = swap
        self.chunks: queue.Queue = queue.Queue(_IN_FLIGHT)
        for run in (self._read, self._write):
            threading.Thread(target=run, daemon=True).start()

    def _read(self) -> None:
        free_at = 0.0  # when this direction has carried everything read so far
        read = 0
        try:
            while not self.stop.is_set():
                data = self.source.recv(_CHUNK)
                if not data:
                    break
                if self.swap and read < _HANDSHAKE:
                    data = data.replace(*self.swap)
                read += len(data)
                now = time.perf_counter()
                free_at = max(now, free_at) + (len(data) / self.rate if self.rate else 0.0)
                self.chunks.put((free_at + self.delay, data))
        except OSError:
            pass
        finally:
            self.chunks.put((0.0, b""))

    def _write(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    due, data = self.chunks.get(timeout=0.5)
                except queue.Empty:
                    continue
                if not data:  # the source closed: pass the end on once all before it went
                    self.sink.shutdown(socket.SHUT_WR)
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                self.sink.sendall(data)
        except OSError:
            pass


class Link:
    """A proxy on ``127.0.0.1`` to ``target`` with a one-way ``delay_s`` and a rate in
    bytes per second (``None``: unbounded) in each direction; ``address`` is where to
    connect instead of the target."""

    def __init__(self, target: tuple[str, int], delay_s: float, rate_bytes_per_s: float | None = None,
                 *, lifetime_s: float = 900.0, own_address: bool = False):
        self.target, self.delay, self.rate = target, delay_s, rate_bytes_per_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)  # so the accept loop sees close() and the lifetime
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._swap = None
        if own_address:
            theirs, ours = (f"{a[0]}:{a[1]}".encode() for a in (target, self.address))
            if len(theirs) != len(ours):  # a longer name would break the frame it sits in
                self.close()
                raise ValueError(f"the link at {ours.decode()} cannot stand for {theirs.decode()} "
                                 "in a handshake: the two are not the same length")
            self._swap = (theirs, ours)
        self._stop = threading.Event()
        self._until = time.monotonic() + lifetime_s
        self._sockets: list[socket.socket] = []
        self._held = threading.Lock()  # so a connection made while closing is cut too
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, spec: str, target: tuple[str, int], **kwargs) -> Link:
        """The link ``spec`` (``"10ms,100mbit"``) to ``target``."""
        return cls(target, *parse(spec), **kwargs)

    def _accept(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._until:
            try:
                near, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                far = socket.create_connection(self.target, timeout=10)
            except OSError:
                near.close()
                continue
            for sock in (near, far):
                sock.settimeout(None)
                _nodelay(sock)
            with self._held:
                self._sockets += [near, far]
                if self._stop.is_set():
                    break
            _Direction(near, far, self.delay, self.rate, self._stop)
            _Direction(far, near, self.delay, self.rate, self._stop, self._swap)
        self.close()

    def close(self) -> None:
        """Stops accepting and cuts every connection it carries."""
        with self._held:
            self._stop.set()
            held = [self._server, *self._sockets]
        for sock in held:
            # shutdown first: a close alone neither wakes a thread blocked reading the
            # socket nor ends the connection while that thread holds it.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LinkProcess:
    """The same link in a child process of its own, so its threads take nothing from
    the GIL of the process being measured; it ends with ``close()``, with its parent,
    or after ``lifetime_s``."""

    def __init__(self, spec: str, target: tuple[str, int], *, lifetime_s: float = 900.0,
                 own_address: bool = False):
        parse(spec)  # refuse a bad spec here, not as a child's exit code
        self.spec, self.target = spec, target
        self._child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", spec, f"{target[0]}:{target[1]}",
             f"{lifetime_s:g}", *(["--own-address"] if own_address else [])],
            stdout=subprocess.PIPE, text=True)
        line = self._child.stdout.readline()
        match = re.fullmatch(r"listening on ([0-9.]+):([0-9]+)\n", line)
        if not match:
            self.close()
            raise RuntimeError(f"the link child first said {line!r}, not where it listens")
        self.address = (match.group(1), int(match.group(2)))

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.terminate()
            try:
                self._child.wait(5)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait(5)

    def __enter__(self) -> LinkProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(spec: str, target: str, lifetime_s: float, own_address: bool) -> None:
    """A child's life: one link until its parent goes, or its lifetime ends."""
    host, _, port = target.rpartition(":")
    parent = os.getppid()
    with Link.of(spec, (host, int(port)), lifetime_s=lifetime_s, own_address=own_address) as link:
        print(f"listening on {link.address[0]}:{link.address[1]}", flush=True)
        until = time.monotonic() + lifetime_s
        while time.monotonic() < until and os.getppid() == parent:
            time.sleep(0.2)


# -- the self-check: an echo through the link, measured against what it should cost --------
_LENGTH = struct.Struct("<Q")


def _fill(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            raise ConnectionError("the echo closed mid-message")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _echo(server: socket.socket, stop: threading.Event) -> None:
    server.settimeout(10)
    try:
        conn, _ = server.accept()
    except OSError:
        return
    _nodelay(conn)
    with conn:
        conn.settimeout(30)
        while not stop.is_set():
            try:
                head = _fill(conn, _LENGTH.size)
                conn.sendall(head + _fill(conn, _LENGTH.unpack(head)[0]))
            except (OSError, ConnectionError):
                return


def round_trips(link_of, sizes: list[int], repeat: int = 5) -> dict[int, tuple[float, bool]]:
    """For each size, the fastest of ``repeat`` echo round trips through the link that
    ``link_of(target)`` makes, and whether every byte came back as sent."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=_echo, args=(server, stop), daemon=True).start()
        with link_of(server.getsockname()[:2]) as link, \
                socket.create_connection(link.address, timeout=30) as client:
            _nodelay(client)
            out = {}
            for size in sizes:
                message = os.urandom(size)
                times, intact = [], True
                for _ in range(repeat):
                    start = time.perf_counter()
                    client.sendall(_LENGTH.pack(size) + message)
                    back = _fill(client, _LENGTH.size + size)
                    times.append(time.perf_counter() - start)
                    intact &= back[_LENGTH.size:] == message
                out[size] = (min(times), intact)
        stop.set()
    return out


def main(spec: str) -> None:
    delay, rate = parse(spec)
    sizes = [64, 1 << 20]
    print(f"link {spec}: one-way delay {delay * 1e3:g} ms, rate "
          f"{'unbounded' if rate is None else f'{rate * 8 / 1e6:g} Mbit/s'}; echo round trip, "
          "fastest of 5")
    print(f"{'size':>10}{'measured':>12}{'expected':>12}{'ratio':>8}  intact")
    for name, make in (("in thread", lambda t: Link(t, delay, rate)),
                       ("as child", lambda t: LinkProcess(spec, t))):
        for size, (took, intact) in round_trips(make, sizes).items():
            # There and back: the delay twice, and the message carried once each way.
            expected = 2 * delay + (2 * (size + _LENGTH.size) / rate if rate else 0.0)
            print(f"{size:>10}{took * 1e3:10.2f}ms{expected * 1e3:10.2f}ms"
                  f"{took / expected:7.2f}x  {intact}  ({name})")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        at = sys.argv.index("--serve")
        serve(sys.argv[at + 1], sys.argv[at + 2], float(sys.argv[at + 3]), "--own-address" in sys.argv)
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "10ms,100mbit")
