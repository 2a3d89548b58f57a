"""One connection on a worker: its handshake, its requests, and what stayed for its forward.

The handshake is bounded by the server's timeout in total (TLS included), and a
peer learns nothing computed from the token until it has proven it holds it: the
client proves first, and only then does the worker. Requests run with the core's own
walk; whatever a slice raises is answered with its traceback, which is also written
to the log.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._engine import run_slice
from .._errors import NodeError, ProtocolError, SomaError
from .._node import Opaque
from .._slices import Slice
from .catalog import build, catalog_id, pack_values, unpack_values
from .channel import Channel, Closed
from .log import quoted, say
from .protocol import (
    HANDSHAKE,
    VERSION,
    OtherVersion,
    Session,
    encode,
    new_nonce,
    proof,
    refusal,
    session_key,
)

if TYPE_CHECKING:  # the server hands itself in; nothing here calls it by name
    from .server import Server

__all__ = ["Connection", "short"]

# The engine's own bracket of a walk; the client brackets the forward itself.
_BRACKET = frozenset(("began", "finished"))
_TRACEBACK = 64 << 10  # the most of a traceback's text that travels back


def short(ident: str) -> str:
    """A catalog's id as the log shows it."""
    return ident.split(":", 1)[-1][:12]


class Connection:
    """One client: its handshake, its frames, and what stayed here for its forward."""

    def __init__(self, server: Server, sock: socket.socket, peer: Any, number: int):
        self.server = server
        self.number = number
        self.since = time.monotonic()
        self.deadline = self.since + server.timeout  # for the whole handshake, TLS and all
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
        self._dropped = False  # made room for a newer connection
        self._swap = threading.Lock()  # the channel is replaced once, by TLS

    def interrupt(self) -> None:
        """Ends this connection from another thread: its reader wakes and closes it."""
        with self._swap:
            self._dropped = True
            self.channel.interrupt()

    def run(self) -> None:
        began = time.perf_counter()
        authenticated = False
        try:
            if self.server.tls is not None:
                self._wrap_tls()
            welcome = self._handshake()
            # Counted as authenticated before the client hears so, so that what it was
            # told holds: from here on it is never dropped to make room.
            if not self.server.authenticated(self):
                raise Closed("dropped to make room")
            authenticated = True
            self.channel.send("welcome", welcome)
            self.channel.sock.settimeout(self.server.timeout)
            say.routine("%s: authenticated in %.1f ms", self.name, (time.perf_counter() - began) * 1e3)
            threading.Thread(target=self._beating, daemon=True).start()
            self._serve()
        except Exception as exc:  # whatever it was, this connection ends and no other
            self._ended(exc, authenticated)
        finally:
            self.closed.set()
            self.channel.close()
            self.held.clear()
            self.server.forget(self)
            self.thread_done.set()

    def _ended(self, exc: Exception, authenticated: bool) -> None:
        """Says why this connection ended, in one line."""
        if self._dropped:
            return  # the line that made room said so
        if self.server.stopping.is_set() and isinstance(exc, OSError):
            return  # at shutdown "stopped" says it all
        if isinstance(exc, Closed):
            say.routine("%s: closed by the client", self.name)
        elif isinstance(exc, ProtocolError):
            say("%s: dropped: %s", self.name, _clip(str(exc)))
        elif isinstance(exc, TimeoutError) and not authenticated:
            say("%s: handshake not finished within %.1f s; dropped", self.name,
                self.server.timeout)
        elif isinstance(exc, TimeoutError):
            say("%s: silent past %.1f s mid-frame; dropped", self.name, self.server.timeout)
        elif isinstance(exc, OSError):
            say("%s: ended: %s", self.name, _clip(str(exc)))
        else:
            say("%s: dropped after an unexpected %s: %s", self.name, type(exc).__name__,
                _clip(str(exc)))

    def _wrap_tls(self) -> None:
        with self._swap:
            if self._dropped:
                raise Closed("dropped to make room")
            sock = self.server.tls.wrap_socket(self.channel.sock, server_side=True,
                                               do_handshake_on_connect=False)
            self.channel = Channel(sock, self.server.limits)
        # One timeout for the TLS handshake as a whole: the ssl module counts it
        # against a deadline, however its bytes trickle in.
        sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
        sock.do_handshake()

    # -- the handshake --------------------------------------------------------------
    def _handshake(self) -> dict[str, Any]:
        """Client proves, then the worker: see docs/wire.md, "The handshake". Answers
        with the welcome to send once this connection is counted as authenticated."""
        channel, key, deadline = self.channel, self.server.key, self.deadline
        hello = self._greeted()
        client_nonce = hello.header.get("n")
        if type(client_nonce) is not bytes or len(client_nonce) != 32:
            raise ProtocolError("a hello without a 32-byte nonce")
        wait, most = hello.header.get("t"), hello.header.get("f")
        if type(wait) in (int, float) and wait > 0:
            self.interval = max(0.02, min(1.0, wait / 4))
        worker_nonce = new_nonce()
        challenge = {"v": VERSION, "n": worker_nonce, "a": key is not None, "i": self.server.instance}
        if key is not None:
            challenge["s"] = self.server.salt
        channel.send("challenge", challenge)
        welcome: dict[str, Any] = {"f": self.server.limits.frame, "h": self.server.limits.header}
        if key is not None:
            answer = channel.recv(HANDSHAKE, deadline=deadline)
            if answer.kind == "refused":
                raise ProtocolError(f"the client refused us: {quoted(answer.header.get('why'))}")
            said = answer.header.get("p") if answer.kind == "proof" else None
            if type(said) is not bytes or not hmac.compare_digest(
                    said, proof(key, b"client", client_nonce, worker_nonce)):
                try:
                    channel.send("refused", {"why": "the client does not know this worker's token"})
                except OSError:
                    pass
                raise ProtocolError("wrong token: the client's proof does not match")
            channel.session = Session(session_key(key, client_nonce, worker_nonce), b"W")
            welcome["p"] = proof(key, b"worker", client_nonce, worker_nonce)
        if type(most) is int and most > 0:  # said before it proved anything: it only limits us
            channel.most = most
        current = self.server.current()
        welcome.update(c=current[0] if current else None, i=self.server.instance)
        return welcome

    def _greeted(self) -> Any:
        """The client's hello; a peer of another version is told which, in its own words."""
        channel = self.channel
        try:
            hello = channel.recv(HANDSHAKE, deadline=self.deadline)
        except OtherVersion as exc:
            try:
                channel.sock.sendall(refusal(exc.version, _mismatch(exc.version)))
            except OSError:
                pass
            raise ProtocolError(f"the client speaks wire protocol {exc.version} and this side "
                                f"speaks {VERSION}; refused") from None
        if hello.kind != "hello":
            raise ProtocolError(f"the first frame was {hello.kind!r}, not a hello")
        version = hello.header.get("v")
        if version != VERSION:
            channel.send("refused", {"why": _mismatch(version)})
            raise ProtocolError(f"the client speaks wire protocol {quoted(version, 20)}, this "
                                f"worker {VERSION}")
        return hello

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
        say.routine("%s: provisioned %s (%d bytes) in %.1f ms", self.name, short(ident),
                 len(blob), (time.perf_counter() - began) * 1e3)
        self.channel.send("ok")

    def _refuse_catalog(self, exc: Exception) -> None:
        module = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        text = _traceback_text(exc)
        say.block(f"{self.name}: cannot load the catalog: {type(exc).__name__}: {exc}", text)
        self.channel.send("error", {"e": "catalog", "m": f"{type(exc).__name__}: {exc}",
                                    "module": module, "tb": text})

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
        self.busy_since = time.monotonic()  # a codec's first use may import it (torch: seconds)
        try:
            values = unpack_values(head.get("v", {}), frame.buffers)
        except SomaError as exc:
            self.busy_since = None
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
                self.busy_since = None
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
            self._fail(exc, facts, f"slice {nodes} failed after "
                                   f"{(time.perf_counter() - began) * 1e3:.1f} ms: {exc}")
            return
        self.busy_since = None
        buffers: list[Any] = []
        try:
            trees, refused = pack_values(out, buffers)
        except Exception as exc:  # a codec that failed otherwise than by refusing
            self._fail(exc, facts, f"slice {nodes} ran, and its outputs could not be packed: {exc}")
            return
        for node in refused:
            self.held[node] = out[node]
        header: dict[str, Any] = {"v": trees}
        if refused:
            header["l"] = refused
        if watching:
            header["x"] = _sendable(facts)
        try:
            size = self.channel.send("done", header, buffers)
        except ProtocolError as exc:  # larger than the client takes: nothing was sent
            self._fail(ProtocolError(f"the answer to slice {nodes} is too large for the "
                                     f"client: {exc}; give Worker(..., limits=Limits(frame=...)) "
                                     "a larger frame"), facts)
            return
        say.routine("%s: slice %s ran in %.1f ms, answered %d bytes", self.name, nodes,
                 (time.perf_counter() - began) * 1e3, size)

    def _fail(self, exc: BaseException, facts: list[dict], said: str | None = None) -> None:
        """Answers with what went wrong, the worker's traceback included; ``said`` is
        the log's line for it, which the traceback follows there too."""
        header: dict[str, Any] = {"e": type(exc).__name__, "m": str(exc), "x": _sendable(facts)}
        if isinstance(exc, NodeError):
            header["node"], header["kind"] = exc.node, exc.kind
            if exc.__cause__ is not None:
                header["cause"] = str(exc.__cause__)
        header["tb"] = text = _traceback_text(exc)
        if said is not None:
            say.block(f"{self.name}: {said}", text)
        self.channel.send("error", header)

    def _fail_lost(self, node: str) -> None:
        self.channel.send("error", {"e": "Lost", "node": node, "m": (
            f"the output of node {node!r} is no longer here: the worker kept it for one "
            "forward, and it restarted or another forward began since")})


def _traceback_text(exc: BaseException) -> str:
    """The traceback of what went wrong here, as text: the node's own exception when
    the walk wrapped one (everything chained to it included), or else ``exc``'s."""
    cause = exc.__cause__ if isinstance(exc, NodeError) and exc.__cause__ is not None else exc
    text = "".join(traceback.format_exception(cause))
    if len(text) > _TRACEBACK:  # its start says where, its end what: keep both
        head, tail = _TRACEBACK // 4, _TRACEBACK - _TRACEBACK // 4
        text = (f"{text[:head]}\n... ({len(text) - head - tail} characters of the traceback "
                f"left out) ...\n{text[-tail:]}")
    return text


def _mismatch(version: Any) -> str:
    return (f"this worker speaks wire protocol {VERSION} and the client {version!r}: install "
            "the same somatize on both ends (pip install -U somatize, on the older one)")


def _clip(text: str, limit: int = 500) -> str:
    """A message that may quote a peer, cut to a line's length."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


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
