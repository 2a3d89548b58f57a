"""The host a Ray actor is: a worker's shelf and holdings, for one caller at a time or,
named, for several at once.

It holds nothing a socket worker does not: a catalog per client session, what stayed
for the current forward, and the code that runs a slice (``somatize.wire.host``), the
very code the socket worker runs. An actor Ray restarted is a fresh one holding no
session: one that kept state is said to be lost, never provisioned again behind its
owner's back.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from .._errors import ProtocolError
from ..wire.host import (Holding, Refused, SessionsHere, answer, control, provisioned,
                         refused_catalog)
from ..wire.log import say
from ..wire.buffers import joined, outgoing

__all__ = ["Host"]


class Host:
    """What a Ray actor of somatize holds and answers (Ray calls its methods)."""

    def __init__(self) -> None:
        say.routine_too = False  # Ray forwards an actor's stderr to the client's terminal
        self.sessions = SessionsHere()
        # What stayed for a forward, per session: a named actor runs several clients'
        # calls at once, and one's forward must not clear another's.
        self.holdings: dict[bytes, Holding] = {}
        self.instance = uuid.uuid4().hex

    def ready(self) -> dict[str, Any]:
        """Where this actor runs, once it does."""
        return {"instance": self.instance, "pid": os.getpid(), "node": socket.gethostname()}

    def provision(self, session: bytes, ident: str, kind: str, runtime: Any, blob: Any,
                  keeps: bool = False, live: bool = False) -> tuple[str, dict]:
        """Holds this catalog for the session (built once: the same one again changes
        nothing). A session its owner says has run here (``live``) and that this actor
        does not hold is not made again: ``need``, with why it is gone, is answered."""
        try:
            self.sessions.admits(session, ident)
        except Refused as exc:
            return "error", {"e": "session", "m": str(exc)}
        held, gone = self.sessions.lookup(session)
        if held is not None and held.catalog == ident:
            return "ok", {}
        if held is None and live:
            return "need", {"gone": gone or "Ray started this actor afresh"}
        try:
            graph = provisioned(ident, kind, runtime, [blob])
        except ProtocolError as exc:
            return "error", {"e": "ProtocolError", "m": str(exc)}
        except Exception as exc:
            return "error", refused_catalog(exc)[0]
        try:
            self.sessions.install(session, ident, graph, keeps)
        except Refused as exc:
            return "error", {"e": "session", "m": str(exc)}
        return "ok", {}

    def slice(self, head: dict[str, Any], *buffers: Any) -> tuple:
        """Runs one slice in the session its header names; answers ``(kind, header,
        buffers)`` as the socket worker's reply frame would hold them."""
        session = head.get("s") if type(head) is dict else None
        holding = self.holdings.get(session) if type(session) is bytes else None
        if holding is None:
            if len(self.holdings) > self.sessions.most:  # let go of sessions now gone
                for gone in [s for s in self.holdings if s not in self.sessions]:
                    del self.holdings[gone]
            holding = self.holdings.setdefault(session, Holding())
        try:
            reply = answer(self.sessions, head, joined(buffers), holding)
        except ProtocolError as exc:
            return "error", {"e": "ProtocolError", "m": str(exc)}, []
        if reply.said is not None:
            say.block(f"Ray actor {self.instance[:12]}: {reply.said}", reply.text or "")
        return reply.kind, reply.header, outgoing(reply.buffers)

    def control(self, head: dict[str, Any], *buffers: Any) -> tuple:
        """Answers a verb for the session its header names (``wire.host.control``):
        ``(kind, header, buffers)``, as the socket worker's reply frame would hold them."""
        try:
            reply = control(self.sessions, head, joined(buffers))
        except ProtocolError as exc:
            return "error", {"e": "ProtocolError", "m": str(exc)}, []
        if reply.said is not None:
            say.block(f"Ray actor {self.instance[:12]}: {reply.said}", reply.text or "")
        return reply.kind, reply.header, outgoing(reply.buffers)

    def end(self, session: bytes) -> bool:
        """Lets go of a session its owner closed."""
        self.holdings.pop(session, None)
        return self.sessions.end(session)

    def echo(self, value: Any) -> Any:
        """Its argument, back: a bare round trip, to measure the rest against."""
        return value
