"""Graph.figure: the drawing's structure read back from the plotly figure — a box per
node, edges with arrowheads, lanes per host, overlay and inside — with nothing run."""

import itertools
import json
import random

import pytest

pytest.importorskip("plotly")

from somatize import DeclarationError, Graph, Node
from somatize._plan import levels
from somatize.viz import figure
from somatize.viz._draw import FLAGGED, HERE


class Step(Node):
    calls = 0

    def forward(self, x, ctx):
        Step.calls += 1
        return x


def boxes(fig):
    """Each node's box as (x0, y0, x1, y1), from the filled trace that draws it."""
    out = {}
    for trace in fig.data:
        if trace.fill == "toself" and trace.hoveron == "fills":
            xs, ys = [v for v in trace.x], [v for v in trace.y]
            out[trace.name] = (min(xs), min(ys), max(xs), max(ys))
    return out


def box_trace(fig, node):
    return next(t for t in fig.data if t.name == node and t.hoveron == "fills")


def label(fig, node):
    return next(a.text for a in fig.layout.annotations if a.text and a.text.startswith(f"<b>{node}</b>"))


def edge_paths(fig):
    return [s for s in fig.layout.shapes if s.type == "path"]


def arrows(fig):
    return [a for a in fig.layout.annotations if a.showarrow]


def diamond():
    return Graph.somatize(Step().named("source").cached("v1").frozen()
                          >> (Step().named("left").on("cuda:0") | Step().named("right").mapped())
                          >> Step().named("mean")
                          >> (Step().named("body").at("w1").on("cuda:0") >> Step().named("head").at("w1")))


def test_one_box_per_node_and_nothing_runs():
    Step.calls = 0
    g = diamond()
    fig = g.figure()
    assert sorted(boxes(fig)) == sorted(g.nodes())
    assert Step.calls == 0
    assert "6 nodes, 6 edges, 5 waves" in fig.layout.title.text


def test_columns_follow_the_levels_left_to_right():
    g = diamond()
    drawn = boxes(g.figure())
    level = levels(g.topological_sort(), {n: g.predecessors(n) for n in g.nodes()})
    for a, b in itertools.permutations(g.nodes(), 2):
        if level[a] < level[b]:
            assert drawn[a][2] < drawn[b][0], (a, b)  # a's column ends before b's starts
        elif level[a] == level[b]:
            assert abs((drawn[a][0] + drawn[a][2]) - (drawn[b][0] + drawn[b][2])) < 1e-6


def test_every_edge_is_a_line_from_one_side_to_the_other_with_an_arrowhead():
    g = diamond()
    fig = g.figure()
    drawn = boxes(fig)
    paths, heads = edge_paths(fig), arrows(fig)
    assert len(paths) == len(heads) == len(g.edges())
    for (source, target), path, head in zip(sorted(g.edges(), key=lambda e: g.topological_sort().index(e[1])),
                                            paths, heads):
        start = [float(v) for v in path.path.split()[1].split(",")]
        assert start[0] == pytest.approx(drawn[source][2])
        assert drawn[source][1] <= start[1] <= drawn[source][3]
        assert head.x == pytest.approx(drawn[target][0]) and head.ax < head.x
        assert drawn[target][1] <= head.y <= drawn[target][3]
    crossing = [p for p in paths if p.line.dash == "dash"]
    assert len(crossing) == 1  # mean -> body goes to another host


def test_hosts_are_lanes_with_a_colour_and_a_legend_entry():
    g = diamond()
    fig = g.figure()
    drawn = boxes(fig)
    lanes = [s for s in fig.layout.shapes if s.type == "rect" and s.fillcolor]
    assert len(lanes) == 2
    here, far = sorted(lanes, key=lambda s: s.y0)
    for node, (x0, y0, x1, y1) in drawn.items():
        lane = far if node in ("body", "head") else here
        assert lane.y0 <= y0 and y1 <= lane.y1, node
    assert box_trace(fig, "left").line.color == HERE
    assert box_trace(fig, "body").line.color == far.fillcolor != HERE
    legend = [t.name for t in fig.data if t.showlegend is not False and t.x == (None,)]
    assert legend == ["here", "host w1"]


def test_the_text_of_a_box_says_id_class_placement_and_marks():
    fig = diamond().figure()
    assert "Step" in label(fig, "source") and "cached" in label(fig, "source")
    assert "frozen" in label(fig, "source") and "mapped" in label(fig, "right")
    assert "cuda:0 on w1" in label(fig, "body") and "on w1" in label(fig, "head")
    assert "cuda:0" in label(fig, "left")
    hover = box_trace(fig, "source").text
    assert "class test_viz_figure.Step" in hover and "cached (salt 'v1')" in hover
    assert "frozen" in hover and "runs here" in hover
    assert "runs on host w1, device cuda:0" in box_trace(fig, "body").text
    assert "mapped over the items" in box_trace(fig, "right").text


def test_a_graph_without_hosts_has_no_lanes():
    g = Graph.somatize(Step() >> Step())
    fig = g.figure()
    assert not [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(boxes(fig)) == 2


def test_overlay_colours_flagged_nodes_and_says_why():
    g = diamond()
    fig = g.figure(overlay={"right": ["dying", "saturated"], "head": []})
    flagged = box_trace(fig, "right")
    assert flagged.line.color == FLAGGED
    assert "flagged: dying" in flagged.text and "flagged: saturated" in flagged.text
    assert "dying, saturated" in label(fig, "right")
    assert box_trace(fig, "left").line.color != FLAGGED
    assert any(t.name == "flagged" for t in fig.data)


def test_overlay_refuses_what_is_not_a_node():
    g = diamond()
    with pytest.raises(DeclarationError, match="overlay names 'nobody'.*its nodes are 'source'"):
        g.figure(overlay={"nobody": ["dying"]})
    with pytest.raises(TypeError, match="list of flags"):
        g.figure(overlay={"left": "dying"})
    with pytest.raises(TypeError, match="overlay is a dict"):
        g.figure(overlay=["left"])


PARTS = [
    ("net.0", {"kind": "linear", "cls": "Linear", "shape_in": [64, 8], "shape_out": [64, 32],
               "params": 288, "times": 1}),
    ("net.1", {"kind": "activation", "cls": "ReLU", "shape_in": [64, 32], "shape_out": [64, 32],
               "params": 0, "times": 1}),
    ("blocks.0", {"kind": "linear", "cls": "Block", "shape_in": [64, 32], "shape_out": [64, 32],
                  "params": 1056, "times": 3}),
]


def test_inside_opens_a_box_into_its_parts():
    g = diamond()
    fig = g.figure(inside={"body": PARTS})
    x0, y0, x1, y1 = boxes(fig)["body"]
    texts = [a for a in fig.layout.annotations if a.text in ("Linear", "ReLU", "Block ×3")]
    assert [a.text for a in texts] == ["Linear", "ReLU", "Block ×3"]
    for a in texts:
        assert x0 < a.x < x1 and y0 < a.y < y1
    assert texts[0].y < texts[1].y < texts[2].y  # a column, in order
    hover = next(t for t in fig.data if t.name == "parts").hovertext
    assert "in 64×8 → out 64×32" in hover[0] and "288 parameters" in hover[0]
    assert "1,056 parameters each, ×3 = 3,168" in hover[2]
    assert boxes(g.figure())["body"][3] - boxes(g.figure())["body"][1] < y1 - y0
    assert {"linear", "activation"} <= {t.name for t in fig.data}


def test_an_overlay_on_a_part_colours_that_part():
    g = diamond()
    fig = g.figure(inside={"body": PARTS}, overlay={"body.net.1": ["saturated"]})
    relu = next(a for a in fig.layout.annotations if a.text == "ReLU")
    assert relu.font.color == FLAGGED
    assert box_trace(fig, "body").line.color == FLAGGED
    assert "net.1: saturated" in box_trace(fig, "body").text
    hover = next(t for t in fig.data if t.name == "parts").hovertext
    assert "flagged: saturated" in hover[1] and "flagged" not in hover[0]


def test_inside_refuses_what_it_cannot_draw():
    g = diamond()
    with pytest.raises(DeclarationError, match="inside names 'nobody'"):
        g.figure(inside={"nobody": PARTS})
    with pytest.raises(TypeError, match=r"inside\['body'\]\[0\] is 'net'"):
        g.figure(inside={"body": ["net"]})
    with pytest.raises(ValueError, match="times=0"):
        g.figure(inside={"body": [("net", {"times": 0})]})


def random_graph(n, seed, hosts=("w1", "w2")):
    rnd = random.Random(seed)
    g = Graph()
    ids = [g.node(f"n{i}", Step()) for i in range(n)]
    for i in range(1, n):
        for p in rnd.sample(range(i), k=min(i, rnd.choice([1, 1, 2, 3]))):
            g.edge(ids[p], ids[i])
    for i in ids:
        if rnd.random() < 0.25:
            g.place_at(i, rnd.choice(hosts))
    return g


@pytest.mark.parametrize("n", [1, 7, 50])
def test_boxes_never_overlap_and_fit_the_figure(n):
    fig = random_graph(n, seed=n).figure()
    drawn = list(boxes(fig).values())
    assert len(drawn) == n
    for (a, b) in itertools.combinations(drawn, 2):
        apart = a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
        assert apart, (a, b)
    width, height = fig.layout.xaxis.range[1], fig.layout.yaxis.range[0]
    assert all(0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height for x0, y0, x1, y1 in drawn)


def test_the_same_graph_is_drawn_the_same_way():
    one, two = random_graph(30, seed=4).figure(), random_graph(30, seed=4).figure()
    assert one.to_json() == two.to_json()


def test_an_empty_graph_is_drawn_as_empty():
    fig = Graph().figure()
    assert "empty" in fig.layout.title.text and not boxes(fig)


def test_figure_is_what_graph_figure_draws_and_writes_standalone_html(tmp_path):
    g = diamond()
    assert figure(g).to_json() == g.figure().to_json()
    path = tmp_path / "graph.html"
    g.figure().write_html(path, include_plotlyjs=True)
    page = path.read_text()
    assert "<script src" not in page and len(page) > 1_000_000
    assert json.loads(g.figure().to_json())["layout"]["width"] > 0


def test_an_edge_that_skips_a_column_passes_beside_the_boxes_there():
    g = Graph()
    for n in ("a", "b", "c", "d"):
        g.node(n, Step())
    g.edge("a", "b")
    g.edge("b", "c")
    g.edge("c", "d")
    g.edge("a", "d")  # skips b's and c's columns
    fig = g.figure()
    drawn = boxes(fig)
    skip = next(p for p in edge_paths(fig) if p.path.count(" L ") == 2)
    for node, segment in zip(("b", "c"), skip.path.split(" L ")[1:]):
        y = float(segment.split()[0].split(",")[1])
        _x0, y0, _x1, y1 = drawn[node]
        assert not y0 - 4 <= y <= y1 + 4, (node, y, drawn[node])
