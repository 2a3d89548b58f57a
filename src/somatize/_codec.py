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
import sys
import threading
from collections.abc import Callable
from importlib import import_module
from typing import Any

from ._errors import CorruptObject, SomaError, UnwritableError
from ._opaque import Opaque

__all__ = ["codec", "codec_for", "codec_modules", "codecs_registered", "dumps", "found_in",
           "loads", "pack", "pack_into", "pieces_of", "unpack"]

# kind -> (type, dump, load); type -> (kind, dump). Registration is rare; lookups are
# hot, so packing a value finds both halves of what it writes in one lookup. Who fills
# them is declared with every other registry in ``_registries``.
_by_kind: dict[str, tuple[type, Callable[[Any], Any], Callable[[bytes], Any]]] = {}
_by_type: dict[type, tuple[str, Callable[[Any], Any]]] = {}
_registered_in: dict[str, str] = {}  # kind -> the module that said it
_elsewhere: dict[str, str] = {}  # kind -> the module another process said registers it
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
        if other is not None and other[0] != kind:
            raise ValueError(
                f"{_name(of_type)} already has a codec under kind {other[0]!r}; "
                f"two kinds for one type would make stored bytes ambiguous"
            )
        _by_kind[kind] = (of_type, dump, load)
        _by_type[of_type] = (kind, dump)
        _registered_in.setdefault(kind, sys._getframe(1).f_globals.get("__name__", ""))


def codec_modules() -> dict[str, str]:
    """``{kind: module}``: the module whose import registered each of today's codecs, so
    that another process (a worker) can register the same one when a value of that kind
    first reaches it (``found_in``)."""
    with _lock:
        return {k: m for k, m in _registered_in.items() if m and m != "__main__"}


def found_in(modules: dict[str, str]) -> None:
    """Says where the codecs of these kinds are registered (``codec_modules`` of another
    process): a kind nobody registered here is looked for there the first time a value
    of it is read, by importing that module, and not before."""
    with _lock:
        for kind, module in modules.items():
            if kind not in _by_kind:
                _elsewhere[kind] = module

def codecs_registered() -> dict[str, type]:
    """What has a codec today, ``{kind: type}``, in the order they were registered."""
    with _lock:
        return {kind: entry[0] for kind, entry in _by_kind.items()}


def codec_for(value: Any) -> tuple[str, Callable[[Any], Any]]:
    """The kind and dump function for this value's type (or the nearest base with one)."""
    cls = type(value)
    written = _by_type.get(cls)
    if written is None:
        for base in cls.__mro__[1:]:
            written = _by_type.get(base)
            if written is not None:
                break
        else:
            raise UnwritableError(
                f"{_name(cls)} has no codec, so it cannot be written down; register one "
                f"with somatize.codec(kind, {cls.__qualname__}, dump=..., load=...) "
                "(for torch tensors, import somatize.torch)"
            )
    return written


def loader(kind: str) -> Callable[[bytes], Any]:
    entry = _by_kind.get(kind)
    if entry is None and kind in _elsewhere:
        try:
            import_module(_elsewhere[kind])
        except ImportError as exc:
            raise UnwritableError(
                f"a value was written with codec kind {kind!r}, which {_elsewhere[kind]} "
                f"registers, and it cannot be imported here ({exc}); install what it needs "
                "where this runs") from None
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
    return pack_into(value, buffers), buffers


def pack_into(value: Any, buffers: list[Any]) -> Any:
    """The tree of ``value``, its buffers appended to ``buffers`` (several values may
    share one list, as the values of one message do)."""
    cls = type(value)
    if cls in _SCALARS:
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
            # A message is mostly dicts of tensors and numbers: their leaves are written
            # here rather than through a call each (a tenth of a small dict's opcodes).
            leaf = type(item)
            if leaf in _SCALARS:
                out[key] = item
            elif (written := _by_type.get(leaf)) is not None:
                buffers.append(written[1](item))
                out[key] = {OPAQUE: written[0], "buffer": len(buffers) - 1}
            else:
                out[key] = pack_into(item, buffers)
        return out
    if cls is list:
        return [pack_into(item, buffers) for item in value]
    if cls is tuple:
        return {TUPLE: [pack_into(item, buffers) for item in value]}
    # A value whose type has a codec (a tensor) is common: it is found by one lookup
    # rather than after every other kind of data has been tried, which cost it some
    # 50 opcodes. Lists and tuples, as common, are told apart before it.
    written = _by_type.get(cls)
    if written is not None:
        buffers.append(written[1](value))
        return {OPAQUE: written[0], "buffer": len(buffers) - 1}
    if cls is bytes or cls is bytearray or cls is memoryview:
        buffers.append(value)
        return {BYTES: len(buffers) - 1}
    if cls is Opaque:
        return pack_into(value.value, buffers)
    if isinstance(value, (str, int, float)):  # bool is an int; subclasses of data are data
        return pack_into(_plain(value), buffers)
    if isinstance(value, (list, tuple, dict)):
        return pack_into(_plain(value), buffers)
    kind, dump = codec_for(value)  # a subclass of a type with a codec
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
    """The mirror of ``pack``: the value alive again, non-data through the codecs.

    A buffer is handed to its codec as it is (a view of what was read or received,
    without a copy); a codec that insists on ``bytes`` is handed bytes."""
    cls = type(tree)
    if cls is dict:
        if OPAQUE in tree:
            return _loaded(tree, buffers)
        if BYTES in tree:
            at = tree[BYTES]
            if type(at) is not int or not 0 <= at < len(buffers):
                raise _no_buffer(at, buffers)
            return bytes(buffers[at])
        if TUPLE in tree:
            items = tree[TUPLE]
            if type(items) is not list:
                raise _Malformed(f"a tuple is written as {type(items).__name__}, not a list")
            return tuple(unpack(item, buffers) for item in items)
        return {key: unpack(item, buffers) for key, item in tree.items()}
    if cls is list:
        if _SCALARS.issuperset(map(type, tree)):  # a list of numbers or text: as it was read
            return tree[:]
        return [unpack(item, buffers) for item in tree]
    return tree


_SCALARS = frozenset((str, int, float, bool, type(None)))


def _no_buffer(at: Any, buffers: list[Any]) -> _Malformed:
    return _Malformed(f"it points at buffer {at!r}, and there are {len(buffers)}")


def _loaded(tree: dict[str, Any], buffers: list[Any]) -> Any:
    """A codec's value, handed its buffer as it is (a codec written for bytes alone is
    handed bytes, once more); whatever else it raises says the bytes are bad."""
    kind = tree[OPAQUE]
    if type(kind) is not str:
        raise _Malformed(f"a codec kind is {kind!r}, not a str")
    entry = _by_kind.get(kind)
    load = entry[2] if entry is not None else loader(kind)
    at = tree.get("buffer")
    if type(at) is not int or not 0 <= at < len(buffers):
        raise _no_buffer(at, buffers)
    buffer = buffers[at]
    try:
        try:
            return load(buffer)
        except SomaError:
            raise
        except Exception:
            if type(buffer) is bytes:
                raise
            return load(bytes(buffer))
    except CorruptObject as exc:
        raise _Malformed(f"its {kind!r} value is corrupt ({exc})") from exc
    except SomaError:
        raise
    except Exception as exc:  # any failure to decode is the bytes'
        raise _Malformed(f"its {kind!r} value cannot be read back "
                         f"({type(exc).__name__}: {exc})") from exc


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
