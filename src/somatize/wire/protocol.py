"""Frames and the handshake, as pure functions over bytes.

A frame is a fixed 48-byte prefix, a msgpack header, then raw buffers sent as they
are (a tensor's bytes never become a list of floats)::

    offset size
    0      2    magic b"SZ"
    2      1    protocol version
    3      1    flags: MACED (the MAC field is set), SEALED (a MAC trailer follows the buffers)
    4      4    header length, u32 little-endian
    8      8    length of all buffers together, u64 little-endian
    16     32   MAC over (direction, sequence, prefix[:16], header); zeros before auth
    48     ...  header: a msgpack map with "k" (the kind) and "b" (each buffer's length)
    ...    ...  the buffers, back to back
    ...    32   only when SEALED: MAC over (direction, sequence, MAC, buffers)

The MAC is keyed BLAKE2b-256 under a key fresh for each connection, derived with
HMAC-SHA256 from both sides' nonces and the worker's key: the token stretched by
scrypt under a salt the worker draws when it starts, so that every guess at a token
seen on the network costs milliseconds rather than a microsecond.

Every size is checked against ``Limits`` before anything is allocated, and the header's
MAC is checked before its buffers are read, so a peer without the token can make us
read at most one handshake-sized header. The sequence number is never sent: each side
counts the frames it sends and receives, so a replayed, dropped or reordered frame
fails its MAC. Buffers are covered by the MAC only when sealed (the catalog, which is
unpickled); values are not, because hashing 64 MB costs more than sending it — TLS is
what protects them from an attacker who can rewrite the stream. ``docs/wire.md``
describes the messages built on top.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

try:
    import msgpack
except ImportError as exc:  # the core does without; the wire cannot
    raise ImportError("the wire needs msgpack: pip install 'somatize[wire]'") from exc

from .._errors import ProtocolError, whole_number

__all__ = [
    "PREFIX",
    "VERSION",
    "Frame",
    "Limits",
    "OtherVersion",
    "Keyed",
    "decode",
    "derive_key",
    "encode",
    "new_nonce",
    "new_salt",
    "proof",
    "read_header",
    "refusal",
    "connection_key",
    "split_prefix",
]

#: 4: a slice may name its form (session, nodes, outputs) by the number it was said
#: under earlier on the connection, which a worker of 3 would take for a malformed
#: slice. 3: every request names the client session it belongs to, and a worker holds
#: a catalog per session. 2 had one catalog per worker, which any client replaced; 2,
#: 3 and 4 share the handshake: the client proves it holds the token first, the worker
#: answers after, and the MAC key is the token stretched by scrypt. 1 (somatize 1.0)
#: had the worker prove first.
VERSION = 4
MAGIC = b"SZ"
MACED, SEALED = 1, 2
_PREFIX = struct.Struct("<2sBBIQ")
MAC_SIZE = 32
PREFIX = _PREFIX.size + MAC_SIZE
# The same, read with the magic and the version as one field, and the MAC as bytes.
_WHOLE_PREFIX = struct.Struct(f"<3sBIQ{MAC_SIZE}s")
_LEAD = MAGIC + bytes([VERSION])
_NO_MAC = bytes(MAC_SIZE)
_SEQ = struct.Struct("<Q")
_FLAGS = frozenset({0, MACED, MACED | SEALED})  # SEALED is only ever set with MACED
_INT = frozenset({int})

#: Every kind a frame may have; anything else is not one of ours.
FRAME_KINDS = frozenset({
    "hello", "challenge", "proof", "welcome", "refused",        # the handshake
    "catalog", "provision", "slice", "control", "end",          # client -> worker
    "ok", "need", "done", "error", "beat",                      # worker -> client
})


@dataclass(frozen=True)
class Limits:
    """How big a frame may be, checked before anything is allocated.

    ``header`` bounds the msgpack header (where data values travel), ``frame`` the
    whole frame, ``buffers`` how many buffers one frame may carry.
    """

    header: int = 64 << 20
    frame: int = 4 << 30
    buffers: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("header", "frame", "buffers"):
            whole_number(getattr(self, name), f"Limits.{name}")
        if self.header >= 1 << 32:
            raise ValueError(f"Limits.header must stay under 4 GiB, not {self.header}")


#: What an unauthenticated peer may send: a small header and no buffers at all.
HANDSHAKE = Limits(header=4096, frame=4096 + PREFIX, buffers=1)


@dataclass
class Frame:
    """One message: its kind, its header (a dict) and its buffers."""

    kind: str
    header: dict[str, Any]
    buffers: list[Any] = field(default_factory=list)
    size: int = 0  # bytes it took on the wire
    sealed: bool = False  # whether the buffers were covered by a MAC
    took_us: int = 0  # from its first byte to its last, when read from a socket


class Keyed:
    """The MAC state of one authenticated connection: a key and two counters.

    ``side`` is ``b"C"`` for the client and ``b"W"`` for the worker; what one side
    sends the other receives, so the direction byte is the sender's.
    """

    __slots__ = ("_keyed", "peer", "received", "sent", "side")

    def __init__(self, key: bytes, side: bytes):
        # Keyed once per connection: copying a hash that has taken in its key costs
        # less than keying a fresh one for every frame, and answers the same.
        self._keyed = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
        self.side = side
        self.peer = b"W" if side == b"C" else b"C"
        self.sent = 0
        self.received = 0

    def tag(self, direction: bytes, seq: int, *parts: Any) -> bytes:
        """The MAC of these parts from this direction at this sequence number: keyed
        BLAKE2b, a MAC by design and a third of HMAC-SHA256's cost on small frames."""
        mac = self._keyed.copy()
        mac.update(direction + _SEQ.pack(seq))
        for part in parts:
            mac.update(part)
        return mac.digest()

    def header_tag(self, direction: bytes, seq: int, start: Any, raw: Any) -> bytes:
        """``tag(direction, seq, start, raw)``, the MAC of a frame's header, written
        out without the loop since every frame pays for it on both ends."""
        mac = self._keyed.copy()
        mac.update(direction + _SEQ.pack(seq))
        mac.update(start)
        mac.update(raw)
        return mac.digest()


class OtherVersion(ProtocolError):
    """A frame of another version of the protocol; ``version`` is the one it speaks."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def new_salt() -> bytes:
    return secrets.token_bytes(16)


# About 1 MiB and a few milliseconds a derivation: once per worker process and once per
# worker a client talks to, but as much for every guess at a token a proof was seen with.
_SCRYPT = {"n": 1 << 10, "r": 8, "p": 1}


@functools.lru_cache(maxsize=32)
def derive_key(token: bytes, salt: bytes) -> bytes:
    """The key proofs and sessions are made with: ``token`` stretched by scrypt."""
    return hashlib.scrypt(token, salt=b"somatize wire 2 " + salt, dklen=32, **_SCRYPT)


def proof(key: bytes, who: bytes, client_nonce: bytes, worker_nonce: bytes) -> bytes:
    """What ``who`` (b"client" or b"worker") sends to show it holds the key."""
    return hmac.new(key, b"somatize proof " + who + client_nonce + worker_nonce,
                    hashlib.sha256).digest()


def connection_key(key: bytes, client_nonce: bytes, worker_nonce: bytes) -> bytes:
    """The key this one connection MACs its frames with: fresh nonces, fresh key."""
    return hmac.new(key, b"somatize session" + client_nonce + worker_nonce,
                    hashlib.sha256).digest()


def refusal(version: int, why: str) -> bytes:
    """A ``refused`` frame a peer speaking ``version`` can read.

    Every version keeps the prefix and an unauthenticated ``refused`` frame as they
    are, so whichever side is older learns why it was turned away.
    """
    raw = msgpack.packb({"k": "refused", "why": why}, use_bin_type=True)
    return _PREFIX.pack(MAGIC, version, 0, len(raw), 0) + _NO_MAC + raw


# -- encoding -----------------------------------------------------------------------
#: What a codec may answer with to send one buffer from several places (a header and
#: a tensor's own memory, say): sent back to back, and received as one buffer.
_GROUPS = (tuple, list)


def encode(kind: str, header: dict[str, Any] | None = None, buffers: list[Any] = (),
           keyed: Keyed | None = None, sealed: bool = False,
           most: int | None = None) -> list[Any]:
    """A frame as the pieces to send, in order; buffers are not copied.

    ``keyed`` MACs it (and advances the send counter); ``sealed`` adds a MAC over
    the buffers, where the connection is keyed. A frame larger than
    ``most`` bytes (what the far side accepts) is refused before the counter moves.
    """
    # Each buffer's views and its size in one pass: for a small frame, nested lists
    # and sums over them cost as much as the rest of this function.
    views: list[memoryview] = []
    sizes: list[int] = []
    for buffer in buffers:
        size = 0
        for part in buffer if type(buffer) in _GROUPS else (buffer,):
            view = memoryview(part)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            views.append(view)
            size += view.nbytes
        sizes.append(size)
    # A copy, since a caller may send the same header again (a retried slice does).
    head = dict(header) if header else {}
    if "k" in head or "b" in head:  # the frame's own keys: a caller's would be lost
        raise ProtocolError(f"a {kind!r} frame's header may not use the keys 'k' and 'b', "
                            "which say the frame's kind and its buffers' sizes; name the "
                            "field otherwise")
    head["k"] = kind
    if sizes:
        head["b"] = sizes
    try:
        raw = _packed(head)
    except OverflowError:
        raise ProtocolError(
            f"a {kind!r} frame holds an int beyond 64 bits, which msgpack cannot carry; "
            "send it as a str, or wrap it in Opaque with a codec"
        ) from None
    body = sum(sizes)
    if most is not None and PREFIX + len(raw) + body > most:
        raise ProtocolError(f"a {kind!r} frame of {PREFIX + len(raw) + body} bytes is over "
                            f"the far side's limit of {most} bytes")
    if keyed is None:
        return [_PREFIX.pack(MAGIC, VERSION, 0, len(raw), body) + _NO_MAC + raw, *views]
    flags = MACED | SEALED if sealed and sizes else MACED
    start = _PREFIX.pack(MAGIC, VERSION, flags, len(raw), body)
    seq = keyed.sent
    keyed.sent = seq + 1
    mac = keyed.header_tag(keyed.side, seq, start, raw)
    pieces: list[Any] = [start + mac + raw, *views]
    if flags & SEALED:
        pieces.append(keyed.tag(keyed.side, seq, mac, *views))
    return pieces


# msgpack.packb makes a Packer for every call, a quarter of what packing a small
# header costs. Packers are kept instead, each taken by one encode at a time: list
# pop and append are atomic, so two threads never share one.
_idle_packers: list[Any] = []
_PACKER_KEEPS = 1 << 20  # a Packer's buffer stays as large as the largest it packed


def _packed(head: dict[str, Any]) -> bytes:
    """``head`` as msgpack, by a Packer nobody else is using."""
    try:
        packer = _idle_packers.pop()
    except IndexError:  # none made yet, or every one in use
        packer = msgpack.Packer(use_bin_type=True)
    raw = packer.pack(head)
    if len(raw) <= _PACKER_KEEPS:
        _idle_packers.append(packer)
    return raw


# -- decoding -----------------------------------------------------------------------
def split_prefix(prefix: bytes | bytearray | memoryview, limits: Limits) -> tuple[int, int, int, bytes]:
    """``(flags, header length, buffers length, mac)`` of a 48-byte prefix, checked."""
    try:
        lead, flags, header_len, body_len, mac = _WHOLE_PREFIX.unpack(prefix)
    except struct.error:
        raise ProtocolError(f"a frame prefix is {PREFIX} bytes, got {len(prefix)}") from None
    if lead != _LEAD:
        if lead[:2] != MAGIC:
            raise ProtocolError(f"not a somatize frame (it starts {lead[:2]!r}, not {MAGIC!r})")
        raise OtherVersion(
            f"a frame of wire protocol {lead[2]}, and this side speaks {VERSION}; "
            "install the same somatize on both ends", lead[2]
        )
    if flags not in _FLAGS:
        raise ProtocolError(f"a frame with unknown flags {flags:#x}")
    if header_len > limits.header:
        raise ProtocolError(f"a frame header of {header_len} bytes is over the limit of {limits.header}")
    if header_len + body_len + PREFIX > limits.frame:
        raise ProtocolError(
            f"a frame of {header_len + body_len + PREFIX} bytes is over the limit of {limits.frame}"
        )
    return flags, header_len, body_len, mac


def read_header(raw: bytes | bytearray | memoryview, body_len: int, limits: Limits) -> tuple[str, dict[str, Any], list[int]]:
    """The kind, the header and the buffer sizes; anything malformed is a ProtocolError."""
    try:
        head = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                               ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack has a dozen ways of saying "not msgpack"
        raise ProtocolError(f"a frame header that is not msgpack ({type(exc).__name__}: {exc})") from None
    if type(head) is not dict:
        raise ProtocolError(f"a frame header is a map, not a {type(head).__name__}")
    kind = head.get("k")
    if kind not in FRAME_KINDS:
        raise ProtocolError(f"a frame of unknown kind {kind!r}")
    sizes = head.get("b", [])
    # Every size an int (a bool is not one) and none negative: checked by loops in C
    # (the set of their types, the least of them) rather than a generator in Python,
    # which every frame with buffers paid for.
    if (type(sizes) is not list or len(sizes) > limits.buffers
            or not {*map(type, sizes)} <= _INT or sizes and min(sizes) < 0):
        raise ProtocolError(f"a {kind!r} frame with malformed buffer sizes")
    if sum(sizes) != body_len:
        raise ProtocolError(
            f"a {kind!r} frame announces {body_len} bytes of buffers and sizes adding to {sum(sizes)}"
        )
    return kind, head, sizes


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"a frame header with a msgpack extension type ({code})")


def check_header_mac(keyed: Keyed | None, flags: int, prefix: Any, raw: Any, mac: bytes,
                     refusal_ok: bool = False) -> int | None:
    """Verifies a header's MAC and returns the sequence number it was checked at.

    ``refusal_ok`` lets a frame without a MAC through (answering None) for the caller
    to accept only if it is a ``refused``: the one frame a worker that does not share
    the key can answer a proof with.
    """
    if keyed is None:
        if flags:
            raise ProtocolError("an authenticated frame before the handshake finished")
        return None
    if not flags & MACED:
        if refusal_ok:
            return None
        raise ProtocolError("a frame without a MAC on an authenticated connection")
    seq = keyed.received
    expected = keyed.header_tag(keyed.peer, seq, prefix[:_PREFIX.size], raw)
    if not hmac.compare_digest(expected, mac):
        raise ProtocolError(
            "a frame whose MAC does not match: replayed, reordered, altered or forged"
        )
    keyed.received = seq + 1
    return seq


def check_seal(keyed: Keyed, seq: int, mac: bytes, buffers: list[Any], trailer: bytes) -> None:
    expected = keyed.tag(keyed.peer, seq, mac, *buffers)
    if not hmac.compare_digest(expected, bytes(trailer)):
        raise ProtocolError("a sealed frame whose buffers do not match their MAC")


def decode(data: bytes | bytearray | memoryview, limits: Limits = HANDSHAKE,
           keyed: Keyed | None = None) -> list[Frame]:
    """Every frame in ``data``, which must hold whole frames and nothing else.

    The same checks a connection makes, over bytes already in hand: what is not a
    frame of ours, in any way, raises ProtocolError and nothing else.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    frames = []
    at = 0
    while at < len(view):
        prefix = _take(view, at, PREFIX, "prefix")
        flags, header_len, body_len, mac = split_prefix(prefix, limits)
        at += PREFIX
        raw = _take(view, at, header_len, "header")
        at += header_len
        seq = check_header_mac(keyed, flags, prefix, raw, mac)
        kind, head, sizes = read_header(raw, body_len, limits)
        buffers = []
        for size in sizes:
            buffers.append(bytearray(_take(view, at, size, "buffer")))
            at += size
        if flags & SEALED:
            trailer = _take(view, at, MAC_SIZE, "seal")
            at += MAC_SIZE
            check_seal(keyed, seq, mac, buffers, trailer)  # type: ignore[arg-type]
        frames.append(Frame(kind, head, buffers, PREFIX + header_len + body_len
                            + (MAC_SIZE if flags & SEALED else 0), bool(flags & SEALED)))
    return frames


def _take(view: memoryview, at: int, size: int, what: str) -> memoryview:
    if at + size > len(view):
        raise ProtocolError(f"a frame truncated in its {what} ({len(view) - at} of {size} bytes)")
    return view[at:at + size]
