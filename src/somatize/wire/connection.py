"""One connection on a worker: its handshake, its requests, and what stayed for its forward.

The handshake is bounded by the server's timeout in total (TLS included), and a
peer learns nothing computed from the token until it has proven it holds it: the
client proves first, and only then does the worker. Requests run with the core's own
walk; whatever a slice raises is answered with its traceback, which is also written
to the log.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import ProtocolError
from .._graph import user_ids
from .channel import Channel, Closed
from .host import (Holding, Refused, SessionsHere, SliceFormHere, answer, control, failed,
                   provisioned, refused_catalog, short, slice_form_here)
from .log import quoted, say
from .transport import FORMS
from .protocol import (
    HANDSHAKE,
    VERSION,
    Keyed,
    OtherVersion,
    connection_key,
    new_nonce,
    proof,
    refusal,
)


class Serving(Protocol):
    """What a connection needs of the worker that admitted it (``server.Server``, which
    hands itself in): its settings, its sessions, and two calls back."""

    token: bytes | None
    tls: Any
    timeout: float
    key: bytes | None
    salt: bytes
    limits: Any
    instance: str
    sessions: SessionsHere
    stopping: threading.Event

    def authenticated(self, connection: Connection) -> bool: ...

    def forget(self, connection: Connection) -> None: ...

__all__ = ["Connection", "short"]


class Connection:
    """One client: its handshake, its frames, and what stayed here for its forward."""

    def __init__(self, server: Serving, sock: socket.socket, peer: Any, number: int):
        self.server = server
        self.number = number
        self.since = time.monotonic()
        self.deadline = self.since + server.timeout  # for the whole handshake, TLS and all
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.name = f"connection {number} from {self.peer}"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel = Channel(sock, server.limits)
        self.holding = Holding()  # what stayed here for this client's forward
        self.forms: list[SliceFormHere] = []  # what slices said in full here, by number
        self.busy_since: float | None = None
        self.running_afterwards = False  # running what a slice left for after its answer
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
            self.channel.set_timeout(self.server.timeout)
            say.routine("%s: authenticated in %.1f ms", self.name, (time.perf_counter() - began) * 1e3)
            threading.Thread(target=self._beating, daemon=True).start()
            self._serve()
        except Exception as exc:  # whatever it was, this connection ends and no other
            self._ended(exc, authenticated)
        finally:
            self.closed.set()
            self.channel.close()
            self.holding.clear()
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
            channel.keyed = Keyed(connection_key(key, client_nonce, worker_nonce), b"W")
            welcome["p"] = proof(key, b"worker", client_nonce, worker_nonce)
        if type(most) is int and most > 0:  # said before it proved anything: it only limits us
            channel.most = most
        welcome["i"] = self.server.instance
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
        """Says "still here" while a slice computes, and never after its answer unless
        the client already asked again: while the work a slice left for afterwards runs,
        a beat goes only once the next request waits, since one that came to an idle
        client would look to it like the connection closing."""
        while not self.closed.wait(self.interval):
            if self.busy_since is None:
                continue
            try:
                self.channel.send_if("beat", self._may_beat)
            except OSError:
                return

    def _may_beat(self) -> bool:
        return self.busy_since is not None and not self.closed.is_set() and (
            not self.running_afterwards or not self.channel.idle_and_open())

    # -- requests -------------------------------------------------------------------
    def _serve(self) -> None:
        handlers: dict[str, Callable[[Any], None]] = {
            "catalog": self._on_catalog, "provision": self._on_provision, "slice": self._on_slice,
            "control": self._on_control, "end": self._on_end,
        }
        while True:
            frame = self.channel.recv(patient=True)
            handler = handlers.get(frame.kind)
            if handler is None:
                raise ProtocolError(f"a {frame.kind!r} frame where a request was expected")
            handler(frame)
            frame = handler = None  # let its buffers go before the next one is read

    def _on_catalog(self, frame: Any) -> None:
        """Whether this worker holds the catalog a session names: ``ok``, or ``need``
        (with why the session is gone, where it was held), or a refusal."""
        session, wanted = _session_of(frame), frame.header.get("c")
        if type(wanted) is not str:
            raise ProtocolError("a catalog frame without the id of its catalog")
        sessions = self.server.sessions
        try:
            sessions.admits(session, wanted)
        except Refused as exc:
            self._refuse_session(exc)
            return
        held, gone = sessions.lookup(session)
        if held is not None and held.catalog == wanted:
            self.channel.send("ok")
        else:
            self.channel.send("need", {"gone": gone} if gone and held is None else {})

    def _on_provision(self, frame: Any) -> None:
        head = frame.header
        session = _session_of(frame)
        if type(head.get("c")) is not str:
            raise ProtocolError("a provision frame without the id of its catalog")
        if self.server.token is not None and not frame.sealed:
            raise ProtocolError("a catalog that is not sealed on an authenticated connection")
        try:  # refused before anything is unpickled
            self.server.sessions.admits(session, head.get("c"))
        except Refused as exc:
            self._refuse_session(exc)
            return
        began = time.perf_counter()
        self.busy_since = time.monotonic()
        try:
            graph = provisioned(head.get("c"), head.get("kind"), head.get("r"), frame.buffers)
        except ProtocolError:
            raise
        except Exception as exc:
            self.busy_since = None
            self._refuse_catalog(exc)
            return
        self.busy_since = None
        try:
            self.server.sessions.install(session, head["c"], graph, head.get("keeps") is True)
        except Refused as exc:
            self._refuse_session(exc)
            return
        say.routine("%s: provisioned %s for session %s (%d bytes) in %.1f ms", self.name,
                    short(head["c"]), session.hex()[:12], len(frame.buffers[0]),
                    (time.perf_counter() - began) * 1e3)
        self.channel.send("ok")

    def _on_control(self, frame: Any) -> None:
        """A verb for a session (``host.control``): its buffers sealed, as a catalog's
        are, since what it carries is taken into a trainer whole (weights, optimizer
        state); its header is MACed as every frame's is."""
        if self.server.token is not None and frame.buffers and not frame.sealed:
            raise ProtocolError("a control frame whose buffers are not sealed on an "
                                "authenticated connection")
        self.busy_since = time.monotonic()
        try:
            reply = control(self.server.sessions, frame.header, frame.buffers)
        finally:
            self.busy_since = None
        if reply.said is not None:
            say.block(f"{self.name}: {reply.said}", reply.text)
        self._reply(reply, [frame.header.get("c")])

    def _on_end(self, frame: Any) -> None:
        self.server.sessions.end(_session_of(frame))
        self.channel.send("ok")

    def _refuse_session(self, exc: Refused) -> None:
        say("%s: refused: %s", self.name, exc)
        self.channel.send("error", {"e": "session", "m": str(exc)})

    def _refuse_catalog(self, exc: Exception) -> None:
        header, text = refused_catalog(exc)
        say.block(f"{self.name}: cannot load the catalog: {type(exc).__name__}: {exc}", text)
        self.channel.send("error", header)

    def _on_slice(self, frame: Any) -> None:
        began = time.perf_counter()
        form = self._form(frame.header)
        nodes = frame.header.get("n") if form is None else form.nodes
        self.busy_since = time.monotonic()  # a codec's first use may import it (torch: seconds)
        try:
            reply = answer(self.server.sessions, frame.header, frame.buffers, self.holding, form,
                           defers=True)
        finally:
            self.busy_since = None
        frame = None  # let its buffers go before the answer is sent
        if reply.said is not None:
            say.block(f"{self.name}: {reply.said}", reply.text)
        try:
            size = self._reply(reply, nodes)
            took = time.perf_counter() - began
        finally:
            if reply.afterwards is not None:
                self._run_afterwards(reply.afterwards)
        if reply.kind == "done" and size and say.routine_too:
            say.routine("%s: slice %s ran in %.1f ms, answered %d bytes", self.name,
                        _said(nodes), took * 1e3, size)

    def _run_afterwards(self, afterwards: Callable[[], None]) -> None:
        """Runs what a slice's nodes left for after its answer, now it has gone: busy
        for the heartbeat, which waits for the client's next request (``_may_beat``)."""
        self.running_afterwards = True  # before busy: no beat may see busy alone
        self.busy_since = time.monotonic()
        try:
            afterwards()
        finally:
            self.busy_since = None
            self.running_afterwards = False

    def _reply(self, reply: Any, nodes: Any) -> int:
        """Sends a slice's answer and returns its size; one larger than the client takes
        is not sent, and an error saying so goes instead (answering 0)."""
        try:
            return self.channel.send(reply.kind, reply.header, reply.buffers)
        except ProtocolError as exc:  # nothing was sent
            failure = failed(ProtocolError(
                f"the answer to slice {_said(nodes)} is too large for the client: {exc}; give "
                "Worker(..., limits=Limits(frame=...)) a larger frame"), [])
            failure.header["x"] = reply.header.get("x", [])
            self.channel.send("error", failure.header)
            return 0

    def _form(self, head: dict[str, Any]) -> SliceFormHere | None:
        """The form a slice request says in full and numbers (kept, under the next
        number, for the requests after it on this connection), or names by its number;
        None for a request that does neither."""
        number = head.get("p")
        if number is None:
            return None
        forms = self.forms
        # what a number that is not one is called: its type (a peer's value may nest
        # past what repr can follow)
        said = number if type(number) is int else f"a {type(number).__name__}"
        if "n" in head:  # said in full: numbered in order, and at most FORMS of them
            if type(number) is not int or number != len(forms) or number >= FORMS:
                raise ProtocolError(f"a slice numbering its form {said} where {len(forms)} "
                                    "was next")
            form = slice_form_here(head)
            forms.append(form)
            return form
        if type(number) is not int or not 0 <= number < len(forms):
            raise ProtocolError(f"a slice naming form {said}, which this connection was "
                                "never told")
        return forms[number]


def _session_of(frame: Any) -> bytes:
    """The session a request names; a request naming none is not one of ours."""
    session = frame.header.get("s")
    if type(session) is not bytes or not 0 < len(session) <= 64:
        raise ProtocolError(f"a {frame.kind!r} frame without its session")
    return session


def _mismatch(version: Any) -> str:
    said = quoted(version, 20) if type(version) in (str, bytes) else (
        repr(version) if type(version) in (int, float, bool, type(None)) else
        f"a {type(version).__name__}")  # a peer's list may nest past what repr follows
    return (f"this worker speaks wire protocol {VERSION} and the client {said}: install "
            "the same somatize on both ends (pip install -U somatize, on the older one)")


def _clip(text: str, limit: int = 500) -> str:
    """A message that may quote a peer, cut to a line's length."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _said(nodes: Any) -> Any:
    """A slice's nodes as the user knows them; what a malformed request named, as it is."""
    ok = isinstance(nodes, list) and all(type(n) is str for n in nodes)
    return user_ids(nodes) if ok else nodes
