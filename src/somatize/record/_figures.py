"""The record drawn: a curve over the forwards, and where the time went.

plotly is imported here and nowhere above, so ``somatize.record`` reads runs on a
machine without it and only drawing asks for the ``viz`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._read import Tally, series, tally

__all__ = ["curve_figure", "progress", "smoothed", "spent"]

RAW = "rgba(99, 110, 250, 0.5)"
SMOOTH = "rgb(45, 55, 200)"
VALIDATION = "rgb(230, 120, 20)"  # what Trainer.evaluate said, beside the training loss
FONT = {"family": "Helvetica, Arial, sans-serif", "size": 13}


def go() -> Any:
    try:
        from plotly import graph_objects
    except ImportError:
        raise ImportError("drawing a record needs plotly: pip install 'somatize[viz]'") from None
    return graph_objects


def smoothed(values: Sequence[float], weight: float) -> list[float | None]:
    """An exponential moving average, debiased so the start is not pulled toward zero
    (as TensorBoard does); a value that is not finite is passed over, not averaged in."""
    out: list[float | None] = []
    average, seen = 0.0, 0
    for value in values:
        if math.isfinite(value):
            average = weight * average + (1 - weight) * value
            seen += 1
        out.append(average / (1 - weight ** seen) if seen else None)
    return out


def _smoothed_as_drawn(values: Sequence[float], weight: float, log: bool) -> list[float | None]:
    """The moving average in the axis's own terms: of the logarithms on a log axis, where
    an average of the values is ruled by the largest (a loss gone from 1 to 1e-8 would
    end smoothed near 1e-2, far above every point it smooths)."""
    if not log:
        return smoothed(values, weight)
    logs = [math.log10(v) if math.isfinite(v) and v > 0 else math.nan for v in values]
    return [None if m is None else 10 ** m for m in smoothed(logs, weight)]


def _check_weight(smoothing: Any) -> float:
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) \
            or not 0 <= smoothing < 1:
        raise ValueError(f"smoothing is a weight from 0 (none) up to but not including 1, "
                         f"not {smoothing!r}; 0.9 averages over about ten forwards")
    return float(smoothing)


def curve_figure(xs: Sequence[int], values: Sequence[float], *, name: str = "loss",
                 title: str = "", smoothing: float = 0.9) -> Any:
    """A curve raw and smoothed, forward index across: what ``progress`` and ``Live`` draw."""
    graph_objects = go()
    weight = _check_weight(smoothing)
    clean = [v if math.isfinite(v) else None for v in values]
    fig = graph_objects.Figure()
    fig.add_trace(graph_objects.Scatter(
        x=list(xs), y=clean, mode="lines", name=f"{name} (raw)",
        line={"color": RAW, "width": 1},
        hovertemplate=f"forward %{{x}}<br>{name} %{{y:.6g}}<extra>raw</extra>",
    ))
    finite = [v for v in values if math.isfinite(v)]
    # Losses spread over decades read better on a log axis.
    log = bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= 100
    fig.add_trace(graph_objects.Scatter(
        x=list(xs), y=_smoothed_as_drawn(values, weight, log), mode="lines",
        name=f"{name} (smoothed {weight:g})",
        line={"color": SMOOTH, "width": 2.5},
        hovertemplate="forward %{x}<br>smoothed %{y:.6g}<extra>smoothed</extra>",
    ))
    flat = _flat(finite)
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left"}, template="plotly_white", font=FONT,
        height=420, margin={"l": 70, "r": 30, "t": 70, "b": 55}, hovermode="x",
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"},
        xaxis={"title": "forward", "rangemode": "tozero"},
        yaxis={"title": name + (" (log scale)" if log else ""), "type": "log" if log else "linear",
               **({"range": list(flat), "tickformat": ".4~g"} if flat else {}),
               # a label a decade, as a power of ten: minor ones crowd it
               **({"dtick": 1, "exponentformat": "power"} if log else {})},
    )
    if flat:
        level = (flat[0] + flat[1]) / 2
        fig.add_annotation(text=f"flat: every value within {FLAT:g} of its size of {level:.6g}",
                           showarrow=False, xref="paper", yref="paper", x=0.01, y=0.98,
                           xanchor="left", yanchor="top", font={"size": 12, "color": "#5b6272"})
    if not values:
        fig.add_annotation(text=f"no {name!r} facts to draw yet", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 16})
    return fig


FLAT = 1e-5  # a curve whose values all lie within this share of their size is drawn flat


def _flat(finite: list[float]) -> tuple[float, float] | None:
    """The y range to draw a curve on when it does not move: its level with room either
    side; None when it moves. Left to itself, plotly zooms into float noise (1e-8 of a
    loss of 0.69), where no tick label fits and a smoothed line zigzags as if the loss
    moved."""
    if len(finite) < 2:
        return None
    low, high = min(finite), max(finite)
    size = max(abs(low), abs(high))
    if high - low > FLAT * size:
        return None
    pad = size * 0.05 if size > 0 else 1.0
    return low - pad, high + pad


def progress(store: Any, run: str, *, fact: str = "loss", smoothing: float = 0.9) -> Any:
    """A plotly figure of one fact over a run (the loss by default), raw and smoothed.

    Read from the names alone when the run summarised the fact, so a long run draws
    without opening its records. ``smoothing`` is the moving average's weight.
    """
    _check_weight(smoothing)
    # A loss curve is drawn with what each Trainer.evaluate said beside it, read in
    # the same pass over the records.
    wanted = [(fact, "value")] + ([("evaluated", "loss")] if fact == "loss" else [])
    found, *more = series(store, run, wanted)
    checked = more[0] if more else []
    xs = [forward for forward, _ in found]
    values = [value for _, value in found]
    if values:
        last = values[-1]
        finite = [(v, x) for x, v in found if math.isfinite(v)]
        best = min(finite) if finite else None
        said = f"last {last:.4g}" + (f", lowest {best[0]:.4g} at forward {best[1]}" if best else "")
        title = f"<b>{run}</b> — {fact} over {len(values)} forwards ({said})"
    else:
        title = f"<b>{run}</b> — no {fact!r} facts recorded"
    fig = curve_figure(xs, values, name=fact, title=title, smoothing=smoothing)
    if checked:
        fig.add_trace(go().Scatter(
            x=[forward for forward, _ in checked], y=[value for _, value in checked],
            mode="lines+markers", name="validation loss", line={"color": VALIDATION, "width": 2},
            marker={"size": 7},
            hovertemplate="forward %{x}<br>validation loss %{y:.6g}<extra>evaluated</extra>"))
    return fig


def _ms(us: float) -> str:
    if us >= 1_000_000:
        return f"{us / 1e6:.3g} s"
    return f"{us / 1000:.3g} ms"


def _bytes(count: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"


def spent(store: Any, run: str) -> Any:
    """A plotly figure of where a run's time went: per node, largest on top, its time
    forward, backward (a trainer walking back through it) and in the run's first
    forward (its warm-up), each apart, and coloured by host; below, the time and bytes
    sent to and received from each host when the run crossed a wire.

    The title compares like with like: the forwards' end-to-end time with the nodes'
    forward time (here, and on workers), both after the first forward; the backward
    and the warm-up are said on their own, since no end to end of a forward holds them.
    """
    summed = tally(store, run)
    graph_objects = go()
    from plotly.subplots import make_subplots

    ranked = sorted(summed.nodes.items(), key=lambda item: (-item[1]["total_us"], item[0]))
    rows = 2 if summed.hops else 1
    heights = [max(1, len(ranked)), max(1, len(summed.hops)) + 1] if rows == 2 else [1]
    fig = make_subplots(rows=rows, cols=1, row_heights=heights, vertical_spacing=0.16,
                        subplot_titles=[_NODES_TITLE]
                        + (["time on the wire, by host (ms)"] if rows == 2 else []))
    _node_bars(fig, graph_objects, ranked)
    if summed.hops:
        _hop_bars(fig, graph_objects, summed)
    bars = len(ranked) + (2 * len(summed.hops) + 2 if summed.hops else 0)
    fig.update_layout(
        # The title's lines from the top down, clear of the nodes' own title below them.
        title={"text": _spent_title(run, summed), "x": 0.01, "xanchor": "left",
               "yref": "container", "y": 1, "yanchor": "top", "pad": {"t": 16}},
        template="plotly_white", font=FONT, barmode="group", bargap=0.25,
        height=max(360, 210 + 34 * bars), margin={"l": 140, "r": 40, "t": 140, "b": 50},
        # to the right of the bars, clear of the titles above them, which it covered
        legend={"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1.0, "yanchor": "top"},
    )
    fig.update_xaxes(rangemode="tozero", row=1, col=1)
    fig.update_annotations(selector={"text": _NODES_TITLE}, x=0, xanchor="left")
    if not ranked:
        fig.add_annotation(text="no node ran in this run", showarrow=False, xref="paper",
                           yref="paper", x=0.5, y=0.5, font={"size": 16})
    return fig


_NODES_TITLE = "time in each node (ms, summed over the run)"


def _spent_title(run: str, summed: Tally) -> str:
    entries = summed.nodes.values()
    here = sum(e["forward_us"] for e in entries if e["host"] is None)
    away = sum(e["forward_us"] for e in entries if e["host"] is not None)
    backward = sum(e["backward_us"] for e in entries)
    first = sum(e["first_us"] for e in entries)
    wire_us = sum(h["sent_us"] + h["received_us"] for h in summed.hops.values())
    later = summed.took_us - summed.first_took_us
    head = [f"{summed.forwards} forwards"]
    if summed.failed:
        head.append(f"{summed.failed} failed")
    if summed.damaged:
        head.append(f"{len(summed.damaged)} damaged, left out")
    lines = [f"<b>{run}</b> — where the time went ({', '.join(head)})"]
    if summed.took_us:
        said = [f"forwards end to end {_ms(later)}" + (" after the first" if summed.forwards > 1
                                                       else ""),
                f"in the nodes forward {_ms(here)} here" + (f", {_ms(away)} on workers"
                                                            if away else "")]
        if wire_us:
            said.append(f"wire {_ms(wire_us)}")
        lines.append(" · ".join(said))
    apart = []
    if backward:
        apart.append(f"backward {_ms(backward)} (after the forwards, so not in their end to end)")
    if summed.first_took_us or first:
        apart.append(f"first forward {_ms(summed.first_took_us)} end to end, "
                     f"{_ms(first)} in its nodes (warm-up)")
    if apart:
        lines.append(" · ".join(apart))
    return "<br>".join(lines[:1] + [f"<span style='font-size:12px'>{line}</span>"
                                    for line in lines[1:]])


_PARTS = (("forward_us", "forward", ""), ("backward_us", "backward", "/"),
          ("first_us", "first forward (warm-up)", "."))


def _node_bars(fig: Any, graph_objects: Any, ranked: list[tuple[str, dict[str, Any]]]) -> None:
    # The graph's own figure colours hosts this way too; drawing is the one part of the
    # record that reaches the viz layer, so the record still reads runs without it.
    from ..viz import host_colours

    colours = host_colours([entry["host"] for _, entry in ranked])
    by_host: dict[str | None, list[tuple[str, dict[str, Any]]]] = {}
    for node, entry in ranked:
        by_host.setdefault(entry["host"], []).append((node, entry))
    order = [node for node, _ in ranked][::-1]  # largest at the top
    # Each node's parts end to end, one after the other: drawn from where the one
    # before ended (base), in one slot per node, since the wire's bars below are grouped.
    bases = {node: {} for node, _ in ranked}
    for node, entry in ranked:
        at = 0.0
        for key, _, _ in _PARTS:
            bases[node][key] = at
            at += entry[key] / 1000
    for key, part, pattern in _PARTS:
        for host, group in by_host.items():
            shown = [(n, e) for n, e in group if e[key]]
            if not shown:
                continue
            where = "here" if host is None else f"on {host}"
            fig.add_trace(graph_objects.Bar(
                orientation="h", y=[n for n, _ in shown], x=[e[key] / 1000 for _, e in shown],
                base=[bases[n][key] for n, _ in shown], offsetgroup="nodes",
                name=f"{part} · {where}", marker_color=colours[host],
                marker_pattern_shape=pattern, marker_opacity=0.55 if key == "first_us" else 1,
                text=[f"{_ms(e[key])}" + (f" · {e['ran']}× · {_ms(e['mean_us'])} each"
                                          if key == "forward_us" else "") for _, e in shown],
                textposition="inside", insidetextanchor="middle",
                customdata=[[e["ran"], e["recalled"], e["kept"], e["unneeded"], e["failed"],
                             e["mean_us"] / 1000, where, part] for _, e in shown],
                hovertemplate=("<b>%{y}</b> (%{customdata[6]}): %{customdata[7]} "
                               "%{x:.4g} ms<br>ran %{customdata[0]}×, mean %{customdata[5]:.4g} "
                               "ms<br>recalled %{customdata[1]}×, kept %{customdata[2]}×<br>"
                               "unneeded %{customdata[3]}×, failed %{customdata[4]}×"
                               "<extra></extra>"),
            ), row=1, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=order, row=1, col=1)


def _hop_bars(fig: Any, graph_objects: Any, summed: Tally) -> None:
    hosts = list(summed.hops)
    for way, colour in (("sent", "#e45756"), ("received", "#72b7b2")):
        fig.add_trace(graph_objects.Bar(
            orientation="h", y=hosts, x=[summed.hops[h][f"{way}_us"] / 1000 for h in hosts],
            name=way, marker_color=colour, offsetgroup=way,
            text=[f"{_bytes(summed.hops[h][f'{way}_bytes'])} in {summed.hops[h][way]} messages"
                  for h in hosts],
            textposition="auto",
            hovertemplate=f"<b>%{{y}}</b><br>{way} %{{x:.4g}} ms<br>%{{text}}<extra></extra>",
        ), row=2, col=1)
    fig.update_xaxes(rangemode="tozero", row=2, col=1)
    fig.update_annotations(selector={"text": "time on the wire, by host (ms)"}, x=0, xanchor="left")
    fig.update_yaxes(autorange="reversed", row=2, col=1)
