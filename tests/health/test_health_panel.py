"""The health panel: a real plotly figure of the history with the findings marked, and
the report section around it."""

import pytest

go = pytest.importorskip("plotly.graph_objects")

from healthruns import chain, recorded  # noqa: E402

from somatize.health import diagnose, panel, section  # noqa: E402
from somatize.store import Store  # noqa: E402


def measures(n):
    return {"act_zero": 1.0 if n > 4 else 0.4, "grad_norm": 0.5 + n / 10, "update_ratio": 2e-3,
            "act_saturated": 0.01, "nonfinite": 0}


def test_the_panel_draws_each_where_per_measure_and_marks_each_finding(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "r", chain(30, body=measures, head=measures))
    figure = panel(store, "r")
    assert isinstance(figure, go.Figure)
    drawn = {(trace.name, trace.yaxis) for trace in figure.data}
    assert drawn == {("loss", "y")} | {(w, axis) for w in ("body", "head")
                                       for axis in ("y2", "y3", "y4", "y5")}
    loss = next(t for t in figure.data if t.name == "loss")
    assert list(loss.y[:2]) == [1.0, 0.5]  # the loss the Trainer said, step by step
    body = next(t for t in figure.data if t.name == "body" and t.yaxis == "y4")
    assert list(body.x) == list(range(1, 31)) and body.y[-1] == 1.0
    assert figure.layout.yaxis2.type == "log" and figure.layout.yaxis4.type == "linear"
    marks = [shape for shape in figure.layout.shapes if shape.x0 == 5]
    assert len(marks) == 1 and marks[0].yref == "y4 domain"  # one line on the row of zeros
    assert "dying · body, head" in {a.text for a in figure.layout.annotations}
    assert len(diagnose(store, "r")) == 2
    assert panel(store, "r", dying=1.1).layout.shapes == ()  # a threshold moved: no marks


def test_the_section_is_a_table_of_findings_over_the_panel_or_a_note(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "r", chain(20, body=measures))
    heading, body = section(store, "r")
    assert heading == "Health" and "<table" in body and "dying" in body
    assert "what to do" in body and "Most of what body produces is exactly 0" in body
    assert "somatize-health" in body and "<script" in body  # the figure, without plotly's js
    recorded(store, "plain", [{}])
    heading, body = section(store, "plain")
    assert "auditing=True" in body and "<table" not in body
