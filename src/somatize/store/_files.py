"""Files read and listed without following a link, and what dead writers leave behind.

The directory store's own I/O, below the layout: the flags every open uses, one whole
file read from an open descriptor, ``openat2`` where Linux has it, and the sweep of
tmp/. Nothing here knows names or digests.
"""

from __future__ import annotations

import errno
import os
import platform
import re
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ABSENT", "CREATE", "DIR", "HOST", "LINKED", "MAX_WRITE", "READ", "READ_ONLY", "TOP", "Anchor",
           "Odd", "discard", "drain", "slurp", "strict_opener", "sweep"]

MAX_WRITE = 1 << 30
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TOP = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC  # names/ itself
DIR = TOP | os.O_NOFOLLOW  # any directory below names/ or objects/
# O_NONBLOCK so that a fifo planted as a record cannot make a reader wait forever.
READ = os.O_RDONLY | _CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
LINKED = {errno.ELOOP, errno.EMLINK}  # what O_NOFOLLOW answers for a link (EMLINK: BSD)
ABSENT = (errno.ENOENT, errno.ENOTDIR)  # not there, or a file where a directory would be
#: This machine, as the names of temp files say it: whose pids they are.
HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
# openat2's number where the kernel uses the generic table of system calls.
_OPENAT2 = 437 if platform.machine() in (
    "x86_64", "aarch64", "arm64", "armv7l", "armv8l", "riscv64", "ppc64le", "s390x") else None


class Odd(OSError):
    """A symbolic link, or something else that is not a plain file, where a store keeps
    its files; ``path`` is where, below the store."""

    def __init__(self, what: str, path: str):
        super().__init__(errno.ELOOP, what, path)
        self.what, self.path = what, path

    def __reduce__(self) -> tuple[Any, ...]:  # pickle's default passes OSError's arguments
        return Odd, (self.what, self.path)


def strict_opener() -> Callable[[bytes], int] | None:
    """``openat2(path, RESOLVE_NO_SYMLINKS)`` as a function answering a descriptor, or
    minus the errno where it fails (no exception: a miss is common, and raising one
    from Python would cost more than the call); None where the kernel (or a seccomp
    filter) does not offer it."""
    if sys.platform != "linux" or _OPENAT2 is None:
        return None
    import ctypes  # here, not at the top: 6 ms that only a directory store needs

    class How(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                    ("resolve", ctypes.c_uint64)]

    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                     ctypes.c_size_t]
    how = How(READ, 0, 0x04)  # RESOLVE_NO_SYMLINKS
    where, size, here = ctypes.byref(how), ctypes.sizeof(how), -100  # AT_FDCWD
    errno_now = ctypes.get_errno

    def opened(path: bytes) -> int:
        fd = call(_OPENAT2, here, path, where, size)
        return fd if fd >= 0 else -errno_now()

    fd = opened(b"/")
    if fd < 0:
        return None
    os.close(fd)
    return opened


def slurp(path: str, fd: int | None, shown: str) -> bytes:
    """The whole of a file that is never rewritten in place; ``Odd`` if it is a link
    or not a plain file (``shown`` says where, for the message)."""
    try:
        handle = os.open(path, READ, dir_fd=fd)
    except OSError as exc:
        if exc.errno in LINKED:
            raise Odd("a symbolic link", shown) from None
        raise
    return drain(handle, shown)


def drain(handle: int, shown: str) -> bytes:
    """What ``slurp`` reads from the file once it is open; closes it."""
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):
            raise Odd("not a plain file", shown)
        size = status.st_size
        data = os.read(handle, size) if size < MAX_WRITE else b""
        if len(data) == size:  # nearly always: what follows is for giant files
            return data
        chunks, have = [data], len(data)
        while have < size:
            chunk = os.read(handle, min(size - have, MAX_WRITE))
            if not chunk:
                break
            chunks.append(chunk)
            have += len(chunk)
    finally:
        os.close(handle)
    return b"".join(chunks)


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process: alive
        return True
    return True


class Anchor:
    """An open directory still to be descended from; closed when nothing uses it."""

    __slots__ = ("fd", "users")

    def __init__(self, fd: int):
        self.fd, self.users = fd, 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.fd != -1:
            os.close(self.fd)
            self.fd = -1


def sweep(tmp: str, stale_after: float) -> None:
    """Removes from ``tmp`` the files older than ``stale_after`` seconds, except those of
    a process of this machine that is still alive: stalled, not dead, it may still
    rename its file. Stops at the first it may not remove (a read-only store)."""
    try:
        entries = os.scandir(tmp)
    except OSError:
        return
    oldest = time.time() - stale_after
    with entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) or \
                        entry.stat(follow_symlinks=False).st_mtime > oldest:
                    continue
            except OSError:
                continue
            host, _, rest = entry.name.partition("-")
            pid = rest.partition("-")[0]
            if host == HOST and pid.isdigit() and _alive(int(pid)):
                continue
            try:
                os.unlink(entry.path)
            except OSError as exc:
                if exc.errno in READ_ONLY:
                    return
