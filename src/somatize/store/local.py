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

Below names/ and objects/ a symbolic link is never followed, neither to read nor to
write. Every directory is opened on its own, relative to the one above it and with
``O_NOFOLLOW``, and so is every file, so no path handed to the OS is longer than one
component either (a 1024-character name escapes to as much as 12 KiB, more than any OS
takes as a path). Reading one object or one record, which a cache hit does twice, is
one ``openat2`` with ``RESOLVE_NO_SYMLINKS`` where Linux has it (5.6 on), on the
store's real path: the kernel refuses a link anywhere on the way, for the price of a
plain open. A link where a record would be is reported, not read; where an object
would be, it is not that object. That makes this backend POSIX-only.

Opening writes nothing, so a store on a read-only mount or owned by somebody else
can be read; a write to it is refused, saying so. Opening also removes what writers
that died left in tmp/: files older than ``STALE_AFTER`` seconds, except those of a
process of this machine that is still alive.

``durable`` fsyncs each file before it is moved into place and its directory after,
so what was answered for survives a power cut; without it files are still whole, but
the last few written may be lost.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import stat
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from .._errors import StoreError
from ._files import (ABSENT, CREATE, DIR, HOST, LINKED, MAX_WRITE, READ, READ_ONLY, TOP,
                     Anchor, Odd, discard, drain, slurp, strict_opener, sweep)

__all__ = ["STALE_AFTER", "DirectoryBackend", "translated"]

#: Seconds after which a file in tmp/ is taken for a dead writer's and removed. A live
#: writer touches its file with every write it makes, so only one that has stalled
#: for this long could lose its file (and it would then fail, never write a wrong one).
STALE_AFTER = 3600.0

_CHUNK = 200  # longest escaped piece of a part in one path component
_PLAIN = re.compile(r"[a-z0-9._\-]+").fullmatch
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}
_FAST_PATH = 4000  # bytes: longest path given to openat2, under Linux's PATH_MAX
_PIECE = 1 << 20  # what holds() reads at a time: small enough to stay in a cache
# Temp files are host-pid-<random><count>: the pid tells a dead writer's, the random
# part one process from another that had its pid before, the count one file from the
# next without asking the OS for randomness per file.
_ONCE, _TEMPS = os.urandom(4).hex(), itertools.count()


def translated(where: str, action: str, call: Callable[..., Any], *args: Any,
               writing: bool = False) -> Any:
    """``call(*args)``, with the ``OSError`` it may raise turned into a ``StoreError``
    that says what could not be done (``action.format(*args)``), where, and what to do;
    a ``StoreError`` passes as it is. A write refused for want of permission says the
    store is read-only.

    The one place a Store turns a backend's failures into its own. A function and not
    a context manager: it is on the path of every cache hit, where a ``with`` would
    cost more than the rest of the bookkeeping.
    """
    try:
        return call(*args)
    except StoreError:
        raise
    except OSError as exc:
        raise failed(where, action.format(*args), exc, writing) from exc


def failed(where: str, action: str, exc: OSError, writing: bool = False) -> StoreError:
    """The ``StoreError`` for an ``OSError`` met while trying to ``action`` in ``where``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if writing and exc.errno in READ_ONLY:
        on = f" ({os.fsdecode(exc.filename)})" if exc.filename else ""
        return StoreError(
            f"could not {action}: the store at {where} is read-only to this process "
            f"({reason}{on}); reading it works — to write, open a store you may write "
            "(a copy of this one will do), or get write access to it")
    return StoreError(f"could not {action} in {where}: {reason}; check that it is "
                      "reachable, writable and not full")


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


_strict: list[Callable[[bytes], int] | None] = []  # found on first use, once per process


class DirectoryBackend:
    """Objects and names as files under one directory (see the module's docstring).

    ``stale_after`` is how old, in seconds, a file in tmp/ must be before opening takes
    it for a dead writer's; the default is ``STALE_AFTER``, an hour.
    """

    def __init__(self, directory: Any, durable: bool = True, *,
                 stale_after: float = STALE_AFTER):
        if not isinstance(directory, (str, bytes, os.PathLike)):
            raise TypeError(f"a store's directory is a path, not a {type(directory).__qualname__}")
        if isinstance(stale_after, bool) or not isinstance(stale_after, (int, float)) \
                or not stale_after > 0:
            raise ValueError(f"stale_after={stale_after!r} is refused: it is a positive "
                             "number of seconds")
        where = os.path.abspath(os.fsdecode(directory))
        self.where = where
        self.durable = bool(durable)
        self.stale_after = float(stale_after)
        self._objects = os.path.join(where, "objects")
        self._names = os.path.join(where, "names")
        self._tmp = os.path.join(where, "tmp")
        self._unwritable: OSError | None = None  # why tmp/ could not be made, if it was not
        if not _strict:
            _strict.append(strict_opener())
        self._open = _strict[0]
        try:
            if os.path.exists(where) and not os.path.isdir(where):
                raise NotADirectoryError(errno.ENOTDIR, "it is there but it is not a directory")
            self._lay_out()
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.filename and os.fsdecode(exc.filename) != where:
                why = f"{why} ({os.fsdecode(exc.filename)})"
            raise StoreError(
                f"cannot keep a store in {where}: {why}; give a directory that can be "
                "created and written, or whose parents are directories"
            ) from exc
        # The fast reads refuse a link anywhere on the path, so they start from one with
        # none: links above the store are the user's own, and resolved once, here.
        real = os.path.realpath(where)
        self._fast_objects, self._fast_names = f"{real}/objects/", f"{real}/names/"
        sweep(self._tmp, self.stale_after)

    def __repr__(self) -> str:
        return f"DirectoryBackend({self.where!r}, durable={self.durable})"

    def __reduce__(self) -> tuple[Any, ...]:
        if self.stale_after == STALE_AFTER:
            return (type(self), (self.where, self.durable))
        return (_reopened, (type(self), self.where, self.durable, self.stale_after))

    # -- objects

    def object_at(self, hexdigest: str) -> str:
        return f"{self._objects}/{hexdigest[:2]}/{hexdigest}"

    def has_object(self, hexdigest: str) -> bool:
        try:
            fd = self._down(self._objects, [hexdigest[:2]], False, "objects")
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            status = os.stat(hexdigest, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return stat.S_ISREG(status.st_mode)  # a link there is not the object

    def read_object(self, hexdigest: str) -> bytes | None:
        handle = self._object(hexdigest)
        if handle is None:
            return None
        try:
            return drain(handle, "")
        except Odd:  # not a plain file: not the object
            return None

    def holds(self, hexdigest: str, data: memoryview) -> bool:
        """Whether the object kept under this digest is exactly ``data``: compared a
        piece at a time, so that checking a large object needs no second copy of it."""
        handle = self._object(hexdigest)
        if handle is None:
            return False
        try:
            status = os.fstat(handle)
            if not stat.S_ISREG(status.st_mode) or status.st_size != data.nbytes:
                return False
            whole = data.obj if type(data.obj) is bytes and len(data.obj) == data.nbytes \
                else None
            at = 0
            while piece := os.read(handle, _PIECE):
                end = at + len(piece)
                if piece != (whole[at:end] if whole is not None else data[at:end].tobytes()):
                    return False
                at = end
            return at == data.nbytes
        finally:
            os.close(handle)

    def _object(self, hexdigest: str) -> int | None:
        """The object's file, open (without following a link), or None if it is not there."""
        if self._open is not None:
            path = f"{self._fast_objects}{hexdigest[:2]}/{hexdigest}"
            handle = self._open(path.encode())
            if handle >= 0:
                return handle
            if -handle in ABSENT:
                return None
            if -handle not in LINKED:
                raise OSError(-handle, os.strerror(-handle), path)
            # a link on the way: the walk below says which, and what it means
        try:
            fd = self._down(self._objects, [hexdigest[:2]], False, "objects")
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.open(hexdigest, READ, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in LINKED:  # a link there is not the object
                return None
            raise
        finally:
            os.close(fd)

    def write_object(self, hexdigest: str, data: memoryview) -> None:
        tmp = self._temp(data, 0o444)
        try:
            fd = self._down(self._objects, [hexdigest[:2]], True, "objects")
            try:
                os.replace(tmp, hexdigest, dst_dir_fd=fd)  # over a planted link, not through it
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            discard(tmp)
            raise

    # -- names

    def read_name(self, name: str) -> bytes | None:
        if self._open is not None:
            path = self._fast_names + "/".join(_components(name, ".n"))
            if len(path) < _FAST_PATH:  # only ASCII is below: characters are bytes
                handle = self._open(path.encode())
                if handle >= 0:
                    try:
                        return drain(handle, "")
                    except Odd as odd:
                        odd = Odd(odd.what, "names/" + "/".join(_components(name, ".n")))
                        raise self._odd(odd) from None
                if -handle in ABSENT:
                    return None
                if -handle not in LINKED:
                    raise OSError(-handle, os.strerror(-handle), path)
                # a link on the way: the walk below says which
        try:
            return self._at(name, False, lambda leaf, fd, shown: slurp(leaf, fd, shown))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Odd as odd:
            raise self._odd(odd) from None

    def write_name(self, name: str, record: bytes) -> None:
        tmp = self._temp(memoryview(record), 0o644)

        def place(leaf: str, fd: int | None, shown: str) -> None:
            os.replace(tmp, leaf, dst_dir_fd=fd)
            if self.durable:
                self._sync(fd)

        try:
            self._at(name, True, place)
        except BaseException:
            discard(tmp)
            raise

    def claim_name(self, name: str, record: bytes) -> bool:
        tmp = self._temp(memoryview(record), 0o644)

        def link(leaf: str, fd: int | None, shown: str) -> bool:
            try:
                os.link(tmp, leaf, dst_dir_fd=fd)
            except FileExistsError:
                if stat.S_ISLNK(os.stat(leaf, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise self._odd(Odd("a symbolic link", shown)) from None
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
                self._sync(fd)
            return True

        try:
            return self._at(name, True, link)
        finally:
            discard(tmp)

    def list_names(self, prefix: str | None) -> list[tuple[str, bytes | OSError]]:
        """Every record below names/; one that is there but cannot be read comes as the
        ``OSError`` that says why, in place of its bytes."""
        found: list[tuple[str, bytes | OSError]] = []
        if prefix is None:
            dirs, parts = [], ()
        else:
            try:
                record = self.read_name(prefix)
            except OSError as exc:
                record = exc
            if record is not None:
                found.append((prefix, record))
            dirs, parts = _components(prefix, ".d"), tuple(prefix.split("/"))
        try:
            fd = self._down(self._names, dirs, False, "names")
            if fd is None:
                fd = os.open(self._names, TOP)
        except (FileNotFoundError, NotADirectoryError):
            return found
        except StoreError as exc:  # the prefix's own directory is a link
            found.append((prefix or "", exc))
            return found
        self._walk(fd, parts, "names/" + "/".join(dirs) if dirs else "names", found)
        return found

    # -- inside

    def _walk(self, top: int, parts: tuple[str, ...], shown: str,
              found: list[tuple[str, bytes | OSError]]) -> None:
        """Adds every record below the open directory ``top`` to ``found``, depth first,
        without recursion; closes ``top``. Holds one descriptor per level still to be
        gone back to, never one per directory."""
        anchor = Anchor(top)
        stack: list[tuple[Anchor, str, tuple[str, ...], str, str]] = []
        try:
            self._list(anchor, parts, "", shown, stack, found)
            while stack:
                parent, entry, below, carry, shown = stack.pop()
                try:
                    fd = os.open(entry, DIR, dir_fd=parent.fd)
                except FileNotFoundError:  # removed since it was listed
                    fd = -1
                except OSError as exc:  # swapped for a link or a file since it was listed
                    fd = -1
                    if isinstance(exc, NotADirectoryError):
                        exc = self._odd(Odd("no longer a directory", shown))
                    found.append(("/".join(below), exc))
                parent.release()
                if fd != -1:
                    anchor = Anchor(fd)
                    self._list(anchor, below, carry, shown, stack, found)
        finally:  # only an error leaves any open
            for held in {id(a): a for a in [anchor, *(item[0] for item in stack)]}.values():
                if held.fd != -1:
                    os.close(held.fd)
                    held.fd = -1

    def _list(self, anchor: Anchor, parts: tuple[str, ...], pending: str, shown: str,
              stack: list[tuple[Anchor, str, tuple[str, ...], str, str]],
              found: list[tuple[str, bytes | OSError]]) -> None:
        """Reads the records in one open directory and stacks the directories in it."""
        fd = anchor.fd
        with os.scandir(fd) as entries:
            listed = [(e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in entries]
        for entry, is_dir, is_link in listed:
            stem, suffix = entry[:-2], entry[-2:]
            if suffix == ".n" and not is_dir:
                part = _unescape(pending, stem)
                if part is not None:
                    name = "/".join(parts + (part,))
                    try:
                        found.append((name, slurp(entry, fd, f"{shown}/{entry}")))
                    except FileNotFoundError:  # unbound since it was listed
                        pass
                    except Odd as odd:
                        found.append((name, self._odd(odd)))
                    except OSError as exc:
                        found.append((name, exc))
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
            if is_link:
                found.append(("/".join(below), self._odd(Odd("a symbolic link",
                                                              f"{shown}/{entry}"))))
            elif is_dir:
                anchor.users += 1
                stack.append((anchor, entry, below, carry, f"{shown}/{entry}"))
        if anchor.users == 0:
            anchor.release()

    def _down(self, root: str, dirs: list[str], create: bool, shown: str) -> int | None:
        """The directory ``root/dirs...``, opened one component at a time without
        following a link; None when ``dirs`` is empty. With ``create``, missing
        directories are made on the way. The caller closes what it gets."""
        fd = None
        try:
            for component in dirs:
                path = component if fd is not None else f"{root}/{component}"
                shown = f"{shown}/{component}"
                try:
                    opened = os.open(path, DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    self._mkdir(path, fd)
                    opened = os.open(path, DIR, dir_fd=fd)
                except NotADirectoryError:
                    if stat.S_ISLNK(os.stat(path, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise self._odd(Odd("a symbolic link", shown)) from None
                    raise
                if fd is not None:
                    os.close(fd)
                fd = opened
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return fd

    def _at(self, name: str, create: bool, act: Callable[[str, int | None, str], Any]) -> Any:
        """``act(leaf, fd, shown)`` on the name's file: ``leaf`` relative to the open
        directory ``fd`` (or absolute, with ``fd`` None), ``shown`` its path for messages."""
        *dirs, leaf = _components(name, ".n")
        fd = self._down(self._names, dirs, create, "names")
        shown = "/".join(("names", *dirs, leaf))
        try:
            return act(f"{self._names}/{leaf}" if fd is None else leaf, fd, shown)
        finally:
            if fd is not None:
                os.close(fd)

    def _odd(self, odd: Odd) -> StoreError:
        return StoreError(
            f"{odd.path} in the store at {self.where} is {odd.what}, which a store never "
            "reads or writes through (it could lead anywhere); remove it — whoever put "
            "it there can write to the store")

    def _temp(self, data: memoryview, mode: int) -> str:
        """A new file in tmp/ holding ``data`` (fsynced when durable); answers its path."""
        if self._unwritable is not None:
            raise OSError(self._unwritable.errno, self._unwritable.strerror, self._tmp)
        path = f"{self._tmp}/{HOST}-{os.getpid()}-{_ONCE}{next(_TEMPS)}"
        handle = os.open(path, CREATE, mode)
        try:
            try:
                while data:
                    data = data[os.write(handle, data[:MAX_WRITE]):]
                if self.durable:
                    os.fsync(handle)
            finally:
                os.close(handle)
        except BaseException:
            discard(path)
            raise
        return path

    def _mkdir(self, path: str, fd: int | None) -> None:
        try:
            os.mkdir(path, dir_fd=fd)
        except FileExistsError:
            return
        if self.durable:
            if fd is None:
                self._sync(None, os.path.dirname(path))
            else:
                self._sync(fd)

    def _sync(self, fd: int | None, folder: str | None = None) -> None:
        """fsyncs a directory, so that what was just renamed or linked into it stays;
        the open one ``fd``, or else names/ (or ``folder``)."""
        if fd is not None:
            os.fsync(fd)
            return
        handle = os.open(folder or self._names, TOP)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)

    # -- opening

    def _lay_out(self) -> None:
        """Makes the directories that are missing; writes nothing when all are there.

        A store that has objects/ and names/ but where tmp/ cannot be made is opened
        all the same: it can be read, and a write will say why it cannot be.
        """
        for path in (self._objects, self._names, self._tmp):
            if os.path.isdir(path):
                continue
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                if not (path == self._tmp and exc.errno in READ_ONLY
                        and os.path.isdir(self._objects) and os.path.isdir(self._names)):
                    raise
                self._unwritable = exc

def _reopened(kind: type, where: str, durable: bool, stale_after: float) -> DirectoryBackend:
    return kind(where, durable, stale_after=stale_after)
