"""The Recorder: what happened, written down behind the run, a batch at a time.

A forward's record is every fact from one ``began`` up to the next, so what a trainer
says after the engine's ``finished`` (``loss``, ``updated``) lands in the forward it
belongs to. A writer thread writes the forwards that finished as one batch at most a
quarter second after the first of them did, bound as ``run/{run}/{i}`` for the batch's
first forward; ``flush()``, ``close()`` and the end of the interpreter write whatever
is left. The name of every forward resolves all the same: ``store.resolve`` answers a
forward inside a batch with the batch's part that is that forward (``record._read``
registers how), so ``store.resolve(f"run/{r.run}/{n}")`` is forward ``n``'s record for
every ``n``, however the forwards were batched. A read of a run's names through any Store of this process (``resolve``,
``bound``, and so ``somatize.record`` and ``somatize.health``) has the Recorders of
that run and store write what they hold first, so what was said here is read here; a
reader elsewhere sees a batch whole or not at all, at most about half a second behind.

A batch is one JSON document, ``{"format": 2, "run": ..., "forward": i, "forwards":
[[facts of i], [facts of i + 1], ...]}``, and its name's meta holds, under the key
``""`` (which no summarised fact can have), one summary per forward (or, for a run that
summarises nothing, how many forwards it holds); the readers see
one forward at a time either way, and still read the records of format 1, one forward
each with its ``"facts"``. A float that is not finite is written as JSON's common
``NaN``/``Infinity`` extension, which Python reads back, since a diverging loss is
exactly what a record must keep. A fact of plain values is kept as it came and turned
into JSON with its batch; any other is turned into JSON as it arrives, so a fact that
cannot be written down is refused to whoever said it, while the state is still as it was.

A batch that cannot be written (a full disk, a read-only store) never fails the
forward or the step that said it: the Recorder warns once, with the reason, and tries
again on its next write, so recording resumes by itself once the store can be written
again; ``Recorder.lost`` counts the forwards it gave up on (those still unwritten at
``close()``, or more than it keeps waiting).
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
from ..store._store import before_reading

__all__ = ["EACH", "FORMAT", "Recorder", "check_run", "default_run", "flush_pending", "forward_name"]

#: The version of the record's shape this somatize writes, and the newest it reads.
FORMAT = 2
#: The meta key of a batch's summaries, one per forward: no summarised fact is called "".
EACH = ""
TRAIL = 0.25  # seconds the writer lets facts gather before it writes them
PER_OBJECT = 1000  # forwards in one batch at most
KEPT_UNWRITTEN = 100_000  # forwards kept while the store refuses them, at most
_PLAIN = frozenset((str, int, float, bool, type(None)))
_KEYS = frozenset((str,))

_SCALARS = (str, int, float, bool, type(None))
_stamp_lock = threading.Lock()
_last_stamp = [0]
_open: weakref.WeakSet[_Book] = weakref.WeakSet()  # the books of this process's Recorders
_writing_here = threading.local()  # .on while this thread writes a batch


def _plain(value: Any) -> Any:
    """What a non-JSON value in a fact is written as: torch and numpy scalars and
    arrays by their ``tolist()``; anything else is not guessed at."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None and callable(tolist):
        return tolist()
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__}")


_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=True, default=_plain).encode
# What a batch of plain facts is written with: they hold no containers, so no cycles.
_batch = json.JSONEncoder(separators=(",", ":"), allow_nan=True, check_circular=False).encode


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


def _written_first(store: Any, name: str | None) -> None:
    """Before this process reads a run's names through any Store, the Recorders of this
    process that still hold forwards of that run for that store write them, so that
    ``store.resolve(f"run/{r.run}/0")`` right after a forward finds it. A reader
    elsewhere still trails by the write-behind delay. Nothing is done for other names,
    nor in a thread that is writing a batch (its own look at the run must not wait
    for itself)."""
    if not _open or getattr(_writing_here, "on", False):
        return
    if name is None or name == "run":
        run = None
    elif name.startswith("run/"):
        run = name[4:].partition("/")[0]
    else:
        return
    where = store.where
    for book in list(_open):
        if (run is None or book.run == run) and (book.store is store or book.where == where):
            book.flush()


before_reading(_written_first)


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


def held(bound: Any) -> int:
    """How many forwards one binding of a run holds: a batch's count, else one."""
    each = bound.meta.get(EACH) if type(bound.meta) is dict else None
    if type(each) is list and each:
        return len(each)
    return each if type(each) is int and each > 0 else 1


def next_forward(store: Any, run: str) -> int:
    """The index after the last forward a run already has (0 for a new run)."""
    prefix = f"run/{run}"
    after = 0
    for bound in store.bound(prefix):
        rest = bound.name[len(prefix) + 1:]
        if rest.isdigit() and rest.isascii():
            after = max(after, int(rest) + held(bound))
    return after


class Recorder:
    """Writes down what happened, one record per forward, in batches under ``run/{run}/``
    in a store, at most about half a second behind the run.

    Call it with each fact (it is a watcher: ``g.forward(x, watching=recorder)``). A
    writer thread writes the forwards that finished (a Trainer's step, whose ``began``
    says ``step``, once its ``loss`` is in) a quarter second after the first of them
    did, as one batch; facts said later are written with their forward again.
    ``flush()`` writes everything now; ``close()`` too, and then refuses more; the end
    of the interpreter, or the Recorder being garbage-collected, writes what is left,
    so it need not be closed. ``somatize.record``'s readers in this process flush it
    first. ``summarising=["loss"]`` copies the last value of each named fact into the
    binding's meta, so a curve is read from names alone. A directory store is written
    without fsync: every write is still whole (temp file and rename), but the last few
    may not survive a power cut.

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
        """How many forwards' records were given up (whole, or their last facts): the
        store refused them (it was full, read-only, unreachable) until ``close()``, or
        for more than ``KEPT_UNWRITTEN`` forwards; the Recorder said so once, as a
        warning, when it was first refused."""
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


class _Entry:
    """One forward as the book holds it: its facts (plain ones as they came, the others
    as JSON already) and its summarised values."""

    __slots__ = ("began", "items", "plain", "ready", "stepping", "summary", "written")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.plain = True  # every item is a fact as it came, none JSON already
        self.summary: dict[str, Any] = {}
        self.began = False
        self.stepping = False  # a Trainer's forward: ready once its loss is in
        self.ready = False  # finished (or closed by the next began): worth writing
        self.written = False


# A forward as a batch takes it: the entry, how many of its facts go, its summary.
_Snapshot = tuple[_Entry, int, dict[str, Any]]


class _Book:
    """What a Recorder holds: the forwards not written yet, the last batch written, and
    the writer thread that writes them behind the run.

    The writer wakes when there is something to write, lets a quarter second of facts
    gather, then writes every ready forward as one batch: one object and one name for
    all of them, where a name and an object per forward cost more than the forward.
    The last forward of the last batch may still hear facts (a Trainer's ``loss``
    after ``finished``); then that batch is written again, with whatever came since.
    """

    def __init__(self, store: Any, run: str, summarising: tuple[str, ...], first: int):
        self.store = store
        self.run = run
        self.summarising = summarising
        self.wanted = frozenset(summarising)
        self.lock = threading.Lock()  # guards what follows; never held while writing
        self.writing = threading.Lock()  # one batch written at a time
        self.next = first  # the index the next batch starts at
        self.pending: list[_Entry] = []  # forwards not written yet, in order
        self.current: _Entry | None = None  # the forward facts go to
        self.sealed: list[_Entry] = []  # the last batch written
        self.sealed_at = -1  # ...bound at this index
        self.dirty = False  # its last forward heard more since it was written
        self.closed = False
        self.forwards = 0
        self.lost = 0  # forwards whose record the store refused, for good
        self.warned = False
        self.where = getattr(store, "where", None)
        self.head = f'{{"format":{FORMAT},"run":{json.dumps(run)},"forward":'  # then the index
        self.wake = threading.Event()
        self.writer_pid = 0  # the process whose writer thread is running, if any

    def take(self, fact: Any) -> None:
        if type(fact) is not dict:
            raise TypeError(f"a fact is a dict with a 'fact' key, not a {type(fact).__qualname__}: {fact!r}")
        kind = fact.get("fact")
        if type(kind) is not str:
            raise TypeError(f"a fact names itself with a str under 'fact'; this one does not: {fact!r}")
        # Plain facts are kept as they are and turned into JSON a batch at a time; any
        # other is turned into JSON now, so what cannot be written is refused here.
        if _PLAIN.issuperset(map(type, fact.values())) and _KEYS.issuperset(map(type, fact)):
            item: Any = fact.copy()
        else:
            item = _line(fact, kind)
        with self.lock:
            if self.closed:
                raise RecordError(
                    f"the Recorder of run {self.run!r} is closed; make a new "
                    f"Recorder(store, run={self.run!r}) to go on with the run"
                )
            entry = self.current
            if entry is None or (kind == "began" and entry.began):
                if entry is not None:
                    entry.ready = True
                entry = self.current = _Entry()
                self.pending.append(entry)
                self.forwards += 1
            if kind == "began":  # facts said before the first forward open it
                entry.began = True
                entry.stepping = "step" in fact
            entry.items.append(item)
            if type(item) is str:
                entry.plain = False
            if kind in self.wanted:
                entry.summary[kind] = _summary(fact, kind)
            if entry.written:
                self.dirty = True
            if (kind == "finished" and not entry.stepping) or (kind == "loss" and entry.stepping):
                entry.ready = True
        if not self.wake.is_set():
            self._wake()

    def _wake(self) -> None:
        pid = os.getpid()
        if self.writer_pid != pid:  # none yet, or this is a fork, which has no threads
            self.writer_pid = pid
            threading.Thread(target=self._writing, name=f"somatize-recorder-{self.run}",
                             daemon=True).start()
        self.wake.set()

    def _writing(self) -> None:
        while True:
            self.wake.wait()
            if self.closed:
                return
            time.sleep(TRAIL)  # let what the next quarter second says join this batch
            self.wake.clear()
            if self.closed:
                return
            self._write(everything=False)

    def flush(self) -> None:
        self._write(everything=True)

    def close(self) -> None:
        _open.discard(self)
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.wake.set()  # the writer sees closed and ends
        if not self._write(everything=True):
            with self.lock:
                self.lost += len(self.pending) + self.dirty
                self.pending = []
                self.dirty = False

    def _write(self, everything: bool) -> bool:
        """Writes the forwards that are ready (all of them with ``everything``), and the
        last batch again if it heard more; False if the store refused, the forwards
        staying for the next try. The facts' lock is held only to choose what to write
        and to take note of what was, so forwards go on while the batch is written."""
        with self.writing:
            with self.lock:
                plan = self._plan(everything)
            if not plan:
                return True
            _writing_here.on = True
            try:
                for again, batch in plan:
                    try:  # a new batch goes after the last one bound, wherever that landed
                        at = self._put(self.sealed_at if again else self.next, batch, again)
                    except OSError as exc:  # every StoreError is one
                        self._refused(exc)
                        return False
                    with self.lock:  # noted at once: a batch bound is never bound twice
                        self._wrote(at, batch, again)
            finally:
                _writing_here.on = False
            return True

    def _plan(self, everything: bool) -> list[tuple[bool, list[_Snapshot]]]:
        """What to write: ``(again, [(entry, how many of its facts, its summary)])`` per
        batch, as the forwards are now (facts may come while they are written)."""
        going = len(self.pending)
        if not everything and going and not self.pending[-1].ready:
            going -= 1
        fresh = [self._snapshot(entry) for entry in self.pending[:going]]
        plan = []
        if self.dirty:
            room = max(0, PER_OBJECT - len(self.sealed))
            plan.append((True, [self._snapshot(entry) for entry in self.sealed] + fresh[:room]))
            fresh = fresh[room:]
        while fresh:
            plan.append((False, fresh[:PER_OBJECT]))
            fresh = fresh[PER_OBJECT:]
        return plan

    def _snapshot(self, entry: _Entry) -> _Snapshot:
        """``entry`` as it stands now: facts it hears while the batch is written are
        counted out, and the batch is written again for them (``dirty``)."""
        return entry, len(entry.items), {name: entry.summary.get(name) for name in self.summarising}

    def _wrote(self, at: int, batch: list[_Snapshot], again: bool) -> None:
        """Takes note that ``batch`` is bound at ``at``."""
        entries = [entry for entry, _, _ in batch]
        added = len(entries) - len(self.sealed) if again else len(entries)
        del self.pending[:added]
        for entry in entries:
            entry.written = True
        self.sealed, self.sealed_at = entries, at
        self.next = max(self.next, at + len(entries))
        last, said, _ = batch[-1]
        self.dirty = len(last.items) > said  # it heard more while the batch was written

    def _refused(self, exc: OSError) -> None:
        with self.lock:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"the Recorder of run {self.run!r} could not write forward "
                    f"{self.sealed_at if self.dirty else self.next} to {self.where}: {exc}. "
                    "Training goes on; the Recorder tries again, and Recorder.lost counts the "
                    "forwards whose record it could not write", UserWarning, stacklevel=6)
            if len(self.pending) > KEPT_UNWRITTEN:  # the store has refused for long: let go
                dropped = len(self.pending) - KEPT_UNWRITTEN
                self.lost += dropped
                del self.pending[:dropped]

    def _put(self, at: int, batch: list[_Snapshot], again: bool) -> int:
        """Binds ``batch`` as the forwards from ``at``; answers where it was bound."""
        each: Any = [summary for _, _, summary in batch] if self.summarising else len(batch)
        meta = {EACH: each}
        if again:
            self.store.bind(forward_name(self.run, at), self.store.put(self._body(at, batch)), meta)
            return at
        # The first binding of a batch is a claim: another process recording the same
        # run may have taken this index, and its record is not ours to replace.
        while not self.store.claim(forward_name(self.run, at),
                                   self.store.put(self._body(at, batch)), meta):
            at = max(at + 1, next_forward(self.store, self.run))
        return at

    def _body(self, at: int, batch: list[_Snapshot]) -> bytes:
        texts, plain = [], []
        for entry, said, _ in batch:
            items = entry.items[:said]
            if entry.plain:
                plain.append(items)
                continue
            if plain:
                texts.append(_batch(plain)[1:-1])
                plain = []
            texts.append("[" + ",".join(item if type(item) is str else _batch(item)
                                        for item in items) + "]")
        if plain:
            texts.append(_batch(plain)[1:-1])
        return "".join((self.head, str(at), ',"forwards":[', ",".join(texts), "]}")).encode()


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
