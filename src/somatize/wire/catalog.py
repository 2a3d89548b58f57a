"""What a worker is provisioned with, and how values cross in both directions.

A catalog is the nodes a wire runs (pickled as one object, so two positions of one
trainer stay one object over there) plus the graph's own description (``describe``:
every id, every edge in the order it was said, so fan-in maps are keyed and ordered as
here, and every declaration), with the hosts of the nodes that run elsewhere. The
worker rebuilds the graph from it with ``undescribed``; nodes that run elsewhere are
placeholders that refuse to run.

Values cross as ``_codec`` trees plus raw buffers, read back by ``_codec.unpack``,
which hands a received buffer to its codec as it is.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pickle
import threading
from typing import Any

from .._codec import codec_modules, found_in, pack_into, unpack
from .._errors import DeclarationError, ProtocolError, SomaError, UnwritableError
from .._graph import GraphData, describe, made_from, undescribed

__all__ = ["Elsewhere", "build", "catalog_id", "pack_nodes", "pack_values", "runtime_of",
           "unpack_values"]

MODES = ("project", "network")
_by_value = threading.Lock()  # cloudpickle's by-value registry is process-wide


# -- packing nodes ------------------------------------------------------------------
def pack_nodes(nodes: dict[str, Any], mode: str, send: tuple[str, ...]) -> tuple[str, str, bytes]:
    """The nodes as ``(kind, id, bytes)``: plain pickle in project mode (classes by
    reference, the worker imports them), cloudpickle in network mode."""
    if mode == "project":
        for node_id, impl in nodes.items():
            module = type(impl).__module__
            if module == "__main__":
                raise DeclarationError(
                    f"node {made_from(node_id)!r} is a {type(impl).__qualname__} defined in "
                    "__main__, "
                    "which a worker in mode='project' cannot import; move the class to a "
                    "module the worker can import, or use mode='network' so the code travels"
                )
        try:
            blob = pickle.dumps(nodes, protocol=5)
        except Exception as exc:
            raise _unpicklable(nodes, exc) from exc
        kind = "pickle"
    else:
        blob = _cloudpickled(nodes, send)
        kind = "cloudpickle"
    return kind, "sha256:" + hashlib.sha256(blob).hexdigest(), blob


def _cloudpickled(nodes: dict[str, Any], send: tuple[str, ...]) -> bytes:
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError("mode='network' needs cloudpickle: pip install 'somatize[wire]'") from exc
    modules = []
    for name in send:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            raise DeclarationError(
                f"send={list(send)!r} names {name!r}, which cannot be imported here ({exc}); "
                "send names modules this process has imported"
            ) from None
    with _by_value:
        already = set(cloudpickle.list_registry_pickle_by_value())
        added = [m for m in modules if m.__name__ not in already]
        for module in added:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cloudpickle.dumps(nodes, protocol=5)
        except Exception as exc:
            raise _unpicklable(nodes, exc) from exc
        finally:
            for module in added:
                cloudpickle.unregister_pickle_by_value(module)


def _unpicklable(nodes: dict[str, Any], exc: Exception) -> UnwritableError:
    for node_id, impl in nodes.items():  # find the culprit for the message
        try:
            pickle.dumps(impl, protocol=5)
        except Exception:
            return UnwritableError(
                f"node {made_from(node_id)!r} ({type(impl).__qualname__}) cannot be sent to a "
                "worker: "
                f"{type(exc).__name__}: {exc}; keep what cannot be pickled (open files, "
                "locks, sockets) out of the node, or build it on first use"
            )
    return UnwritableError(f"the nodes cannot be sent to a worker: {type(exc).__name__}: {exc}")


def runtime_of(data: GraphData, here: set[str]) -> dict[str, Any]:
    """What a worker needs besides the nodes: the graph's description, and where each
    node it does not hold runs (``""`` for the client)."""
    return {**describe(data),
            "elsewhere": {n: data.hosts.get(n, "") for n in data.ids if n not in here},
            "codecs": codec_modules()}


def catalog_id(kind: str, blob_id: str, runtime: dict[str, Any]) -> str:
    """What a catalog is called: a digest of how it was packed, its bytes and its topology."""
    text = json.dumps([kind, blob_id, runtime], sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# -- the worker's side --------------------------------------------------------------
class Elsewhere:
    """Stands in a worker's catalog for a node that runs somewhere else."""

    def __init__(self, node: str, host: str):
        self.node, self.host = node, host

    def forward(self, input: Any, ctx: Any) -> Any:
        where = f"on host {self.host!r}" if self.host else "on the client"
        raise DeclarationError(
            f"node {self.node!r} runs {where}, not on this worker; it was sent a slice "
            "that is not its own"
        )


def build(kind: str, blob: Any, runtime: Any) -> GraphData:
    """The worker's graph: the nodes unpickled, the rest placeholders.

    Called only on an authenticated connection, with a sealed blob.
    """
    elsewhere = runtime.get("elsewhere") if type(runtime) is dict else None
    if type(elsewhere) is not dict or not all(
            type(k) is str and type(v) is str for k, v in elsewhere.items()):
        raise ProtocolError("a catalog whose topology is malformed: elsewhere")
    if kind == "cloudpickle":
        import cloudpickle  # noqa: F401  (its functions are what the pickle calls)
    elif kind != "pickle":
        raise ProtocolError(f"a catalog packed as {kind!r}; this worker knows 'pickle' and 'cloudpickle'")
    _register_codecs(runtime.get("codecs", []))
    nodes = pickle.loads(blob)
    if type(nodes) is not dict:
        raise ProtocolError(f"a catalog whose nodes are a {type(nodes).__name__}, not a dict")

    def held(node: str, identity: str) -> Any:
        return nodes[node] if node in nodes else Elsewhere(node, elsewhere.get(node, ""))

    try:
        return undescribed(runtime, held)
    except ValueError as exc:
        raise ProtocolError(f"a catalog whose topology is malformed: {exc}") from None


def _register_codecs(modules: Any) -> None:
    """Notes where the client's codecs are registered, so that what it sends (a tensor
    to a worker holding no torch node, say) is read back here the same way; the module
    is imported when a value of its kind first arrives, not with the catalog."""
    if type(modules) is not dict or not all(
            type(k) is str and type(m) is str for k, m in modules.items()):
        raise ProtocolError("a catalog whose codecs are malformed")
    found_in(modules)


# -- values -------------------------------------------------------------------------
def pack_values(values: dict[str, Any], buffers: list[Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Packs each value on its own, so one that cannot travel leaves the others going.

    Returns the trees of those that can and, for the rest, why not.
    """
    trees: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for name, value in values.items():
        mark = len(buffers)
        try:
            trees[name] = pack_into(value, buffers)
        except UnwritableError as exc:
            del buffers[mark:]
            refused[name] = str(exc)
    return trees, refused


def unpack_values(tree: Any, buffers: list[Any]) -> Any:
    """A value alive again from a tree and the buffers as received.

    This is where bytes from the far side become values, so whatever a malformed tree
    or a codec fed bad bytes raises is said here, once, as a ProtocolError (an
    UnwritableError when no codec of that kind is here).
    """
    try:
        return unpack(tree, buffers)
    except SomaError:
        raise
    except RecursionError:
        raise ProtocolError("a value nested deeper than this process can unpack") from None
    except Exception as exc:  # a tree pack_values never makes, or bytes its codec refuses
        raise ProtocolError(f"a value that cannot be unpacked ({type(exc).__name__}: "
                            f"{exc})") from None
