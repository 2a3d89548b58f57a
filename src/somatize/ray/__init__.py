"""Hosts on a Ray cluster: ``Worker.on_ray(num_gpus=1)`` is a worker that is a Ray actor.

The actor runs a slice the way ``somatize worker`` does (``somatize.wire.host``); only
the carrying differs: a slice is one actor call, its tensors and bytes travel as
objects in Ray's store, and a death is Ray's to see.

This layer sits above the wire: as it loads it tells the wire how ``Worker.on_ray`` is
answered (``provides``), and the wire, which never imports it, loads it by name the first
time ``on_ray`` is asked for. Importing it costs nothing: Ray itself is imported when
the first such worker is declared.
"""

from __future__ import annotations

from typing import Any

from .._optional import optional
from ..wire.declare import provides

__all__ = ["RayWorker"]


def _on_ray(mode: str, send: Any, **options: Any) -> Any:
    return optional(f"{__name__}.worker", "ray", "Worker.on_ray").RayWorker(mode, send, **options)


def __getattr__(name: str) -> Any:
    if name == "RayWorker":
        from .worker import RayWorker

        return RayWorker
    raise AttributeError(f"module 'somatize.ray' has no attribute {name!r}")


provides("ray", _on_ray)
