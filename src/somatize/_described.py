"""A graph as data, and a graph rebuilt from that data for drawing.

A record holds what happened, not what ran it; a report drawn later, in another
process, still wants the graph. So a Trainer says a ``graph`` fact once — the ids,
edges, what implements each node (by name), placement and declarations — and a
reader rebuilds a graph from it whose nodes are stand-ins: they carry the recorded
class name, so a drawing says the same thing, and they refuse to run.
"""

from __future__ import annotations

from typing import Any

from ._graph import Graph

__all__ = ["describe", "rebuilt"]


def describe(graph: Graph) -> dict[str, Any]:
    """The graph as plain data (what a ``graph`` fact carries)."""
    return {
        "nodes": graph.nodes(),
        "edges": [list(edge) for edge in graph.edges()],
        "identities": graph.identities(),
        "devices": graph.devices(),
        "hosts": graph.hosts(),
        "cached": graph.cached(),
        "frozen": graph.frozen(),
        "mapped": graph.mapped_nodes(),
    }


def rebuilt(description: dict[str, Any]) -> Graph:
    """A drawable graph from ``describe``'s data; its nodes cannot be run."""
    graph = Graph()
    kinds: dict[str, type] = {}
    for node in description["nodes"]:
        identity = description["identities"].get(node, "unknown.Unknown")
        kind = kinds.get(identity)
        if kind is None:
            module, _, name = identity.rpartition(".")
            kind = kinds[identity] = type(name, (_StandIn,), {"__module__": module or "unknown"})
        graph._add(node, kind())
    for source, target in description["edges"]:
        graph._connect(source, target)
    graph._devices.update(description.get("devices", {}))
    graph._hosts.update(description.get("hosts", {}))
    graph._cached.update(description.get("cached", {}))
    graph._frozen.update(description.get("frozen", {}))
    graph._mapped.update(dict.fromkeys(description.get("mapped", [])))
    return graph


class _StandIn:
    """Where a recorded node is drawn: its class's name, and nothing to run."""

    def forward(self, input: Any, ctx: Any) -> Any:
        raise RuntimeError(f"{type(self).__qualname__} was rebuilt from a record to be drawn; "
                           "it cannot run")
