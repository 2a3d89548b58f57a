"""A host's side of a slice, whatever carried it there: a socket, or a Ray actor call.

Everything here is the transport's business only through plain data: a slice arrives
as the request header the client wrote (``n`` nodes, ``w`` wanted, ``f`` forward,
``v`` values, ``r`` references to what stayed here, ``x`` watching, ``t`` walked
back) and its buffers, and leaves as an :class:`Answer`, a reply's kind, header and
buffers, which the transport sends as they are. The socket worker
(``connection.py``) and the Ray actor (``somatize.ray``) both call :func:`answer`,
so a slice runs one way whichever way it came.
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback
from typing import Any, NamedTuple

from .._engine import run_slice
from .._errors import NodeError, ProtocolError, SomaError
from .._node import Opaque
from .._slices import Slice
from .catalog import build, catalog_id, pack_values, unpack_values
from .log import say

__all__ = ["Answer", "Holding", "Shelf", "answer", "provisioned", "refused_catalog", "short"]

# The engine's own bracket of a walk; the client brackets the forward itself.
_BRACKET = frozenset(("began", "finished"))
_TRACEBACK = 64 << 10  # the most of a traceback's text that travels back


def short(ident: str) -> str:
    """A catalog's id as the log shows it."""
    return ident.split(":", 1)[-1][:12]


class Answer(NamedTuple):
    """A reply to send: ``kind`` (``"done"`` or ``"error"``), its header and buffers;
    ``said`` is the log's line for a failure (its traceback follows it, ``text``)."""

    kind: str
    header: dict[str, Any]
    buffers: list[Any]
    said: str | None = None
    text: str | None = None


class Holding:
    """What one client's forward left on a host: the outputs that could not travel,
    kept for the slices of the same forward that read them."""

    def __init__(self) -> None:
        self.forward: bytes | None = None
        self.held: dict[str, Any] = {}

    def clear(self) -> None:
        self.held.clear()


class Shelf:
    """The one catalog a host holds; a different one replaces it, and says so."""

    def __init__(self) -> None:
        self.catalog: tuple[str, Any] | None = None
        self._lock = threading.Lock()

    def install(self, ident: str, graph: Any) -> None:
        """Holds this catalog from now on; the same one again changes nothing, so its
        nodes' live state (a trainer's optimizer) survives a second provisioning."""
        with self._lock:
            if self.catalog is not None and self.catalog[0] == ident:
                return
            previous = self.catalog
            self.catalog = (ident, graph)
        held = [n for n, impl in graph.impls.items() if type(impl).__name__ != "Elsewhere"]
        if previous is None:
            say.routine("catalog %s holds %s", short(ident), ", ".join(held))
        else:
            say.routine("catalog %s replaces %s; it holds %s", short(ident), short(previous[0]),
                        ", ".join(held))

    def current(self) -> tuple[str, Any] | None:
        with self._lock:
            return self.catalog


def provisioned(ident: Any, kind: Any, runtime: Any, blobs: list[Any]) -> Any:
    """The graph a catalog's bytes make, checked against the id it was sent under.

    A request that is not a catalog of ours is a ProtocolError; whatever building it
    raises (an import that fails, most often) is raised as it is, for
    :func:`refused_catalog` to answer."""
    if len(blobs) != 1 or type(ident) is not str or type(kind) is not str:
        raise ProtocolError("a provision frame without exactly one blob, an id and a kind")
    blob = blobs[0]
    blob_id = "sha256:" + hashlib.sha256(blob).hexdigest()
    if catalog_id(kind, blob_id, runtime) != ident:
        raise ProtocolError("a catalog whose bytes do not match its id")
    return build(kind, blob, runtime)


def refused_catalog(exc: Exception) -> tuple[dict[str, Any], str]:
    """The error header for a catalog that cannot be loaded here, and its traceback."""
    module = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    text = traceback_text(exc)
    return {"e": "catalog", "m": f"{type(exc).__name__}: {exc}", "module": module, "tb": text}, text


def answer(shelf: Shelf, declared: str | None, head: Any, buffers: list[Any],
           holding: Holding) -> Answer:
    """Runs the slice a request header describes, here, against the catalog the client
    said it runs against (``declared``): ``"need"`` when the shelf holds another.

    A request that is not a slice of ours raises ProtocolError (the transport drops
    whoever sent it); anything the slice itself raises is answered as an error."""
    nodes, wanted, forward = head.get("n"), head.get("w"), head.get("f")
    if (type(nodes) is not list or type(wanted) is not list or type(forward) is not bytes
            or not all(type(n) is str for n in nodes + wanted)):
        raise ProtocolError("a slice frame without its nodes, its outputs or its forward")
    current = shelf.current()
    if current is None or current[0] != declared:
        return Answer("need", {"c": current[0] if current else None}, [])
    graph = current[1]
    if forward != holding.forward:  # what stayed for an earlier forward is nobody's now
        holding.forward, holding.held = forward, {}
    try:
        values = unpack_values(head.get("v", {}), buffers)
    except SomaError as exc:
        return failed(exc, [])
    refs = head.get("r", [])
    if (type(values) is not dict or type(values.get("g", {})) is not dict
            or type(refs) is not list or not all(type(r) is str for r in refs)):
        raise ProtocolError("a slice whose values or references are malformed")
    # Values arrive unwrapped, as the walk holds them; Opaque lets them in as they
    # are. A walk back hands what it is given to its nodes untouched.
    wrap = (lambda value: value) if head.get("t") else Opaque
    given = {node: wrap(value) for node, value in values.get("g", {}).items()}
    for ref in refs:
        if ref not in holding.held:
            return Answer("error", {"e": "Lost", "node": ref, "m": (
                f"the output of node {ref!r} is no longer here: the worker kept it for one "
                "forward, and it restarted or another forward began since")}, [])
        given[ref] = wrap(holding.held[ref])
    return _run(graph, nodes, wanted, given, Opaque(values.get("i")), bool(head.get("x")),
                bool(head.get("t")), holding)


def _run(graph: Any, nodes: list[str], wanted: list[str], given: dict[str, Any], input: Any,
         watching: bool, transposed: bool, holding: Holding) -> Answer:
    facts: list[dict] = []
    began = time.perf_counter()
    try:
        out = run_slice(graph, Slice("", graph, tuple(nodes), given=given, input=input,
                                     wanted=tuple(wanted), watching=watching,
                                     transposed=transposed), facts)
    except Exception as exc:  # the one boundary where a slice's failure is translated
        return failed(exc, facts, f"slice {nodes} failed after "
                                  f"{(time.perf_counter() - began) * 1e3:.1f} ms: {exc}")
    buffers: list[Any] = []
    try:
        trees, refused = pack_values(out, buffers)
    except Exception as exc:  # a codec that failed otherwise than by refusing
        return failed(exc, facts, f"slice {nodes} ran, and its outputs could not be packed: {exc}")
    for node in refused:
        holding.held[node] = out[node]
    header: dict[str, Any] = {"v": trees}
    if refused:
        header["l"] = refused
    if watching:
        header["x"] = sendable(facts)
    return Answer("done", header, buffers)


def failed(exc: BaseException, facts: list[dict], said: str | None = None) -> Answer:
    """The answer saying what went wrong, the host's traceback included; ``said`` is
    the log's line for it, which the traceback follows there too."""
    header: dict[str, Any] = {"e": type(exc).__name__, "m": str(exc), "x": sendable(facts)}
    if isinstance(exc, NodeError):
        header["node"], header["kind"] = exc.node, exc.kind
        if exc.__cause__ is not None:
            header["cause"] = str(exc.__cause__)
    header["tb"] = text = traceback_text(exc)
    return Answer("error", header, [], said, text)


def traceback_text(exc: BaseException) -> str:
    """The traceback of what went wrong here, as text: the node's own exception when
    the walk wrapped one (everything chained to it included), or else ``exc``'s."""
    cause = exc.__cause__ if isinstance(exc, NodeError) and exc.__cause__ is not None else exc
    text = "".join(traceback.format_exception(cause))
    if len(text) > _TRACEBACK:  # its start says where, its end what: keep both
        head, tail = _TRACEBACK // 4, _TRACEBACK - _TRACEBACK // 4
        text = (f"{text[:head]}\n... ({len(text) - head - tail} characters of the traceback "
                f"left out) ...\n{text[-tail:]}")
    return text


def sendable(facts: list[dict]) -> list[dict]:
    """The host's facts the client has not said itself, as data msgpack carries."""
    out = []
    for fact in facts:
        if fact.get("fact") in _BRACKET:
            continue
        buffers: list[Any] = []
        trees, refused = pack_values(fact, buffers)
        if not buffers and not refused:
            out.append(trees)
    return out
