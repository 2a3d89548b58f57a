"""Every error somatize raises, under one base.

Each one is also the built-in a caller would reach for first, so ``except
ValueError`` keeps working for code that has never heard of somatize::

    SomaError
    ├── DeclarationError        ValueError   the graph as written cannot be built
    │   ├── CycleError                       an edge would close a cycle (the path is named)
    │   ├── MissingForward      TypeError    a Node subclass without forward
    │   └── NotWhole            TypeError    a count that is not a whole number in range
    ├── EdgeError               TypeError    a value on an edge is neither data nor Opaque
    ├── NodeError               ValueError   a node raised; names the node (and host)
    ├── CacheError              ValueError   a cache over something that can still change,
    │                                        or over something that cannot be written down
    ├── UnwritableError         TypeError    a value has no codec and had to be written
    ├── StoreError              OSError      a store could not do what was asked
    │   ├── CorruptObject       ValueError   bytes that do not match their digest
    │   └── BadName             ValueError   a name or digest that is not well formed
    ├── RecordError             ValueError   a run, forward or record that cannot be read
    │   └── CorruptRecord                    a record's bytes that are not a record (also
    │                                        a CorruptObject: they hash right all the same)
    ├── WireError               ConnectionError   a worker could not be reached or answered badly
    │   ├── Silent              TimeoutError      a connection quiet past its heartbeat
    │   ├── Unauthorised        PermissionError   the token or the certificate did not match
    │   ├── ProtocolError                         a frame that is not one
    │   └── StateLost                             what a session learnt on a worker is gone
    ├── Lost                    LookupError  an output that stayed on the worker that made it
    ├── NoGradient              RuntimeError something the optimizer holds got no gradient
    └── OutOfStep               RuntimeError a gradient for an activation that is gone

Foreign exceptions are translated at one boundary each (the walk, the store, the
wire); nothing else catches broadly. Every one pickles with its fields
(``SomaError.__reduce__``), so it crosses a process boundary as itself.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadName",
    "CacheError",
    "CorruptObject",
    "CycleError",
    "DeclarationError",
    "EdgeError",
    "Lost",
    "MissingForward",
    "NotWhole",
    "NoGradient",
    "NodeError",
    "OutOfStep",
    "ProtocolError",
    "RecordError",
    "Silent",
    "SomaError",
    "StateLost",
    "StoreError",
    "Unauthorised",
    "UnwritableError",
    "WireError",
    "whole_number",
]


class SomaError(Exception):
    """The base of everything somatize raises on purpose.

    Every one crosses a process boundary (a process pool, a Ray task, a submitit job)
    as itself, its fields included: pickle's default would call ``type(error)(*args)``,
    which an error whose fields are keyword-only (``NodeError``, ``Lost``) or extra
    (``CycleError``) refuses, so the error is remade without ``__init__``, from its
    ``args`` and its attributes (an ``OSError``'s errno and file names among them).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        fields = dict(self.__dict__)
        if isinstance(self, OSError):
            # OSError's own slots, not in __dict__; only those set are put back, since
            # one set to None prints otherwise than one never set
            for name in ("errno", "strerror", "filename", "filename2"):
                if getattr(self, name) is not None:
                    fields[name] = getattr(self, name)
        return _remade, (type(self), self.args), fields or None


class DeclarationError(SomaError, ValueError):
    """The graph, as written, cannot be built: unknown ids, duplicates, bad names."""


class CycleError(DeclarationError):
    """An edge would close a cycle. ``path`` is the cycle, first node repeated last."""

    def __init__(self, message: str, path: list[str]):
        super().__init__(message)
        self.path = path


class MissingForward(DeclarationError, TypeError):
    """A Node subclass that does not say what it computes."""


class EdgeError(SomaError, TypeError):
    """A value on an edge that is neither data nor an ``Opaque``."""


class NodeError(SomaError, ValueError):
    """A node raised while running.

    ``node`` is its id, ``host`` where it ran (None for here), ``kind`` the name of
    the exception's type. Here the original is the ``__cause__``; from a worker its
    text crosses, and the worker's traceback, as text, is the cause.
    """

    def __init__(self, message: str, *, node: str, host: str | None = None, kind: str = ""):
        super().__init__(message)
        self.node = node
        self.host = host
        self.kind = kind


class CacheError(SomaError, ValueError):
    """A ``.cached()`` node that cannot be kept honestly."""


class UnwritableError(SomaError, TypeError):
    """A value had to be written down and nobody said how (no codec for its type)."""


class StoreError(SomaError, OSError):
    """A store could not do what it was asked."""


class CorruptObject(StoreError, ValueError):
    """Bytes whose digest is not the one they are stored under."""


class BadName(StoreError, ValueError):
    """A name or digest that is not well formed."""


class RecordError(SomaError, ValueError):
    """A run, a forward or a record that cannot be read as asked."""


class CorruptRecord(CorruptObject, RecordError):
    """An object bound as a record whose bytes are not one; caught as either parent."""


class WireError(SomaError, ConnectionError):
    """A worker could not be reached, died, or answered with something else."""

    def __init__(self, message: str, *, host: str | None = None):
        super().__init__(message)
        self.host = host


class Silent(WireError, TimeoutError):
    """A connection that said nothing, not even a heartbeat, for too long."""


class Unauthorised(WireError, PermissionError):
    """The other end does not share our token, or its TLS certificate does not verify."""


class ProtocolError(WireError):
    """Something arrived that is not a frame of ours."""


class StateLost(WireError):
    """What a session had learnt on a worker (its trainers' weights and optimizer
    state) is gone: the worker restarted, or let go of the session. ``nodes`` are the
    ones whose state it was; resuming from a checkpoint starts the session afresh."""

    def __init__(self, message: str, *, host: str | None = None, nodes: list[str] = ()):
        super().__init__(message, host=host)
        self.nodes = list(nodes)


class Lost(SomaError, LookupError):
    """An output that could not travel and stayed where it was made."""

    def __init__(self, message: str, *, node: str, host: str):
        super().__init__(message)
        self.node = node
        self.host = host


class NoGradient(SomaError, RuntimeError):
    """Something the optimizer holds never got a gradient."""


class OutOfStep(SomaError, RuntimeError):
    """A gradient arrived for an activation that is not there any more."""


class NotWhole(DeclarationError, TypeError):
    """A count (steps, pieces, a depth) that is not a whole number in its range. Both a
    ValueError and a TypeError, since either is what a caller would reach for."""


def whole_number(value: Any, name: str, *, least: int = 1, of: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``least``; else ``NotWhole``
    naming ``of`` (who asks), the argument and what was given. The one such check."""
    if type(value) is not int or value < least:
        said = f"{of}: " if of else ""
        raise NotWhole(f"{said}{name}={value!r}; {name} is a whole number from {least} up")
    return value


def _remade(cls: type[SomaError], args: tuple[Any, ...]) -> SomaError:
    """An error of type ``cls`` holding ``args``, its ``__init__`` left uncalled; pickle
    then puts its attributes back (``SomaError.__reduce__``)."""
    error = cls.__new__(cls, *args)
    error.args = args
    return error


def walk_error(exc: SomaError) -> SomaError:
    """Marks an error the walk raised itself (already naming the node), so the walk
    does not wrap it again as that node's failure."""
    exc.soma_walk = True  # type: ignore[attr-defined]
    return exc
