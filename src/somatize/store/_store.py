"""The Store: bytes kept under the digest of their content, and names bound to digests.

Everything that decides what is allowed lives here, once, whatever the backend: the
form of names and digests, the check that a name only ever points at an object the
store has, what meta may hold, the hashing on the way in and the verification on the
way out (bytes that do not hash to their digest are an error, never data), and the
codecs for ``keep``/``recall``. Underneath, a backend only moves bytes (see
``somatize.store.backend``); its ``OSError``s come out of here as ``StoreError``.
Whatever the bytes say, reading them raises nothing but somatize's own errors: bytes
that hash right but do not decode are ``CorruptObject``, naming the object.

A name is ``/``-separated parts, like a relative path. Refused: an empty name or
part, a leading ``/``, a part that is ``.`` or ``..``, a backslash, a control
character, a lone surrogate (the name has to be UTF-8), more than 1000 bytes of UTF-8
(so that a bucket can hold it as a key).

A name's record is a small JSON document, ``{"digest", "meta", "when"}``; meta is
JSON data with str keys, kept in the order given, so that what comes back is equal
to what went in (tuples, sets and other objects are refused, not converted). A record
that cannot be read makes ``resolve`` of its name fail, and is left out of ``bound``
with a warning, so one bad file does not hide every other name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._codec import MAGIC, dumps, loads
from .._errors import BadName, CorruptObject, StoreError
from .._optional import optional
from .backend import Backend
from .local import DirectoryBackend, translated

__all__ = ["Bound", "Store", "answers_unbound", "before_reading", "check_name"]

MAX_NAME = 1000  # UTF-8 bytes: with a short prefix, still a valid S3 key (1024 bytes)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}").fullmatch  # fullmatch: "$" would let "\n" in
_BAD = r"\x00-\x1f\x7f\\/\ud800-\udfff"
_NAME = re.compile(rf"[^{_BAD}]+(?:/[^{_BAD}]+)*").fullmatch
_decode = json.JSONDecoder().decode
_finite = math.isfinite

# Run before a name (or, with None, every name) is read through any Store: a layer above
# that holds writes back, such as a Recorder writing behind its run, registers here to
# write them first, so that a process reads its own writes and the store need not know
# who holds what. (This and ``_standing_in`` are rows of ``_registries``.)
_readers_first: list[Callable[[Store, str | None], None]] = []


def before_reading(hook: Callable[[Store, str | None], None]) -> None:
    """Has ``hook(store, name)`` run before ``resolve(name)`` and ``bound(prefix)`` (with
    ``None`` for every name) read through any Store of this process. It must be cheap
    for a name it has nothing for: it runs on every read."""
    _readers_first.append(hook)


# Asked, in order, for a name nobody bound, before ``resolve`` answers None: a layer above
# that binds several names as one object (a Recorder's batch of forwards, under the
# first one's name) answers the binding that stands for this one, so that every name it
# promised resolves, however it was laid out.
_standing_in: list[Callable[[Store, str], Bound | None]] = []


def answers_unbound(hook: Callable[[Store, str], Bound | None]) -> None:
    """Has ``hook(store, name)`` answer ``resolve(name)`` where ``name`` itself is not
    bound (None: it has nothing for it). Only names a store does not have reach it, so
    it costs nothing where they are bound; it must be cheap for a name not its own."""
    _standing_in.append(hook)


@dataclass(frozen=True, slots=True)
class Bound:
    """A name as it is bound: the object it points at, its meta, and when it was bound."""

    name: str
    digest: str
    meta: dict[str, Any] = field(hash=False)
    when: float


def _show(text: Any) -> str:
    if isinstance(text, str) and len(text) > 80:
        return f"{text[:60]!r}… ({len(text)} characters)"
    return repr(text)


def _well_formed(name: Any) -> bool:
    return (type(name) is str and len(name) <= MAX_NAME and _NAME(name) is not None
            and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME
            and ("." not in name or not any(p in (".", "..") for p in name.split("/"))))


def check_name(name: Any, what: str = "name") -> str:
    """``name`` if it is a well-formed name; otherwise ``BadName`` saying which rule it breaks."""
    if _well_formed(name):
        return name
    raise BadName(f"{what} {_show(name)} is refused: {_broken(name, what)}")


def _broken(name: Any, what: str) -> str:
    if type(name) is not str:
        return f"a {what} is a str, not a {type(name).__qualname__}"
    if not name:
        if what == "prefix":
            return "it is empty; to list every name pass no prefix (None)"
        return "it is empty; a name is words separated by '/', such as 'run/a/0'"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME:
        return (f"it is {size} bytes long in UTF-8 and names have at most {MAX_NAME} (what an "
                "S3 key allows, with room for a prefix); shorten it")
    if name.startswith("/"):
        return "it starts with '/'; names are relative, so drop the leading '/'"
    for at, char in enumerate(name):
        if char == "\\":
            return f"it has a backslash at {at}; parts are separated by '/' only"
        if ord(char) < 32 or ord(char) == 127:
            return f"it has the control character {char!r} at {at}; use printable characters"
        if 0xD800 <= ord(char) <= 0xDFFF:
            return f"it has a lone surrogate {char!r} at {at}; a name must be valid Unicode"
    parts = name.split("/")
    if "" in parts:
        return "it has an empty part ('//' or a trailing '/'); remove it"
    return "it has a '.' or '..' part, which would mean 'here' or 'up'; spell the part out"


def _hex(digest: Any) -> str:
    if type(digest) is str and _DIGEST(digest):
        return digest[7:]
    raise BadName(
        f"{_show(digest)} is not a digest: a digest is 'sha256:' and 64 lowercase hex "
        "digits, as put() returns it"
    )


def _check_meta(meta: Any) -> dict[str, Any]:
    if meta is None:
        return {}
    if type(meta) is not dict:
        raise TypeError(f"meta is a dict with str keys, not a {type(meta).__qualname__}")
    for key, value in meta.items():
        if type(key) is not str:
            raise TypeError(f"meta key {key!r} is a {type(key).__qualname__}; meta keys are str")
        _check_value(value, f"meta[{key!r}]")
    return meta


def _check_value(value: Any, where: str) -> None:
    kind = type(value)
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return
    if kind is list:
        for at, item in enumerate(value):
            _check_value(item, f"{where}[{at}]")
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"{where} has the key {key!r}, a {type(key).__qualname__}; "
                                "keys in meta are str")
            _check_value(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {kind.__qualname__}; meta holds JSON data only (None, bool, int, "
        "float, str, and lists and str-keyed dicts of those) — convert it (a tuple to a "
        "list), or keep() the value and put its digest in meta"
    )


def _view(data: Any) -> memoryview:
    if isinstance(data, str):
        raise TypeError("put takes bytes, not str; encode the text first (text.encode())")
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"put takes bytes, bytearray or memoryview, not a {type(data).__qualname__}; "
            "to store a value, use keep()"
        ) from None
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


class Store:
    """Bytes kept by their content and names that point at them, shared by every process
    (and machine) that opens the same place.

    ``Store(directory)`` keeps them in a directory, made if missing; ``durable=False``
    skips the fsyncs (writes are still all-or-nothing) for callers that write a lot.
    ``Store.over(backend)`` keeps them anywhere else. A Store pickles as where it is.
    """

    __slots__ = ("_backend",)

    def __init__(self, directory: Any, *, durable: bool = True):
        self._backend: Backend = DirectoryBackend(directory, durable)

    @classmethod
    def over(cls, backend: Backend) -> Store:
        """A Store kept by ``backend`` (anything with the methods of ``Backend``)."""
        if not isinstance(backend, Backend):
            raise TypeError(f"{backend!r} is not a store backend: it lacks the methods of "
                            "somatize.store.backend.Backend")
        store = object.__new__(cls)
        store._backend = backend
        return store

    @classmethod
    def on_bucket(cls, endpoint: str, bucket: str, *, region: str = "us-east-1",
                  key: str | None = None, secret: str | None = None, hosted: bool = False,
                  prefix: str = "") -> Store:
        """The same store in an S3 bucket, for machines that share no directory.

        Needs boto3 (the ``s3`` extra). The endpoint is asked to honour a conditional
        write before this returns, and refused if it does not; see
        ``somatize.store.bucket`` for the layout, addressing and credentials.
        """
        bucket_backend = optional("somatize.store.bucket", "s3", "Store.on_bucket").BucketBackend
        return cls.over(bucket_backend.opened(endpoint, bucket, region=region, key=key,
                                             secret=secret, hosted=hosted, prefix=prefix))

    @property
    def where(self) -> str:
        """Where the store is: its directory, or the backend's own address."""
        return self._backend.where

    @property
    def backend(self) -> Backend:
        """What keeps the bytes; for inspection, since it checks nothing itself."""
        return self._backend

    def __repr__(self) -> str:
        backend = self._backend
        if type(backend) is DirectoryBackend:
            return f"Store({backend.where!r}{'' if backend.durable else ', durable=False'})"
        return f"Store.over({backend!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).over, (self._backend,))

    # -- objects

    def put(self, data: Any) -> str:
        """Keeps bytes and answers their digest, ``"sha256:<hex>"``; the same bytes are
        kept once."""
        view = _view(data)
        hexdigest = hashlib.sha256(view).hexdigest()
        translated(self._backend.where, "put {2.nbytes} bytes as sha256:{1}", _keep,
                   self._backend, hexdigest, view, writing=True)
        return "sha256:" + hexdigest

    def get(self, digest: str) -> bytes | None:
        """The bytes kept under ``digest``, checked against it; None if there are none."""
        hexdigest = _hex(digest)
        backend = self._backend
        data = translated(backend.where, "read sha256:{0}", backend.read_object, hexdigest)
        if data is None:
            return None
        actual = hashlib.sha256(data).hexdigest()
        if actual != hexdigest:
            raise CorruptObject(
                f"the object {digest} at {backend.object_at(hexdigest)} is corrupt: its "
                f"{len(data)} bytes hash to sha256:{actual}; delete that file and put the "
                "original bytes again"
            )
        return data

    # -- names

    def bind(self, name: str, digest: str, meta: dict[str, Any] | None = None) -> None:
        """Points ``name`` at the object ``digest``, replacing what it pointed at before."""
        record = self._record(check_name(name), digest, _check_meta(meta))
        translated(self._backend.where, "bind {0!r}", self._backend.write_name, name, record,
                   writing=True)

    def claim(self, name: str, digest: str, meta: dict[str, Any] | None = None) -> bool:
        """Points ``name`` at ``digest`` only if nobody has bound it yet; True if this
        call did. Of any number of processes claiming one name, exactly one wins."""
        record = self._record(check_name(name), digest, _check_meta(meta))
        return translated(self._backend.where, "claim {0!r}", self._backend.claim_name, name,
                          record, writing=True)

    def resolve(self, name: str) -> Bound | None:
        """What ``name`` is bound to, or None if it is not bound. A name a layer above
        binds as part of another (a forward in a Recorder's batch) answers that part:
        see ``answers_unbound``."""
        check_name(name)
        for hook in _readers_first:
            hook(self, name)
        record = translated(self._backend.where, "read the name {0!r}",
                            self._backend.read_name, name)
        if record is not None:
            return self._bound(name, record)
        for hook in _standing_in:
            found = hook(self, name)
            if found is not None:
                return found
        return None

    def bound(self, prefix: str | None = None) -> list[Bound]:
        """Every name bound, sorted by name; with ``prefix``, only that name and the
        names below it (``"run/a"`` reaches ``"run/a/0"``, not ``"run/ab/0"``).

        A record that cannot be read is left out, and one ``UserWarning`` names every
        such record and how to mend it."""
        if prefix is not None:
            check_name(prefix, "prefix")
            below = prefix + "/"
        for hook in _readers_first:
            hook(self, prefix)
        listed = translated(self.where, "list the names", self._backend.list_names, prefix)
        found, unreadable = [], []
        for name, record in listed:
            if prefix is not None and name != prefix and not name.startswith(below):
                continue
            if isinstance(record, BaseException):  # there, but the backend could not read it
                unreadable.append(f"{_show(name)} ({_reason(record)})")
            elif _well_formed(name):
                bound = _parsed(name, record)
                if bound is None:
                    unreadable.append(f"{_show(name)} (not a name's record: "
                                      f"{bytes(record[:60])!r})")
                else:
                    found.append(bound)
        if unreadable:
            warnings.warn(_left_out(self.where, unreadable), UserWarning, stacklevel=2)
        found.sort(key=lambda bound: bound.name)
        return found

    # -- values

    def keep(self, name: str, what: Any, meta: dict[str, Any] | None = None) -> str:
        """Writes ``what`` down through the codecs, binds ``name`` to it, answers the
        digest. A value with no codec is refused before anything is written."""
        check_name(name)
        meta = _check_meta(meta)
        digest = self.put(dumps(what))
        self.bind(name, digest, meta)
        return digest

    def recall(self, name: str) -> Any | None:
        """The value kept under ``name``, alive again; None if the name is not bound."""
        bound = self.resolve(name)
        if bound is None:
            return None
        blob = self.get(bound.digest)
        if blob is None:
            raise StoreError(
                f"{_show(name)} is bound to {bound.digest}, which {self.where} does not "
                "have; keep the value again, or put its bytes back"
            )
        if not blob.startswith(MAGIC):
            raise StoreError(
                f"{_show(name)} is bound to {bound.digest}, which is not a kept value (it "
                "was put as raw bytes); read it with get(resolve(name).digest)"
            )
        return loads(blob, f"the object {bound.digest} bound to {_show(name)} in {self.where}")

    # -- inside

    def _record(self, name: str, digest: Any, meta: dict[str, Any]) -> bytes:
        hexdigest = _hex(digest)
        present = translated(self.where, "look for sha256:{0}", self._backend.has_object,
                             hexdigest)
        if not present:
            raise StoreError(
                f"cannot bind {_show(name)} to {digest}: {self.where} does not have that "
                "object; put() the bytes first and bind the digest it answers"
            )
        document = {"digest": digest, "meta": meta, "when": time.time()}
        return json.dumps(document, separators=(",", ":"), allow_nan=True).encode()

    def _bound(self, name: str, record: bytes) -> Bound:
        bound = _parsed(name, record)
        if bound is None:
            raise CorruptObject(
                f"the record of {_show(name)} in {self.where} cannot be read (not a name's "
                f"record: {bytes(record[:60])!r}); bind the name again")
        return bound


def _parsed(name: str, record: bytes) -> Bound | None:
    """What a name record says, or None if it is not one."""
    try:
        document = _decode(record.decode())
        digest, meta, when = document["digest"], document["meta"], float(document["when"])
    except (ValueError, LookupError, TypeError, AttributeError, RecursionError,
            OverflowError):
        return None
    # float() also takes a str or a bool, which a record never holds
    if type(digest) is str and _DIGEST(digest) and type(meta) is dict and \
            type(document["when"]) in (int, float) and _finite(when):
        return Bound(name, digest, meta, when)
    return None


def _keep(backend: Backend, hexdigest: str, view: memoryview) -> None:
    """Writes an object unless the very bytes are kept already. What is there is
    compared, not trusted: a corrupt object is healed by putting the right bytes."""
    holds = getattr(backend, "holds", None)
    if holds is not None:
        kept = holds(hexdigest, view)
    else:
        kept = _same(backend.read_object(hexdigest), view, hexdigest)
    if not kept:
        backend.write_object(hexdigest, view)


def _same(kept: bytes | None, view: memoryview, hexdigest: str) -> bool:
    """Whether the bytes kept are the ones being put: compared where they lie when they
    can be (bytes against bytes is a memcmp), else hashed."""
    if kept is None or len(kept) != view.nbytes:
        return False
    whole = view.obj
    if type(whole) in (bytes, bytearray) and len(whole) == view.nbytes:
        return kept == whole
    return hashlib.sha256(kept).hexdigest() == hexdigest


def _reason(error: BaseException) -> str:
    if isinstance(error, StoreError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}"


def _left_out(where: str, unreadable: list[str]) -> str:
    count = len(unreadable)
    shown = "; ".join(unreadable[:20]) + (f"; and {count - 20} more" if count > 20 else "")
    return (f"{count} name record{'s' if count > 1 else ''} in {where} cannot be read and "
            f"{'are' if count > 1 else 'is'} left out of this listing: {shown}. Bind each "
            "such name again (or remove its record) to mend it; the other names are listed")

