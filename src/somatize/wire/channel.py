"""Frames over a socket: sent without copying, read into buffers that grow as bytes come.

A Channel knows nothing of workers or slices; it moves ``protocol`` frames and says
how many bytes each took. A peer that closes mid-frame raises ``Closed``; a socket
timeout, or a deadline passed, escapes as ``TimeoutError`` for the caller to name (it
knows the host).
"""

from __future__ import annotations

import math
import mmap
import select
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any

from .._errors import ProtocolError
from .protocol import (
    MAC_SIZE,
    PREFIX,
    SEALED,
    Frame,
    Limits,
    Keyed,
    check_header_mac,
    check_seal,
    encode,
    read_header,
    split_prefix,
)

__all__ = ["Channel", "Closed"]

# Past this size a buffer is mapped rather than allocated, and its pages are committed
# in steps as its bytes arrive, each step no larger than what already came: a peer that
# announces gigabytes gets as much memory as it sends, not what it announced. A step is
# pre-faulted (MADV_POPULATE_WRITE) so the kernel zeroes its pages in one pass instead
# of one fault per page while the bytes are copied in.
_MAPPED = 1 << 22
_LAZY = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
         | getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0))
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
_IOV_MAX = 512
_AHEAD = 64 << 10  # what one read may take at once, for the frames that follow
# A socket given a timeout in Python polls before every recv and every send: two
# syscalls a call where one does. On Linux a plain socket stays blocking and the kernel
# keeps its timeout instead (SO_RCVTIMEO, SO_SNDTIMEO), and a call that runs past it
# fails with EAGAIN, which is read here as the TimeoutError it stands for.
_KERNEL_TIMEOUTS = sys.platform.startswith("linux") and hasattr(socket, "SO_RCVTIMEO")
_TIMEVAL = struct.Struct("@ll")
_UNSET = object()  # no timeout set yet


class Closed(ConnectionError):
    """The peer closed the connection (cleanly or not)."""


class Channel:
    """One connection's frames: sends serialised by a lock, receives by one reader."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock = sock
        self.limits = limits
        self.keyed: Keyed | None = None
        self.lock = threading.Lock()
        self._gather = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg")
        self._kernel = self._gather and _KERNEL_TIMEOUTS
        # How long one read or send may wait (None: as long as it takes); what bounds
        # reads and sends now, once set, where a deadline's reads may differ for a while.
        self.timeout: float | None = sock.gettimeout()
        self._reading: Any = _UNSET
        self._sending: Any = _UNSET
        if self._kernel:
            sock.settimeout(None)
        self.set_timeout(self.timeout)
        self._spare: list[Any] = []  # the last frame's large buffers, for the next one
        self._poller: Any = None
        # Bytes read past the frame that wanted them (a small frame is read whole in one
        # call, with whatever follows it): _ahead[_lo:_hi] is the next frame's start.
        self._ahead = memoryview(bytearray(_AHEAD))
        self._lo = self._hi = 0
        self.most: int | None = None  # the largest frame the far side said it accepts
        self.sent = self.received = 0  # bytes of whole frames, each way, over its life

    def set_timeout(self, seconds: float | None) -> None:
        """How long one read or send may wait from now on (None: as long as it takes);
        one that waits longer raises TimeoutError. A setting already in force costs
        no syscall, and reads take theirs up as they begin."""
        self.timeout = seconds
        if not self._kernel:
            self.sock.settimeout(seconds)
            self._reading = self._sending = seconds
        elif seconds != self._sending:
            self._kernel_timeout(socket.SO_SNDTIMEO, seconds)
            self._sending = seconds

    def _bound_reads(self, seconds: float | None) -> None:
        """Bounds the next reads by ``seconds`` (a deadline's rest, or the timeout again)."""
        if not self._kernel:
            self.sock.settimeout(seconds)
        elif seconds != self._reading:
            self._kernel_timeout(socket.SO_RCVTIMEO, seconds)
        self._reading = seconds

    def _kernel_timeout(self, option: int, seconds: float | None) -> None:
        if seconds is None:
            value = _TIMEVAL.pack(0, 0)  # zero: no limit
        else:  # rounded up, so that a deadline a hair away is not read as none
            value = _TIMEVAL.pack(*divmod(max(1, math.ceil(seconds * 1e6)), 1_000_000))
        self.sock.setsockopt(socket.SOL_SOCKET, option, value)

    @property
    def duplex(self) -> bool:
        """Whether a send can read meanwhile (a plain socket; TLS cannot, here)."""
        return self._gather

    def send(self, kind: str, header: dict[str, Any] | None = None, buffers: Any = (),
             sealed: bool = False, reading: Any = None) -> int:
        """Sends one frame and returns how many bytes it took.

        ``reading``, on a ``duplex`` channel, is called whenever the socket will take no
        more and there is something to read: a peer that answers earlier requests
        while this one goes out then never waits for us to read. It answers False
        once there is nothing more it wants to read."""
        with self.lock:
            pieces = encode(kind, header, buffers, self.keyed, sealed, self.most)
            if reading is None or not self._gather:
                size = self._send_pieces(pieces)
            else:
                size = self._send_reading(pieces, reading)
            self.sent += size
            return size

    def send_if(self, kind: str, still: Any) -> bool:
        """Sends a frame with no header or buffers, if ``still()`` holds once no other
        send is under way (a heartbeat, which must never follow its slice's answer);
        answers whether it was sent."""
        with self.lock:
            if not still():
                return False
            self._send_pieces(encode(kind, None, [], self.keyed))
            return True

    def _send_reading(self, pieces: list[Any], reading: Any) -> int:
        sock, timeout = self.sock, self.timeout
        blocking = None if self._kernel else timeout  # what the socket goes back to
        total = sum(map(len, pieces))
        views = [memoryview(p) for p in pieces]
        poller = select.poll()
        wants = select.POLLOUT | select.POLLIN
        poller.register(sock, wants)
        sock.settimeout(0.0)
        try:
            while True:
                try:
                    views = _advance(views, sock.sendmsg(views[:_IOV_MAX]))
                except BlockingIOError:
                    pass
                if not views:
                    return total
                ready = poller.poll(None if timeout is None else timeout * 1000)
                if not ready:
                    raise TimeoutError("the peer took nothing and said nothing")
                if ready[0][1] & (select.POLLIN | select.POLLERR | select.POLLHUP) and wants & select.POLLIN:
                    sock.settimeout(blocking)
                    try:
                        more = reading()
                    finally:
                        sock.settimeout(0.0)
                    if more is False:
                        wants = select.POLLOUT
                        poller.modify(sock, wants)
        finally:
            sock.settimeout(blocking)

    def _send_pieces(self, pieces: list[Any]) -> int:
        """Sends what ``encode`` made (bytes, and byte views of the buffers)."""
        total = sum(map(len, pieces))  # a view's len is its nbytes: encode casts to bytes
        if not self._gather:
            for piece in pieces:
                self.sock.sendall(piece)
            return total
        try:
            sent = self.sock.sendmsg(pieces[:_IOV_MAX])
            if sent == total:  # a frame that fits the socket's buffer: nearly all of them
                return total
            views = _advance([memoryview(p) for p in pieces], sent)
            while views:
                views = _advance(views, self.sock.sendmsg(views[:_IOV_MAX]))
        except BlockingIOError:  # the kernel's send timeout passed
            raise TimeoutError("the peer took nothing within the timeout") from None
        return total

    def recv(self, limits: Limits | None = None, patient: bool = False,
             deadline: float | None = None, refusal_ok: bool = False) -> Frame:
        """Reads one whole frame, checked.

        Every read is bounded by the socket's timeout; a ``patient`` reader waits as
        long as it takes for a frame to start, and one with a ``deadline`` (a
        ``time.monotonic()``) is bounded by it in total, however the bytes trickle in.
        ``refusal_ok`` accepts a ``refused`` frame without a MAC on a connection that
        has a key, which is how a worker turns down a proof.
        """
        limits = limits or self.limits
        if self._hi - self._lo < PREFIX:
            self._refill(PREFIX, patient, deadline)
        began = time.perf_counter_ns()
        # The prefix and the header are checked where they lie when both came (nearly
        # always) rather than copied out first: two buffers and two calls fewer a frame.
        ahead, lo = self._ahead, self._lo
        prefix = ahead[lo:lo + PREFIX]
        self._lo = lo = lo + PREFIX
        flags, header_len, body_len, mac = split_prefix(prefix, limits)
        if self._hi - lo >= header_len:
            raw = ahead[lo:lo + header_len]
            self._lo = lo + header_len
        else:  # the rest of the header is read over what is ahead, the prefix too
            prefix = bytes(prefix)
            raw = self._receive(header_len, deadline)
        seq = check_header_mac(self.keyed, flags, prefix, raw, mac, refusal_ok)
        kind, head, sizes = read_header(raw, body_len, limits)
        if seq is None and self.keyed is not None and kind != "refused":
            raise ProtocolError(f"a {kind!r} frame without a MAC on an authenticated connection")
        prefix = raw = None
        buffers = []
        for size in sizes:
            buffers.append(self._receive(size, deadline, True))
        if buffers:  # the large ones are kept for the next frame to receive into
            self._spare = [b for b in buffers if len(b) >= _MAPPED] if body_len >= _MAPPED else []
        size = PREFIX + header_len + body_len
        sealed = bool(flags & SEALED)
        if sealed:
            trailer = bytearray(MAC_SIZE)
            self._fill(memoryview(trailer), deadline=deadline)
            check_seal(self.keyed, seq, mac, buffers, trailer)  # type: ignore[arg-type]
            size += MAC_SIZE
        self.received += size
        return Frame(kind, head, buffers, size, sealed, (time.perf_counter_ns() - began) // 1000)

    def _receive(self, size: int, deadline: float | None = None, reuse: bool = False) -> Any:
        """``size`` bytes off the socket, in memory committed only as they arrive."""
        lo = self._lo
        if self._hi - lo >= size:  # they came with an earlier read: most small frames
            self._lo = lo + size
            return bytearray(self._ahead[lo:lo + size])
        if size < _MAPPED:
            buffer = bytearray(size)
            self._fill(memoryview(buffer), deadline=deadline)
            return buffer
        space = self._reusable(size) if reuse else None
        fresh = space is None
        if fresh:
            space = mmap.mmap(-1, size, flags=_LAZY)
        with memoryview(space) as view:
            at = 0
            while at < size:
                end = min(size, max(_MAPPED, 2 * at))
                if fresh:
                    _commit(space, at, end)
                self._fill(view[at:end], deadline=deadline)
                at = end
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

    def _fill(self, view: memoryview, patient: bool = False, deadline: float | None = None) -> None:
        """Fills ``view`` with the next bytes: those read ahead, then the socket's."""
        size, lo = view.nbytes, self._lo
        got = min(size, self._hi - lo)
        if got:  # what came with an earlier read
            view[:got] = self._ahead[lo:lo + got]
            self._lo = lo + got
        rest = size - got
        if not rest:
            return
        if rest < _AHEAD:  # a small rest: read what is there, the next frame's too
            self._refill(rest, patient and not got, deadline)
            self._lo = rest
            view[got:] = self._ahead[:rest]
            return
        self._read(view[got:], patient and not got, deadline, need=rest)

    def _refill(self, need: int, patient: bool, deadline: float | None) -> None:
        """Reads until at least ``need`` bytes (at most ``_AHEAD``) are ahead, with
        whatever else is there; those already ahead are moved to the front first."""
        ahead, rest = self._ahead, self._hi - self._lo
        if rest:
            ahead[:rest] = ahead[self._lo:self._hi]
        self._lo, self._hi = 0, rest
        self._hi = rest + self._read(ahead[rest:], patient and not rest, deadline, need - rest)

    def _read(self, view: memoryview, patient: bool, deadline: float | None, need: int) -> int:
        """Reads at least ``need`` bytes into ``view`` (more if they are there and it has
        room); answers how many it read."""
        got = 0
        while got < need:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the deadline passed with {got} of {need} bytes read")
                self._bound_reads(left)
            elif self._reading != self.timeout:  # the first read, or one after a deadline
                self._bound_reads(self.timeout)
            try:
                n = self.sock.recv_into(view[got:])
            except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's timeout
                if patient and not got and deadline is None:  # an idle peer is not a silent one
                    continue
                raise TimeoutError(f"nothing came within the timeout ({got} of {need} bytes "
                                   "read)") from None
            if not n:
                raise Closed(f"the peer closed the connection ({got} of {need} bytes read)")
            got += n
        return got

    def idle_and_open(self) -> bool:
        """Whether nothing at all is waiting on an idle connection.

        Between requests the far side says nothing, so anything readable then is its
        end of the connection (a restarted worker) or garbage: either way not a
        connection to send on.
        """
        if self._lo < self._hi or isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        try:
            if self._poller is None:  # not select(): it refuses descriptors past 1024
                self._poller = select.poll()
                self._poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return not self._poller.poll(0)
        except (OSError, ValueError):
            return False

    def interrupt(self) -> None:
        """Wakes whoever reads or writes this connection, from any thread.

        The socket is shut down, not closed: its descriptor stays its reader's to
        close, so it cannot be handed to another connection while still being read.
        The plain socket's shutdown, even under TLS, since ``SSLSocket.shutdown``
        drops the TLS state its reader may be using.
        """
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.interrupt()
        self.sock.close()


def _commit(space: mmap.mmap, start: int, end: int) -> None:
    """Pre-faults ``space[start:end]`` where the kernel can; elsewhere the pages fault in
    as the bytes are copied, slower but the same."""
    global _POPULATE_WRITE
    if _POPULATE_WRITE is None:
        return
    try:
        space.madvise(_POPULATE_WRITE, start, end - start)
    except (OSError, ValueError, AttributeError):  # a kernel before 5.14 says EINVAL
        _POPULATE_WRITE = None


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
