"""What a worker is provisioned with, and how values cross in both directions.

A catalog is the nodes a wire runs (pickled as one object, so two positions of one
trainer stay one object over there) plus the topology the walk needs: every id, every
edge in the order it was said (so fan-in maps are keyed and ordered as here), devices
and mapped nodes. Nodes that run elsewhere are placeholders that refuse to run.

Values cross as ``_codec`` trees plus raw buffers. The reverse is done here rather
than by ``_codec.unpack`` so a received buffer is handed to a codec as it is, without
the copy into ``bytes`` a store needs.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pickle
import threading
from typing import Any

from .._codec import BYTES, OPAQUE, TUPLE, _pack, loader
from .._errors import DeclarationError, ProtocolError, SomaError, UnwritableError
from .._graph import Graph

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
                    f"node {node_id!r} is a {type(impl).__qualname__} defined in __main__, "
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
                f"node {node_id!r} ({type(impl).__qualname__}) cannot be sent to a worker: "
                f"{type(exc).__name__}: {exc}; keep what cannot be pickled (open files, "
                "locks, sockets) out of the node, or build it on first use"
            )
    return UnwritableError(f"the nodes cannot be sent to a worker: {type(exc).__name__}: {exc}")


def runtime_of(graph: Graph, here: set[str]) -> dict[str, Any]:
    """The topology a worker needs to run slices of this graph, as plain data."""
    return {
        "ids": graph.nodes(),
        "edges": [list(edge) for edge in graph.edges()],
        "devices": graph.devices(),
        "mapped": graph.mapped_nodes(),
        "elsewhere": {n: graph._hosts.get(n, "") for n in graph.nodes() if n not in here},
    }


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


def build(kind: str, blob: Any, runtime: Any) -> Graph:
    """The worker's graph: the nodes unpickled, the rest placeholders.

    Called only on an authenticated connection, with a sealed blob.
    """
    _check_runtime(runtime)
    if kind == "cloudpickle":
        import cloudpickle  # noqa: F401  (its functions are what the pickle calls)
    elif kind != "pickle":
        raise ProtocolError(f"a catalog packed as {kind!r}; this worker knows 'pickle' and 'cloudpickle'")
    nodes = pickle.loads(blob)
    if type(nodes) is not dict:
        raise ProtocolError(f"a catalog whose nodes are a {type(nodes).__name__}, not a dict")
    graph = Graph()
    elsewhere = runtime["elsewhere"]
    for node_id in runtime["ids"]:
        if node_id in nodes:
            impl = nodes[node_id]
        else:
            impl = Elsewhere(node_id, elsewhere.get(node_id, ""))
        graph._impl[node_id] = impl
        graph._preds[node_id] = []
        graph._succs[node_id] = []
    for source, target in runtime["edges"]:
        graph._connect(source, target)
    graph._devices.update(runtime["devices"])
    graph._mapped.update(dict.fromkeys(runtime["mapped"]))
    return graph


def _check_runtime(runtime: Any) -> None:
    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"a catalog whose topology is malformed: {what}")

    if type(runtime) is not dict:
        raise bad("not a map")
    ids = runtime.get("ids")
    if type(ids) is not list or not all(type(n) is str for n in ids) or len(set(ids)) != len(ids):
        raise bad("ids")
    known = set(ids)
    edges = runtime.get("edges")
    if type(edges) is not list or not all(
            type(e) is list and len(e) == 2 and e[0] in known and e[1] in known for e in edges):
        raise bad("edges")
    for key in ("devices", "elsewhere"):
        table = runtime.get(key)
        if type(table) is not dict or not all(k in known and type(v) is str for k, v in table.items()):
            raise bad(key)
    mapped = runtime.get("mapped")
    if type(mapped) is not list or not all(n in known for n in mapped):
        raise bad("mapped")


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
            trees[name] = _pack(value, buffers)
        except UnwritableError as exc:
            del buffers[mark:]
            refused[name] = str(exc)
    return trees, refused


def pack_one(value: Any, buffers: list[Any]) -> Any:
    return _pack(value, buffers)


def unpack_values(tree: Any, buffers: list[Any]) -> Any:
    """A value alive again from a tree and the buffers as received.

    A tree that is not one ``pack_values`` makes, or a buffer its codec cannot load,
    is a ProtocolError (an UnwritableError when no codec of that kind is here).
    """
    try:
        return _unpacked(tree, buffers)
    except RecursionError:
        raise ProtocolError("a value nested deeper than this process can unpack") from None


def _unpacked(tree: Any, buffers: list[Any]) -> Any:
    cls = type(tree)
    if cls is dict:
        if OPAQUE in tree:
            return _load(tree, buffers)
        if BYTES in tree:
            return bytes(_buffer(buffers, tree[BYTES]))
        if TUPLE in tree:
            items = tree[TUPLE]
            if type(items) is not list:
                raise ProtocolError(f"a tuple sent as a {type(items).__name__}, not a list")
            return tuple(_unpacked(item, buffers) for item in items)
        return {key: _unpacked(item, buffers) for key, item in tree.items()}
    if cls is list:
        return [_unpacked(item, buffers) for item in tree]
    return tree


def _load(tree: dict[str, Any], buffers: list[Any]) -> Any:
    kind = tree[OPAQUE]
    if type(kind) is not str:
        raise ProtocolError(f"an opaque value whose codec kind is a {type(kind).__name__}, not a str")
    try:
        load = loader(kind)
    except UnwritableError:
        if not kind.startswith("torch."):
            raise
        # A worker holding no torch node still passes tensors on: the codec is ours.
        try:
            import somatize.torch  # noqa: F401
        except ImportError:
            raise UnwritableError(
                f"a value was sent as {kind!r} and torch is not installed here; install "
                "somatize[torch] where it runs") from None
        load = loader(kind)
    buffer = _buffer(buffers, tree.get("buffer"))
    try:
        try:
            return load(buffer)
        except TypeError:
            if type(buffer) is bytes:
                raise
            return load(bytes(buffer))  # a codec that insists on bytes gets bytes
    except SomaError:
        raise
    except Exception as exc:  # the codec's own error, whatever it is, says the bytes are bad
        raise ProtocolError(f"a value sent as {kind!r} that its codec cannot load "
                            f"({type(exc).__name__}: {exc})") from None


def _buffer(buffers: list[Any], at: Any) -> Any:
    if type(at) is not int or not 0 <= at < len(buffers):
        raise ProtocolError(f"a value that points at buffer {at!r} of {len(buffers)}")
    return buffers[at]
