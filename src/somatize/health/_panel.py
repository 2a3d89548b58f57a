"""The health of a run drawn for its report: ``panel`` (a plotly figure) and ``section``
(that figure under a table of the findings and what to do about each, as
``somatize.record.report`` takes it).

plotly is imported when something is drawn, never before, so reading and judging a
record needs nothing beyond somatize itself.
"""

from __future__ import annotations

import html
import math
from typing import Any

from ._loss import LOSS
from ._read import history_of, judged_facts, places_of
from ._rules import Finding, findings_of

__all__ = ["panel", "section"]

# What each row draws, and which findings are marked on it.
_LOSS_ROW = (LOSS, "loss", True, ("plateau", "diverging", "oscillating"))
_ROWS = (("grad_norm", "gradient norm", True, ("vanishing", "exploding")),
         ("update_ratio", "update ratio ‖Δw‖/‖w‖", True, ("not_updating", "update_too_large")),
         ("act_zero", "share of zeros (dying)", False, ("dying",)),
         ("act_saturated", "share saturated", False, ("saturated",)),
         ("leak_direction_auc", "label leak AUC, direction attack", False, ("label_leak",)),
         ("leak_norm_auc", "label leak AUC, norm attack", False, ()),
         ("input_dcor", "distance correlation, input ↔ sent", False, ()),
         ("input_dcor_corrected", "distance correlation, bias-corrected", False, ()))
_MARK = "rgb(214, 39, 40)"
_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b",
            "#ff9da6", "#9d755d", "#bab0ac")


def panel(store: Any, run: str, findings: list[Finding] | None = None, **thresholds: float) -> Any:
    """A plotly figure of a run's health: its loss, and per where, over the measured
    steps, its gradient norm, update ratio and shares of zeros and of saturated values,
    with each finding marked on its row at the step it starts (a NaN or Inf on every
    row, the run's own findings on the loss's).

    ``findings`` are what ``diagnose`` answered, if already at hand; otherwise it is
    asked with ``thresholds``. A run without health facts draws an empty figure that
    says so.
    """
    facts = judged_facts(store, run)
    if findings is None:
        findings = findings_of(facts, **thresholds)
    return _figure(run, _with_loss(facts), findings, places_of(facts))


def _with_loss(facts: list[dict[str, Any]]) -> dict[str, dict[str, list]]:
    """The history, and the loss as one more where with one measure (step n's loss is
    the n-th), drawn on its own row."""
    history = history_of(facts)
    losses = [fact.get("value") for fact in facts if fact["fact"] == "loss"]  # never a graph
    series = [(at, v) for at, v in enumerate(losses, 1)
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if series:
        history = {LOSS: {LOSS: series}, **history}
    return history


def _figure(run: str, history: dict[str, dict[str, list]], findings: list[Finding],
            places: dict[str, tuple[str, str]] | None = None) -> Any:
    from plotly.subplots import make_subplots

    places = places or {}
    rows = [row for row in (_LOSS_ROW, *_ROWS)
            if any(row[0] in measures for measures in history.values())] or list(_ROWS[:1])
    figure = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                           subplot_titles=[title for _, title, _, _ in rows])
    scales = {measure: _log_scale(history, measure) for measure, _, log, _ in rows if log}
    for at, where in enumerate(history):
        colour = _COLOURS[at % len(_COLOURS)]
        inside = places.get(where, (where, ""))[1] != ""  # a module inside a node: dotted
        for row, (measure, _, log, _) in enumerate(rows, 1):
            series = history[where].get(measure, [])
            if not series:
                continue
            scale = scales.get(measure)
            figure.add_scatter(
                x=[step for step, _ in series],
                y=[_drawable(v, scale is not None) for _, v in series],
                customdata=[_shown(v) for _, v in series], mode="lines",
                name=where, legendgroup=where, showlegend=row == 1 or not any(
                    history[where].get(m) for m, *_ in rows[:row - 1]),
                line={"color": colour, "width": 1 if inside else 1.5,
                      "dash": "dot" if inside else "solid"},
                hovertemplate=f"{html.escape(where)}<br>step %{{x}}<br>{measure} %{{customdata}}"
                              "<extra></extra>", row=row, col=1)
            zeros = [step for step, v in series if _is_zero(v)]
            if scale is not None and scale[0] is not None and zeros:
                _zeros_on_the_axis(figure, zeros, where, measure, colour, scale[0], row)
    for row, (measure, _, log, _) in enumerate(rows, 1):  # shares are drawn on their whole range
        scale = scales.get(measure)
        if not log:
            figure.update_yaxes(type="linear", range=[-0.02, 1.02], row=row, col=1)
        elif scale[0] is None:  # nothing above 0 to put on a log axis: drawn as it is
            figure.update_yaxes(type="linear", row=row, col=1)
        else:
            low, high = scale
            # A decade a label, as a power of ten, when the axis spans a few (its minor
            # labels would crowd it); else 1, 2 and 5 of each decade, each written whole:
            # plotly's own labels there are bare digits ("5 4 3 2 0.01").
            wide = high - low >= 2
            figure.update_yaxes(type="log", range=[low, high], row=row, col=1,
                                dtick=1 if wide else "D2", exponentformat="power",
                                tickformat=None if wide else ".2~g")
    _mark(figure, rows, findings)
    figure.update_xaxes(title_text="step", row=len(rows), col=1)
    figure.update_layout(
        title=f"Health of run {run}" + ("" if history else " — no health facts (not audited)"),
        height=220 * len(rows) + 120, template="plotly_white",
        font={"family": "Helvetica, Arial, sans-serif", "size": 13},
        legend={"title": {"text": "where"}}, margin={"l": 70, "r": 30, "t": 70, "b": 50})
    return figure


def _log_scale(history: dict[str, dict[str, list]], measure: str) -> tuple[float | None, float]:
    """The log axis's range (in decades) over every value above 0, a little beyond
    them, so that the axis's lower edge is below every one: that is where a zero is
    marked, as a zero. ``(None, 0)`` when nothing is above 0."""
    positive = [v for measures in history.values() for _, v in measures.get(measure, [])
                if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not positive:
        return None, 0.0
    low, high = math.log10(min(positive)), math.log10(max(positive))
    pad = max(0.15, (high - low) * 0.06)
    return low - pad, high + pad


def _zeros_on_the_axis(figure: Any, steps: list[int], where: str, measure: str, colour: str,
                       low: float, row: int) -> None:
    """Values of exactly 0 on a log axis, which has no 0: a marker on the axis's lower
    edge at each such step, said to be 0 — never a line drawn down to an invented floor,
    which a reader would take for a real value."""
    figure.add_scatter(
        x=steps, y=[10 ** low] * len(steps), mode="markers", name=f"{where}: exactly 0",
        legendgroup=where, showlegend=False, cliponaxis=False,
        marker={"symbol": "triangle-up", "size": 7, "color": colour,
                "line": {"width": 0.5, "color": "white"}},
        hovertemplate=f"{html.escape(where)}<br>step %{{x}}<br>{measure} exactly 0"
                      "<extra>0: on the axis</extra>", row=row, col=1)
    axis = figure.get_subplot(row, 1).yaxis.plotly_name.replace("yaxis", "y")
    said = "▲ on the axis: exactly 0"
    if not any(a.text == said and a.yref == f"{axis} domain" for a in figure.layout.annotations):
        figure.add_annotation(text=said, xref="paper", x=1, xanchor="right", yref=f"{axis} domain",
                              y=0.02, yanchor="bottom", showarrow=False,
                              font={"size": 10, "color": "#5b6272"})


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _drawable(value: Any, log: bool) -> float | None:
    """A value an axis can show: non-finite ones are gaps, and so, on a log axis, is
    a zero (marked on the axis instead) or a negative."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return None if log and value <= 0 else value


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def _mark(figure: Any, rows: list[tuple], findings: list[Finding]) -> None:
    """A dotted line per row and step where findings start, saying which and where."""
    marks: dict[tuple[int, int], dict[str, list[str]]] = {}
    for finding in findings:
        for row, (_, _, _, marked) in enumerate(rows, 1):
            if finding.what in marked or finding.what == "nonfinite":
                wheres = marks.setdefault((row, finding.since), {}).setdefault(finding.what, [])
                wheres.append(finding.where)
    for (row, since), said_here in marks.items():
        text = "; ".join(f"{what} · {', '.join(wheres)}" for what, wheres in said_here.items())
        figure.add_vline(x=since, row=row, col=1, line_dash="dot", line_color=_MARK,
                         line_width=1, annotation_text=html.escape(text),
                         annotation_font={"size": 10, "color": _MARK},
                         annotation_position="top right")


def section(store: Any, run: str) -> tuple[str, str] | None:
    """The report's health section: the findings as a table, then the panel. A run
    without health facts gets a line saying how to have them instead."""
    facts = judged_facts(store, run)
    if not any(fact["fact"] == "health" for fact in facts):
        return ("Health", ("<p class='note'>This run has no <code>health</code> facts: a "
                           "Trainer says them with <code>auditing=True</code>.</p>"))
    findings = findings_of(facts)
    figure = _figure(run, _with_loss(facts), findings, places_of(facts))
    body = figure.to_html(full_html=False, include_plotlyjs=False, div_id="somatize-health",
                          config={"displaylogo": False})
    return ("Health", table_html(findings) + body)


def table_html(findings: list[Finding]) -> str:
    """The findings as an HTML table, what to do about each beside it, or a line
    saying there are none."""
    if not findings:
        return "<p>No findings at the default thresholds.</p>"
    cells = "".join(
        f"<tr><td>{html.escape(f.where)}</td><td>{html.escape(f.what)}</td>"
        f"<td style='text-align:right'>{f.since}</td><td>{html.escape(f.brief)}</td>"
        f"<td class='advice'>{html.escape(f.advice)}</td></tr>"
        for f in findings)
    return ("<table style='border-collapse:collapse;font-size:14px;margin-bottom:12px' "
            "cellpadding='4'><tr><th align='left'>where</th><th align='left'>what</th>"
            "<th>since</th><th align='left'>evidence</th><th align='left'>what to do</th></tr>"
            f"{cells}</table>")
