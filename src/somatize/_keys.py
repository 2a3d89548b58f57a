"""Names for outputs, made of content: a canonical encoding of data, and Merkle keys.

Small pieces of the encoding are gathered and hashed in one go (lists of ints, floats
or strs are encoded all at once), while a big buffer is fed to the hash where it lies,
so a 256 MB input is never copied. Every value is tagged with its type and its length,
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
from ._opaque import Opaque

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
    parts: list[Any] = []
    _encode(value, parts, update)
    update(b"".join(parts))


def digest_of(value: Any) -> bytes:
    """The raw sha256 of the canonical encoding; ``Unwritable`` if it has none."""
    h = hashlib.sha256()
    parts: list[Any] = []
    _encode(value, parts, h.update)
    h.update(b"".join(parts))
    return h.digest()


def hexdigest_of(value: Any) -> str:
    """``sha256:<hex>`` of the canonical encoding."""
    return "sha256:" + digest_of(value).hex()


# The encoding gathers its small pieces in a list, joined and hashed once: one call into
# the hash per piece was most of what a key of small data cost. A buffer this big or
# bigger is fed to the hash where it lies instead, after whatever came before it.
_BIG = 1 << 16


def _encode(value: Any, parts: list[Any], update: Any) -> None:
    """Appends the canonical encoding of ``value`` to ``parts``; a big buffer goes
    straight to ``update``, once ``parts`` so far have."""
    cls = type(value)
    if cls is str:
        raw = value.encode("utf-8", "surrogatepass")
        parts.append(b"s" + _LEN.pack(len(raw)) + raw)
    elif cls is int:
        parts.append(_INTS.get(value) or _int_piece(value))
    elif cls is float:
        parts.append(b"f" + _F64.pack(value))
    elif cls is bool:
        parts.append(b"T" if value else b"F")
    elif value is None:
        parts.append(b"N")
    elif cls is list or cls is tuple:
        parts.append((b"l" if cls is list else b"t") + _LEN.pack(len(value)))
        if len(value) < 4 or not _encode_alike(value, parts):
            for item in value:
                _encode(item, parts, update)
    elif cls is dict:
        parts.append(b"d" + _LEN.pack(len(value)))
        try:
            keys = sorted(value)
        except TypeError:
            raise Unwritable(dict) from None
        for key in keys:
            if type(key) is not str:
                raise Unwritable(type(key))
            raw = key.encode("utf-8", "surrogatepass")
            parts.append(b"s" + _LEN.pack(len(raw)) + raw)
            _encode(value[key], parts, update)
    elif cls is bytes or cls is bytearray or cls is memoryview:
        view = memoryview(value)
        parts.append(b"b" + _LEN.pack(view.nbytes))
        if view.nbytes < _BIG:
            parts.append(view.tobytes() if cls is not bytes else value)
        else:
            update(b"".join(parts))
            parts.clear()
            update(view)
    elif cls is Opaque:  # the node below sees what is inside, so that is what is named
        _encode(value.value, parts, update)
    elif isinstance(value, (bool, int, float, str, bytes, list, tuple, dict)):
        from ._codec import _plain

        _encode(_plain(value), parts, update)
    else:
        kind, inner = _opaque(value)
        raw = kind.encode("utf-8", "surrogatepass")
        parts.append(b"os" + _LEN.pack(len(raw)) + raw + inner)


def _encode_alike(items: Any, parts: list[Any]) -> bool:
    """Appends the encoding of a list's items all at once when they are all ints, all
    floats or all strs (what big inputs are made of); False, appending nothing, if not."""
    kinds = set(map(type, items))
    if len(kinds) != 1:
        return False
    kind = kinds.pop()
    if kind is int:
        pieces = list(map(_INTS.get, items))
        if None in pieces:
            pieces = [piece or _int_piece(item) for piece, item in zip(pieces, items)]
        parts.extend(pieces)
    elif kind is float:
        count = len(items)
        raw = struct.pack(f"<{count}d", *items)
        out = bytearray(9 * count)
        out[0::9] = b"f" * count  # a tag before each float's eight bytes, laid in by slices
        for at in range(8):
            out[1 + at::9] = raw[at::8]
        parts.append(out)
    elif kind is str:
        parts.extend([b"s" + _LEN.pack(len(raw)) + raw
                      for raw in [item.encode("utf-8", "surrogatepass") for item in items]])
    else:
        return False
    return True


def _int_piece(value: int) -> bytes:
    raw = str(value).encode()
    piece = b"i" + _LEN.pack(len(raw)) + raw
    if len(raw) <= 20 and len(_INTS) < _INTS_KEPT:  # small ints seen are kept, up to a bound
        _INTS[value] = piece
    return piece


_INTS_KEPT = 1 << 14
_INTS: dict[int, bytes] = {}
for _i in range(-256, 1024):
    _int_piece(_i)


def _opaque(value: Any) -> tuple[str, bytes]:
    """A value with a codec: its kind, and the digest of what the codec writes."""
    try:
        kind, dump = codec_for(value)
    except UnwritableError:
        raise Unwritable(type(value)) from None
    inner = hashlib.sha256()
    for piece in pieces_of(dump(value)):  # a header and a view: hashed where they lie
        inner.update(piece)
    return kind, inner.digest()


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
