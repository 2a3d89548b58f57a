"""A run as one HTML file that opens anywhere, offline: plotly's script is inside it.

A report is a list of sections, each asked in turn with ``(store, run)``; one answers
``(heading, body)`` where the body is a plotly figure or a piece of HTML, or None to
leave itself out. ``SECTIONS`` is the list later parts extend.
"""

from __future__ import annotations

import datetime
import html
import os
from collections.abc import Callable
from typing import Any

from .._version import __version__
from ._read import curve, run_of
from ._recorder import check_run

__all__ = ["SECTIONS", "Section", "drawing", "report"]

Section = tuple[str, Any]


def _progress(store: Any, run: str) -> Section | None:
    from ._figures import progress

    if not curve(store, run, "loss"):
        return ("Progress", ("<p class='note'>This run has no <code>loss</code> facts: a "
                             "Trainer says one after every step, a bare forward does not.</p>"))
    return ("Progress", progress(store, run))


def _spent(store: Any, run: str) -> Section | None:
    from ._figures import spent

    return ("Where the time went", spent(store, run))


def _health(store: Any, run: str) -> Section | None:
    from ..health import (
        section,  # health reads records: imported when asked, not before
    )

    return section(store, run)


def drawing(graph: Any = None, inside: Any = None) -> Callable[[Any, str], Section | None]:
    """A report section: ``graph`` — or, without one, the graph the run's Trainer
    described in a ``graph`` fact — drawn with the audit's findings laid over it and
    ``inside`` (``architecture``'s answer) opening its boxes. Nothing for a run that
    neither was given nor described a graph."""
    def section(store: Any, run: str) -> Section | None:
        from .._described import rebuilt
        from ..health import diagnose, overlay
        from ._read import facts

        drawn = graph
        if drawn is None:
            said = [f for f in facts(store, run, 0) if f.get("fact") == "graph"]
            if not said:
                return None
            drawn = rebuilt(said[-1]["graph"])
        flags = overlay(diagnose(store, run)) or None
        return ("The graph", drawn.figure(overlay=flags, inside=inside))
    return section


#: What a report holds, in order; a list that later parts extend.
SECTIONS: list[Callable[[Any, str], Section | None]] = [_progress, _health, drawing(), _spent]

_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; color: #222; margin: 24px auto;
       max-width: 1280px; padding: 0 24px; }
h1 { font-size: 22px; margin-bottom: 4px; }
h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.facts { color: #555; font-size: 14px; }
.note { color: #666; font-style: italic; }
footer { color: #999; font-size: 12px; margin-top: 32px; }
"""


def _when(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _heading(store: Any, run: str) -> str:
    found = run_of(store, run)
    said = [f"{found.forwards} forwards", f"from {_when(found.first)} to {_when(found.last)}"]
    said += [f"last {key} {value:.5g}" if isinstance(value, float) else f"last {key} {value}"
             for key, value in found.summary.items() if not isinstance(value, (dict, list))]
    said.append(f"store {getattr(store, 'where', store)}")
    return " · ".join(html.escape(part) for part in said)


def _body(part: Any, at: int) -> str:
    if isinstance(part, str):
        return part
    return part.to_html(full_html=False, include_plotlyjs=False, div_id=f"somatize-{at}",
                        config={"displaylogo": False})


def report(store: Any, run: str, path: Any, *, sections: list[Callable[[Any, str], Section | None]] | None = None) -> str:
    """Writes one run as a self-contained HTML file at ``path`` and answers the path.

    Everything it needs is inside the file, plotly's script included, so it opens
    without a network. Written beside the target and renamed into place, so a reader
    never finds half a report. An unknown run is refused before anything is written.
    """
    from plotly.offline import get_plotlyjs

    from ._read import listed

    listed(store, check_run(run))  # refuses an unknown run, naming the known ones
    parts = []
    for at, section in enumerate(SECTIONS if sections is None else sections):
        answer = section(store, run)
        if answer is not None:
            heading, body = answer
            parts.append(f"<section><h2>{html.escape(heading)}</h2>{_body(body, at)}</section>")
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>somatize — {html.escape(run)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        f"<h1>Run {html.escape(run)}</h1><p class='facts'>{_heading(store, run)}</p>"
        + "".join(parts)
        + f"<footer>written by somatize {__version__} on {_when(_now())}</footer></body></html>\n"
    )
    target = os.fspath(path)
    scratch = f"{target}.tmp"
    with open(scratch, "w", encoding="utf-8") as out:
        out.write(page)
    os.replace(scratch, target)
    return target


def _now() -> float:
    return datetime.datetime.now(datetime.UTC).timestamp()
