"""Frames over a socket: sent without copying, read into buffers allocated once.

A Channel knows nothing of workers or slices; it moves ``protocol`` frames and says
how many bytes each took. A peer that closes mid-frame raises ``Closed``; a socket
timeout escapes as ``TimeoutError`` for the caller to name (it knows the host).
"""

from __future__ import annotations

import mmap
import select
import socket
import ssl
import sys
import threading
import time
from typing import Any

from .protocol import (
    MAC_SIZE,
    PREFIX,
    SEALED,
    Frame,
    Limits,
    Session,
    check_header_mac,
    check_seal,
    encode,
    read_header,
    split_prefix,
)

__all__ = ["Channel", "Closed"]

# Past this size a buffer is mapped pre-faulted: the kernel zeroes the pages in one
# pass instead of one fault per page while the bytes arrive.
_MAPPED = 1 << 22
_IOV_MAX = 512


class Closed(ConnectionError):
    """The peer closed the connection (cleanly or not)."""


class Channel:
    """One connection's frames: sends serialised by a lock, receives by one reader."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock = sock
        self.limits = limits
        self.session: Session | None = None
        self.lock = threading.Lock()
        self._gather = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg")
        self._prefix = bytearray(PREFIX)
        self._spare: list[Any] = []  # the last frame's large buffers, for the next one
        self._poller: Any = None

    def send(self, kind: str, header: dict[str, Any] | None = None, buffers: Any = (),
             sealed: bool = False) -> int:
        """Sends one frame and returns how many bytes it took."""
        with self.lock:
            pieces = encode(kind, header, list(buffers), self.session, sealed)
            return self._send_pieces(pieces)

    def _send_pieces(self, pieces: list[Any]) -> int:
        """Sends what ``encode`` made (bytes, and byte views of the buffers)."""
        total = sum(len(p) for p in pieces)
        if not self._gather:
            for piece in pieces:
                self.sock.sendall(piece)
            return total
        sent = self.sock.sendmsg(pieces[:_IOV_MAX])
        if sent == total:  # a frame that fits the socket's buffer: nearly all of them
            return total
        views = _advance([memoryview(p) for p in pieces], sent)
        while views:
            views = _advance(views, self.sock.sendmsg(views[:_IOV_MAX]))
        return total

    def recv(self, limits: Limits | None = None, patient: bool = False) -> Frame:
        """Reads one whole frame, checked. Every read is bounded by the socket's
        timeout; a ``patient`` reader waits as long as it takes for a frame to start."""
        limits = limits or self.limits
        prefix = self._prefix
        self._fill(memoryview(prefix), patient)
        began = time.perf_counter_ns()
        flags, header_len, body_len, mac = split_prefix(prefix, limits)
        raw = bytearray(header_len)
        self._fill(memoryview(raw))
        seq = check_header_mac(self.session, flags, prefix, raw, mac)
        kind, head, sizes = read_header(raw, body_len, limits)
        buffers = [self._read_buffer(size) for size in sizes]
        if buffers:
            self._spare = [b for b in buffers if len(b) >= _MAPPED]
        if flags & SEALED:
            trailer = bytearray(MAC_SIZE)
            self._fill(memoryview(trailer))
            check_seal(self.session, seq, mac, buffers, trailer)  # type: ignore[arg-type]
        size = PREFIX + header_len + body_len + (MAC_SIZE if flags & SEALED else 0)
        return Frame(kind, head, buffers, size, bool(flags & SEALED),
                     (time.perf_counter_ns() - began) // 1000)

    def _read_buffer(self, size: int) -> Any:
        if size < _MAPPED:
            buffer = bytearray(size)
            self._fill(memoryview(buffer))
            return buffer
        space = self._reusable(size)
        if space is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            space = mmap.mmap(-1, size, flags=flags)
        self._fill(memoryview(space))
        return space

    def _reusable(self, size: int) -> Any:
        """A large buffer of the last frame that nobody holds any more, if one fits.

        Faulting in fresh pages costs a third of receiving them, and a training loop
        sends the same shapes every step. Whether anybody still holds it (a codec that
        kept it, a value) is read off its reference count, so a buffer in use is never
        written over.
        """
        spare = self._spare
        for i in range(len(spare)):  # not enumerate: its tuple would hold a reference
            space = spare[i]
            if len(space) == size and sys.getrefcount(space) == 3:  # spare, space, argument
                del spare[i]
                return space
        return None

    def _fill(self, view: memoryview, patient: bool = False) -> None:
        recv_into = self.sock.recv_into
        got, size = 0, view.nbytes
        while got < size:
            try:
                n = recv_into(view[got:])
            except TimeoutError:
                if patient and not got:  # nothing began: an idle peer is not a silent one
                    continue
                raise
            if not n:
                raise Closed(f"the peer closed the connection ({got} of {size} bytes read)")
            got += n

    def idle_and_open(self) -> bool:
        """Whether nothing at all is waiting on an idle connection.

        Between requests the far side says nothing, so anything readable then is its
        end of the connection (a restarted worker) or garbage: either way not a
        connection to send on.
        """
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        try:
            if self._poller is None:  # not select(): it refuses descriptors past 1024
                self._poller = select.poll()
                self._poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return not self._poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left to send once ``sent`` bytes of ``views`` went."""
    at = 0
    while at < len(views) and sent >= views[at].nbytes:
        sent -= views[at].nbytes
        at += 1
    rest = views[at:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest
