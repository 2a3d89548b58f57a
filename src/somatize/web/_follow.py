"""A store read and never written, kept current by reading only what changed.

``Following(store)`` answers what the record's readers ask of a store (``bound``,
``resolve``, ``get``, ``where``) from what it has read already, and has no method that
writes: whatever draws a page over it cannot change the store, even by mistake.

It catches up two ways. ``scan`` lists every run's names: the only way to learn of a
new run, and the costly one (a name read per batch of forwards), so it runs at most
every ``SCAN_EVERY`` seconds, and never more than a tenth of the time. ``follow(run)``
asks for the name after a run's last forward, and the one after that batch, until one
is missing, then for the binding that held the previous last forward again (a Recorder
writes a batch again when its last forward heard more after it was written), so a run
that grew by three batches costs six name reads, whatever its length (the store answers
the missing name by reading the batch before it, which a batch bound again may have
grown into; it is told where the batches begin, so it lists nothing). Names
are never unbound, so what was read stays true until it is bound again. Objects are
kept by digest, whose bytes never change, up to ``keep_bytes``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from ..record._read import batches_begin, forwards_of
from ..record._recorder import EACH

__all__ = ["Following"]

SCAN_EVERY = 2.0  # seconds between two scans of every run, at least
SCAN_SHARE = 10  # ...and at least this many times what the last scan took
FOLLOW_EVERY = 0.4  # seconds between two looks at one run's newest names
PROBES = 64  # names asked one at a time before listing the run whole instead
KEEP_BYTES = 128 << 20  # objects kept, the least recently read going first


def _forward(name: str) -> tuple[str, int] | None:
    """``(run, i)`` for a name ``run/<run>/<i>``, else None."""
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "run" and parts[2].isdigit() and parts[2].isascii():
        return parts[1], int(parts[2])
    return None


class _Run:
    """What has been read of one run: its bindings as the store has them (a batch of
    forwards under the index of its first), and each forward's, by index."""

    __slots__ = ("bounds", "followed_at", "last", "last_at", "listing", "lock", "log", "raw",
                 "version")

    def __init__(self) -> None:
        self.raw: dict[int, Any] = {}  # the bindings, by the index they are bound at
        self.bounds: dict[int, Any] = {}  # each forward's, by its index
        self.last = -1  # the highest index read
        self.last_at = -1  # the index of the binding that holds it (a batch's first)
        self.version = 0  # counts the changes, so a reader can tell that nothing moved
        self.log: list[int] = []  # the index each change was to: change v is log[v - 1]
        self.listing: list[Any] | None = None  # the bindings sorted by name, as Store.bound answers
        self.followed_at = 0.0
        self.lock = threading.Lock()  # one look at the newest names at a time

    def took(self, at: int, bound: Any) -> None:
        """Takes in one binding of the run, bound at ``at``: each forward it holds."""
        had = self.raw.get(at)
        if had is not None and had.when > bound.when:
            return
        if had != bound:
            self.raw[at] = bound
            self.listing = None
        for index, one in forwards_of(bound, at):
            if self.take(index, one) and index == self.last:
                self.last_at = at

    def take(self, index: int, bound: Any) -> bool:
        had = self.bounds.get(index)
        if had is not None and (had == bound or had.when > bound.when):  # meta may change alone
            return False
        self.bounds[index] = bound
        self.last = max(self.last, index)
        self.version += 1
        self.log.append(index)
        return True


class Following:
    """A store as the record's readers see it, read once and then only where it grew.

    Hand it to ``somatize.record`` and ``somatize.health`` in place of the store. It
    answers from what it has read; ``scan`` and ``follow`` bring that up to date.
    """

    def __init__(self, store: Any, *, keep_bytes: int = KEEP_BYTES):
        for method in ("bound", "resolve", "get"):
            if not callable(getattr(store, method, None)):
                raise TypeError(f"Following reads a Store, not a {type(store).__qualname__} "
                                f"(it has no {method}())")
        self._store = store
        self.where = str(getattr(store, "where", store))
        self._lock = threading.Lock()  # guards the dicts below; never held while reading the store
        self._runs: dict[str, _Run] = {}
        self._scanning = threading.Lock()
        self._scanned_at: float | None = None
        self._scan_took = 0.0
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._kept = 0
        self._keep = keep_bytes

    def __repr__(self) -> str:
        return f"Following({self.where!r}, runs={len(self._runs)})"

    # -- what the readers ask ----------------------------------------------------------
    def bound(self, prefix: str | None = None) -> list[Any]:
        """Every binding under ``prefix``, sorted by name, as a Store answers it; a run's
        and every run's from what was read, anything else from the store."""
        if prefix == "run":
            self._scanned()
            with self._lock:
                runs = list(self._runs.values())
            return sorted((b for run in runs for b in self._listing(run)), key=_name)
        parts = prefix.split("/") if isinstance(prefix, str) else []
        if len(parts) == 2 and parts[0] == "run":
            run = self._known(parts[1])
            return [] if run is None else list(self._listing(run))
        return self._store.bound(prefix)

    def resolve(self, name: str) -> Any:
        """What ``name`` is bound to: a forward of a known run from what was read."""
        found = _forward(name) if isinstance(name, str) else None
        if found is not None:
            run = self._known(found[0])
            if run is not None:
                with self._lock:
                    # a batch's binding under its first index; a forward inside one, as
                    # the store answers it too (the batch's part that is this forward)
                    bound = run.raw.get(found[1]) or run.bounds.get(found[1])
                if bound is not None:
                    return bound
        return self._store.resolve(name)

    def get(self, digest: str) -> bytes | None:
        """The bytes under ``digest``, read from the store once while there is room."""
        with self._lock:
            data = self._objects.get(digest)
            if data is not None:
                self._objects.move_to_end(digest)
                return data
        data = self._store.get(digest)
        if data is not None and len(data) <= self._keep // 8:
            with self._lock:
                if digest not in self._objects:
                    self._objects[digest] = data
                    self._kept += len(data)
                while self._kept > self._keep:
                    _, dropped = self._objects.popitem(last=False)
                    self._kept -= len(dropped)
        return data

    # -- catching up -------------------------------------------------------------------
    def runs(self) -> dict[str, int]:
        """``{run: version}`` for every run read so far (scanning once if never)."""
        self._scanned()
        with self._lock:
            return {name: run.version for name, run in self._runs.items()}

    def version(self, run: str) -> int | None:
        """How often what was read of ``run`` changed; None for a run not seen."""
        found = self._known(run)
        return None if found is None else found.version

    def changed(self, run: str, since: int) -> tuple[int, list[tuple[int, Any]]]:
        """``(version, [(index, Bound), ...])``: the run's version now and the forwards
        bound, or bound again, after version ``since``, in forward order. So a reader
        that keeps up pays for what changed, not for the run's length."""
        found = self._known(run)
        if found is None:
            return 0, []
        with self._lock:
            indices = sorted(set(found.log[max(since, 0):]))
            return found.version, [(index, found.bounds[index]) for index in indices]

    def scan(self, *, force: bool = False) -> bool:
        """Lists every run's names again if a scan is due (or ``force``); answers
        whether it did. A scan already under way in another thread is not repeated."""
        if not self._scanning.acquire(blocking=force):
            return False
        try:
            if not force and not self.scan_due():
                return False
            began = time.monotonic()
            listed = self._store.bound("run")
            with self._lock:
                for bound in listed:
                    found = _forward(bound.name)
                    if found is not None:
                        self._runs.setdefault(found[0], _Run()).took(found[1], bound)
                self._scan_took = time.monotonic() - began
                self._scanned_at = time.monotonic()
            return True
        finally:
            self._scanning.release()

    def scan_due(self) -> bool:
        if self._scanned_at is None:
            return True
        return time.monotonic() - self._scanned_at >= max(SCAN_EVERY, SCAN_SHARE * self._scan_took)

    def follow(self, run: str) -> int | None:
        """Reads the names a run bound since it was last looked at (at most every
        ``FOLLOW_EVERY`` seconds); answers its version, None for a run not seen."""
        found = self._known(run)
        if found is None or time.monotonic() - found.followed_at < FOLLOW_EVERY:
            return None if found is None else found.version
        if not found.lock.acquire(blocking=False):  # somebody is looking right now
            return found.version
        try:
            self._newest(run, found)
            found.followed_at = time.monotonic()
        finally:
            found.lock.release()
        return found.version

    def _newest(self, name: str, run: _Run) -> None:
        after = run.last + 1
        new = []
        with self._lock:
            known = list(run.raw)
        # what the store's answer for a forward past them reads, instead of a listing
        batches_begin(self._store, name, known)
        while len(new) < PROBES:
            bound = self._store.resolve(f"run/{name}/{after}")
            if bound is None or EACH not in bound.meta:
                # None, or a forward inside the batch that held the last one, bound
                # again with more since: that batch is read again, whole, below
                break
            new.append(bound)
            batches_begin(self._store, name, [after])
            after = forwards_of(bound, after)[-1][0] + 1  # past the batch it is
        if len(new) == PROBES:  # far behind: one listing (parallel on a bucket) is cheaper
            new = self._store.bound(f"run/{name}")
        # Asked after the newer ones: had the previous last been bound again, it was
        # before the next forward was, so this read sees its final form.
        at = run.last_at
        again = self._store.resolve(f"run/{name}/{at}") if at >= 0 else None
        with self._lock:
            for bound in new + ([again] if again is not None else []):
                found = _forward(bound.name)
                if found is not None and found[0] == name:
                    run.took(found[1], bound)

    def _scanned(self) -> None:
        if self._scanned_at is None:
            self.scan(force=True)

    def _known(self, name: str) -> _Run | None:
        """The run called ``name``, listed on its own if the last scan missed it."""
        self._scanned()
        with self._lock:
            run = self._runs.get(name)
        if run is not None or not name or "/" in name:
            return run
        try:
            listed = self._store.bound(f"run/{name}")
        except (ValueError, TypeError):  # not a name at all (the store says why elsewhere)
            return None
        forwards = [(found[1], bound) for bound in listed
                    if (found := _forward(bound.name)) is not None and found[0] == name]
        if not forwards:
            return None
        with self._lock:
            run = self._runs.setdefault(name, _Run())
            for index, bound in forwards:
                run.took(index, bound)
        return run

    def _listing(self, run: _Run) -> list[Any]:
        with self._lock:
            if run.listing is None:
                run.listing = sorted(run.raw.values(), key=_name)
            return run.listing


def _name(bound: Any) -> str:
    return bound.name
