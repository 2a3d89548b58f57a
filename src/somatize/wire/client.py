"""The client's end of a socket: one connection to one worker, opened at first need.

A SocketLink is opened when a slice needs it, kept open between forwards, and reopened
when it broke (the sessions the worker holds outlive a connection; a worker that
restarted is told apart by the instance its welcome names). Every failure is
translated here, once, into an error that names the host: nothing answers, the worker
died mid-slice, it went silent past the timeout or past a call's deadline, it does not
share our token, or it said something that is not a frame.
"""

from __future__ import annotations

import collections
import hmac
import socket
import ssl
import threading
import time
import warnings
from typing import Any

from .._errors import ProtocolError, Silent, Unauthorised, WireError
from .._slices import Outcome
from .channel import Channel, Closed
from .._verbs import END
from .protocol import HANDSHAKE, VERSION, Keyed, connection_key, derive_key, new_nonce, proof
from .transport import (FORMS, Link, Pending, Request, SessionThere, catalog_refused, outcome_of,
                        state_lost, verb_answered, verb_request)

__all__ = ["SocketLink", "SocketPending"]


class SocketPending(Pending):
    """A slice sent on a socket and not answered yet: ``result()`` reads its answer (and
    those of the slices sent before it on the same connection, which come first)."""

    __slots__ = ("request", "sent_at")

    def __init__(self, link: SocketLink, request: Request):
        super().__init__(link, request)
        self.request: Request | None = request  # what to send, again if the worker asks
        self.sent_at = 0.0  # time.monotonic() when it went out, for a call's deadline


class SocketLink(Link):
    """One connection to one worker. Requests go out in order, and may go out before
    the answers to earlier ones are read (a pipeline, a fan-out): the worker answers
    them in the order it got them, so ``inflight`` is read oldest first.

    What a session holds on the worker outlives a connection: a connection dropped and
    opened again to the same worker process finds it there, and one to another process
    (the worker restarted) finds it gone, which is said for a session that keeps state
    and re-provisioned for one that does not."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.ordered = True  # a connection's requests are answered in the order they came
        self.channel: Channel | None = None
        self.lock = threading.Lock()
        self.instance: str | None = None  # the worker process the connection reaches
        self.inflight: collections.deque[SocketPending] = collections.deque()
        self._sending = False
        self._carried = [0, 0]  # bytes sent and received on connections since dropped
        # Which connection this is (counted over the link's life), and how many forms it
        # said in full: a form said on it notes both (SliceForm.said), so nothing here holds
        # on to a form, nor to the session and catalog behind it.
        self._connection = 0
        self._forms = 0

    # -- a slice --------------------------------------------------------------------
    def run(self, request: Request) -> Outcome:
        """Runs one slice there and answers with what came back."""
        pending = SocketPending(self, request)
        with self.lock:  # sent and read under one hold of the lock: the common case
            self._send(pending, retry=True)
            while not pending.answered:
                self._read_one()
        if pending.error is not None:
            raise pending.error
        return pending.outcome

    def submit(self, request: Request) -> SocketPending:
        """Sends one slice now; its answer is read by the ``Pending``'s ``result()``."""
        pending = SocketPending(self, request)
        with self.lock:
            self._send(pending, retry=True)
        return pending

    def _send(self, pending: SocketPending, retry: bool) -> None:
        """Sends a slice (under the lock), reading earlier answers meanwhile where the
        socket is full, so that neither side waits on the other to read."""
        host, nodes, request = pending.host, pending.nodes, pending.request
        for attempt in (0, 1):
            fresh = self._open(host)
            if not pending.there.declared_in(self.instance):
                self._read_replies()  # a catalog's round trip comes after what is out
                self._declare(host, pending.there)
            if self.inflight and not self.channel.duplex:
                self._read_replies()  # TLS cannot read while it sends: no overlap there
            header, naming = self._header(request)
            began = time.perf_counter_ns()
            reading = self._read_more if self.inflight else None
            self._sending = True
            try:
                sent = self.channel.send("slice", header, request.buffers, reading=reading)
            except ProtocolError as exc:  # refused before a byte went: the connection is well
                raise self._too_large(host, f"slice {nodes}", exc) from None
            except TimeoutError:
                raise self._silent(host, f"while sending slice {nodes}") from None
            except OSError as exc:
                alone = not self.inflight
                self._drop()
                if attempt == 0 and not fresh and alone and retry:  # it broke before it ran
                    continue
                raise self._broken(host, f"while sending slice {nodes}", exc) from None
            finally:
                self._sending = False
            if naming is not None:  # said in full and numbered: named by its number from now on
                request.form.said = (self._connection, naming)
                self._forms += 1
            pending.sent, pending.took_sent = sent, (time.perf_counter_ns() - began) // 1000
            pending.sent_at = time.monotonic()
            self.inflight.append(pending)
            return

    def _header(self, request: Request) -> tuple[dict[str, Any], int | None]:
        """The request's header on this connection: its form named by number when it was
        said here before, else said in full with the number it will go by (answered
        beside, to be kept once the frame went out), or said in full every time once
        this connection named as many forms as it may."""
        said = request.form.said
        if said is not None and said[0] == self._connection:
            return request.header({"p": said[1]}), None
        header = request.header()
        number = self._forms
        if number >= FORMS:
            return header, None
        header["p"] = number
        return header, number

    def read_reply(self, pending: SocketPending) -> None:
        """Reads answers, oldest first, until ``pending``'s is in."""
        with self.lock:
            while not pending.answered:
                if not self.inflight:  # dropped with it unanswered, and told so
                    raise AssertionError("a pending slice that is neither out nor answered")
                self._read_one()

    def _read_more(self) -> bool:
        """Reads one answer while a send waits; False once none is owed."""
        if self.inflight:
            self._read_one()
        return bool(self.inflight)

    def _read_replies(self) -> None:
        while self.inflight:
            self._read_one()

    def _read_one(self) -> None:
        """Reads the next answer and fills in the oldest slice out with it."""
        owed = list(self.inflight)
        pending = owed[0]
        host, nodes = pending.host, pending.nodes
        deadline = self.worker.deadline
        until = pending.sent_at + deadline if deadline is not None else None
        try:
            reply = self._answer(host, None, until, nodes)
        except BaseException as exc:  # the connection is gone: so is every answer owed
            self.inflight.clear()
            for each in owed:
                self._fill(each, None, exc)
            raise
        self.inflight.popleft()
        there = pending.there
        if reply.kind == "need":  # the worker holds the session no more
            there.declared = None
            if there.learnt:
                self._fill(pending, None, state_lost(
                    host, self.worker.where(host), there,
                    reply.header.get("gone") or "the worker let go of its session"))
                return
            if not self.inflight and pending.request is not None and not self._sending:
                # alone on the wire: declared again and sent once more
                try:
                    self._send(pending, retry=False)
                except BaseException as exc:
                    self._fill(pending, None, exc)
                pending.request = None  # no third time
                return
            self._fill(pending, None, WireError(
                f"host {host!r}: the worker keeps letting go of this client's session "
                f"({reply.header.get('gone') or 'no reason given'})", host=host))
            return
        there.live = True  # it ran there, whatever it answered
        try:
            outcome = self._outcome(host, nodes, reply, pending.sent, pending.took_sent,
                                    pending.watching)
        except Exception as exc:
            self._fill(pending, None, exc)
        else:
            self._fill(pending, outcome, None)

    @staticmethod
    def _fill(pending: SocketPending, outcome: Outcome | None, error: BaseException | None) -> None:
        pending.outcome, pending.error, pending.answered = outcome, error, True
        pending.request = None

    def _fail_inflight(self, exc: BaseException) -> None:
        while self.inflight:
            self._fill(self.inflight.popleft(), None, exc)

    def _outcome(self, host: str, nodes: list[str], reply: Any, sent: int, took_sent: int,
                 watching: bool) -> Outcome:
        if reply.kind not in ("done", "error"):
            self._drop()
        return outcome_of(host, nodes, reply.kind, reply.header, reply.buffers, sent=sent,
                          took_sent=took_sent, size=reply.size, took_us=reply.took_us,
                          watching=watching)

    # -- a verb ---------------------------------------------------------------------
    def control(self, there: SessionThere, verb: str, args: Any = None, *, host: str = "") -> Any:
        """Asks the worker a verb for the session (``Link.control``) in one round trip,
        after the answers still owed on the connection, in a sealed frame."""
        if verb == END:
            return self.end(there)
        head, buffers = verb_request(there, verb, args)
        doing = f"while answering verb {verb!r}"
        with self.lock:
            for attempt in (0, 1):
                self._open(host)
                self._read_replies()  # the connection answers in order: what is out first
                if not there.declared_in(self.instance):
                    self._declare(host, there)
                self._request(host, "control", head, buffers, sealed=True)
                reply = self._answer(host, doing)
                if reply.kind == "need":  # the worker holds the session no more
                    there.declared = None
                    if there.learnt:
                        raise state_lost(host, self.worker.where(host), there,
                                         reply.header.get("gone")
                                         or "the worker let go of its session")
                    if attempt == 0:
                        continue
                    raise WireError(f"host {host!r}: the worker keeps letting go of this "
                                    "client's session", host=host)
                if reply.kind not in ("done", "error"):
                    self._drop()
                return verb_answered(host, verb, reply.kind, reply.header, reply.buffers)
        raise AssertionError("unreachable")

    # -- the catalog ----------------------------------------------------------------
    def _declare(self, host: str, there: SessionThere) -> None:
        """Makes sure the worker holds this session's catalog, sending it only if the
        worker says it lacks it. A session that keeps state and has run is never
        handed its first copy again: that it is gone is said (``StateLost``)."""
        staged = there.staged
        where = self.worker.where(host)
        if there.lost_in(self.instance):
            raise state_lost(host, where, there, f"the worker restarted (it was process "
                             f"{there.instance[:12]}, and is {str(self.instance)[:12]} now)")
        head = {"c": staged.ident, "s": there.session}
        self._request(host, "catalog", head)
        reply = self._answer(host, "while checking its catalog")
        if reply.kind == "need":
            if there.learnt:
                raise state_lost(host, where, there, reply.header.get("gone")
                                 or "the worker holds its session no more")
            self._request(host, "provision", {**head, "kind": staged.kind, "r": staged.runtime,
                                              "keeps": there.keeps}, [staged.blob], sealed=True)
            reply = self._answer(host, "while receiving its catalog")
        if reply.kind == "error":
            raise catalog_refused(host, where, reply.header)
        if reply.kind != "ok":
            self._drop()
            raise ProtocolError(f"host {host!r} answered a catalog with {reply.kind!r}", host=host)
        there.declared, there.instance = staged.ident, self.instance

    def end(self, there: SessionThere) -> None:
        """Tells the worker its owner is done with this session, so what it holds goes
        now rather than at its lease. Answers still owed on the connection are read
        first (their slices are answered with them), and a dropped connection is opened
        again, since the session outlives it; a worker that restarted holds nothing of
        it. One that cannot be reached is warned about: it lets the session go at its
        ``--session-lease``."""
        with self.lock:
            if there.declared is None:  # nothing of it is held there, as far as we know
                return
            there.declared = None
            try:
                self._read_replies()
                self._open("")
                if there.instance != self.instance:  # another process: it holds nothing
                    return
                self._request("", "end", {"s": there.session})
                self._answer("", "while ending a session")
            except WireError as exc:
                warnings.warn(
                    f"the worker at {self.worker.where('')} could not be told to end session "
                    f"{there.session.hex()[:12]} ({exc}); it holds what the session trained "
                    "until its --session-lease runs out", RuntimeWarning, stacklevel=4)

    def _too_large(self, host: str, what: str, exc: ProtocolError) -> ProtocolError:
        return ProtocolError(
            f"host {host!r} ({self.worker.where(host)}) cannot take {what}: {exc}; start the "
            "worker with a larger --max-frame (or send less at once)", host=host)

    # -- the connection -------------------------------------------------------------
    def _open(self, host: str) -> bool:
        """Opens the connection if it is not open and well; says whether it did."""
        if self.channel is not None:
            if self.inflight or self.channel.idle_and_open():  # answers owed: in use
                return False
            self._drop()
        worker = self.worker
        address = worker.address(host)
        where = worker.where(host)
        try:
            sock = socket.create_connection(address, timeout=worker.timeout)
        except TimeoutError:
            raise Silent(f"host {host!r}: nothing answered a connection to {where} within "
                         f"{worker.timeout:g} s", host=host) from None
        except OSError as exc:
            raise WireError(
                f"host {host!r}: cannot connect to {where}: {exc.strerror or exc}; is a worker "
                f"listening there? Start one with: python -m somatize.worker --listen {where}",
                host=host) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if worker.tls is not None:
                sock = self._tls(host, sock, address[0])
            self.channel = Channel(sock, worker.limits)
            self._handshake(host)
        except BaseException:
            if self.channel is not None:
                self._drop()
            else:
                sock.close()
            raise
        return True

    def _tls(self, host: str, sock: socket.socket, name: str) -> ssl.SSLSocket:
        """``sock`` wrapped in TLS, the worker's certificate checked against ``name``."""
        where = self.worker.where(host)
        try:
            return self.worker.tls.wrap_socket(sock, server_hostname=name)
        except ssl.SSLCertVerificationError as exc:
            raise Unauthorised(
                f"host {host!r} ({where}): its TLS certificate does not verify: "
                f"{exc.verify_message or exc.reason or exc}; give Worker.at(..., tls=) the CA "
                f"that signed it (the path of a PEM file, or an ssl.SSLContext), and a "
                f"certificate that names {name!r}", host=host) from None
        except TimeoutError:
            raise Silent(f"host {host!r} ({where}): the TLS handshake did not finish within "
                         f"{self.worker.timeout:g} s", host=host) from None
        except (ssl.SSLError, OSError) as exc:
            raise WireError(
                f"host {host!r} ({where}): the TLS handshake failed: {exc}; is the worker "
                "serving TLS (--tls-cert/--tls-key)?", host=host) from None

    def _handshake(self, host: str) -> None:
        """We prove we hold the token, then the worker does: see docs/wire.md."""
        channel, token, where = self.channel, self.worker.token, self.worker.where(host)
        deadline = time.monotonic() + self.worker.timeout
        client_nonce = new_nonce()
        self._request(host, "hello", {"v": VERSION, "n": client_nonce, "t": self.worker.timeout,
                                      "f": self.worker.limits.frame})
        challenge = self._greeting(host, deadline)
        head = challenge.header
        if challenge.kind == "refused":
            raise ProtocolError(f"host {host!r} ({where}) refused us: {head.get('why')}", host=host)
        if challenge.kind != "challenge" or head.get("v") != VERSION:
            raise ProtocolError(
                f"host {host!r} ({where}) speaks wire protocol {head.get('v')!r} and this client "
                f"{VERSION}; install the same somatize on both ends", host=host)
        worker_nonce, salt = head.get("n"), head.get("s")
        if type(worker_nonce) is not bytes or len(worker_nonce) != 32:
            raise ProtocolError(f"host {host!r} ({where}) sent a challenge without a nonce", host=host)
        if head.get("a") and token is None:
            self._refuse(host, "this client has no token")
            raise Unauthorised(
                f"host {host!r} ({where}) asks for a token and this client has none; give it "
                "the worker's: Worker.at(..., token=...) or SOMATIZE_TOKEN", host=host)
        if not head.get("a") and token is not None:
            self._refuse(host, "this client has a token and the worker does not ask for one")
            raise Unauthorised(
                f"host {host!r} ({where}) does not ask for a token, so it cannot prove it knows "
                "ours; start the worker with the same token (SOMATIZE_TOKEN or --token-file), "
                "or drop the client's", host=host)
        key = None
        if token is not None:
            if type(salt) is not bytes or not 8 <= len(salt) <= 64:
                raise ProtocolError(f"host {host!r} ({where}) sent a challenge without a salt",
                                    host=host)
            key = derive_key(token, salt)
            self._request(host, "proof", {"p": proof(key, b"client", client_nonce, worker_nonce)})
            channel.keyed = Keyed(connection_key(key, client_nonce, worker_nonce), b"C")
        welcome = self._welcome(host, deadline)
        said = welcome.header.get("p")
        if key is not None and (type(said) is not bytes or not hmac.compare_digest(
                said, proof(key, b"worker", client_nonce, worker_nonce))):
            self._drop()
            raise Unauthorised(
                f"host {host!r} ({where}) does not know our token (its proof does not match); "
                "give both ends the same SOMATIZE_TOKEN", host=host)
        most = welcome.header.get("f")
        channel.most = most if type(most) is int and most > 0 else None
        self.instance = welcome.header.get("i")

    def _greeting(self, host: str, deadline: float) -> Any:
        """The worker's answer to our hello; silence and a close are named here, since
        an older worker closes without a word on a hello it cannot read."""
        try:
            return self.channel.recv(HANDSHAKE, deadline=deadline)
        except (Closed, ConnectionResetError) as exc:  # reset: it left our hello unread
            raise self._broken(host, "as soon as it was greeted", exc, hint=(
                f"; a worker of an older somatize (another wire protocol than {VERSION}) "
                "does that: install the same somatize on both ends. Otherwise its log "
                "says why")) from None
        except (TimeoutError, ProtocolError, OSError) as exc:
            raise self._translated(host, "while greeting it", exc) from None

    def _welcome(self, host: str, deadline: float) -> Any:
        """The worker's answer to our proof: a welcome, or a refusal (without a MAC,
        since a worker that turns the proof down has no key in common with us)."""
        try:
            welcome = self.channel.recv(HANDSHAKE, deadline=deadline, refusal_ok=True)
        except ProtocolError as exc:
            self._drop()
            raise Unauthorised(f"host {host!r} ({self.worker.where(host)}) answered our proof "
                               f"with a frame that does not prove it knows our token ({exc})",
                               host=host) from None
        except (TimeoutError, OSError) as exc:
            raise self._translated(host, "while greeting it", exc) from None
        if welcome.kind == "refused":
            self._drop()
            raise Unauthorised(f"host {host!r} ({self.worker.where(host)}) refused us: "
                               f"{welcome.header.get('why')}; give both ends the same "
                               "SOMATIZE_TOKEN", host=host)
        if welcome.kind != "welcome":
            self._drop()
            raise ProtocolError(f"host {host!r} answered our greeting with {welcome.kind!r}",
                                host=host)
        self.channel.set_timeout(self.worker.timeout)
        return welcome

    def _refuse(self, host: str, why: str) -> None:
        """Tells the worker why we go, so its log says so; it may be gone already."""
        try:
            self.channel.send("refused", {"why": why})
        except OSError:
            pass

    def _request(self, host: str, kind: str, header: dict[str, Any] | None = None,
                 buffers: list[Any] = (), sealed: bool = False) -> int:
        try:
            return self.channel.send(kind, header, buffers, sealed)
        except ProtocolError as exc:
            raise self._too_large(host, f"a {kind!r} frame", exc) from None
        except TimeoutError:
            raise self._silent(host, f"while sending {kind!r}") from None
        except OSError as exc:
            raise self._broken(host, f"while sending {kind!r}", exc) from None

    def _answer(self, host: str, doing: str | None, until: float | None = None,
                nodes: Any = None) -> Any:
        """The next frame that is not a heartbeat; a silence past the timeout is Silent,
        and no answer by ``until`` (a call's deadline, a ``time.monotonic()``) is a
        WireError naming the slice's ``nodes``, the connection dropped with it. What it
        was ``doing`` is said in the error (None: running the slice ``nodes``), and
        worded only then."""
        channel = self.channel
        try:
            while True:
                if until is None:
                    frame = channel.recv()
                else:
                    frame = channel.recv(deadline=min(until, time.monotonic() + self.worker.timeout))
                if frame.kind != "beat":
                    return frame
        except (TimeoutError, ProtocolError, OSError) as exc:
            if until is not None and isinstance(exc, TimeoutError) and time.monotonic() >= until:
                self._drop()
                raise WireError(
                    f"host {host!r} ({self.worker.where(host)}): slice {nodes} did not answer "
                    f"within its deadline of {self.worker.deadline:g} s (Worker(..., deadline=)); "
                    "the worker may still be computing it, and serves on", host=host) from None
            raise self._translated(host, doing or f"while running slice {nodes}", exc) from None
        finally:
            if until is not None and self.channel is channel:
                channel.set_timeout(self.worker.timeout)

    def _translated(self, host: str, doing: str, exc: BaseException) -> WireError:
        """What a failure to read from the worker is called, naming the host."""
        if isinstance(exc, TimeoutError):
            return self._silent(host, doing)
        if isinstance(exc, ProtocolError):
            self._drop()
            return ProtocolError(f"host {host!r} ({self.worker.where(host)}): {exc}", host=host)
        return self._broken(host, doing, exc)

    def _silent(self, host: str, doing: str) -> Silent:
        self._drop()
        timeout = self.worker.timeout
        return Silent(
            f"host {host!r} ({self.worker.where(host)}) said nothing, not even a heartbeat, "
            f"for {timeout:g} s {doing}: it is stopped, overloaded or unreachable. If it is "
            "only slow, raise the timeout (Worker.at(..., timeout=) or SOMATIZE_TIMEOUT)",
            host=host)

    def _broken(self, host: str, doing: str, exc: BaseException, hint: str = "") -> WireError:
        self._drop()
        return WireError(
            f"host {host!r} ({self.worker.where(host)}) closed the connection {doing}: the "
            f"worker died or dropped us ({exc}){hint or '; its log says why'}", host=host)

    def traffic(self) -> dict[str, int]:
        """The bytes of every frame sent to the worker and received from it, over this
        link's life (handshakes, catalogs, slices and answers, MACs included)."""
        channel = self.channel
        now = (channel.sent, channel.received) if channel is not None else (0, 0)
        return {"sent": self._carried[0] + now[0], "received": self._carried[1] + now[1]}

    def _drop(self) -> None:
        channel, self.channel = self.channel, None
        self._connection += 1  # the next one knows no form
        self._forms = 0
        if channel is not None:
            self._carried[0] += channel.sent
            self._carried[1] += channel.received
        if self.inflight:
            where = self.worker.where(self.inflight[0].host)
            self._fail_inflight(WireError(
                f"host {self.inflight[0].host!r} ({where}): the connection was dropped before "
                "this slice was answered", host=self.inflight[0].host))
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self.lock:
            self._drop()
