"""Worker: where a slice goes and how to pack for it — a declaration, not a connection.

``Worker`` is what a user holds for every kind of worker: its constructors say which
(``at``, ``generic`` and ``spawn`` a process reached over a socket, a ``SocketWorker``;
``on_ray`` a Ray actor; ``in_process`` a host in this process), and each answers a
``Worker``. The socket one is here; the others are filled in by their own modules.

Declaring opens nothing, so a host that is not there fails when a slice needs it and
not when it is named. The children of ``generic`` and ``spawn`` are started when
declared (so their start-up overlaps whatever the client does next) but waited for
only at first need, and never outlive the client: ``close``, a ``with`` block, the
interpreter's exit, and on Linux the kernel itself (the child asks to be sent SIGTERM
when the thread that started it dies; that thread lives as long as the process).
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import secrets
import select
import ssl
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from .._errors import DeclarationError, StateLost, WireError
from .._optional import optional
from .._registries import PLACES
from .client import SocketLink
from .protocol import Limits
from .transport import Link, Place, SessionThere

__all__ = ["SocketWorker", "Worker", "parse_address", "provides", "sharing_cores"]

_LISTENING = re.compile(r"^listening on (\[[0-9A-Fa-f:.]+\]|[^\s:]+):(\d+)\s*$")
_STARTUP = 60.0  # how long a child may take to say where it listens


def parse_address(addr: Any, listening: bool = False) -> tuple[str, int]:
    """``"node3:7000"`` or ``"[::1]:7000"`` as ``(host, port)``, or a DeclarationError.
    Port 0 (any free port) only makes sense for ``listening``."""
    match = _LISTENING.match(f"listening on {addr}") if isinstance(addr, str) else None
    port = int(match.group(2)) if match else -1
    if not match or not (0 if listening else 1) <= port < 65536:
        raise DeclarationError(
            f"{addr!r} is not an address a worker listens at; write HOST:PORT, e.g. "
            "'node3:7000', '127.0.0.1:7000' or '[::1]:7000'"
        )
    return match.group(1).strip("[]"), port


def _token(token: Any) -> bytes | None:
    if token is None:
        token = os.environ.get("SOMATIZE_TOKEN") or None
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes) or not token:
        raise DeclarationError("a token is a non-empty str or bytes")
    return token


def _tls(tls: Any) -> ssl.SSLContext | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, ssl.SSLContext):
        return tls
    if isinstance(tls, (str, os.PathLike)):
        return ssl.create_default_context(cafile=os.fspath(tls))
    raise DeclarationError(
        f"tls is an ssl.SSLContext, the path of a CA file, or True, not {tls!r}")


# Places a worker can be besides a socket. Each is filled in by a module (of a layer
# above this one, or beside it) that subclasses Worker and says so with ``provides`` as
# it loads. Asking for a place finds its module by the name the registries' table
# gives it (``_registries.PLACES``, beside the ``places`` row), the way fsspec finds
# its implementations, so a user need not import it first.
_places: dict[str, Any] = {}


def provides(name: str, make: Any) -> None:
    """Says that ``Worker.on_<name>(...)`` is answered by ``make(mode, send, **options)``."""
    _places[name] = make


def _placed(name: str) -> Any:
    """What answers ``Worker.on_<name>``, loading the module that fills it if need be."""
    make = _places.get(name)
    if make is None:
        module, extra = PLACES[name]
        optional(module, extra, f"Worker.on_{name}")
        make = _places.get(name)
        if make is None:  # only a broken install has the module but not its place
            raise DeclarationError(f"Worker.on_{name} needs {module} to say how it places "
                                   "a worker, which it did not; reinstall somatize")
    return make


class Worker(Place):
    """A worker: where the slices of the hosts it is listed for run, and how to pack
    for it. Declaring one opens nothing.

    Every kind is a ``Worker``, whatever carries its slices: ``Worker.at``,
    ``Worker.generic`` and ``Worker.spawn`` (or ``Worker(target, ...)`` itself) a
    process reached over a socket, ``Worker.on_ray`` a Ray actor, ``Worker.in_process``
    a host in this very process. A transport's place subclasses it, so that what a
    constructor answers is the class the user named.
    """

    def __new__(cls, *args: Any, **options: Any) -> Worker:
        # Worker(target, ...) has always meant the socket worker (and so Worker.at,
        # generic and spawn); a subclass is its own.
        return super().__new__(SocketWorker if cls is Worker else cls)

    @classmethod
    def at(cls, addr: str, mode: str = "project", send: Sequence[str] = (), *,
           token: str | bytes | None = None, tls: Any = None,
           timeout: float | None = None, deadline: float | None = None) -> Worker:
        """A worker already standing at ``addr``; the token defaults to SOMATIZE_TOKEN."""
        return cls(addr, mode, send, token=token, tls=tls, timeout=timeout, deadline=deadline)

    @classmethod
    def generic(cls, mode: str = "project", send: Sequence[str] = (), python: str | None = None,
                *, timeout: float | None = None, log: str | os.PathLike | None = None,
                verbose: bool | None = None, deadline: float | None = None) -> Worker:
        """A child ``python -m somatize.worker`` on a free loopback port, with a fresh
        token and this process's environment (so the same code is importable there).

        Its everyday lines (a connection, a catalog, a slice) would drown a training
        loop's output in this terminal, so they are left out; ``log`` sends the whole
        log to that file instead, and ``verbose=True`` (or ``SOMATIZE_WORKER_VERBOSE=1``)
        brings the lines back here. Failures and warnings are always said.
        """
        argv = [python or sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0"]
        if log is not None:
            argv += ["--log", os.fspath(log)]
        if verbose is None:
            verbose = os.environ.get("SOMATIZE_WORKER_VERBOSE", "") not in ("", "0")
        if log is None and not verbose:
            argv.append("--quiet")
        return cls(argv, mode, send, timeout=timeout, deadline=deadline)

    @classmethod
    def spawn(cls, argv: list[str], mode: str = "project", send: Sequence[str] = (), *,
              timeout: float | None = None, deadline: float | None = None) -> Worker:
        """Any child that prints ``listening on HOST:PORT`` first; it is handed a fresh
        token in SOMATIZE_TOKEN."""
        return cls(list(argv), mode, send, timeout=timeout, deadline=deadline)

    @classmethod
    def on_ray(cls, mode: str = "project", send: Sequence[str] = (), *,
               num_cpus: float | None = None, num_gpus: float | None = None,
               resources: dict[str, float] | None = None, runtime_env: dict[str, Any] | None = None,
               max_restarts: int = 3, timeout: float | None = None,
               deadline: float | None = None, name: str | None = None) -> Worker:
        """A worker that is a Ray actor, placed by the cluster where these resources
        are (``num_gpus=1``); ``runtime_env`` is handed to Ray as it is. It connects
        to the cluster ``ray.init`` did, or starts a local one. ``timeout`` bounds how
        long the cluster may take to place the actor (by default a minute: a node may
        be starting); Ray restarts an actor that died up to ``max_restarts`` times.
        ``name`` makes it the one actor of that name on the cluster, which every client
        naming it reaches, from any process — where clients share a trainer
        (``Split(..., shared=key)``) — and which outlives them all, closing included.
        Needs the ``ray`` extra: ``pip install 'somatize[ray]'``."""
        return _placed("ray")(mode, send, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                    runtime_env=runtime_env, max_restarts=max_restarts, timeout=timeout,
                    deadline=deadline, name=name)

    @classmethod
    def in_process(cls, mode: str = "network", send: Sequence[str] = (), *,
                   deadline: float | None = None) -> Worker:
        """A host in this very process, reached through a real pickle round trip of every
        message and run by the worker's own code (``wire.host``): what a test, or a
        notebook with no second machine, hands a broker where a worker would go. Its
        ``restart()`` makes it a fresh host, as a worker that restarted is."""
        return _placed("in_process")(mode, send, deadline=deadline)


class SocketWorker(Worker):
    """A worker process reached over a socket (``Worker.at``, ``generic``, ``spawn``).

    ``target`` is an address (``"node3:7000"``, a worker already standing) or an argv
    (a child to start). ``mode="project"`` sends nodes by reference (the worker
    imports their code from its own installation; identity, versions and state
    travel); ``"network"`` sends the code as well, and ``send=["my_package"]`` makes
    those modules travel by value. ``send`` without ``"network"`` is refused, since
    it would silently do nothing.

    ``timeout`` bounds a silence (no answer and no heartbeat), so a slice may compute
    for hours; ``deadline`` (off by default) bounds each call in all, past which it is
    a ``WireError`` naming the host and the nodes, and the worker serves on.
    """

    def __init__(self, target: str | list[str], mode: str = "project", send: Sequence[str] = (),
                 *, token: str | bytes | None = None, tls: Any = None,
                 timeout: float | None = None, limits: Limits | None = None,
                 deadline: float | None = None):
        super().__init__(mode, send, timeout=timeout, deadline=deadline, limits=limits)
        self._child: subprocess.Popen | None = None
        self._listening: tuple[str, int] | None = None
        self._start_lock = threading.Lock()
        if isinstance(target, str):
            self._target = parse_address(target)
            self.token, self.tls = _token(token), _tls(tls)
            self._argv = None
        elif isinstance(target, (list, tuple)) and target and all(isinstance(a, str) for a in target):
            self._target = None
            self._argv = list(target)
            self.token = _token(token) if token is not None else secrets.token_hex(32).encode()
            self.tls = _tls(tls)
            self._start()
        else:
            raise DeclarationError(
                f"a worker is declared with an address ('node3:7000') or an argv to start, "
                f"not {target!r}")
        self._link = SocketLink(self)
        self._lanes: dict[bytes, SocketLink] = {}  # a connection per session that shares
        self._lanes_carried = {"sent": 0, "received": 0}  # by the lanes closed since
        self._wire = (b"at " + f"{self._target[0].lower()}:{self._target[1]}".encode()
                      if self._target else b"child " + secrets.token_hex(16).encode())

    # -- the child --------------------------------------------------------------------
    def _start(self) -> None:
        env = dict(os.environ)
        env["SOMATIZE_TOKEN"] = self.token.decode()
        env["SOMATIZE_PARENT_PID"] = str(os.getpid())
        kept = _share_cores(env)
        # The child imports the somatize this process runs, wherever it came from; an
        # installed one it finds by itself, and naming site-packages would shadow the
        # caller's own PYTHONPATH.
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if here not in _site_dirs():
            paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in paths if p != here])
        try:
            self._child = _spawner.popen(self._argv, env)
        except OSError as exc:
            raise DeclarationError(f"cannot start the worker {self._argv!r}: {exc}") from None
        _children.add(self)
        weakref.finalize(self, _end, self._child)
        for hook in _sharing if kept is not None else ():
            hook(kept)

    def address(self, host: str) -> tuple[str, int]:
        """Where to connect: the declared address, or where the child says it listens."""
        if self._target is not None:
            return self._target
        if self._child is None:  # started, then closed: what it held is gone with it
            raise StateLost(
                f"host {host!r}: the worker this process started for it was closed (its "
                "`with` block ended, or close() was called), and what it held went with "
                "it: the weights and optimizer state of the nodes trained there included. "
                "Ask for them (export(), a checkpoint) inside the `with` block, or close "
                "the worker only once you have them", host=host)
        with self._start_lock:
            if self._listening is None:
                self._listening = self._read_listening(host)
            return self._listening

    def _read_listening(self, host: str) -> tuple[str, int]:
        child = self._child
        if child is None:
            raise WireError(f"host {host!r}: its worker was closed", host=host)
        fd = child.stdout.fileno()
        said = b""
        deadline = time.monotonic() + max(_STARTUP, self.timeout)
        while b"\n" not in said:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                raise WireError(f"host {host!r}: the worker {self._argv!r} did not say where "
                                f"it listens within {max(_STARTUP, self.timeout):g} s", host=host)
            chunk = os.read(fd, 4096)
            if not chunk:
                code = child.wait(timeout=5)
                raise WireError(f"host {host!r}: the worker {self._argv!r} exited with code "
                                f"{code} before listening; its stderr says why", host=host)
            said += chunk
        line, _, rest = said.partition(b"\n")
        threading.Thread(target=_drain, args=(child, rest), daemon=True).start()
        match = _LISTENING.match(line.decode(errors="replace"))
        if not match:
            raise WireError(f"host {host!r}: the worker {self._argv!r} first said {line!r}, "
                            "not 'listening on HOST:PORT'", host=host)
        return match.group(1).strip("[]"), int(match.group(2))

    def where(self, host: str) -> str:
        address = self._target or self._listening
        if address is None:
            return f"the child {self._argv!r}"
        return f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"

    def link_for(self, there: SessionThere) -> Link:
        """A session that shares a trainer there has a connection of its own: a worker
        answers one connection's requests in turn, and a shared trainer's slice may wait
        for another client's gradient, which must not queue behind it."""
        if not there.shares:
            return self._link
        lane = self._lanes.get(there.session)
        if lane is None:
            lane = self._lanes.setdefault(there.session, SocketLink(self))
        return lane

    def end(self, there: SessionThere) -> None:
        """Ends the session there; its own connection, if it had one, goes with it."""
        super().end(there)
        lane = self._lanes.pop(there.session, None)
        if lane is not None:
            lane.close()
            for way, size in lane.traffic().items():
                self._lanes_carried[way] += size

    def traffic(self) -> dict[str, int]:
        """The bytes sent to the worker and received from it over this place's life, on
        its connection and on those of the sessions that share a trainer there."""
        total = dict(self._lanes_carried)
        for link in (self._link, *list(self._lanes.values())):
            for way, size in link.traffic().items():
                total[way] += size
        return total

    def close(self) -> None:
        """Closes the connection, and ends the child if this worker started one."""
        self._link.close()
        for lane in list(self._lanes.values()):
            lane.close()
        self._lanes.clear()
        child, self._child = self._child, None
        _children.discard(self)
        if child is not None:
            _end(child)

    def __repr__(self) -> str:
        where = self.where("") if (self._target or self._listening) else f"child {self._argv!r}"
        return f"Worker({where}, mode={self.mode!r})"


_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch's CPU kernels size their pools by
_sharing: list[Callable[[int], None]] = []


def sharing_cores(hook: Callable[[int], None]) -> None:
    """Registers ``hook(threads)``, called in this process each time it starts a worker
    child on this machine, with how many threads this process keeps: the layer that
    runs kernels here (``somatize.torch``) registers one, since the wire knows none."""
    _sharing.append(hook)


def _share_cores(env: dict[str, str]) -> int | None:
    """Gives a child on this machine half the cores this process may use, where the
    caller set no thread count, and answers how many are left to this process (None
    where the caller set one: theirs is kept, on both sides).

    Left to torch's default, the child and its client each take every core, and their
    pools spin against each other while they take turns: 40 split steps of a small
    model took 6.6 s on two busy cores where half each took 0.3 s (benchmarks/cores.py)."""
    if any(env.get(name) for name in _THREADS):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    child = max(1, (cores or 2) // 2)
    env.update({name: str(child) for name in _THREADS})
    return max(1, (cores or 2) - child)


def _site_dirs() -> set[str]:
    import site

    found = set(getattr(site, "getsitepackages", list)())
    found.add(site.getusersitepackages())
    return {os.path.abspath(p) for p in found}


def _drain(child: subprocess.Popen, first: bytes) -> None:
    """Passes on what a child writes after its first line, so it never blocks on a pipe."""
    out = getattr(sys.stderr, "buffer", None)
    try:
        chunk = first
        while True:
            if chunk and out is not None:
                out.write(chunk)
                out.flush()
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                return
    except (OSError, ValueError):
        return


def _end(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if child.stdout is not None:
        child.stdout.close()


class _Spawner:
    """One thread that starts every child and lives as long as the process.

    Linux sends a child its parent-death signal when the *thread* that forked it ends,
    so a child started from a short-lived thread (a wave's pool) would die with it.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="somatize-spawner",
                                                daemon=True)
                self._thread.start()
        done: Future = Future()
        self._queue.put((argv, env, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            argv, env, done = self._queue.get()
            try:
                done.set_result(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.PIPE))
            except BaseException as exc:
                done.set_exception(exc)


_spawner = _Spawner()
_children: weakref.WeakSet[SocketWorker] = weakref.WeakSet()


@atexit.register
def _end_children() -> None:
    for worker in list(_children):
        worker.close()
