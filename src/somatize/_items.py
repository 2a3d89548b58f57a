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

__all__ = ["remember_items"]

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


def remember_items(store: Any, node: str, prefix: bytes, items: list[Any],
                   compute: Any, emit: Any) -> tuple[list[Any], bytes]:
    """The node's answer for ``items``, computing only the missing ones with
    ``compute(list) -> list``; returns the answer and the key of the whole of it."""
    keys = item_keys(node, prefix, items)
    manifest_name = "items/" + hashlib.sha256(prefix).hexdigest()
    manifest = _manifest(store, manifest_name)
    found = _found(store, keys, manifest)
    out: list[Any] = [None] * len(items)
    gone = set(_load(store, found, out))
    missing = [at for at in range(len(items)) if at not in found or at in gone]
    where = {at: list(found[at]) for at in found if at not in gone}
    if len(missing) < len(items) and emit is not None:
        emit({"fact": "recalled", "node": node, "items": len(items) - len(missing)})
    if missing:
        fresh = compute([items[at] for at in missing])
        try:
            digest = store.put(dumps(fresh))
        except UnwritableError as exc:
            raise walk_error(UnwritableError(
                f"node {node!r}: what it answered for an item cannot be kept: {exc}")) from None
        for index, (at, value) in enumerate(zip(missing, fresh)):
            out[at] = value
            where[at] = [digest, index]
            store.bind("key/" + keys[at].hex(), digest, {"node": node, "item": index})
        if emit is not None:
            emit({"fact": "kept", "node": node, "items": len(missing)})
    latest = {keys[at].hex(): where[at] for at in range(len(items))}
    if latest != manifest:
        store.bind(manifest_name, store.put(json.dumps(latest).encode()), {"node": node})
    return out, node_key(MAPPED + prefix, keys)
