"""How values that are not data are written down, and how a whole value is packed.

A codec is two functions for one type. Its *kind* is the name written beside the
bytes, so it is what a store keeps forever: it names the type, never the run.

Packing turns any value (data with non-data leaves anywhere inside it) into a tree
of plain JSON-able data plus a list of raw buffers. Bytes and codec output never go
through the tree: they travel as buffers, so a 64 MB tensor is 64 MB on disk or on
the wire and not a list of floats. The store writes the pair as one blob; the wire
sends the tree in its header and the buffers as they are.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from typing import Any

from ._errors import CorruptObject, SomaError, UnwritableError
from ._node import Opaque

__all__ = ["codec", "codecs_registered", "dumps", "loads", "pack", "pieces_of", "unpack", "codec_for"]

# kind -> (type, dump, load); type -> kind. Registration is rare; lookups are hot.
_by_kind: dict[str, tuple[type, Callable[[Any], Any], Callable[[bytes], Any]]] = {}
_by_type: dict[type, str] = {}
_lock = threading.Lock()

# The markers a packed tree uses. A user dict that has one of these as a key would be
# read back as something else, so it is refused rather than silently changed.
OPAQUE = "__soma_opaque__"
BYTES = "__soma_bytes__"
TUPLE = "__soma_tuple__"
_MARKERS = frozenset((OPAQUE, BYTES, TUPLE))

DATA_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict)


def codec(kind: str, of_type: type, *, dump: Callable[[Any], Any], load: Callable[[bytes], Any]) -> None:
    """Says how objects of ``of_type`` are written down (``dump``) and read back (``load``).

    ``dump`` returns bytes, any buffer, or a tuple of buffers that are written one after
    the other (so a header and a view of memory that is already there need no copy to
    join them); ``load`` takes one bytes-like object. Saying the same thing
    again is harmless; a kind already taken by another type, or a type already written
    under another kind, is refused, since stored bytes would then read back as something
    else.
    """
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"a codec's kind must be a non-empty str, not {kind!r}")
    if not isinstance(of_type, type):
        raise TypeError(f"codec {kind!r}: of_type must be a type, not {of_type!r}")
    if not callable(dump) or not callable(load):
        raise TypeError(f"codec {kind!r}: dump and load must both be callable")
    if issubclass(of_type, DATA_TYPES) or of_type is Opaque:
        raise TypeError(
            f"codec {kind!r}: {of_type.__qualname__} is data and is written down already; "
            "a codec is for what is not"
        )
    with _lock:
        taken = _by_kind.get(kind)
        if taken is not None and taken[0] is not of_type:
            raise ValueError(
                f"codec kind {kind!r} is already registered for {_name(taken[0])}; "
                f"choose another kind for {_name(of_type)}"
            )
        other = _by_type.get(of_type)
        if other is not None and other != kind:
            raise ValueError(
                f"{_name(of_type)} already has a codec under kind {other!r}; "
                f"two kinds for one type would make stored bytes ambiguous"
            )
        _by_kind[kind] = (of_type, dump, load)
        _by_type[of_type] = kind


def codecs_registered() -> dict[str, type]:
    """What has a codec today, ``{kind: type}``, in the order they were registered."""
    with _lock:
        return {kind: entry[0] for kind, entry in _by_kind.items()}


def codec_for(value: Any) -> tuple[str, Callable[[Any], Any]]:
    """The kind and dump function for this value's type (or the nearest base with one)."""
    cls = type(value)
    kind = _by_type.get(cls)
    if kind is None:
        for base in cls.__mro__[1:]:
            kind = _by_type.get(base)
            if kind is not None:
                break
        else:
            raise UnwritableError(
                f"{_name(cls)} has no codec, so it cannot be written down; register one "
                f"with somatize.codec(kind, {cls.__qualname__}, dump=..., load=...) "
                "(for torch tensors, import somatize.torch)"
            )
    return kind, _by_kind[kind][1]


def loader(kind: str) -> Callable[[bytes], Any]:
    entry = _by_kind.get(kind)
    if entry is None:
        raise UnwritableError(
            f"a value was written with codec kind {kind!r}, which nobody registered here; "
            "import the module that registers it (for tensors, somatize.torch)"
        )
    return entry[2]


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pack(value: Any) -> tuple[Any, list[Any]]:
    """Turns a value into ``(tree, buffers)``: JSON-able data and raw buffers."""
    buffers: list[Any] = []
    return _pack(value, buffers), buffers


def _pack(value: Any, buffers: list[Any]) -> Any:
    cls = type(value)
    if cls is str or cls is int or cls is float or cls is bool or value is None:
        return value
    if cls is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise UnwritableError(
                    f"a dict key {key!r} is a {type(key).__qualname__}; only str keys can "
                    "be written down — convert the keys, or wrap the dict in Opaque with a codec"
                )
            if key in _MARKERS:
                raise UnwritableError(f"the dict key {key!r} is reserved by somatize")
            out[key] = _pack(item, buffers)
        return out
    if cls is list:
        return [_pack(item, buffers) for item in value]
    if cls is tuple:
        return {TUPLE: [_pack(item, buffers) for item in value]}
    if cls is bytes or cls is bytearray or cls is memoryview:
        buffers.append(value)
        return {BYTES: len(buffers) - 1}
    if cls is Opaque:
        return _pack(value.value, buffers)
    if isinstance(value, (str, int, float)):  # bool is an int; subclasses of data are data
        return _pack(_plain(value), buffers)
    if isinstance(value, (list, tuple, dict)):
        return _pack(_plain(value), buffers)
    kind, dump = codec_for(value)
    buffers.append(dump(value))
    return {OPAQUE: kind, "buffer": len(buffers) - 1}


def _plain(value: Any) -> Any:
    """The built-in this subclass of data stands for (an enum's str, a namedtuple's tuple)."""
    for base in (bool, int, float, str, dict, tuple, list):
        if isinstance(value, base):
            return base(value)
    raise AssertionError(value)


class _Malformed(Exception):
    """What ``loads`` found wrong, said once it knows what to call the bytes."""


def unpack(tree: Any, buffers: list[Any]) -> Any:
    """The mirror of ``pack``: the value alive again, non-data through the codecs."""
    cls = type(tree)
    if cls is dict:
        if OPAQUE in tree:
            kind = tree[OPAQUE]
            if type(kind) is not str:
                raise _Malformed(f"a codec kind is {kind!r}, not a str")
            load = loader(kind)
            buffer = bytes(_buffer(buffers, tree.get("buffer")))
            try:
                return load(buffer)
            except CorruptObject as exc:
                raise _Malformed(f"its {kind!r} value is corrupt ({exc})") from exc
            except SomaError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to decode is the bytes'
                raise _Malformed(f"its {kind!r} value cannot be read back "
                                 f"({type(exc).__name__}: {exc})") from exc
        if BYTES in tree:
            return bytes(_buffer(buffers, tree[BYTES]))
        if TUPLE in tree:
            items = tree[TUPLE]
            if type(items) is not list:
                raise _Malformed(f"a tuple is written as {type(items).__name__}, not a list")
            return tuple(unpack(item, buffers) for item in items)
        return {key: unpack(item, buffers) for key, item in tree.items()}
    if cls is list:
        return [unpack(item, buffers) for item in tree]
    return tree


def _buffer(buffers: list[Any], at: Any) -> Any:
    if type(at) is not int or not 0 <= at < len(buffers):
        raise _Malformed(f"it points at buffer {at!r}, and there are {len(buffers)}")
    return buffers[at]


# One value as one blob: MAGIC, the tree as JSON, then each buffer with its length.
MAGIC = b"SOMA\x01"
_LENGTH = struct.Struct("<Q")


def dumps(value: Any) -> bytes:
    """One value as bytes, through the codecs."""
    tree, buffers = pack(value)
    head = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
    parts = [MAGIC, _LENGTH.pack(len(head)), head, _LENGTH.pack(len(buffers))]
    for buffer in buffers:
        pieces = [memoryview(piece).cast("B") for piece in pieces_of(buffer)]
        parts.append(_LENGTH.pack(sum(piece.nbytes for piece in pieces)))
        parts.extend(pieces)
    return b"".join(parts)


def pieces_of(buffer: Any) -> tuple[Any, ...]:
    """A codec's output as the buffers it is made of, in order."""
    return buffer if type(buffer) is tuple else (buffer,)


def loads(blob: bytes, what: str = "these bytes") -> Any:
    """The mirror of ``dumps``. Bytes it did not write are a ``CorruptObject`` naming
    them as ``what`` (``"the object sha256:… bound to 'x'"``); a codec kind nobody
    registered here is an ``UnwritableError``, since the bytes may be right."""
    view = memoryview(blob)
    try:
        if bytes(view[: len(MAGIC)]) != MAGIC:
            raise _Malformed("they were not written by somatize.dumps (bad magic)")
        at, size = _length(view, len(MAGIC), "the tree's length")
        if size > len(view) - at:
            raise _Malformed(f"the tree is said to be {size} bytes, past the end")
        try:
            tree = json.loads(bytes(view[at : at + size]))
        except (ValueError, RecursionError) as exc:
            raise _Malformed(f"the tree is not JSON ({type(exc).__name__}: {exc})") from None
        at, count = _length(view, at + size, "the number of buffers")
        buffers = []
        for number in range(count):
            at, size = _length(view, at, f"the length of buffer {number}")
            if size > len(view) - at:
                raise _Malformed(f"buffer {number} is said to be {size} bytes, past the end")
            buffers.append(view[at : at + size])
            at += size
        if at != len(view):
            raise _Malformed(f"{len(view) - at} stray bytes follow the last buffer")
        try:
            return unpack(tree, buffers)
        except RecursionError:
            raise _Malformed("the tree is nested deeper than Python can follow") from None
    except _Malformed as malformed:
        raise CorruptObject(
            f"{what} cannot be read as a value: {malformed}; they hash right, so they were "
            "written this way — put the value again, or remove the name that points at it"
        ) from malformed.__cause__


def _length(view: memoryview, at: int, what: str) -> tuple[int, int]:
    """The 8-byte length at ``at`` and where what follows it begins."""
    if at + _LENGTH.size > len(view):
        raise _Malformed(f"they end where {what} should be")
    return at + _LENGTH.size, _LENGTH.unpack_from(view, at)[0]
