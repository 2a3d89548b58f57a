"""The host a Ray actor is: a worker's shelf and holdings, run one call at a time.

It holds nothing a socket worker does not: one catalog, what stayed for the current
forward, and the code that runs a slice (``somatize.wire.host``), the very code the
socket worker runs. An actor Ray restarted is a fresh one, so it asks again for the
catalog, and a step's activation that died with it is an ``OutOfStep`` there.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from .._errors import ProtocolError
from ..wire.host import Holding, Shelf, answer, provisioned, refused_catalog
from ..wire.log import say
from .buffers import joined, outgoing

__all__ = ["Host"]


class Host:
    """What a Ray actor of somatize holds and answers (Ray calls its methods)."""

    def __init__(self) -> None:
        say.routine_too = False  # Ray forwards an actor's stderr to the client's terminal
        self.shelf = Shelf()
        self.holding = Holding()
        self.instance = uuid.uuid4().hex

    def ready(self) -> dict[str, Any]:
        """Where this actor runs, once it does."""
        return {"instance": self.instance, "pid": os.getpid(), "node": socket.gethostname()}

    def provision(self, ident: str, kind: str, runtime: Any, blob: Any) -> tuple[str, dict]:
        """Holds this catalog (built once: the same one again changes nothing)."""
        current = self.shelf.current()
        if current is not None and current[0] == ident:
            return "ok", {}
        try:
            graph = provisioned(ident, kind, runtime, [blob])
        except ProtocolError as exc:
            return "error", {"e": "ProtocolError", "m": str(exc)}
        except Exception as exc:
            return "error", refused_catalog(exc)[0]
        self.shelf.install(ident, graph)
        return "ok", {}

    def slice(self, declared: str | None, head: dict[str, Any], *buffers: Any) -> tuple:
        """Runs one slice against the catalog ``declared``; answers ``(kind, header,
        buffers)`` as the socket worker's reply frame would hold them."""
        try:
            reply = answer(self.shelf, declared, head, joined(buffers), self.holding)
        except ProtocolError as exc:
            return "error", {"e": "ProtocolError", "m": str(exc)}, []
        if reply.said is not None:
            say.block(f"Ray actor {self.instance[:12]}: {reply.said}", reply.text or "")
        return reply.kind, reply.header, outgoing(reply.buffers)

    def echo(self, value: Any) -> Any:
        """Its argument, back: a bare round trip, to measure the rest against."""
        return value
