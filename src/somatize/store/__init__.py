"""Where somatize keeps things: bytes by their content, and names that point at them.

Caching, training records and federated rounds all go through a Store; it is the one
thing two processes (or two machines) share. ``Store(directory)`` keeps everything in
a directory; ``Store.over(backend)`` in any place a ``Backend`` can reach.
"""

from __future__ import annotations

from ._store import Bound, Store
from .backend import Backend
from .local import DirectoryBackend

__all__ = ["Backend", "Bound", "DirectoryBackend", "Store"]
