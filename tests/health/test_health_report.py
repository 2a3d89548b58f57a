"""The report's graph, drawn from the store alone: the layers a Trainer recorded open
its boxes as ``architecture`` lists them, an older run's boxes stay closed, and a
user's own ``inside=`` still wins."""

import pytest

torch = pytest.importorskip("torch", reason="the runs it draws are trained with torch")
pytest.importorskip("plotly", reason="the report draws with plotly (the viz extra)")

from somatize import Graph, Node, Opaque  # noqa: E402
from somatize.health import diagnose, drawing, overlay, report  # noqa: E402
from somatize.record import Recorder  # noqa: E402
from somatize.store import Store  # noqa: E402
from somatize.torch import Trainer, architecture, parameters  # noqa: E402


class Body(Node):
    def __init__(self):
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.LayerNorm(16))

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self):
        self.out = torch.nn.Linear(16, 1)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x, ctx):
        return Opaque(self.out(x) * self.scale)

    def parameters(self):
        return [*self.out.parameters(), self.scale]


class Plus(Node):  # holds nothing: it has no layers to draw
    def forward(self, x, ctx):
        return Opaque(x + 1)


def trained(store, run, said=lambda fact: fact):
    """Body >> Head >> Plus trained a few steps by a Trainer recording to ``store``;
    ``said`` may change a fact on its way to the Recorder (to record an older run)."""
    torch.manual_seed(0)
    g = Graph.somatize(Body().named("body") >> Head().named("head") >> Plus().named("plus"))
    recorder = Recorder(store, run=run)
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05),
                      watching=lambda fact: recorder(said(fact)), auditing=True)
    x = torch.randn(12, 8)
    trainer.fit([(x, x.sum(1, keepdim=True))] * 4)
    trainer.close()
    recorder.close()
    return g, x


def parts_drawn(figure):
    """The parts drawn inside the boxes: each part's hover, first line (``node.path``)
    and second (``Class (kind)``)."""
    hovers = [text for trace in figure.data if trace.name == "parts" for text in trace.hovertext]
    return [tuple(text.split("<br>")[:2]) for text in hovers]


def test_the_report_opens_the_boxes_as_architecture_lists_them(tmp_path):
    store = Store(tmp_path / "store")
    g, _ = trained(store, "r")
    drawn = drawing()(store, "r")[1]
    expected = g.figure(overlay=overlay(diagnose(store, "r")) or None, inside=architecture(g))
    assert parts_drawn(drawn) == [
        ("<b>body.net.0</b>", "Linear (linear)"), ("<b>body.net.1</b>", "ReLU (activation)"),
        ("<b>body.net.2</b>", "LayerNorm (normalisation)"), ("<b>head.out</b>", "Linear (linear)"),
        ("<b>head.scale</b>", "Parameter (parameter)")]
    assert drawn.to_dict() == expected.to_dict()  # what a user drawing it by hand sees
    page = report(store, "r", tmp_path / "r.html")
    assert "body.net.2" in open(page, encoding="utf-8").read()


def test_a_run_recorded_before_trainers_said_their_layers_draws_closed_boxes(tmp_path):
    store = Store(tmp_path / "store")
    g, _ = trained(store, "old", lambda fact: {k: v for k, v in fact.items() if k != "inside"})
    drawn = drawing()(store, "old")[1]
    assert parts_drawn(drawn) == []
    assert drawn.to_dict() == g.figure(overlay=overlay(diagnose(store, "old")) or None).to_dict()


def test_what_the_user_passes_wins_over_what_was_recorded(tmp_path):
    store = Store(tmp_path / "store")
    g, x = trained(store, "r")
    seen = architecture(g, x)  # run on an example: with its shapes
    drawn = drawing(inside=seen)(store, "r")[1]
    assert drawn.to_dict() == g.figure(overlay=overlay(diagnose(store, "r")) or None,
                                       inside=seen).to_dict()
    assert any("in 12×8 → out 12×16" in text for trace in drawn.data if trace.name == "parts"
               for text in trace.hovertext)


@pytest.mark.parametrize("inside", [
    {"body": [["net.0", "not a dict"]]},  # not what a Trainer writes: drawn closed
    {"body": [["net.0", {"kind": "linear", "times": -1}]]},
    {"body": "net.0"},
    ["body"],
])
def test_layers_a_record_says_wrongly_leave_the_boxes_closed(tmp_path, inside):
    store = Store(tmp_path / "store")
    g, _ = trained(store, "odd", lambda fact: {**fact, "inside": inside}
                   if fact["fact"] == "graph" else fact)
    assert parts_drawn(drawing()(store, "odd")[1]) == []


def test_layers_of_nodes_another_graph_has_are_left_out(tmp_path):
    """A graph passed in draws what the record says of its own nodes, and no others."""
    store = Store(tmp_path / "store")
    trained(store, "r")
    torch.manual_seed(0)
    other = Graph.somatize(Body().named("body") >> Plus().named("tail"))
    drawn = drawing(other)(store, "r")[1]
    assert [hover[0] for hover in parts_drawn(drawn)] == [
        "<b>body.net.0</b>", "<b>body.net.1</b>", "<b>body.net.2</b>"]
