"""The whole report of a run: the record's sections with the health ones between them.

The record writes a report of what it holds; the health panel and the graph with its
findings laid over it are opinions, so they are composed here, above both, and handed
to the record's ``report`` as sections.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .._described import rebuilt
from ..record import _report as recorded
from .._errors import SomaError
from ..record._read import listed, readable
from ._panel import section
from ._rules import diagnose, overlay

__all__ = ["drawing", "report"]

Section = recorded.Section


def drawing(graph: Any = None, inside: Any = None) -> Callable[[Any, str], Section | None]:
    """A report section: ``graph`` — or, without one, the graph the run's Trainer
    described in a ``graph`` fact — drawn with the run's findings laid over it and
    ``inside`` (``architecture``'s answer) opening its boxes; without ``inside``, the
    layers the Trainer recorded beside the graph open them, so a report drawn from the
    store alone shows what the run's own did. Nothing for a run that neither was given
    nor described a graph."""
    def drawn_section(store: Any, run: str) -> Section | None:
        said = graph_said(store, run)
        drawn = graph if graph is not None else described(said)
        if drawn is None:
            return None
        flags = overlay(diagnose(store, run)) or None
        if inside is not None:  # the caller's: what is wrong with it is theirs to see
            return ("The graph", drawn.figure(overlay=flags, inside=inside))
        # A record may hold anything: layers it says wrongly are left out, the graph
        # drawn closed (as a run recorded before Trainers said them is).
        with contextlib.suppress(SomaError, TypeError, ValueError):
            return ("The graph", drawn.figure(overlay=flags, inside=layers(said, drawn.nodes())))
        return ("The graph", drawn.figure(overlay=flags))
    return drawn_section


def graph_said(store: Any, run: str) -> dict[str, Any] | None:
    """The ``graph`` fact a run's Trainer said in its first forward (the last one there, if
    it said several); None when it said none that holds a graph."""
    first = readable(store, listed(store, run)[0][1])
    said = [f for f in (first or {}).get("facts", []) if type(f) is dict and f.get("fact") == "graph"
            and type(f.get("graph")) is dict]
    return said[-1] if said else None


def described(said: dict[str, Any] | None) -> Any:
    """The graph a ``graph`` fact describes, rebuilt to be drawn; None when there is no
    fact, or what it said is not a graph (a record may hold anything)."""
    if said is None:
        return None
    try:
        return rebuilt(said["graph"])
    except (SomaError, ValueError):  # undescribed() checks it whole, and says it is not
        return None  # not what describe() writes: the section is left out, as for none


def layers(said: dict[str, Any] | None, nodes: Any) -> dict[str, list] | None:
    """What each node holds, as a ``graph`` fact's ``inside`` recorded it
    (``{node: [[path, what], ...]}``), for the nodes among ``nodes``; None for a run
    recorded before Trainers said it, or one whose graph held no modules."""
    inside = (said or {}).get("inside")
    if type(inside) is not dict:
        return None
    known = set(nodes)
    kept = {node: parts for node, parts in inside.items() if node in known and type(parts) is list}
    return kept or None


def report(store: Any, run: str, path: Any, *, graph: Any = None, inside: Any = None) -> str:
    """Writes a run's whole report at ``path`` (one HTML file that opens offline) and
    answers the path: progress, health with the findings and what to do, the graph with
    the findings over it (``graph`` and ``inside`` as for ``drawing``), where the time
    went."""
    sections = [recorded.progress_section, section, drawing(graph, inside),
                recorded.spent_section]
    return recorded.report(store, run, path, sections=sections)
