"""How a message's buffers ride in Ray's store, and what they are once read back.

A buffer goes as a ``pickle.PickleBuffer``, which Ray writes out of band: straight
into its shared-memory store, read back there as a view of that memory, with no
copy and no pickle of the values. A tensor's buffer is two pieces (its header and a
view of its own memory); they travel as they are and are joined, with the one copy
torch needs to own writable memory, where they arrive.
"""

from __future__ import annotations

import mmap
import pickle
from typing import Any

__all__ = ["joined", "outgoing", "size"]

_LARGE = 1 << 20  # past this, the block a buffer is joined into is mapped, not zeroed


def outgoing(buffers: list[Any]) -> list[Any]:
    """The buffers as Ray carries them without copying them into a pickle."""
    return [tuple(_view(p) for p in b) if type(b) in (tuple, list) else _view(b) for b in buffers]


def _view(piece: Any) -> Any:
    if type(piece) is bytes and len(piece) < 4096:  # in the message is cheaper
        return piece
    try:
        return pickle.PickleBuffer(piece)
    except (TypeError, BufferError, ValueError):  # not C-contiguous: one copy, then as bytes
        return bytes(memoryview(piece))


def joined(buffers: Any) -> list[Any]:
    """The buffers as received, each one contiguous block (the pieces of one joined)."""
    out = []
    for buffer in buffers:
        if type(buffer) is tuple:
            total = sum(memoryview(p).nbytes for p in buffer)
            # bytearray(n) writes n zeros before we write n bytes; an anonymous map's
            # pages come from the kernel as they are first written, once.
            whole: Any = mmap.mmap(-1, total) if total >= _LARGE else bytearray(total)
            at = 0
            for piece in buffer:
                view = memoryview(piece).cast("B")
                whole[at:at + view.nbytes] = view
                at += view.nbytes
            buffer = whole
        out.append(buffer)
    return out


def size(buffers: Any) -> int:
    """How many bytes these buffers hold."""
    return sum(size(b) if type(b) in (tuple, list) else memoryview(b).nbytes for b in buffers)
