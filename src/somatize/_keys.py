"""Names for outputs, made of content: a canonical encoding of data, and Merkle keys.

The encoding is fed straight into a hash, never built as bytes first, so a 256 MB
input is hashed where it lies. Every value is tagged with its type and its length,
so ``1``, ``1.0``, ``True`` and ``"1"`` are four different things, a dict is the
same whatever order it was built in, and a float is its exact bits.

A node's key is the digest of what decides its output: what implements it (its
identity), what it was built with (its declaration), the salt, the state it is frozen
at, and the keys of its inputs in predecessor order. Device, host and fingerprint are
not in it: where something ran does not change what it is. Only the graph's input is
ever hashed; intermediate values never are (a ``.mapped()`` node's items are the one
exception, since an item is named after itself).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from ._codec import codec_for, pieces_of
from ._errors import UnwritableError
from ._node import Opaque

__all__ = ["Unwritable", "digest_of", "hexdigest_of", "feed", "node_prefix", "node_key"]

_F64 = struct.Struct("<d")
_LEN = struct.Struct("<Q")


class Unwritable(Exception):
    """Internal: this value cannot be written down (carries the offending type)."""

    def __init__(self, what: type):
        super().__init__(what)
        self.what = what


def feed(update: Any, value: Any) -> None:
    """Feeds the canonical encoding of ``value`` to a hash's ``update``."""
    cls = type(value)
    if cls is str:
        raw = value.encode("utf-8", "surrogatepass")
        update(b"s" + _LEN.pack(len(raw)))
        update(raw)
    elif cls is int:
        raw = str(value).encode()
        update(b"i" + _LEN.pack(len(raw)) + raw)
    elif cls is float:
        update(b"f" + _F64.pack(value))
    elif cls is bool:
        update(b"T" if value else b"F")
    elif value is None:
        update(b"N")
    elif cls is bytes or cls is bytearray or cls is memoryview:
        view = memoryview(value)
        update(b"b" + _LEN.pack(view.nbytes))
        update(view)
    elif cls is list or cls is tuple:
        update((b"l" if cls is list else b"t") + _LEN.pack(len(value)))
        for item in value:
            feed(update, item)
    elif cls is dict:
        update(b"d" + _LEN.pack(len(value)))
        try:
            keys = sorted(value)
        except TypeError:
            raise Unwritable(dict) from None
        for key in keys:
            if type(key) is not str:
                raise Unwritable(type(key))
            feed(update, key)
            feed(update, value[key])
    elif cls is Opaque:  # the node below sees what is inside, so that is what is named
        feed(update, value.value)
    elif isinstance(value, (bool, int, float, str, bytes, list, tuple, dict)):
        from ._codec import _plain

        feed(update, _plain(value))
    else:
        _feed_opaque(update, value)


def _feed_opaque(update: Any, value: Any) -> None:
    try:
        kind, dump = codec_for(value)
    except UnwritableError:
        raise Unwritable(type(value)) from None
    inner = hashlib.sha256()
    for piece in pieces_of(dump(value)):  # a header and a view: hashed where they lie
        inner.update(piece)
    inner = inner.digest()
    update(b"o")
    feed(update, kind)
    update(inner)


def digest_of(value: Any) -> bytes:
    """The raw sha256 of the canonical encoding; ``Unwritable`` if it has none."""
    h = hashlib.sha256()
    feed(h.update, value)
    return h.digest()


def hexdigest_of(value: Any) -> str:
    """``sha256:<hex>`` of the canonical encoding."""
    return "sha256:" + digest_of(value).hex()


def node_prefix(identity: str, declaration: str | None, salt: str | None,
                frozen: str | None) -> bytes:
    """What decides a node's output apart from its inputs, encoded once per graph."""
    h = bytearray()
    feed(h.extend, ("node", identity, declaration, salt, frozen))
    return bytes(h)


def node_key(prefix: bytes, input_keys: list[bytes]) -> bytes:
    """A node's key from its prefix and the keys of its inputs, in predecessor order."""
    h = hashlib.sha256(prefix)
    h.update(_LEN.pack(len(input_keys)))
    for key in input_keys:
        h.update(key)
    return h.digest()
