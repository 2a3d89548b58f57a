"""A graph drawn with plotly: boxes in lanes, edges with arrowheads, hover for the rest.

Everything is read from the graph's declarations; nothing runs. Coordinates are the
pixels of the figure (the y axis points down), so text is sized once and fits its
box at any zoom the figure opens at.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import DeclarationError, whole_number
from ._layout import PAD, Layout, layout

__all__ = ["figure"]

HERE = "#4c78a8"
HOSTS = ("#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d")
FLAGGED, FLAGGED_FILL, FLAGGED_PART = "#d62728", "#fdecea", "#f4b6b2"
EDGE, WIRE = "#8c8c8c", "#444444"
MARKS = {"cached": "#2e7d32", "frozen": "#1565c0", "mapped": "#6a1b9a"}
KIND_COLOURS = {
    "linear": "#c6dbef", "conv": "#c7e9c0", "normalisation": "#fdd0a2",
    "activation": "#fee391", "attention": "#dadaeb", "embedding": "#d9f0a3",
    "dropout": "#f0f0f0", "pooling": "#c7eae5", "recurrent": "#fcc5c0", "block": "#e5d8bd",
    "parameter": "#f2f2f2", "other": "#e0e0e0",
}
FONT = "Helvetica, Arial, sans-serif"
TOP = 66  # above the drawing: the title and the legend


def _escape(text: str) -> str:
    """Text made safe for plotly's HTML-like labels (quotes are left as they are)."""
    return html.escape(text, quote=False)


def _go() -> Any:
    try:
        from plotly import graph_objects
    except ImportError:
        raise ImportError("Graph.figure needs plotly: pip install 'somatize[viz]'") from None
    return graph_objects


# -- what was asked ---------------------------------------------------------------------
def _no_node(graph: Any, what: str, where: Any) -> DeclarationError:
    known = ", ".join(repr(n) for n in graph.ids[:20]) or "none"
    return DeclarationError(f"{what} names {where!r}, which is not a node of this graph; "
                            f"its nodes are {known}")


def read_overlay(graph: Any, overlay: Any) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """``{node: [flag, ...]}`` checked; a key ``node.path`` flags a part of the node too."""
    if overlay is None:
        return {}, {}
    if not isinstance(overlay, Mapping):
        raise TypeError(f"overlay is a dict {{node: [flag, ...]}}, not a {type(overlay).__qualname__}")
    nodes, parts = {}, {}
    known = set(graph.ids)
    for where, said in overlay.items():
        if not isinstance(where, str):
            raise TypeError(f"overlay keys are node ids (str), not {where!r}")
        if isinstance(said, (str, bytes)) or not isinstance(said, Iterable):
            raise TypeError(f"overlay[{where!r}] is a list of flags, e.g. ['dying'], not {said!r}")
        said = [str(flag) for flag in said]
        if where in known:
            nodes.setdefault(where, []).extend(said)
            continue
        node, _, path = where.partition(".")
        if node not in known or not path:
            raise _no_node(graph, "overlay", where)
        nodes.setdefault(node, []).extend(f"{path}: {flag}" for flag in said)
        parts.setdefault(node, {}).setdefault(path, []).extend(said)
    return nodes, parts


def read_inside(graph: Any, inside: Any) -> dict[str, list[tuple[str, Mapping[str, Any]]]]:
    """``{node: [(path, what), ...]}`` checked, each ``what`` a dict (``times`` ≥ 1)."""
    if inside is None:
        return {}
    if not isinstance(inside, Mapping):
        raise TypeError(f"inside is a dict {{node: [(path, what), ...]}}, not a {type(inside).__qualname__}")
    known = set(graph.ids)
    opened = {}
    for node, listed in inside.items():
        if node not in known:
            raise _no_node(graph, "inside", node)
        if isinstance(listed, (str, bytes, Mapping)) or not isinstance(listed, Iterable):
            raise TypeError(f"inside[{node!r}] is a list of (path, what) pairs, not {listed!r}")
        pairs = []
        for at, pair in enumerate(listed):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                    and isinstance(pair[0], str) and isinstance(pair[1], Mapping)):
                raise TypeError(f"inside[{node!r}][{at}] is {pair!r}; each part is a pair "
                                "(path, what) with what a dict of kind, cls, shapes, params, times")
            whole_number(pair[1].get("times", 1), "times",
                         of=f"inside[{node!r}][{at}] ({pair[0]!r})")
            pairs.append((pair[0], pair[1]))
        opened[node] = pairs
    return opened


# -- what each box says -----------------------------------------------------------------
class _BoxText:
    """A box's text: ``plain`` lines size it, ``rich`` lines are drawn, ``hover`` is shown."""

    def __init__(self) -> None:
        self.plain: list[str] = []
        self.rich: list[str] = []
        self.hover: list[str] = []

    def line(self, plain: str, rich: str | None = None) -> None:
        self.plain.append(plain)
        self.rich.append(_escape(plain) if rich is None else rich)


class _Declared:
    """What a graph declares about its nodes, asked once per drawing."""

    def __init__(self, graph: Any):
        self.graph = graph
        self.identities = {n: graph.identity(n) for n in graph.ids}
        self.devices, self.hosts = graph.devices, graph.hosts
        self.cached, self.frozen = graph.cached, graph.frozen
        self.mapped = graph.mapped


def _describe(declared: _Declared, node: str, flags: list[str], opened: bool) -> _BoxText:
    identity = declared.identities[node]
    device, host = declared.devices.get(node), declared.hosts.get(node)
    said = _BoxText()
    said.line(node, f"<b>{_escape(node)}</b>")
    said.line(identity.rsplit(".", 1)[-1], f"<span style='color:#555'>{_escape(identity.rsplit('.', 1)[-1])}</span>")
    placed = " ".join(part for part in (device, f"on {host}" if host else None) if part)
    if placed:
        said.line(placed, f"<span style='color:#333'>{_escape(placed)}</span>")
    marks = [mark for mark, on in (("cached", node in declared.cached),
                                   ("frozen", node in declared.frozen),
                                   ("mapped", node in declared.mapped)) if on]
    if marks:
        said.line(" · ".join(marks), " · ".join(
            f"<i><span style='color:{MARKS[m]}'>{m}</span></i>" for m in marks))
    if flags:
        text = "! " + ", ".join(dict.fromkeys(flags))
        shown = text if len(text) <= 34 else text[:33] + "…"
        said.line(shown, f"<b><span style='color:{FLAGGED}'>{_escape(shown)}</span></b>")
    said.hover = _hover(declared, node, flags, opened)
    return said


def _hover(declared: _Declared, node: str, flags: list[str], opened: bool) -> list[str]:
    identity = declared.identities[node]
    device, host = declared.devices.get(node), declared.hosts.get(node)
    hover = [f"<b>{_escape(node)}</b>", f"class {_escape(identity)}",
             "runs " + (f"on host {_escape(host)}" if host else "here")
             + (f", device {_escape(device)}" if device else ", no device said")]
    cached, frozen = declared.cached, declared.frozen
    if node in cached:
        salt = cached[node]
        hover.append("cached" + (f" (salt {_escape(repr(salt))})" if salt is not None else ""))
    if node in frozen:
        state = frozen[node]
        hover.append("frozen" + (f" at {_escape(state[:23])}…" if state else ""))
    if node in declared.mapped:
        hover.append("mapped over the items of its input")
    before, after = declared.graph.preds[node], declared.graph.succs[node]
    hover.append("from " + (", ".join(map(_escape, before)) if before else "the input")
                 + " → to " + (", ".join(map(_escape, after)) if after else "the output"))
    for flag in dict.fromkeys(flags):
        hover.append(f"<span style='color:{FLAGGED}'>flagged: {_escape(flag)}</span>")
    if opened:
        hover.append("<i>its parts are drawn inside</i>")
    return hover


def _shape(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return "×".join(str(v) for v in value)
    return "?" if value is None else str(value)


def _part(node: str, path: str, what: Mapping[str, Any], flags: list[str]) -> tuple[str, str]:
    """A part's label and hover."""
    times = what.get("times", 1)
    cls = str(what.get("cls") or what.get("kind") or path)
    label = cls + (f" ×{times}" if times > 1 else "")
    params = what.get("params")
    hover = [f"<b>{_escape(node)}.{_escape(path)}</b>" if path else f"<b>{_escape(node)}</b>",
             f"{_escape(cls)} ({_escape(str(what.get('kind', 'other')))})"]
    shape_in, shape_out = what.get("shape_in"), what.get("shape_out")
    if shape_in is not None or shape_out is not None:  # listed without a run: no shapes seen
        hover.append(f"in {_escape(_shape(shape_in))} → out {_escape(_shape(shape_out))}")
    if isinstance(params, int):
        hover.append(f"{params:,} parameters" + (f" each, ×{times} = {params * times:,}" if times > 1 else ""))
    if times > 1:
        hover.append(f"stands for {times} identical copies")
    for flag in flags:
        hover.append(f"<span style='color:{FLAGGED}'>flagged: {_escape(flag)}</span>")
    return label, "<br>".join(hover)


# -- drawing ----------------------------------------------------------------------------
def host_colours(places: Iterable[str | None]) -> dict[str | None, str]:
    """One colour per host in order of appearance; nodes run here (None) keep the first.
    The graph's figure and the record's ``spent`` both colour hosts with it."""
    colours: dict[str | None, str] = {None: HERE}
    for host in places:
        if host not in colours:
            colours[host] = HOSTS[(len(colours) - 1) % len(HOSTS)]
    return colours


def figure(graph: Any, overlay: Any = None, inside: Any = None) -> Any:
    """A graph's data form (``Graph.data()``) as a plotly figure: one box per node in columns by level, lanes by
    host, edges with arrowheads; ``overlay`` flags nodes (red, said on hover) and
    ``inside`` opens nodes into their parts. Unknown nodes in either are refused.
    A Graph is drawn through its data form."""
    if callable(getattr(graph, "data", None)):
        graph = graph.data()
    flags, part_flags = read_overlay(graph, overlay)
    opened = read_inside(graph, inside)
    graph_objects = _go()
    order = list(graph.order)
    preds = {n: list(graph.preds[n]) for n in order}
    hosts = graph.hosts
    declared = _Declared(graph)
    said = {n: _describe(declared, n, flags.get(n, []), n in opened) for n in order}
    parts = {n: [_part(n, path, what, part_flags.get(n, {}).get(path, []))
                 for path, what in opened[n]] for n in opened}
    geometry = layout(order, preds, hosts, {n: s.plain for n, s in said.items()},
                      {n: [label for label, _ in labelled] for n, labelled in parts.items()})
    colours = host_colours(band.host for band in geometry.bands)
    fig = graph_objects.Figure()
    annotations: list[dict[str, Any]] = []
    shapes: list[dict[str, Any]] = []
    if geometry.lanes:
        _lanes(geometry, colours, shapes, annotations)
    _edges(geometry, shapes, annotations)
    _boxes(fig, graph_objects, geometry, said, flags, colours, annotations)
    if parts:
        _parts(fig, graph_objects, geometry, opened, parts, part_flags, annotations)
    _legend(fig, graph_objects, geometry, colours, bool(flags), opened)
    _frame(fig, graph, geometry, shapes, annotations)
    return fig


def _lanes(geometry: Layout, colours: dict[str | None, str], shapes: list, annotations: list) -> None:
    for band in geometry.bands:
        colour = colours[band.host]
        shapes.append({"type": "rect", "layer": "below", "x0": 4, "x1": geometry.width - 4, "y0": band.y,
                           "y1": band.y + band.height, "fillcolor": colour, "opacity": 0.08,
                           "line": {"width": 0}})
        shapes.append({"type": "rect", "layer": "below", "x0": 4, "x1": geometry.width - 4, "y0": band.y,
                           "y1": band.y + band.height, "line": {"color": colour, "width": 1, "dash": "dot"}})
        annotations.append({"x": 10, "y": band.y + 3, "xanchor": "left", "yanchor": "top", "showarrow": False,
                                "text": f"<b>{_escape('here' if band.host is None else 'host ' + band.host)}</b>",
                                "font": {"color": colour, "size": 12}})


def _curve(ax: float, ay: float, bx: float, by: float) -> str:
    bend = max(24.0, (bx - ax) / 2)
    return f" C {ax + bend:.1f},{ay:.1f} {bx - bend:.1f},{by:.1f} {bx:.1f},{by:.1f}"


def _edges(geometry: Layout, shapes: list, annotations: list) -> None:
    bands = {n: box.band for n, box in geometry.boxes.items()}
    for edge in geometry.edges:
        crossing = bands[edge.source] != bands[edge.target]
        colour = WIRE if crossing else EDGE
        end = edge.x1 - 9  # the arrowhead covers the last pixels
        path, x, y = f"M {edge.x0:.1f},{edge.y0:.1f}", edge.x0, edge.y0
        for left, right, middle in edge.through:  # straight through each column it skips
            path += _curve(x, y, left, middle) + f" L {right:.1f},{middle:.1f}"
            x, y = right, middle
        path += _curve(x, y, end, edge.y1)
        shapes.append({
            "type": "path", "layer": "below", "path": path,
            "line": {"color": colour, "width": 1.6, "dash": "dash" if crossing else "solid"},
        })
        annotations.append({"x": edge.x1, "y": edge.y1, "ax": end - 1, "ay": edge.y1, "xref": "x",
                            "yref": "y", "axref": "x", "ayref": "y", "text": "", "showarrow": True,
                            "arrowhead": 2, "arrowsize": 1.1, "arrowwidth": 1.6,
                            "arrowcolor": colour, "standoff": 0})


def _boxes(fig: Any, graph_objects: Any, geometry: Layout, said: dict[str, _BoxText],
           flags: dict[str, list[str]], colours: dict[str | None, str], annotations: list) -> None:
    for node, box in geometry.boxes.items():
        flagged = node in flags
        band = geometry.bands[box.band]
        x0, y0, x1, y1 = box.x, box.y, box.x + box.width, box.y + box.height
        fig.add_trace(graph_objects.Scatter(
            x=[x0, x1, x1, x0, x0], y=[y0, y0, y1, y1, y0], mode="lines", fill="toself",
            fillcolor=FLAGGED_FILL if flagged else "white",
            line={"color": FLAGGED if flagged else colours[band.host], "width": 2.5 if flagged else 1.5},
            hoveron="fills", hoverinfo="text", text="<br>".join(said[node].hover),
            name=node, showlegend=False,
        ))
        annotations.append({"x": x0 + PAD, "y": y0 + PAD - 1, "xanchor": "left", "yanchor": "top",
                                "align": "left", "showarrow": False, "text": "<br>".join(said[node].rich),
                                "font": {"size": 12, "color": "#222"}})


def _parts(fig: Any, graph_objects: Any, geometry: Layout, opened: dict, parts: dict,
           part_flags: dict, annotations: list) -> None:
    """The rows of opened boxes: a filled trace per kind, labels, and invisible points
    at their middles so each row has its own hover."""
    by_fill: dict[str, tuple[list, list]] = {}
    xs, ys, hovers = [], [], []
    seams: tuple[list, list] = ([], [])  # where one opened block's parts end and the next's begin
    for node, labelled in parts.items():
        box = geometry.boxes[node]
        previous = None
        for (path, what), (label, hover), (x, y, w, h) in zip(opened[node], labelled, box.parts):
            within = what.get("within")
            if previous is not None and within != previous:
                seams[0].extend([x - 2, x + w + 2, None])
                seams[1].extend([y, y, None])
            previous = within
            flagged = path in part_flags.get(node, {})
            fill = FLAGGED_PART if flagged else KIND_COLOURS.get(str(what.get("kind")), KIND_COLOURS["other"])
            px, py = by_fill.setdefault(fill, ([], []))
            px += [x, x + w, x + w, x, x, None]
            py += [y, y, y + h, y + h, y, None]
            annotations.append({"x": x + 6, "y": y + h / 2, "xanchor": "left", "yanchor": "middle",
                                    "showarrow": False, "text": _escape(label),
                                    "font": {"size": 11, "color": FLAGGED if flagged else "#222"}})
            xs.append(x + w / 2)
            ys.append(y + h / 2)
            hovers.append(hover)
    for fill, (px, py) in by_fill.items():
        fig.add_trace(graph_objects.Scatter(
            x=px, y=py, mode="lines", fill="toself", fillcolor=fill,
            line={"color": "#9e9e9e", "width": 0.8}, hoverinfo="skip", showlegend=False,
        ))
    if seams[0]:
        fig.add_trace(graph_objects.Scatter(
            x=seams[0], y=seams[1], mode="lines", line={"color": "#555555", "width": 2},
            hoverinfo="skip", showlegend=False, name="blocks",
        ))
    fig.add_trace(graph_objects.Scatter(
        x=xs, y=ys, mode="markers", marker={"size": 16, "opacity": 0, "symbol": "square"},
        hovertext=hovers, hoverinfo="text", showlegend=False, name="parts",
    ))


def _legend(fig: Any, graph_objects: Any, geometry: Layout, colours: dict[str | None, str],
            flagged: bool, opened: dict) -> None:
    def entry(name: str, colour: str, symbol: str = "square-open") -> None:
        fig.add_trace(graph_objects.Scatter(
            x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
            marker={"symbol": symbol, "size": 13, "color": colour, "line": {"width": 2, "color": colour}},
        ))

    if geometry.lanes:
        for band in geometry.bands:
            entry("here" if band.host is None else f"host {band.host}", colours[band.host])
    if flagged:
        entry("flagged", FLAGGED, "square")
    # An unknown kind is drawn as "other", so it is named once, after that mapping.
    kinds = dict.fromkeys(kind if kind in KIND_COLOURS else "other" for kind in (
        str(what.get("kind")) for listed in opened.values() for _, what in listed))
    for kind in kinds:
        entry(kind, KIND_COLOURS[kind], "square")


def _frame(fig: Any, graph: Any, geometry: Layout, shapes: list, annotations: list) -> None:
    count, edges = len(geometry.boxes), len(geometry.edges)
    places = [band.host for band in geometry.bands if band.host is not None]
    title = (f"<b>graph</b> — {count} node{'s' if count != 1 else ''}, {edges} edge"
             f"{'s' if edges != 1 else ''}, {geometry.columns} wave{'s' if geometry.columns != 1 else ''}")
    if places:
        title += " · hosts " + ", ".join(map(_escape, places))
    if not count:
        title = "<b>graph</b> — empty: no nodes to draw"
    width = max(geometry.width, 460)
    height = geometry.height + TOP + 10
    fig.update_layout(
        title={"text": title, "x": 0, "xref": "paper", "xanchor": "left", "y": 1 - 10 / height,
                   "yref": "container", "yanchor": "top", "font": {"size": 14}},
        width=width + 20, height=height, autosize=False,
        margin={"l": 10, "r": 10, "t": TOP, "b": 10}, plot_bgcolor="white", paper_bgcolor="white",
        font={"family": FONT, "size": 12}, dragmode="pan", hovermode="closest",
        showlegend=True,
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom",
                    "font": {"size": 12}, "itemclick": False, "itemdoubleclick": False},
        xaxis={"range": [0, width], "visible": False, "showgrid": False, "zeroline": False},
        yaxis={"range": [geometry.height, 0], "visible": False, "showgrid": False, "zeroline": False,
                   "scaleanchor": "x", "scaleratio": 1},
        shapes=shapes, annotations=annotations,
        hoverlabel={"bgcolor": "white", "font": {"family": FONT, "size": 12}, "align": "left"},
    )
