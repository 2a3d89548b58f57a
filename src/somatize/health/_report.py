"""The whole report of a run: the record's sections with the health ones between them.

The record writes a report of what it holds; the health panel and the graph with its
findings laid over it are opinions, so they are composed here, above both, and handed
to the record's ``report`` as sections.
"""

from __future__ import annotations

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
    ``inside`` (``architecture``'s answer) opening its boxes. Nothing for a run that
    neither was given nor described a graph."""
    def drawn_section(store: Any, run: str) -> Section | None:
        drawn = graph if graph is not None else described(store, run)
        if drawn is None:
            return None
        flags = overlay(diagnose(store, run)) or None
        return ("The graph", drawn.figure(overlay=flags, inside=inside))
    return drawn_section


def described(store: Any, run: str) -> Any:
    """The graph a run's Trainer described in its first forward's ``graph`` fact, rebuilt
    to be drawn; None when it described none, or what it said is not a graph (a record
    may hold anything)."""
    first = readable(store, listed(store, run)[0][1])
    said = [f for f in (first or {}).get("facts", []) if type(f) is dict and f.get("fact") == "graph"
            and type(f.get("graph")) is dict]
    if not said:
        return None
    try:
        return rebuilt(said[-1]["graph"])
    except (SomaError, ValueError):  # undescribed() checks it whole, and says it is not
        return None  # not what describe() writes: the section is left out, as for none


def report(store: Any, run: str, path: Any, *, graph: Any = None, inside: Any = None) -> str:
    """Writes a run's whole report at ``path`` (one HTML file that opens offline) and
    answers the path: progress, health with the findings and what to do, the graph with
    the findings over it (``graph`` and ``inside`` as for ``drawing``), where the time
    went."""
    sections = [recorded.progress_section, section, drawing(graph, inside),
                recorded.spent_section]
    return recorded.report(store, run, path, sections=sections)
