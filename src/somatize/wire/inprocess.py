"""A host in this very process: the smallest transport, and the one to copy.

Every request and every answer is pickled and unpickled on its way (the in-band
pickle a byte stream would carry, so nothing the client holds is shared with the host),
and the host is the worker's own code: ``host.answer`` over ``host.SessionsHere``. So a
test, a notebook with no second machine, or a new transport's author sees exactly what
any host does — sessions, what stays there, refusals, tracebacks — without a process
or a socket. ``restart()`` makes it a fresh host, as a worker that restarted is.
"""

from __future__ import annotations

import pickle
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Late
from typing import Any

from .._errors import DeclarationError, ProtocolError, WireError
from .._slices import Outcome
from .buffers import joined, outgoing, size
from .declare import Worker, provides
from .._verbs import END
from .host import Holding, Refused, SessionsHere, answer, control, provisioned, refused_catalog
from .transport import (Link, Pending, Request, SessionThere, catalog_refused, outcome_of,
                        state_lost, verb_answered, verb_request)

__all__ = ["InProcess", "InProcessLink"]


class InProcess(Worker):
    """A worker whose host is in this process, reached through a pickle round trip;
    see the module (``Worker.in_process`` answers one)."""

    def __init__(self, mode: str = "network", send: Any = (), *, deadline: float | None = None):
        super().__init__(mode, send, deadline=deadline)
        self._link = InProcessLink(self)
        self._wire = b"in-process " + secrets.token_hex(16).encode()

    def where(self, host: str) -> str:
        return "in this process"

    def restart(self) -> None:
        """Makes the host a fresh one, holding nothing, as a restarted worker does."""
        self._link.restart()

    def __repr__(self) -> str:
        return f"Worker.in_process(mode={self.mode!r})"


class InProcessLink(Link):
    """Runs each request through ``host.answer`` after a pickle round trip, at once (so
    it keeps any caller's order); with a deadline, on a thread of its own that the
    call waits for no longer than that."""

    def __init__(self, place: InProcess):
        self.place = place
        self.lock = threading.Lock()  # one request at a time, as a host's connection is
        self._pool: ThreadPoolExecutor | None = None
        self.restart()

    def restart(self) -> None:
        # its everyday lines would be this process's own terminal's: left out
        self.sessions, self.holding = SessionsHere(routine=lambda *said: None), Holding()
        self.lanes: dict[bytes, tuple[threading.Lock, Holding]] = {}
        self.instance = uuid.uuid4().hex

    def _lane(self, there: SessionThere) -> tuple[threading.Lock, Holding]:
        """The lock and held outputs a session's requests run under: the host's one
        connection, or one of its own for a session whose slices wait for other
        clients' (a shared trainer), as a socket gives it a connection of its own."""
        if not there.shares:
            return self.lock, self.holding
        lane = self.lanes.get(there.session)
        if lane is None:
            lane = self.lanes.setdefault(there.session, (threading.Lock(), Holding()))
        return lane

    def submit(self, request: Request) -> Pending:
        pending = Pending(self, request)
        try:
            pending.outcome = self._run(request)
        except Exception as exc:
            pending.error = exc
        pending.answered = True
        return pending

    def _run(self, request: Request) -> Outcome:
        host, nodes, there = request.host, request.nodes, request.there
        for attempt in (0, 1):
            self._provide(host, there)
            head, buffers = _carried(request.header(), request.buffers)
            began = time.perf_counter_ns()
            kind, head, back = self._answered(host, nodes, head, buffers, there)
            if kind == "need":
                self._needed(host, there, head, attempt)
                continue
            there.live = True
            return outcome_of(host, nodes, kind, head, back, sent=size(request.buffers),
                              size=size(back), took_us=(time.perf_counter_ns() - began) // 1000,
                              watching=request.watching)
        raise AssertionError("unreachable")

    def control(self, there: SessionThere, verb: str, args: Any = None, *, host: str = "") -> Any:
        """Asks the host a verb for the session (``Link.control``), through the same
        pickle round trip and the same host code as a slice."""
        if verb == END:
            return self.end(there)
        for attempt in (0, 1):
            self._provide(host, there)
            head, buffers = _carried(*verb_request(there, verb, args))
            kind, head, back = self._answered(host, [verb], head, buffers, there, verb=True)
            if kind == "need":
                self._needed(host, there, head, attempt)
                continue
            return verb_answered(host, verb, kind, head, back)
        raise AssertionError("unreachable")

    def _needed(self, host: str, there: SessionThere, head: dict, attempt: int) -> None:
        """The host holds the session no more: said where it learnt there, and given
        its catalog again (once) where it did not."""
        there.declared = None
        if there.learnt:
            raise state_lost(host, self.place.where(host), there,
                             head.get("gone") or "the host was started afresh")
        if attempt:
            raise WireError(f"host {host!r}: the host keeps letting go of this session",
                            host=host)

    def _answered(self, host: str, nodes: list[str], head: dict, buffers: list,
                  there: SessionThere, verb: bool = False) -> tuple:
        """The host's answer as it would arrive: kind, header and buffers, carried back.
        The process's own random state is put back after it: the client draws from it."""
        lock, holding = self._lane(there)

        def serve() -> tuple:
            with lock:
                try:
                    if verb:
                        reply = control(self.sessions, head, buffers, stays=False)
                    else:
                        reply = answer(self.sessions, head, buffers, holding, stays=False)
                except ProtocolError as exc:
                    return "error", {"e": "ProtocolError", "m": str(exc)}, []
            carried, back = _carried({"k": reply.kind, "h": reply.header}, reply.buffers)
            return carried["k"], carried["h"], back

        deadline = self.place.deadline
        if deadline is None:
            return serve()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="somatize-in-process")
        try:
            return self._pool.submit(serve).result(timeout=deadline)
        except Late:
            raise WireError(f"host {host!r} ({self.place.where(host)}): slice {nodes} did not "
                            f"answer within its deadline of {deadline:g} s; it goes on "
                            "computing, and the calls after it wait for it", host=host) from None

    def _provide(self, host: str, there: SessionThere) -> None:
        """Gives the host the session's catalog, unless it holds it already."""
        if there.declared_in(self.instance):
            return
        where, staged = self.place.where(host), there.staged
        if there.lost_in(self.instance):
            raise state_lost(host, where, there, "the host was started afresh")
        sessions = self.sessions
        try:
            sessions.admits(there.session, staged.ident)
            held, gone = sessions.lookup(there.session)
            if held is None and there.learnt:
                raise state_lost(host, where, there, gone or "the host holds it no more")
            if held is None or held.catalog != staged.ident:
                try:  # the nodes are unpickled there, from the catalog's bytes
                    graph = provisioned(staged.ident, staged.kind, staged.runtime, [staged.blob])
                except ProtocolError:
                    raise
                except Exception as exc:  # what a worker answers a catalog it cannot load
                    raise catalog_refused(host, where, refused_catalog(exc)[0]) from None
                sessions.install(there.session, staged.ident, graph, there.keeps)
        except Refused as exc:
            raise DeclarationError(f"host {host!r} ({where}) refused the catalog: {exc}") from None
        there.declared, there.instance = staged.ident, self.instance

    def end(self, there: SessionThere) -> None:
        self.lanes.pop(there.session, None)
        if there.declared is not None and there.instance == self.instance:
            there.declared = None
            self.sessions.end(there.session)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _carried(head: dict[str, Any], buffers: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """A message as the far side would have it: pickled in band (every buffer copied,
    as a byte stream copies it) and read back."""
    head, pieces = pickle.loads(pickle.dumps((head, outgoing(buffers)), protocol=5))
    return head, joined(pieces)


provides("in_process", InProcess)
