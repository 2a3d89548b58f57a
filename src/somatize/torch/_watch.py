"""One reader of a round per process, shared by every client waiting on it there.

Each waiting client used to ask the store for every missing part, every ``asking``
seconds: a round of n clients in one process cost n × n reads a tick. Here one thread
per (store, round) asks for the names its waiters still lack — the answer first, and
nothing else once it is there — on behalf of all of them, soon after something changed
and ever more rarely while nothing does (doubling from ``_FIRST`` up to ``asking``), so
its reads follow what arrives rather than how long the round waits. It resolves names
rather than listing the round: a listing of a bucket reads every record again. A
client of this process that keeps its part or the average hands the name to the reader
itself, so clients in one process learn of each other's parts at once, and the store
is read only for what other processes write.

The thread ends when its last waiter leaves; the next waiter starts a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..store import Bound, Store

__all__ = ["Reader", "reader"]

_FIRST = 0.002  # seconds: a name on a folder resolves in ~12 us; sooner is mostly waste

_readers: dict[tuple[str, str], Reader] = {}
_registry = threading.Lock()


class Reader:
    """The wanted names of one round found bound so far, and a version that grows each
    time more are found."""

    def __init__(self, store: Store, prefix: str):
        self._store, self._prefix = store, prefix
        self._changed = threading.Condition()
        self._names: dict[str, Bound] = {}
        self._wanted: dict[str, None] = {}  # the names looked for, in order
        self._version = 0
        self._waiters = 0
        self._slowest = 1.0
        self._failed: BaseException | None = None
        self._wake = threading.Event()  # a read is wanted now, or the last waiter left
        self._thread: threading.Thread | None = None
        self.reads = 0  # names resolved, over this reader's life: what the wait costs

    def names(self) -> tuple[dict[str, Bound], int]:
        """The names as last read, and their version; re-raises what stopped the reads."""
        with self._changed:
            if self._failed is not None:
                raise self._failed
            return dict(self._names), self._version

    def wait(self, version: int, timeout: float) -> None:
        """Returns once the names are newer than ``version``, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._version == version and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(left)

    def add(self, bound: Bound | None) -> None:
        """A name this process just bound (as the store resolves it): its waiters learn
        of it now, and nothing is read for it."""
        if bound is None:
            return
        with self._changed:
            if _digests({bound.name: bound}).items() <= _digests(self._names).items():
                return
            self._names = {**self._names, bound.name: bound}
            self._version += 1
            self._changed.notify_all()

    @contextmanager
    def waiting(self, slowest: float, wanted: Iterable[str]) -> Iterator[Reader]:
        """Counts the caller among the waiters (starting the reads if it is the first),
        looks for the ``wanted`` names (the first that is found ends the wait for the
        rest: the round's answer), and asks at least every ``slowest`` seconds."""
        with self._changed:
            self._waiters += 1
            self._wanted.update(dict.fromkeys(wanted))
            self._slowest = min(self._slowest, slowest) if self._waiters > 1 else slowest
            if self._thread is None:
                self._failed = None
                self._thread = threading.Thread(target=self._read, daemon=True,
                                                name=f"somatize-round-{self._prefix}")
                self._thread.start()
        try:
            yield self
        finally:
            with self._changed:
                self._waiters -= 1
                if self._waiters == 0:
                    self._wake.set()

    def _read(self) -> None:
        interval = _FIRST
        while True:
            try:
                listed = self._look()
                failed = None
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                listed, failed = None, exc
            with self._changed:
                if failed is not None:
                    self._failed = failed
                    self._changed.notify_all()
                elif not _digests(listed).items() <= _digests(self._names).items():
                    # a round's names are claimed, never unbound, so what was added
                    # here and is not listed yet stays
                    self._names, self._version = {**self._names, **listed}, self._version + 1
                    self._changed.notify_all()
                    interval = _FIRST
                else:
                    interval = min(interval * 2, self._slowest)
                if self._waiters == 0 or failed is not None:
                    self._thread = None
                    return
            # Not on the condition: the names this process adds wake its waiters, and
            # need no read of the store.
            self._wake.wait(interval)
            self._wake.clear()


    def _look(self) -> dict[str, Bound]:
        """The wanted names not known yet, resolved in order, up to the first one still
        missing after the answer (a round lacking that part is not complete, whatever
        else is in; a client counting parts for a quorum reads them itself); none once
        the answer, the first wanted name, is found."""
        with self._changed:
            wanted, known = list(self._wanted), set(self._names)
        if wanted and wanted[0] in known:
            return {}
        found = {}
        for at, name in enumerate(wanted):
            if name in known:
                continue
            bound = self._store.resolve(name)
            with self._changed:
                self.reads += 1
            if bound is not None:
                found[name] = bound
                if at == 0:
                    break
            elif at > 0:
                break
        return found


def _digests(names: dict[str, Bound]) -> dict[str, str]:
    return {name: bound.digest for name, bound in names.items()}


def reader(store: Store, prefix: str) -> Reader:
    """This process's reader of ``prefix`` in ``store`` (made on first use)."""
    key = (f"{type(store.backend).__qualname__}:{store.where}", prefix)
    with _registry:
        found = _readers.get(key)
        if found is None:
            found = _readers[key] = Reader(store, prefix)
            if len(_readers) > 64:  # rounds long over: forget the idle ones
                for old in [k for k, r in _readers.items() if r._thread is None and k != key]:
                    del _readers[old]
        return found
