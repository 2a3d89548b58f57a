"""The Recorder: what happened, written down one forward at a time.

A record is every fact from one ``began`` up to the next, so what a trainer says after
the engine's ``finished`` (``loss``, ``updated``) lands in the forward it belongs to.
It is bound as ``run/{run}/{i}`` the moment ``finished`` arrives, and bound again only
when later facts are still unwritten and something asks for them: the next ``began``,
``flush()``, ``close()``, or the end of the interpreter.

A record is one JSON document, ``{"format": 1, "run": ..., "forward": i, "facts":
[...]}``; a float that is not finite is written as JSON's common ``NaN``/``Infinity``
extension, which Python reads back, since a diverging loss is exactly what a record
must keep. Each fact is turned into JSON as it arrives, so a fact that cannot be written down is
refused to whoever said it, while the state is still as it was, and a rewrite costs
a join rather than a second encoding.

A record that cannot be written (a full disk, a read-only store) never fails the
forward or the step that said it: the Recorder warns once, with the reason, counts
every forward whose record it lost (``Recorder.lost``), and tries again with the next
one, so recording resumes by itself once the store can be written again.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from .._errors import RecordError, UnwritableError

__all__ = ["FORMAT", "Recorder", "check_run", "default_run", "flush_pending", "forward_name"]

#: The version of the record's shape this somatize writes, and the newest it reads.
FORMAT = 1

_SCALARS = (str, int, float, bool, type(None))
_stamp_lock = threading.Lock()
_last_stamp = [0]
_open: weakref.WeakSet[_Book] = weakref.WeakSet()  # the books of this process's Recorders


def _plain(value: Any) -> Any:
    """What a non-JSON value in a fact is written as: torch and numpy scalars and
    arrays by their ``tolist()``; anything else is not guessed at."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None and callable(tolist):
        return tolist()
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__}")


_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=True, default=_plain).encode


def default_run() -> str:
    """A fresh run name, UTC to the microsecond then six random hex digits, so that
    names sort by when they were made and two processes never pick the same one."""
    with _stamp_lock:
        now = max(time.time_ns() // 1000, _last_stamp[0] + 1)
        _last_stamp[0] = now
    seconds, micro = divmod(now, 1_000_000)
    clock = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds))
    return f"{clock}.{micro:06d}-{os.urandom(3).hex()}"


def check_run(run: Any) -> str:
    """``run`` if it can name a run: a non-empty str that is one part of a name."""
    if type(run) is not str:
        raise TypeError(f"a run is named by a str, not a {type(run).__qualname__} ({run!r})")
    if not run or "/" in run or run in (".", "..") or any(ord(c) < 32 or c == "\\" for c in run):
        raise RecordError(
            f"{run!r} cannot name a run: a run name is one word without '/', '\\' or "
            "control characters, such as 'tuesday' or 'lr-0.01'"
        )
    return run


def forward_name(run: str, forward: int) -> str:
    return f"run/{run}/{forward}"


def flush_pending(store: Any, run: str) -> None:
    """Writes what the Recorders of this process still hold for ``run`` in ``store``,
    so that reading a run here shows everything they were told (the last step's
    loss included); another process sees what was written."""
    where = getattr(store, "where", None)
    for book in list(_open):
        if book.run == run and (book.store is store or (where is not None and book.where == where)):
            book.flush()


def _writable(store: Any) -> Any:
    """The store the records go through: a directory store is reopened without fsync,
    since a durable write per forward would cost more than the forward."""
    if isinstance(store, (str, os.PathLike)):
        from ..store import Store

        return Store(store, durable=False)
    for method in ("put", "bind", "claim", "bound"):
        if not callable(getattr(store, method, None)):
            raise TypeError(
                f"Recorder writes to a Store (or a directory), not a "
                f"{type(store).__qualname__}: it has no {method}()"
            )
    backend = getattr(store, "backend", None)
    if getattr(backend, "durable", False) and os.path.isdir(getattr(store, "where", "") or ""):
        from ..store import Store

        return Store(store.where, durable=False)
    return store


def _summarised(summarising: Any) -> tuple[str, ...]:
    if summarising is None:
        return ()
    if isinstance(summarising, str):
        raise TypeError(
            f"summarising takes a list of fact names, e.g. [{summarising!r}], not a str"
        )
    names = tuple(summarising) if isinstance(summarising, Iterable) else None
    if names is None or not all(type(n) is str and n for n in names):
        raise TypeError(f"summarising takes a list of fact names such as ['loss'], not {summarising!r}")
    return names


def next_forward(store: Any, run: str) -> int:
    """The index after the last forward a run already has (0 for a new run)."""
    prefix = f"run/{run}"
    last = -1
    for bound in store.bound(prefix):
        rest = bound.name[len(prefix) + 1:]
        if rest.isdigit() and rest.isascii():
            last = max(last, int(rest))
    return last + 1


class Recorder:
    """Writes down what happened, one record per forward, as ``run/{run}/{i}`` in a store.

    Call it with each fact (it is a watcher: ``g.forward(x, watching=recorder)``). A
    forward is resolvable as soon as its ``finished`` arrives — a Trainer's step (its
    ``began`` says ``step``) as soon as its ``loss`` does, which is right after; facts
    that come later still are bound with it again at the next ``began``, on
    ``flush()``/``close()``, or when the interpreter exits — the Recorder does not
    have to be closed, and can still be garbage-collected. ``summarising=["loss"]``
    copies the last value of each named fact into the binding's meta, so a curve is
    read from names alone. A directory store is written without fsync: every write is
    still whole (temp file and rename), but the last few may not survive a power cut.

    A run that already has records is continued after its last forward, and a forward
    index taken meanwhile by another process is skipped, never overwritten. A store
    that cannot be written to does not stop the forward: see ``lost``. Refused: a
    fact that is not a dict with a ``fact`` name, a value with no plain form (facts
    hold JSON data; torch and numpy values are written by ``tolist()``), and facts
    after ``close()``. Safe to call from several threads.
    """

    __slots__ = ("__weakref__", "_book", "_done")

    def __init__(self, store: Any, *, run: str | None = None, summarising: Any = None):
        run = default_run() if run is None else check_run(run)
        writable = _writable(store)
        book = _Book(writable, run, _summarised(summarising), next_forward(writable, run))
        self._book = book
        _open.add(book)
        # Holds the book, not the Recorder: the Recorder can be collected, and whatever
        # it had not written yet is written then, or at exit, whichever comes first.
        self._done = weakref.finalize(self, book.close)

    @property
    def run(self) -> str:
        """What this run is called: the middle of every name it writes."""
        return self._book.run

    @property
    def store(self) -> Any:
        """The store the records are written through."""
        return self._book.store

    @property
    def lost(self) -> int:
        """How many forwards' records could not be written (whole, or their last facts):
        the store refused them (it was full, read-only, unreachable), which the
        Recorder said once, as a warning, when it first happened."""
        return self._book.lost

    def __call__(self, fact: dict[str, Any]) -> None:
        self._book.take(fact)

    def flush(self) -> None:
        """Writes whatever this Recorder has not written yet."""
        self._book.flush()

    def close(self) -> None:
        """Writes what is left and stops taking facts."""
        self._done()

    def __enter__(self) -> Recorder:  # noqa: PYI034 (the class is not meant to be subclassed)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        lost = f", lost={self._book.lost}" if self._book.lost else ""
        return f"Recorder(run={self.run!r}, forwards={self._book.forwards}{lost})"


class _Book:
    """What a Recorder holds: the forward being recorded and where it goes.

    Writes happen in the thread that brings the fact that calls for them, under the
    lock. A writer thread for the rewrites was tried and measured slower: handing the
    GIL back and forth cost more than the rewrite it moved.
    """

    def __init__(self, store: Any, run: str, summarising: tuple[str, ...], first: int):
        self.store = store
        self.run = run
        self.summarising = summarising
        self.wanted = frozenset(summarising)
        self.lock = threading.Lock()
        self.next = first  # the index the next forward takes
        self.current: int | None = None  # the index of the forward being recorded
        self.lines: list[str] = []  # its facts, as JSON
        self.summary: dict[str, Any] = {}
        self.unwritten = False
        self.closed = False
        self.forwards = 0
        self.claimed: int | None = None  # the forward whose name this book holds
        self.stepping = False  # a Trainer's forward: written when its loss is in
        self.lost = 0  # forwards whose record the store refused, for good
        self.warned = False
        self.where = getattr(store, "where", None)
        self.head = f'{{"format":{FORMAT},"run":{json.dumps(run)},"forward":'  # then the index

    def take(self, fact: Any) -> None:
        if type(fact) is not dict:
            raise TypeError(f"a fact is a dict with a 'fact' key, not a {type(fact).__qualname__}: {fact!r}")
        kind = fact.get("fact")
        if type(kind) is not str:
            raise TypeError(f"a fact names itself with a str under 'fact'; this one does not: {fact!r}")
        line = _line(fact, kind)
        with self.lock:
            if self.closed:
                raise RecordError(
                    f"the Recorder of run {self.run!r} is closed; make a new "
                    f"Recorder(store, run={self.run!r}) to go on with the run"
                )
            if kind == "began":
                self._began()
                self.stepping = "step" in fact
            self.lines.append(line)
            if kind in self.wanted:
                self.summary[kind] = _summary(fact, kind)
            # A forward is written when it finishes, so it can be read the moment the
            # caller has it back; a Trainer's, once its step's loss is in (it says it
            # right after), so a step costs one write and not two.
            if self.current is not None and (
                    (kind == "finished" and not self.stepping) or (kind == "loss" and self.stepping)):
                self.stepping = False
                self._write()
            else:
                self.unwritten = True

    def _began(self) -> None:
        if self.current is not None:
            if self.unwritten and not self._write():
                self.lost += 1  # its second chance, and its last
            self.lines = []
            self.summary = {}
        # else: facts said before the first forward open it
        self.current = self.next
        self.next += 1
        self.forwards += 1

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def close(self) -> None:
        _open.discard(self)
        with self.lock:
            if not self.closed:
                self.closed = True
                self._flush()

    def _flush(self) -> None:
        if not self.unwritten or not self.lines:
            return
        if self.current is None:  # facts without any forward still make a record
            self.current = self.next
            self.next += 1
            self.forwards += 1
        if not self._write() and self.closed:
            self.lost += 1

    def _write(self) -> bool:
        """Writes the forward being recorded; False, having said so once, if the store
        refused it — the facts stay, for the next try."""
        try:
            self._put()
        except OSError as exc:  # every StoreError is one
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"the Recorder of run {self.run!r} could not write forward "
                    f"{self.current} to {self.where}: {exc}. Training goes on; the Recorder "
                    "tries again with each forward, and Recorder.lost counts the forwards "
                    "whose record it could not write", UserWarning, stacklevel=5)
            return False
        self.unwritten = False
        return True

    def _put(self) -> None:
        meta = {name: self.summary.get(name) for name in self.summarising}
        if self.claimed == self.current:
            self.store.bind(forward_name(self.run, self.current), self.store.put(self._body()), meta)
        else:
            # The first binding of a forward is a claim: another process recording the
            # same run may have taken this index, and its record is not ours to replace.
            while not self.store.claim(forward_name(self.run, self.current),
                                       self.store.put(self._body()), meta):
                self.current = self.next
                self.next += 1
            self.claimed = self.current

    def _body(self) -> bytes:
        return "".join((self.head, str(self.current), ',"facts":[', ",".join(self.lines),
                        "]}")).encode()


def _line(fact: dict[str, Any], kind: str) -> str:
    try:
        return _encode(fact)
    except (TypeError, ValueError) as exc:
        for key, value in fact.items():
            if type(key) is not str:
                raise UnwritableError(
                    f"a {kind!r} fact has the key {key!r} ({type(key).__qualname__}); fact "
                    "keys are str"
                ) from None
            try:
                _encode(value)
            except (TypeError, ValueError):
                raise UnwritableError(
                    f"a {kind!r} fact holds {key!r} = {type(value).__module__}."
                    f"{type(value).__qualname__}, which a record cannot hold; give plain data "
                    "(numbers, str, lists, dicts) — float(x) for a scalar"
                ) from None
        raise UnwritableError(f"a {kind!r} fact cannot be written down: {exc}") from None


def _summary(fact: dict[str, Any], kind: str) -> Any:
    """What goes into meta for a summarised fact: its ``value``, or its other fields."""
    value = fact["value"] if "value" in fact else {k: v for k, v in fact.items() if k != "fact"}
    if type(value) in _SCALARS:
        return value
    return json.loads(_encode(value))
