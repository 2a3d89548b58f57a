"""A graph rebuilt from a record, to be drawn.

A record holds what happened, not what ran it; a report drawn later, in another
process, still wants the graph. A Trainer says a ``graph`` fact once (the graph's
``describe``d data form), and a reader rebuilds from it a graph whose nodes are
stand-ins: they carry the recorded class name, so a drawing says the same thing, and
they refuse to run.
"""

from __future__ import annotations

from typing import Any

from ._graph import Graph, undescribed

__all__ = ["rebuilt"]


def rebuilt(description: dict[str, Any]) -> Graph:
    """A drawable graph from a ``describe``d one; its nodes cannot be run."""
    kinds: dict[str, type] = {}

    def stand_in(node: str, identity: str) -> Any:
        kind = kinds.get(identity)
        if kind is None:
            module, _, name = identity.rpartition(".")
            kind = kinds[identity] = type(name or "Unknown", (_StandIn,),
                                          {"__module__": module or "unknown"})
        return kind()

    return Graph.from_data(undescribed(description, stand_in))


class _StandIn:
    """Where a recorded node is drawn: its class's name, and nothing to run."""

    def forward(self, input: Any, ctx: Any) -> Any:
        raise RuntimeError(f"{type(self).__qualname__} was rebuilt from a record to be drawn; "
                           "it cannot run")
