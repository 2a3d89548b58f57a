"""The directory backend: a Store's objects and names as plain files on one filesystem.

Layout::

    objects/ab/ab12…ef   an object, named by its whole sha256 hex and fanned out by its
                         first two digits; read-only, never rewritten in place
    names/…              one JSON record per bound name (below)
    tmp/                 every file is written here first, then renamed (for claim,
                         hard-linked) into place, so objects/ and names/ only ever hold
                         whole files; a writer killed half-way leaves litter here only

A name becomes a path part by part. Lowercase ASCII letters, digits, ``.``, ``_`` and
``-`` stand for themselves; any other character is written as the ``%XX`` escapes of
its UTF-8 bytes. Escaping capitals keeps "A" and "a" apart on case-insensitive
filesystems, and escaping non-ASCII keeps any filesystem from folding two names into
one by Unicode normalisation. The last part gets the suffix ``.n`` (a file) and every
earlier part ``.d`` (a directory), so "a" is ``names/a.n`` and "a/b" is
``names/a.d/b.n``, side by side. An escaped part longer than 200 characters is cut
into 200-character pieces, each but the last a directory suffixed ``.c``, so that no
component passes the usual 255-byte limit. Decoding undoes the escapes and the
suffixes mark where parts end, so one name has one path and one path one name;
whatever in names/ is not the canonical path of a name (``.DS_Store``, ``A.n``) is
not a name and is skipped.

A 1024-character name escapes to as much as 12 KiB, more than the OS takes as a path
(macOS: 1 KiB), so no path handed to the OS here passes about 900 bytes: walking
down, an open directory becomes the new starting point (``dir_fd=``) whenever the
path from the last one would grow too long. That makes this backend POSIX-only.

``durable`` fsyncs each file before it is moved into place and its directory after,
so what was answered for survives a power cut; without it files are still whole, but
the last few written may be lost.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from .._errors import StoreError

__all__ = ["DirectoryBackend"]

_CHUNK = 200  # longest escaped piece of a part in one path component
_ROOM = _CHUNK + 3  # what one more component can add to a path ("/" + piece + suffix)
_LONG = 900  # longest path handed to the OS, in bytes
_MAX_WRITE = 1 << 30

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_READ = os.O_RDONLY | _CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC

_PLAIN = re.compile(r"[a-z0-9._\-]+").fullmatch
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def _escape(part: str) -> str:
    if _PLAIN(part):
        return part
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in part)


def _unescape(pending: str, stem: str) -> str | None:
    """The part a path component stands for, or None if it is not a canonical one."""
    if not 0 < len(stem) <= _CHUNK:
        return None
    escaped = pending + stem
    if _PLAIN(escaped):
        part = escaped
    else:
        try:
            part = unquote_to_bytes(escaped).decode()
        except UnicodeDecodeError:
            return None
        if "/" in part or _escape(part) != escaped:
            return None
    return None if part in (".", "..") else part


def _components(name: str, last: str) -> list[str]:
    """The path of ``name`` below names/, its final part with the suffix ``last``."""
    out = []
    parts = name.split("/")
    end = len(parts) - 1
    for i, part in enumerate(parts):
        escaped = _escape(part)
        while len(escaped) > _CHUNK:
            out.append(escaped[:_CHUNK] + ".c")
            escaped = escaped[_CHUNK:]
        out.append(escaped + (last if i == end else ".d"))
    return out


def _slurp(path: str, fd: int | None) -> bytes:
    handle = os.open(path, _READ, dir_fd=fd)
    try:
        chunks = []
        while chunk := os.read(handle, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(handle)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _entries(path: str, fd: int | None) -> list[tuple[str, bool]]:
    """What a directory holds, as ``(name, is_dir)``, read in one go."""
    if fd is None:
        with os.scandir(path) as it:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    handle = os.open(path, _DIR, dir_fd=fd)
    try:
        with os.scandir(handle) as it:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    finally:
        os.close(handle)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Anchor:
    """An open directory that deeper paths are taken from; closed when nothing uses it."""

    __slots__ = ("fd", "users")

    def __init__(self, fd: int, users: int = 0):
        self.fd, self.users = fd, users

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            os.close(self.fd)
            self.fd = -1


class DirectoryBackend:
    """Objects and names as files under one directory (see the module's docstring)."""

    def __init__(self, directory: Any, durable: bool = True):
        if not isinstance(directory, (str, bytes, os.PathLike)):
            raise TypeError(f"a store's directory is a path, not a {type(directory).__qualname__}")
        where = os.path.abspath(os.fsdecode(directory))
        self.where = where
        self.durable = bool(durable)
        self._objects = os.path.join(where, "objects")
        self._names = os.path.join(where, "names")
        self._tmp = os.path.join(where, "tmp")
        self._names_size = len(os.fsencode(self._names))
        try:
            if os.path.exists(where) and not os.path.isdir(where):
                raise NotADirectoryError(errno.ENOTDIR, "it is there but it is not a directory")
            for path in (self._objects, self._names, self._tmp):
                os.makedirs(path, exist_ok=True)
            probe = f"{self._tmp}/{os.getpid()}-{os.urandom(8).hex()}.probe"
            os.close(os.open(probe, _CREATE, 0o600))
            os.unlink(probe)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.filename and os.fsdecode(exc.filename) != where:
                why = f"{why} ({os.fsdecode(exc.filename)})"
            raise StoreError(
                f"cannot keep a store in {where}: {why}; give a directory that can be "
                "created and written, or whose parents are directories"
            ) from exc

    def __repr__(self) -> str:
        return f"DirectoryBackend({self.where!r}, durable={self.durable})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.durable))

    # -- objects

    def object_at(self, hexdigest: str) -> str:
        return f"{self._objects}/{hexdigest[:2]}/{hexdigest}"

    def has_object(self, hexdigest: str) -> bool:
        try:
            os.stat(self.object_at(hexdigest))
        except FileNotFoundError:
            return False
        return True

    def read_object(self, hexdigest: str) -> bytes | None:
        try:
            with open(self.object_at(hexdigest), "rb", buffering=0) as handle:
                return handle.readall()
        except FileNotFoundError:
            return None

    def write_object(self, hexdigest: str, data: memoryview) -> None:
        final = self.object_at(hexdigest)
        folder = os.path.dirname(final)
        tmp = self._temp(data, 0o444)
        try:
            try:
                os.replace(tmp, final)
            except FileNotFoundError:
                self._mkdir(folder, None)
                os.replace(tmp, final)
        except BaseException:
            _discard(tmp)
            raise
        if self.durable:
            self._sync(folder, None)

    # -- names

    def read_name(self, name: str) -> bytes | None:
        try:
            return self._at(name, False, lambda leaf, fd, folder: _slurp(leaf, fd))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_name(self, name: str, record: bytes) -> None:
        tmp = self._temp(memoryview(record), 0o644)

        def place(leaf: str, fd: int | None, folder: str) -> None:
            os.replace(tmp, leaf, dst_dir_fd=fd)
            if self.durable:
                self._sync(folder, fd)

        try:
            self._make(name, place)
        except BaseException:
            _discard(tmp)
            raise

    def claim_name(self, name: str, record: bytes) -> bool:
        tmp = self._temp(memoryview(record), 0o644)

        def link(leaf: str, fd: int | None, folder: str) -> bool:
            try:
                os.link(tmp, leaf, dst_dir_fd=fd)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno in _NO_LINKS:
                    raise StoreError(
                        f"cannot claim {name!r} in {self.where}: {exc.strerror}; claiming "
                        "needs hard links, which this filesystem refuses — keep the store "
                        "on a local filesystem (ext4, xfs, apfs)"
                    ) from exc
                raise
            if self.durable:
                self._sync(folder, fd)
            return True

        try:
            return self._make(name, link)
        finally:
            _discard(tmp)

    def list_names(self, prefix: str | None) -> list[tuple[str, bytes]]:
        found: list[tuple[str, bytes]] = []
        if prefix is None:
            start, parts = [], ()
        else:
            record = self.read_name(prefix)
            if record is not None:
                found.append((prefix, record))
            start, parts = _components(prefix, ".d"), tuple(prefix.split("/"))
        try:
            fd, path, size = self._reach(start, False)
        except (FileNotFoundError, NotADirectoryError):
            return found
        self._walk(None if fd is None else _Anchor(fd, 1), path, size, parts, found)
        return found

    # -- inside

    def _walk(self, root: _Anchor | None, path: str, size: int, parts: tuple[str, ...],
              found: list[tuple[str, bytes]]) -> None:
        """Adds every record below ``path`` to ``found``, depth first, without recursion."""
        stack = [(root, path, size, parts, "")]
        opened = [root] if root is not None else []
        try:
            while stack:
                anchor, path, size, parts, pending = stack.pop()
                fd = None if anchor is None else anchor.fd
                try:
                    entries = _entries(path, fd)
                except (FileNotFoundError, NotADirectoryError):
                    entries = []
                deeper = None  # an anchor at ``path``, opened if a child's path gets long
                for entry, is_dir in entries:
                    stem, suffix = entry[:-2], entry[-2:]
                    if not is_dir:
                        part = _unescape(pending, stem) if suffix == ".n" else None
                        if part is not None:
                            try:
                                record = _slurp(f"{path}/{entry}", fd)
                            except FileNotFoundError:
                                continue
                            found.append(("/".join(parts + (part,)), record))
                        continue
                    if suffix == ".c":
                        if len(stem) != _CHUNK:
                            continue
                        below, carry = parts, pending + stem
                    elif suffix == ".d":
                        part = _unescape(pending, stem)
                        if part is None:
                            continue
                        below, carry = parts + (part,), ""
                    else:
                        continue
                    if size + 1 + len(entry) + _ROOM <= _LONG:
                        if anchor is not None:
                            anchor.users += 1
                        stack.append((anchor, f"{path}/{entry}", size + 1 + len(entry),
                                      below, carry))
                        continue
                    if deeper is None:
                        deeper = _Anchor(os.open(path, _DIR, dir_fd=fd))
                        opened.append(deeper)
                    deeper.users += 1
                    stack.append((deeper, entry, len(entry), below, carry))
                if anchor is not None:
                    anchor.release()
        finally:  # only an error leaves any open
            for anchor in opened:
                if anchor.fd != -1:
                    os.close(anchor.fd)
                    anchor.fd = -1

    def _reach(self, dirs: list[str], create: bool) -> tuple[int | None, str, int]:
        """The directory below names/ made of ``dirs``, as ``(fd, path, bytes in path)``.

        ``fd`` is None and ``path`` absolute, or ``fd`` is a directory the caller closes
        and ``path`` is relative to it; either way ``path`` leaves room for one more
        component. With ``create``, missing directories are made on the way.
        """
        fd, path, size = None, self._names, self._names_size
        try:
            for component in dirs:
                if size + 1 + len(component) + _ROOM > _LONG:
                    opened = os.open(path, _DIR, dir_fd=fd)
                    if fd is not None:
                        os.close(fd)
                    fd, path, size = opened, component, len(component)
                else:
                    path, size = f"{path}/{component}", size + 1 + len(component)
                if create:
                    self._mkdir(path, fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return fd, path, size

    def _at(self, name: str, create: bool, act: Callable[[str, int | None, str], Any]) -> Any:
        *dirs, leaf = _components(name, ".n")
        fd, folder, _ = self._reach(dirs, create)
        try:
            return act(f"{folder}/{leaf}", fd, folder)
        finally:
            if fd is not None:
                os.close(fd)

    def _make(self, name: str, act: Callable[[str, int | None, str], Any]) -> Any:
        """``act`` on the name's file, making its directories if they are missing."""
        try:
            return self._at(name, False, act)
        except FileNotFoundError:
            return self._at(name, True, act)

    def _temp(self, data: memoryview, mode: int) -> str:
        """A new file in tmp/ holding ``data`` (fsynced when durable); answers its path."""
        path = f"{self._tmp}/{os.getpid()}-{os.urandom(8).hex()}"
        handle = os.open(path, _CREATE, mode)
        try:
            try:
                while data:
                    data = data[os.write(handle, data[:_MAX_WRITE]):]
                if self.durable:
                    os.fsync(handle)
            finally:
                os.close(handle)
        except BaseException:
            _discard(path)
            raise
        return path

    def _mkdir(self, path: str, fd: int | None) -> None:
        try:
            os.mkdir(path, dir_fd=fd)
        except FileExistsError:
            return
        if self.durable:
            self._sync(os.path.dirname(path), fd)

    def _sync(self, folder: str, fd: int | None) -> None:
        """fsyncs a directory, so that what was just renamed or linked into it stays."""
        if not folder:
            os.fsync(fd)
            return
        handle = os.open(folder, _DIR, dir_fd=fd)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
