"""A run as one HTML file that opens anywhere, offline: plotly's script is inside it.

A report is a list of sections, each asked in turn with ``(store, run)``; one answers
``(heading, body)`` where the body is a plotly figure or a piece of HTML, or None to
leave itself out. ``SECTIONS`` are the record's own (progress, where the time went);
the layers above compose more around them (``somatize.health.report`` adds the health
panel and the graph with its findings), handing them in as ``sections``.
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

__all__ = ["SECTIONS", "Section", "answered", "progress_section", "report", "spent_section"]

Section = tuple[str, Any]


def progress_section(store: Any, run: str) -> Section | None:
    from ._figures import progress

    if not curve(store, run, "loss"):
        return ("Progress", ("<p class='note'>This run has no <code>loss</code> facts: a "
                             "Trainer says one after every step, a bare forward does not.</p>"))
    return ("Progress", progress(store, run))


def spent_section(store: Any, run: str) -> Section | None:
    from ._figures import spent

    return ("Where the time went", spent(store, run))


#: What a report of the record alone holds, in order. ``somatize.health.report`` puts
#: the health panel and the graph with its findings between them.
SECTIONS: list[Callable[[Any, str], Section | None]] = [progress_section, spent_section]

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
    try:
        moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    except (OverflowError, ValueError, OSError):  # a binding may say any time
        return f"{seconds} s"
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _heading(store: Any, run: str) -> str:
    found = run_of(store, run)
    said = [f"{found.forwards} forwards", f"from {_when(found.first)} to {_when(found.last)}"]
    said += [f"last {key} {value:.5g}" if isinstance(value, float) else f"last {key} {value}"
             for key, value in found.summary.items() if not isinstance(value, (dict, list))]
    said.append(f"store {getattr(store, 'where', store)}")
    return " · ".join(html.escape(part) for part in said)


def _damage(store: Any, run: str) -> str:
    """A note naming the records the sections left out, and why; '' when none was."""
    from ._read import damaged

    found = damaged(store, run)
    if not found:
        return ""
    items = "".join(f"<li><code>{html.escape(name)}</code>: {html.escape(why)}</li>"
                    for name, why in list(found.items())[:20])
    more = f"<li>and {len(found) - 20} more</li>" if len(found) > 20 else ""
    return (f"<section class='damaged'><h2>Damaged records</h2><p class='note'>{len(found)} "
            f"record{'s' if len(found) != 1 else ''} of this run could not be read; what is "
            f"drawn above is the rest.</p><ul>{items}{more}</ul></section>")


def answered(section: Callable[[Any, str], Section | None], store: Any, run: str) -> Section | None:
    """What ``section`` answers, or, if what the store holds stops it (a record it
    cannot read, a fact of no shape it knows), a note saying so in its place: one
    section that cannot be drawn must not take the others down with it."""
    from .._errors import SomaError

    try:
        return section(store, run)
    except SomaError as exc:  # a bug of somatize's (any other error) is not hidden here
        name = getattr(section, "__name__", "a section")
        return (name.replace("_section", "").replace("_", " ").capitalize(),
                f"<p class='note'>This section could not be drawn from what the store holds "
                f"({html.escape(type(exc).__name__)}: {html.escape(str(exc)[:300])}).</p>")


def _body(part: Any, at: int) -> str:
    if isinstance(part, str):
        return part
    part.update_layout(modebar={"orientation": "v"})  # upright at the edge, off the title
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
        answer = answered(section, store, run)
        if answer is not None:
            heading, body = answer
            parts.append(f"<section><h2>{html.escape(heading)}</h2>{_body(body, at)}</section>")
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>somatize — {html.escape(run)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        f"<h1>Run {html.escape(run)}</h1><p class='facts'>{_heading(store, run)}</p>"
        + "".join(parts) + _damage(store, run)
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
