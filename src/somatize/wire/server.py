"""The worker: a catalog per client session, a bounded number of connections, slices
run with the core's walk.

A worker is dumb on purpose. Each connection (``connection.py``) authenticates, then
runs slices against the catalog of the session each names (``host.SessionsHere``: sessions
sit side by side and never see each other's nodes). A connection that sends something
that is not a frame of ours is dropped; the others go on.

What an unauthenticated peer can take is bounded: its handshake must finish within
the timeout in total, at most ``max_unauthenticated`` such connections are held at
once (the oldest makes room for a new one), and when descriptors run out the worker
stops accepting for a while instead of spinning, and goes on serving the clients it
has.
"""

from __future__ import annotations

import errno
import selectors
import socket
import ssl
import threading
import time
import uuid
from typing import Any

try:
    import resource
except ImportError:  # Windows: no descriptor limit to read
    resource = None

from .connection import Connection
from .host import SessionsHere
from .log import Often, say
from .protocol import VERSION, Limits, derive_key, new_salt, refusal

__all__ = ["Server", "say"]

# What accept() says when the process or the system is out of something it needs.
_EXHAUSTED = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_BACKOFF = (0.05, 1.0)  # the first pause after accept() ran out, and the longest
_FAREWELLS = 32  # refused sockets waiting to be closed without a reset; past it, reset


def _descriptor_limit() -> int | None:
    """How many descriptors this process may hold (``ulimit -n``), where that is known."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


class Server:
    """Listens, and gives each connection it admits a thread of its own.

    At most ``max_connections`` are held, of which at most ``max_unauthenticated``
    have not finished their handshake; a new connection that would pass either
    limit drops the oldest unauthenticated one, and is refused only when every
    connection held is authenticated. ``max_connections`` is lowered to what the
    descriptor limit leaves room for, keeping a quarter of it (at least 16) for
    whatever else the worker and its nodes open.
    """

    def __init__(self, host: str, port: int, *, token: bytes | None = None,
                 tls: ssl.SSLContext | None = None, timeout: float = 30.0,
                 limits: Limits | None = None, max_connections: int = 128,
                 max_unauthenticated: int | None = None, max_sessions: int = 64,
                 session_lease: float = 86400.0, shared_patience: float = 30.0):
        if max_unauthenticated is None:
            max_unauthenticated = min(16, max_connections)
        if not 1 <= max_unauthenticated <= max_connections:
            raise ValueError(f"max_unauthenticated is between 1 and max_connections "
                             f"({max_connections}), not {max_unauthenticated}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=512)
        self.listener.setblocking(False)
        self.host = host
        self.port = self.listener.getsockname()[1]
        self.token, self.tls, self.timeout = token, tls, timeout
        self.salt = new_salt()
        self.key = derive_key(token, self.salt) if token is not None else None
        self.limits = limits or Limits()
        self.descriptors = _descriptor_limit()
        if self.descriptors is not None:  # a connection is a descriptor: past the limit, none
            max_connections = min(max_connections, max(1, self.descriptors - max(16, self.descriptors // 4)))
        self.max_connections = max_connections
        self.max_unauthenticated = min(max_unauthenticated, max_connections)
        self.instance = uuid.uuid4().hex
        if max_sessions < 1 or not session_lease > 0:
            raise ValueError(f"a worker holds at least one session, for a lease above 0 s, "
                             f"not {max_sessions} for {session_lease} s")
        # a catalog per client session
        self.sessions = SessionsHere(max_sessions, session_lease, patience=shared_patience)
        self._connections: set[Connection] = set()  # every one held, authenticated or not
        self._waiting: dict[Connection, None] = {}  # the unauthenticated, oldest first
        self._lock = threading.Lock()
        self._count = 0
        self.stopping = threading.Event()
        self._wake_read, self._wake_write = socket.socketpair()
        self._made_room = Often()
        self._full = Often()
        self._out, self._back = Often(), Often()
        self._exhausted_since: float | None = None
        self._farewells: dict[socket.socket, float] = {}  # refused, and when to close them
        self._selector: selectors.BaseSelector | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def serve(self) -> None:
        """Accepts connections until ``stop``; returns once they are closed."""
        selector = self._selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ)
        listening, resume_at, pause = False, 0.0, _BACKOFF[0]
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if not listening and now >= resume_at:
                    selector.register(self.listener, selectors.EVENT_READ)
                    listening = True
                wake = min([*self._farewells.values()] + ([] if listening else [resume_at]),
                           default=None)
                ready = selector.select(None if wake is None else max(0.0, wake - now))
                self._part(ready)
                if not any(key.fileobj is self.listener for key, _ in ready) or self.stopping.is_set():
                    continue
                if self._accept_all():
                    pause = _BACKOFF[0]
                    continue
                # Out of descriptors: the listener stays readable, so select would wake
                # at once, forever. Stop listening for a while; the clients held go on.
                selector.unregister(self.listener)
                listening, resume_at = False, time.monotonic() + pause
                pause = min(pause * 2, _BACKOFF[1])
        finally:
            for sock in self._farewells:
                sock.close()
            selector.close()
            self._close_all()

    def _accept_all(self) -> bool:
        """Admits what waits to be accepted; False when the process ran out of
        something accept() needs (descriptors, most often)."""
        for _ in range(64):  # a flood is taken in batches, with the stop flag between
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                break
            except OSError as exc:
                if exc.errno not in _EXHAUSTED:  # nothing we know of; pause as for the rest
                    self._out("accepting a connection failed: %s", exc)
                    return False
                self._exhausted(exc)
                return False
            self._recovered()
            self._admit(sock, peer)
        return True

    def _exhausted(self, exc: OSError) -> None:
        with self._lock:
            made_room = self._drop_oldest_waiting()
            held = len(self._connections)
        if self._exhausted_since is None:  # once until it recovers (and rarely, if it flaps)
            self._exhausted_since = time.monotonic()
            self._out("cannot accept connections: %s; serving the %d held%s, and accepting "
                      "again when descriptors free up (raise the limit: ulimit -n)",
                      exc.strerror or exc, held,
                      " (less the oldest unauthenticated one)" if made_room else "")

    def _recovered(self) -> None:
        if self._exhausted_since is not None:
            self._back("accepting connections again, after %.1f s without",
                       time.monotonic() - self._exhausted_since)
            self._exhausted_since = None

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        with self._lock:
            while self._waiting and (len(self._waiting) >= self.max_unauthenticated
                                     or len(self._connections) >= self.max_connections):
                self._drop_oldest_waiting()
            if len(self._connections) >= self.max_connections:
                self._refuse(sock)
                return
            self._count += 1
            try:
                connection = Connection(self, sock, peer, self._count)
            except OSError:  # it was reset before we got to it
                sock.close()
                return
            self._connections.add(connection)
            self._waiting[connection] = None
        try:
            threading.Thread(target=connection.run, name=f"somatize-conn-{connection.number}",
                             daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: this one goes, the others stay
            say("%s: dropped, no thread for it: %s", connection.name, exc)
            connection.channel.close()
            self.forget(connection)

    def _drop_oldest_waiting(self) -> bool:
        """Makes room: the unauthenticated connection held longest goes (under the lock)."""
        if not self._waiting:
            return False
        oldest = next(iter(self._waiting))
        del self._waiting[oldest]
        self._connections.discard(oldest)
        oldest.interrupt()
        self._made_room("%s: dropped unauthenticated after %.1f s to make room for a newer "
                        "connection (at most %d wait to authenticate: --max-unauthenticated)",
                        oldest.name, time.monotonic() - oldest.since, self.max_unauthenticated)
        return True

    def _refuse(self, sock: socket.socket) -> None:
        """Turns a connection away when every one held is authenticated, with a
        ``refused`` frame that says why.

        Closing it with the client's hello unread would send a reset, and a reset
        discards the refusal before the client reads it: so the socket waits (in the
        accept loop, not a thread) for the hello, or two seconds, before it is closed.
        """
        self._full("refusing connections: all %d held are authenticated (--max-connections)",
                   self.max_connections)
        try:
            sock.setblocking(False)
            sock.send(refusal(VERSION, f"this worker holds its most connections "
                                       f"({self.max_connections}); try again later"))
        except OSError:
            sock.close()
            return
        if len(self._farewells) >= _FAREWELLS:
            sock.close()
            return
        self._farewells[sock] = time.monotonic() + 2.0
        self._selector.register(sock, selectors.EVENT_READ, "farewell")

    def _part(self, ready: list) -> None:
        """Closes the refused sockets whose hello came in, or whose time is up."""
        now = time.monotonic()
        heard = [key.fileobj for key, _ in ready if key.data == "farewell"]
        for sock in heard + [s for s, until in self._farewells.items() if until <= now]:
            if self._farewells.pop(sock, None) is None:
                continue
            self._selector.unregister(sock)
            try:
                sock.recv(65536)
            except OSError:
                pass
            sock.close()

    def authenticated(self, connection: Connection) -> bool:
        """Counts this connection as authenticated; False if it was dropped meanwhile."""
        with self._lock:
            if connection not in self._waiting:
                return False
            del self._waiting[connection]
            return True

    def stop(self) -> None:
        """Asks ``serve`` to return; safe from a signal handler."""
        self.stopping.set()
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
        say.routine("stopped (%d connection%s closed)", len(open_now), "" if len(open_now) == 1 else "s")

    def forget(self, connection: Connection) -> None:
        with self._lock:
            self._connections.discard(connection)
            self._waiting.pop(connection, None)
