"""A ``.mapped()`` and ``.cached()`` node, remembered with the grain of an item.

Each item's key is the digest of the node's prefix and the item's own content, so an
item is named after itself and not after its place. The fresh items of one run are
kept together as one object (a list), and each item's name points at that object
with its index beside it: keeping a thousand items is one object, not a thousand.

Looking up ten thousand names one by one is most of the cost of a run where one
item is new, so each node also keeps a manifest of its latest answer — item key to
``[digest, index]`` — under ``items/<prefix digest>``. The manifest is only an
accelerator: every item is also bound under its own name, which stays the truth, and
an item the manifest does not know is looked up by that name.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ._codec import dumps, loads
from ._errors import UnwritableError, walk_error
from ._keys import Unwritable, digest_of, node_key

__all__ = ["Items"]

MAPPED = b"mapped"


def item_keys(node: str, prefix: bytes, items: list[Any]) -> list[bytes]:
    keys = []
    for item in items:
        try:
            keys.append(node_key(prefix, [digest_of(item)]))
        except Unwritable as exc:
            raise walk_error(UnwritableError(
                f"node {node!r} is .mapped() and .cached(), and an item is a "
                f"{exc.what.__qualname__}, which cannot be written down; register a codec "
                "for it with somatize.codec(...), or drop .cached()"
            )) from None
    return keys


def _manifest(store: Any, name: str) -> dict[str, list]:
    bound = store.resolve(name)
    blob = None if bound is None else store.get(bound.digest)
    return {} if blob is None else json.loads(blob)


def _found(store: Any, keys: list[bytes], manifest: dict[str, list]) -> dict[int, tuple[str, Any]]:
    """Where each item already kept lies: position -> (digest, index in that object)."""
    found = {}
    for at, key in enumerate(keys):
        entry = manifest.get(key.hex())
        if entry is None:
            bound = store.resolve("key/" + key.hex())
            if bound is not None:
                entry = (bound.digest, bound.meta.get("item"))
        if entry is not None:
            found[at] = (entry[0], entry[1])
    return found


def _load(store: Any, found: dict[int, tuple[str, Any]], out: list[Any]) -> list[int]:
    """Fills ``out`` from the kept objects, each read once; returns positions whose
    object has gone missing, to be computed again."""
    objects: dict[str, Any] = {}
    gone = []
    for at, (digest, index) in found.items():
        if digest not in objects:
            blob = store.get(digest)
            objects[digest] = None if blob is None else loads(blob, f"the object {digest}")
        value = objects[digest]
        if value is None:
            gone.append(at)
        else:
            out[at] = value if index is None else value[index]
    return gone


class Items:
    """One mapped, cached node's items for one walk: looked up before it runs, the
    missing ones kept after."""

    def __init__(self, store: Any, node: str, prefix: bytes, items: list[Any], emit: Any):
        self.store, self.node, self.prefix, self.items, self.emit = store, node, prefix, items, emit
        self.keys = item_keys(node, prefix, items)
        self.manifest_name = "items/" + hashlib.sha256(prefix).hexdigest()
        self.manifest = _manifest(store, self.manifest_name)
        found = _found(store, self.keys, self.manifest)
        self.out: list[Any] = [None] * len(items)
        gone = set(_load(store, found, self.out))
        self.missing = [at for at in range(len(items)) if at not in found or at in gone]
        self.where = {at: list(found[at]) for at in found if at not in gone}
        self.key = b""

    @classmethod
    def looked_up(cls, store: Any, node: str, prefix: bytes, items: list[Any], emit: Any) -> Items:
        """The items found already kept (said as ``recalled``), and which are missing."""
        looked = cls(store, node, prefix, items, emit)
        if len(looked.missing) < len(items) and emit is not None:
            emit({"fact": "recalled", "node": node, "items": len(items) - len(looked.missing)})
        return looked

    def missing_items(self) -> list[Any]:
        return [self.items[at] for at in self.missing]

    def kept(self, fresh: list[Any]) -> list[Any]:
        """The whole answer, with ``fresh`` (one per missing item) kept as one object;
        the key of the whole answer is left in ``key``."""
        store, node = self.store, self.node
        if self.missing:
            digest = store.put(dumps(fresh))
            for index, (at, value) in enumerate(zip(self.missing, fresh)):
                self.out[at] = value
                self.where[at] = [digest, index]
                store.bind("key/" + self.keys[at].hex(), digest, {"node": node, "item": index})
            if self.emit is not None:
                self.emit({"fact": "kept", "node": node, "items": len(self.missing)})
        latest = {self.keys[at].hex(): self.where[at] for at in range(len(self.items))}
        if latest != self.manifest:
            store.bind(self.manifest_name, store.put(json.dumps(latest).encode()), {"node": node})
        self.key = node_key(MAPPED + self.prefix, self.keys)
        return self.out
