"""What a Store asks of the place it keeps things in: raw reads and writes, nothing more.

A Store does the checking (names, digests, meta), the hashing, the codecs and the
parsing of name records, so a backend never sees a malformed name or an unverified
digest and never judges bytes. What it owes in return is atomicity: a reader sees a
whole object or name record or none at all, never part of one, and ``claim_name``
succeeds for exactly one caller across every process and machine sharing the place.

A backend may also offer ``holds(hexdigest, data: memoryview) -> bool``: whether the
object kept under the digest is exactly ``data``, which ``put`` asks before it decides
not to write. Without it the Store reads the object back whole and compares; with it a
backend can compare a piece at a time (the directory does) or ask its server (the
bucket compares the ETag), so that putting a large object twice needs no second copy.

I/O failures are raised as ``OSError`` (or ``StoreError``); the Store names the
operation and turns them into ``StoreError`` for its caller (one that a lack of
permission made says the store is read-only). A backend must pickle,
so that a Store can be handed to another process and open the same place there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """The raw I/O under a Store. ``hexdigest`` is always 64 lowercase hex characters."""

    #: Where the things are, as a person would write it (a path, ``s3://bucket/prefix``).
    where: str

    def object_at(self, hexdigest: str) -> str:
        """Where this object is or would be kept, for error messages."""
        ...

    def has_object(self, hexdigest: str) -> bool:
        """Whether an object is kept under this digest (its bytes are not checked)."""
        ...

    def read_object(self, hexdigest: str) -> bytes | None:
        """The bytes kept under this digest, or None; the Store verifies them."""
        ...

    def write_object(self, hexdigest: str, data: memoryview) -> None:
        """Keeps ``data`` under its digest, all at once or not at all.

        The Store calls this only after ``read_object`` found nothing there, or bytes
        that are not these (a corrupt object, which this replaces); a concurrent writer
        may have won meanwhile, and replacing an object with the same bytes must be
        harmless.
        """
        ...

    def read_name(self, name: str) -> bytes | None:
        """The record bound to ``name``, or None."""
        ...

    def write_name(self, name: str, record: bytes) -> None:
        """Binds ``name`` to ``record``, replacing any earlier record in one step."""
        ...

    def claim_name(self, name: str, record: bytes) -> bool:
        """Binds ``name`` to ``record`` only if nothing is bound to it; True if it did.

        Exactly one of any number of concurrent claimers wins, and no reader may ever see
        the winner's record incomplete.
        """
        ...

    def list_names(self, prefix: str | None) -> Iterable[tuple[str, bytes | OSError]]:
        """Every ``(name, record)`` bound, in any order.

        With a prefix, only the name equal to it and the names below it
        (``prefix + "/" + ...``); ``"run/a"`` does not reach ``"run/ab"``. A record that
        is there but cannot be read may come as the ``OSError`` saying why, in place of
        its bytes, so that the Store can list every other name.
        """
        ...
