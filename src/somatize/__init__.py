"""somatize: computation graphs whose nodes are plain objects with a ``forward``.

Write the graph as an expression and let it run — here, or with slices on other
machines through dumb workers. Outputs are remembered by content, what happened is
recorded, and the graph can be drawn::

    from somatize import Graph, Node

    class Clean(Node):
        def forward(self, x, ctx):
            return x.strip()

    class Shout(Node):
        def forward(self, x, ctx):
            return x.upper()

    Graph.somatize(Clean() >> Shout()).forward("  hello  ")   # 'HELLO'

The core imports nothing beyond the standard library: training lives in
``somatize.torch``, figures need the ``viz`` extra, buckets the ``s3`` extra, and the
wire (``Broker``, ``Worker``) is loaded the first time one of them is asked for.
"""

from __future__ import annotations

from typing import Any

from . import _engine  # noqa: F401  (the walk hands its functions down to Graph as it loads)
from ._codec import codec, codecs_registered
from ._errors import (
    BadName,
    CacheError,
    CorruptObject,
    CycleError,
    DeclarationError,
    EdgeError,
    Lost,
    MissingForward,
    NodeError,
    ProtocolError,
    RecordError,
    Silent,
    SomaError,
    StateLost,
    StoreError,
    Unauthorised,
    UnwritableError,
    WireError,
)
from ._graph import Graph
from ._node import Ctx, Done, Node, Opaque
from ._version import __version__

__all__ = [
    "BadName",
    "Bound",
    "Broker",
    "CacheError",
    "CorruptObject",
    "Ctx",
    "CycleError",
    "DeclarationError",
    "Done",
    "EdgeError",
    "Graph",
    "Lost",
    "MissingForward",
    "Node",
    "NodeError",
    "Opaque",
    "ProtocolError",
    "RecordError",
    "Recorder",
    "Silent",
    "SomaError",
    "StateLost",
    "Store",
    "StoreError",
    "Unauthorised",
    "UnwritableError",
    "WireError",
    "Worker",
    "__version__",
    "codec",
    "codecs_registered",
]

# Loaded on first use, so that importing somatize costs the core and nothing else.
_LATER = {
    "Store": ("store", "Store"),
    "Bound": ("store", "Bound"),
    "Recorder": ("record", "Recorder"),
    "Broker": ("wire", "Broker"),
    "Worker": ("wire", "Worker"),
}


def __getattr__(name: str) -> Any:
    if name in _LATER:
        from importlib import import_module

        module, attribute = _LATER[name]
        value = getattr(import_module(f"{__name__}.{module}"), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'somatize' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
