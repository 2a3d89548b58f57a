"""The worker: one catalog, many connections, slices run with the core's own walk.

A worker is dumb on purpose. It proves it knows the token and asks the client to
prove the same before it reads anything but a handshake; then it holds whatever
catalog it is sent (one at a time: a different one replaces it, and says so) and runs
the slices it is asked to. While a slice computes it sends heartbeats, so the client
can tell a long computation from a dead worker. A connection that sends something
that is not a frame of ours is dropped; the others go on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .._engine import run_slice
from .._slices import Slice
from .._errors import NodeError, ProtocolError, SomaError
from .._node import Opaque
from .catalog import build, catalog_id, pack_values, unpack_values
from .channel import Channel, Closed
from .protocol import HANDSHAKE, VERSION, Limits, Session, encode, new_nonce, proof, session_key

__all__ = ["Server", "say"]

# The engine's own bracket of a walk; the client brackets the forward itself.
_BRACKET = frozenset(("began", "finished"))


class _Say:
    """One line on stderr per thing done: a single write, cheap enough for every slice.

    Not the logging module: its record, formatting and handler lock cost a fifth of a
    tiny slice's round trip, and a worker's log is only ever these lines.
    """

    def __init__(self) -> None:
        self._second = -1
        self._stamp = ""

    def __call__(self, message: str, *args: Any) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        text = message % args if args else message
        line = f"{self._stamp}.{int((now - second) * 1000):03d} somatize.worker[{os.getpid()}] {text}\n"
        try:
            os.write(2, line.encode(errors="replace"))
        except OSError:  # nobody reads stderr any more: the work goes on
            pass


say = _Say()


class Server:
    """Listens, and gives each connection a thread of its own."""

    def __init__(self, host: str, port: int, *, token: bytes | None = None,
                 tls: ssl.SSLContext | None = None, timeout: float = 30.0,
                 limits: Limits | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=64)
        self.host = host
        self.port = self.listener.getsockname()[1]
        self.token, self.tls, self.timeout = token, tls, timeout
        self.limits = limits or Limits()
        self.instance = uuid.uuid4().hex
        self.catalog: tuple[str, Any] | None = None
        self._catalog_lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._lock = threading.Lock()
        self._count = 0
        self._stopping = threading.Event()
        self._wake_read, self._wake_write = socket.socketpair()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def serve(self) -> None:
        """Accepts connections until ``stop``; returns once they are closed."""
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fileobj is self.listener and not self._stopping.is_set():
                        self._accept()
        finally:
            selector.close()
            self._close_all()

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except OSError:
            return
        with self._lock:
            self._count += 1
            connection = Connection(self, sock, peer, self._count)
            self._connections.add(connection)
        threading.Thread(target=connection.run, name=f"somatize-conn-{self._count}",
                         daemon=True).start()

    def stop(self) -> None:
        """Asks ``serve`` to return; safe from a signal handler."""
        self._stopping.set()
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass

    def _close_all(self) -> None:
        self.listener.close()
        with self._lock:
            open_now = list(self._connections)
        for connection in open_now:
            connection.channel.close()
        deadline = time.monotonic() + 2.0
        for connection in open_now:
            connection.thread_done.wait(max(0.0, deadline - time.monotonic()))
        say("stopped (%d connection%s closed)", len(open_now), "" if len(open_now) == 1 else "s")

    def forget(self, connection: Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def install(self, ident: str, graph: Any) -> None:
        """Holds this catalog from now on; the same one again changes nothing, so its
        nodes' live state (a trainer's optimizer) survives a second provisioning."""
        with self._catalog_lock:
            if self.catalog is not None and self.catalog[0] == ident:
                return
            previous = self.catalog
            self.catalog = (ident, graph)
        held = [n for n, impl in graph.impls.items() if type(impl).__name__ != "Elsewhere"]
        if previous is None:
            say("catalog %s holds %s", _short(ident), ", ".join(held))
        else:
            say("catalog %s replaces %s; it holds %s", _short(ident), _short(previous[0]),
                     ", ".join(held))

    def current(self) -> tuple[str, Any] | None:
        with self._catalog_lock:
            return self.catalog


def _short(ident: str) -> str:
    return ident.split(":", 1)[-1][:12]


class Connection:
    """One client: its handshake, its frames, and what stayed here for its forward."""

    def __init__(self, server: Server, sock: socket.socket, peer: Any, number: int):
        self.server = server
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.name = f"connection {number} from {self.peer}"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel = Channel(sock, server.limits)
        self.catalog: str | None = None  # the catalog this client said it runs against
        self.forward: bytes | None = None
        self.held: dict[str, Any] = {}
        self.busy_since: float | None = None
        self.interval = 1.0
        self.thread_done = threading.Event()
        self.closed = threading.Event()

    def run(self) -> None:
        began = time.perf_counter()
        try:
            if self.server.tls is not None:
                self._wrap_tls()
            self._handshake()
            say("%s: authenticated in %.1f ms", self.name, (time.perf_counter() - began) * 1e3)
            threading.Thread(target=self._beating, daemon=True).start()
            self._serve()
        except Closed:
            say("%s: closed by the client", self.name)
        except ProtocolError as exc:
            say("%s: dropped: %s", self.name, exc)
        except TimeoutError:
            say("%s: silent past %.1f s mid-frame; dropped", self.name, self.server.timeout)
        except (OSError, ssl.SSLError) as exc:
            if not self.server._stopping.is_set():  # at shutdown "stopped" says it all
                say("%s: ended: %s", self.name, exc)
        except Exception as exc:  # whatever it was, this connection ends and no other
            say("%s: dropped after an unexpected %s: %s", self.name, type(exc).__name__, exc)
        finally:
            self.closed.set()
            self.channel.close()
            self.held.clear()
            self.server.forget(self)
            self.thread_done.set()

    def _wrap_tls(self) -> None:
        sock = self.channel.sock
        sock.settimeout(self.server.timeout)
        self.channel = Channel(self.server.tls.wrap_socket(sock, server_side=True), self.server.limits)

    # -- the handshake --------------------------------------------------------------
    def _handshake(self) -> None:
        channel, token, timeout = self.channel, self.server.token, self.server.timeout
        channel.sock.settimeout(timeout)
        hello = channel.recv(HANDSHAKE)
        if hello.kind != "hello":
            raise ProtocolError(f"the first frame was {hello.kind!r}, not a hello")
        version = hello.header.get("v")
        if version != VERSION:
            channel.send("refused", {"why": f"this worker speaks wire protocol {VERSION}, "
                                            f"the client {version!r}"})
            raise ProtocolError(f"the client speaks wire protocol {version!r}, this worker {VERSION}")
        client_nonce = hello.header.get("n")
        if type(client_nonce) is not bytes or len(client_nonce) != 32:
            raise ProtocolError("a hello without a 32-byte nonce")
        wait = hello.header.get("t")
        if type(wait) in (int, float) and wait > 0:
            self.interval = max(0.02, min(1.0, wait / 4))
        worker_nonce = new_nonce()
        challenge = {"v": VERSION, "n": worker_nonce, "a": token is not None,
                     "i": self.server.instance}
        if token is not None:
            challenge["p"] = proof(token, b"worker", client_nonce, worker_nonce)
        channel.send("challenge", challenge)
        if token is not None:
            answer = channel.recv(HANDSHAKE)
            if answer.kind == "refused":
                raise ProtocolError(f"wrong token: the client says {answer.header.get('why')}")
            said = answer.header.get("p") if answer.kind == "proof" else None
            expected = proof(token, b"client", client_nonce, worker_nonce)
            if type(said) is not bytes or not hmac.compare_digest(said, expected):
                try:
                    channel.send("refused", {"why": "the client does not know this worker's token"})
                except OSError:
                    pass
                raise ProtocolError("wrong token: the client's proof does not match")
            channel.session = Session(session_key(token, client_nonce, worker_nonce), b"W")
        current = self.server.current()
        channel.send("welcome", {"c": current[0] if current else None, "i": self.server.instance})

    def _beating(self) -> None:
        """Says "still here" while a slice computes, and never after its answer."""
        while not self.closed.wait(self.interval):
            if self.busy_since is None:
                continue
            with self.channel.lock:
                if self.busy_since is None or self.closed.is_set():
                    continue
                try:
                    self.channel._send_pieces(encode("beat", None, [], self.channel.session))
                except OSError:
                    return

    # -- requests -------------------------------------------------------------------
    def _serve(self) -> None:
        handlers: dict[str, Callable[[Any], None]] = {
            "catalog": self._on_catalog, "provision": self._on_provision, "slice": self._on_slice,
        }
        while True:
            frame = self.channel.recv(patient=True)
            handler = handlers.get(frame.kind)
            if handler is None:
                raise ProtocolError(f"a {frame.kind!r} frame where a request was expected")
            handler(frame)
            frame = handler = None  # let its buffers go before the next one is read

    def _on_catalog(self, frame: Any) -> None:
        wanted = frame.header.get("c")
        current = self.server.current()
        if current is not None and current[0] == wanted:
            self.catalog = wanted
            self.channel.send("ok")
        else:
            self.channel.send("need", {"c": current[0] if current else None})

    def _on_provision(self, frame: Any) -> None:
        head = frame.header
        ident, kind, runtime = head.get("c"), head.get("kind"), head.get("r")
        if self.server.token is not None and not frame.sealed:
            raise ProtocolError("a catalog that is not sealed on an authenticated connection")
        if len(frame.buffers) != 1 or type(ident) is not str or type(kind) is not str:
            raise ProtocolError("a provision frame without exactly one blob, an id and a kind")
        blob = frame.buffers[0]
        blob_id = "sha256:" + hashlib.sha256(blob).hexdigest()
        if catalog_id(kind, blob_id, runtime) != ident:
            raise ProtocolError("a catalog whose bytes do not match its id")
        began = time.perf_counter()
        self.busy_since = time.monotonic()
        try:
            graph = build(kind, blob, runtime)
        except ProtocolError:
            raise
        except Exception as exc:
            self.busy_since = None
            self._refuse_catalog(exc)
            return
        self.busy_since = None
        self.server.install(ident, graph)
        self.catalog = ident
        say("%s: provisioned %s (%d bytes) in %.1f ms", self.name, _short(ident),
                 len(blob), (time.perf_counter() - began) * 1e3)
        self.channel.send("ok")

    def _refuse_catalog(self, exc: Exception) -> None:
        module = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        say("%s: cannot load the catalog: %s: %s", self.name, type(exc).__name__, exc)
        self.channel.send("error", {"e": "catalog", "m": f"{type(exc).__name__}: {exc}",
                                    "module": module})

    def _on_slice(self, frame: Any) -> None:
        head = frame.header
        nodes, wanted, forward = head.get("n"), head.get("w"), head.get("f")
        if (type(nodes) is not list or type(wanted) is not list or type(forward) is not bytes
                or not all(type(n) is str for n in nodes + wanted)):
            raise ProtocolError("a slice frame without its nodes, its outputs or its forward")
        current = self.server.current()
        if current is None or current[0] != self.catalog:
            self.channel.send("need", {"c": current[0] if current else None})
            return
        if forward != self.forward:  # what stayed for an earlier forward is nobody's now
            self.forward, self.held = forward, {}
        try:
            values = unpack_values(head.get("v", {}), frame.buffers)
        except SomaError as exc:
            self._fail(exc, [])
            return
        refs = head.get("r", [])
        if (type(values) is not dict or type(values.get("g", {})) is not dict
                or type(refs) is not list or not all(type(r) is str for r in refs)):
            raise ProtocolError("a slice whose values or references are malformed")
        # Values arrive unwrapped, as the walk holds them; Opaque lets them in as they
        # are. A walk back hands what it is given to its nodes untouched.
        wrap = (lambda value: value) if head.get("t") else Opaque
        given = {node: wrap(value) for node, value in values.get("g", {}).items()}
        for ref in refs:
            if ref not in self.held:
                self._fail_lost(ref)
                return
            given[ref] = wrap(self.held[ref])
        self._run(current[1], nodes, wanted, given, Opaque(values.get("i")), bool(head.get("x")),
                  bool(head.get("t")))

    def _run(self, graph: Any, nodes: list[str], wanted: list[str], given: dict[str, Any],
             input: Any, watching: bool, transposed: bool) -> None:
        facts: list[dict] = []
        began = time.perf_counter()
        self.busy_since = time.monotonic()
        try:
            out = run_slice(graph, Slice("", graph, tuple(nodes), given=given, input=input,
                                         wanted=tuple(wanted), watching=watching,
                                         transposed=transposed), facts)
        except Exception as exc:  # the one boundary where a slice's failure is translated
            self.busy_since = None
            say("%s: slice %s failed after %.1f ms: %s", self.name, nodes,
                     (time.perf_counter() - began) * 1e3, exc)
            self._fail(exc, facts)
            return
        self.busy_since = None
        buffers: list[Any] = []
        try:
            trees, refused = pack_values(out, buffers)
        except Exception as exc:  # a codec that failed otherwise than by refusing
            self._fail(exc, facts)
            return
        for node in refused:
            self.held[node] = out[node]
        header: dict[str, Any] = {"v": trees}
        if refused:
            header["l"] = refused
        if watching:
            header["x"] = _sendable(facts)
        size = self.channel.send("done", header, buffers)
        say("%s: slice %s ran in %.1f ms, answered %d bytes", self.name, nodes,
                 (time.perf_counter() - began) * 1e3, size)

    def _fail(self, exc: BaseException, facts: list[dict]) -> None:
        header: dict[str, Any] = {"e": type(exc).__name__, "m": str(exc), "x": _sendable(facts)}
        if isinstance(exc, NodeError):
            header["node"], header["kind"] = exc.node, exc.kind
            if exc.__cause__ is not None:
                header["cause"] = str(exc.__cause__)
        self.channel.send("error", header)

    def _fail_lost(self, node: str) -> None:
        self.channel.send("error", {"e": "Lost", "node": node, "m": (
            f"the output of node {node!r} is no longer here: the worker kept it for one "
            "forward, and it restarted or another forward began since")})


def _sendable(facts: list[dict]) -> list[dict]:
    """The worker's facts the client has not said itself, as data msgpack carries."""
    out = []
    for fact in facts:
        if fact.get("fact") in _BRACKET:
            continue
        buffers: list[Any] = []
        trees, refused = pack_values(fact, buffers)
        if not buffers and not refused:
            out.append(trees)
    return out
