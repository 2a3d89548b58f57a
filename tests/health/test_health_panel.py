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


def test_a_zero_on_a_log_axis_is_a_marker_on_the_axis_said_to_be_zero_not_a_floor(tmp_path):
    store = Store(str(tmp_path))
    still = lambda n: {"grad_norm": 0.0 if n > 10 else 0.75, "update_ratio": 0.0,  # noqa: E731
                       "act_zero": 0.1, "nonfinite": 0}
    moving = lambda n: {"grad_norm": 0.75, "update_ratio": 1e-3, "act_zero": 0.1,  # noqa: E731
                        "nonfinite": 0}
    recorded(store, "r", chain(20, frozen=still, head=moving))
    figure = panel(store, "r")
    lines = {(t.name, t.yaxis): t for t in figure.data if t.mode == "lines"}
    frozen_grad = lines[("frozen", "y2")]
    assert list(frozen_grad.y[10:]) == [None] * 10  # a gap, never a line down to a floor
    zeros = {(t.name, t.yaxis): t for t in figure.data if t.mode == "markers"}
    on_axis = zeros[("frozen: exactly 0", "y2")]
    assert list(on_axis.x) == list(range(11, 21))
    assert on_axis.y[0] == pytest.approx(10 ** figure.layout.yaxis2.range[0])  # the lower edge
    assert "exactly 0" in on_axis.hovertemplate
    # the update ratio: the frozen where is 0 throughout, marked on its axis at every step
    assert list(zeros[("frozen: exactly 0", "y3")].x) == list(range(1, 21))
    assert figure.layout.yaxis3.range[0] < -3  # below head's 1e-3, so 0 is under every value
    said = [a for a in figure.layout.annotations if a.text == "▲ on the axis: exactly 0"]
    assert {a.yref for a in said} == {"y2 domain", "y3 domain"}


def test_log_axes_are_labelled_whole_never_with_bare_digits(tmp_path):
    """A log axis spanning decades is labelled a power of ten a decade; one spanning
    less is labelled at 1, 2 and 5 of its decade, each number written whole (plotly's
    own labels there are bare digits: '5 4 3 2 0.01')."""
    store = Store(str(tmp_path))
    wide = lambda n: {"grad_norm": 10.0 ** -n, "update_ratio": 2e-3, "act_zero": 0.1,  # noqa: E731
                      "nonfinite": 0}
    recorded(store, "r", chain(8, body=wide))
    layout = panel(store, "r").layout
    logs = {name: layout[name] for name in layout if name.startswith("yaxis")
            and layout[name].type == "log"}
    assert len(logs) >= 2
    for axis in logs.values():
        assert axis.exponentformat == "power"
        assert axis.dtick == 1 or (axis.dtick == "D2" and axis.tickformat == ".2~g")
    assert {axis.dtick for axis in logs.values()} == {1, "D2"}  # one wide, one narrow here
