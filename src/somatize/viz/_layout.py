"""Where each box of a graph drawing goes: pure geometry, in pixels, no plotly.

Columns are the graph's levels (a node one column right of its latest predecessor),
so what can run together stands in one column and edges only go rightwards. Hosts
are horizontal bands, one per place in order of first appearance, so a graph split
across machines reads as lanes. Within a band and a column the boxes are ordered by
a few barycenter sweeps (the mean position of their neighbours), which untangles
most crossings and, with ties kept in insertion order, draws the same graph the same
way every time.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._plan import levels

__all__ = ["Band", "Box", "Edge", "Layout", "layout", "text_width"]

HEAD = 19  # the first line of a box (its id, bold)
LINE = 16  # every other line of text
PAD = 8  # inside a box, around its text and parts
PART = 20  # one part of an opened box
PART_GAP = 3
COLUMN_GAP = 76  # room for the edges between two columns
ROW_GAP = 22  # between two boxes of one column
BAND_PAD = 12  # inside a band, around its boxes
BAND_LABEL = 20  # the strip at the top of a band where its host is written
BAND_GAP = 14
MARGIN = 16
VIA = 6  # the slot a long edge takes in a column it passes
VIA_GAP = 10
MIN_WIDTH = 120
SWEEPS = 4


def text_width(text: str, size: float = 12) -> float:
    """About how wide a line of sans-serif text is, in pixels (over rather than under)."""
    return len(text) * size * 0.58


@dataclass
class Box:
    """One node's box: top-left corner, size, the band it sits in, its parts' rows."""

    node: str
    x: float
    y: float
    width: float
    height: float
    band: int
    parts: list[tuple[float, float, float, float]] = field(default_factory=list)  # x, y, w, h

    @property
    def middle(self) -> float:
        return self.y + self.height / 2


@dataclass
class Band:
    """The lane of one place: ``host`` None for the nodes run here."""

    host: str | None
    y: float
    height: float


@dataclass
class Edge:
    """An edge from the right side of one box to the left side of another, passing
    each column in between through a slot of its own (``through``: left, right, y)."""

    source: str
    target: str
    x0: float
    y0: float
    x1: float
    y1: float
    through: list[tuple[float, float, float]] = field(default_factory=list)


@dataclass
class Layout:
    boxes: dict[str, Box]
    bands: list[Band]
    edges: list[Edge]
    width: float
    height: float
    columns: int
    lanes: bool  # whether the bands are drawn (more than one place, or one host)


def layout(order: Sequence[str], preds: Mapping[str, Sequence[str]], hosts: Mapping[str, str],
           lines: Mapping[str, Sequence[str]], parts: Mapping[str, Sequence[str]]) -> Layout:
    """Places every node of a graph given in topological ``order``.

    ``lines`` is the text of each box (the first line bold) and ``parts`` the labels of
    the rows an opened box holds; both only size the boxes here. An edge that skips
    columns gets a slot in each of them (a point with no box, ordered like a node), so
    it runs between boxes rather than behind them.
    """
    places = list(dict.fromkeys(hosts.get(n) for n in order))
    level = levels(order, preds)
    ahead, behind, vias = _with_vias(order, preds, level)
    band_of = {n: places.index(hosts.get(n)) for n in order}
    for (source, _), chain in vias.items():
        band_of.update(dict.fromkeys(chain, band_of[source]))
    columns: list[list[Any]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for n in order:
        columns[level[n]].append(n)
    for chain in vias.values():
        for via in chain:
            columns[via[3]].append(via)
    _untangle(columns, behind, ahead, band_of)
    lanes = len(places) > 1 or places != [None]
    sizes = {n: _size(lines.get(n, [n]), parts.get(n, [])) for n in order}
    sizes.update((via, (0.0, VIA)) for chain in vias.values() for via in chain)
    widths = [max((sizes[n][0] for n in column), default=MIN_WIDTH) for column in columns]
    lefts, x = [], MARGIN
    for w in widths:
        lefts.append(x)
        x += w + COLUMN_GAP
    total_width = x - COLUMN_GAP + MARGIN
    boxes, bands = _stack(columns, places, band_of, sizes, widths, lefts, lanes)
    for n in order:
        if parts.get(n):
            _place_parts(boxes[n], len(parts[n]), len(lines.get(n, [n])))
    height = (bands[-1].y + bands[-1].height + MARGIN) if bands else 2 * MARGIN
    edges = _edges(order, preds, boxes, vias)
    real = {n: boxes[n] for n in order}
    return Layout(real, bands, edges, max(total_width, 2 * MARGIN), height, len(columns), lanes)


def _with_vias(order: Sequence[str], preds: Mapping[str, Sequence[str]],
               level: Mapping[str, int]) -> tuple[dict, dict, dict]:
    """The graph with every long edge cut into one-column hops through vias:
    successors, predecessors, and each long edge's chain of vias."""
    ahead: dict[Any, list[Any]] = {n: [] for n in order}
    behind: dict[Any, list[Any]] = {n: [] for n in order}
    vias: dict[tuple[str, str], list[tuple[str, str, str, int]]] = {}
    for n in order:
        for p in preds[n]:
            chain = [("via", p, n, k) for k in range(level[p] + 1, level[n])]
            if chain:
                vias[(p, n)] = chain
            hops = [p, *chain, n]
            for a, b in itertools.pairwise(hops):
                ahead.setdefault(a, []).append(b)
                behind.setdefault(b, []).append(a)
    return ahead, behind, vias


def _size(lines: Sequence[str], parts: Sequence[str]) -> tuple[float, float]:
    width = max([text_width(lines[0], 13)] + [text_width(line) for line in lines[1:]]
                + [text_width(label, 11) + 2 * PAD for label in parts])
    height = PAD + HEAD + LINE * (len(lines) - 1) + PAD
    if parts:
        height += len(parts) * (PART + PART_GAP) + PAD - PART_GAP
    return max(MIN_WIDTH, width + 2 * PAD), height


def _untangle(columns: list[list[Any]], preds: Mapping[Any, Sequence[Any]],
              succs: Mapping[Any, Sequence[Any]], band_of: Mapping[Any, int]) -> None:
    """Orders each column by band, then by where its neighbours stand (in place)."""
    where: dict[Any, float] = {}

    def mark_where(column: list[Any]) -> None:
        for i, n in enumerate(column):
            where[n] = (i + 0.5) / len(column)

    for column in columns:
        column.sort(key=lambda n: band_of[n])
        mark_where(column)
    for sweep in range(SWEEPS):
        rightwards = sweep % 2 == 0
        indices = range(1, len(columns)) if rightwards else range(len(columns) - 2, -1, -1)
        for c in indices:
            column = columns[c]
            keys = {}
            for n in column:
                near = preds[n] if rightwards else succs[n]
                keys[n] = (band_of[n], sum(where[m] for m in near) / len(near) if near else where[n])
            column.sort(key=keys.__getitem__)
            mark_where(column)


def _stack(columns: list[list[Any]], places: list[str | None], band_of: Mapping[Any, int],
           sizes: Mapping[Any, tuple[float, float]], widths: list[float], lefts: list[float],
           lanes: bool) -> tuple[dict[Any, Box], list[Band]]:
    """Boxes (and the slots of long edges, as wide as their column) stacked in each
    column of each band, centred in the band's height."""
    def gap(n: Any) -> float:
        return ROW_GAP if sizes[n][0] else VIA_GAP

    def tall(items: list[Any]) -> float:
        return sum(sizes[n][1] for n in items) + sum(gap(n) for n in items[:-1])

    stacks = [[[n for n in column if band_of[n] == b] for column in columns] for b in range(len(places))]
    top = MARGIN
    bands, boxes = [], {}
    label = BAND_LABEL if lanes else 0
    for b, host in enumerate(places):
        inner = max((tall(items) for items in stacks[b]), default=0.0)
        height = label + inner + 2 * BAND_PAD
        bands.append(Band(host, top, height))
        for c, items in enumerate(stacks[b]):
            y = top + label + BAND_PAD + (inner - tall(items)) / 2
            for n in items:
                w, h = sizes[n]
                if w:
                    boxes[n] = Box(n, lefts[c] + (widths[c] - w) / 2, y, w, h, b)
                else:
                    boxes[n] = Box(n, lefts[c], y, widths[c], h, b)
                y += h + gap(n)
        top += height + BAND_GAP
    return boxes, bands


def _place_parts(box: Box, count: int, lines: int) -> None:
    """The rows of an opened box, below its text."""
    y = box.y + PAD + HEAD + LINE * (lines - 1) + PAD
    box.parts = [(box.x + PAD, y + i * (PART + PART_GAP), box.width - 2 * PAD, PART)
                 for i in range(count)]


def _edges(order: Sequence[str], preds: Mapping[str, Sequence[str]], boxes: Mapping[Any, Box],
           vias: Mapping[tuple[str, str], list[Any]]) -> list[Edge]:
    """Each edge between ports spread down the two boxes' sides, ordered by where the
    edge goes next so that edges leaving or entering one box do not cross there."""
    def first(p: str, n: str) -> float:
        return boxes[vias[(p, n)][0] if (p, n) in vias else n].middle

    def last(p: str, n: str) -> float:
        return boxes[vias[(p, n)][-1] if (p, n) in vias else p].middle

    def ports(box: Box, ends: list[tuple[str, float]]) -> dict[str, float]:
        ranked = [end for end, _ in sorted(ends, key=lambda pair: pair[1])]
        span = min(box.height - 2 * PAD, 14.0 * (len(ranked) - 1))
        step = span / (len(ranked) - 1) if len(ranked) > 1 else 0.0
        return {m: box.middle - span / 2 + i * step for i, m in enumerate(ranked)}

    succs: dict[str, list[str]] = {n: [] for n in order}
    for n in order:
        for p in preds[n]:
            succs[p].append(n)
    outs = {p: ports(boxes[p], [(n, first(p, n)) for n in succs[p]]) for p in order}
    ins = {n: ports(boxes[n], [(p, last(p, n)) for p in preds[n]]) for n in order}
    edges = []
    for n in order:
        for p in preds[n]:
            a, b = boxes[p], boxes[n]
            through = [(via.x, via.x + via.width, via.middle) for via in
                       (boxes[v] for v in vias.get((p, n), []))]
            edges.append(Edge(p, n, a.x + a.width, outs[p][n], b.x, ins[n][p], through))
    return edges
