"""The record drawn: progress, spent and the report, checked as figures and as files."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("plotly")

from somatize import Graph, Node, RecordError
from somatize.record import Recorder, curve, nodes, progress, report, spent
from somatize.record._figures import smoothed
from somatize.store import Store


class Body(Node):
    def forward(self, x, ctx):
        return x + 1


class Head(Node):
    def forward(self, x, ctx):
        return sum(range(200)) + x


def recorded(store, run="a-run", steps=40, losses=None, extra=()):
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    recorder = Recorder(store, run=run, summarising=["loss"])
    for i in range(steps):
        g.forward(i, watching=recorder)
        for fact in extra:
            recorder(dict(fact))
        if losses is not None:
            recorder({"fact": "loss", "value": losses(i)})
    recorder.close()


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


def test_smoothing_is_a_debiased_moving_average_that_skips_what_is_not_finite():
    assert smoothed([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])
    out = smoothed([1.0, float("nan"), 3.0], 0.5)
    assert out[0] == pytest.approx(1.0) and out[1] == pytest.approx(1.0)
    assert out[2] == pytest.approx((0.5 * 0.5 * 1 + 0.5 * 3) / (1 - 0.25))
    assert smoothed([float("inf")], 0.9) == [None]


def test_progress_draws_the_curve_raw_and_smoothed(store):
    recorded(store, steps=40, losses=lambda i: 2.0 / (1 + i) + (0.3 if i % 2 else 0.0))
    fig = progress(store, run="a-run")
    raw, smooth = fig.data
    assert list(raw.x) == list(range(40)) and list(smooth.x) == list(range(40))
    assert list(raw.y) == curve(store, "a-run")
    assert list(smooth.y) == pytest.approx(smoothed(curve(store, "a-run"), 0.9))
    assert "a-run" in fig.layout.title.text and "40 forwards" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "forward"
    assert fig.layout.yaxis.type == "linear"


def test_what_evaluate_said_is_drawn_beside_the_loss(store):
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    recorder = Recorder(store, run="checked")  # nothing summarised: the records are read
    for i in range(6):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": 1.0 / (i + 1)})
        if i % 2:  # an evaluation after every other step, as fit(validate=...) says it
            recorder({"fact": "evaluated", "step": i + 1, "rows": 10, "loss": 2.0 / (i + 1)})
    recorder.close()
    fig = progress(store, "checked")
    drawn = {trace.name: trace for trace in fig.data}
    assert list(drawn["validation loss"].x) == [1, 3, 5]
    assert list(drawn["validation loss"].y) == [1.0, 0.5, 2.0 / 6]
    assert list(drawn["loss (raw)"].y) == [1.0 / (i + 1) for i in range(6)]
    assert "validation loss" not in {t.name for t in progress(store, "checked", fact="x").data}


def test_a_loss_over_decades_is_drawn_on_a_log_axis(store):
    recorded(store, steps=30, losses=lambda i: 10.0 ** (2 - i / 10))
    assert progress(store, "a-run").layout.yaxis.type == "log"


def test_progress_of_a_run_without_the_fact_says_so(store):
    recorded(store, steps=3)
    fig = progress(store, "a-run")
    assert [len(trace.x) for trace in fig.data] == [0, 0]
    assert "no 'loss' facts" in fig.layout.annotations[0].text
    with pytest.raises(ValueError, match="smoothing is a weight"):
        progress(store, "a-run", smoothing=1.0)


def test_not_finite_losses_leave_gaps_in_the_raw_line(store):
    recorded(store, steps=4, losses=lambda i: [1.0, float("nan"), 0.5, float("inf")][i])
    raw, smooth = progress(store, "a-run").data
    assert list(raw.y) == [1.0, None, 0.5, None]
    assert all(v is not None and math.isfinite(v) for v in smooth.y)


def test_spent_draws_each_node_total_sorted_and_coloured_by_host(store):
    remote = [{"fact": "ran", "node": "far", "host": "w1", "began_us": 0, "took_us": 5000}]
    recorded(store, steps=10, extra=remote)
    fig = spent(store, "a-run")
    per_node = nodes(store, "a-run")
    bars = {}
    for trace in fig.data:
        for y, x in zip(trace.y, trace.x):
            bars[y] = bars.get(y, 0) + x
    assert bars == pytest.approx({n: e["total_us"] / 1000 for n, e in per_node.items()})
    ranked = sorted(per_node, key=lambda n: -per_node[n]["total_us"])
    assert list(fig.layout.yaxis.categoryarray) == ranked[::-1]  # the largest on top
    names = {trace.name: trace.marker.color for trace in fig.data}
    assert set(names) == {"forward · here", "forward · on w1", "first forward (warm-up) · here",
                          "first forward (warm-up) · on w1"}
    assert names["forward · here"] != names["forward · on w1"]
    assert "10 forwards" in fig.layout.title.text


def test_spent_shows_the_wire_when_the_run_crossed_one(store):
    hops = [{"fact": "sent", "host": "w1", "bytes": 2048, "took_us": 300},
            {"fact": "received", "host": "w1", "bytes": 1024, "took_us": 200},
            {"fact": "sent", "host": "w2", "bytes": 10, "took_us": 100}]
    recorded(store, steps=5, extra=hops)
    fig = spent(store, "a-run")
    wire = {trace.name: trace for trace in fig.data if trace.name in ("sent", "received")}
    assert list(wire["sent"].y) == ["w1", "w2"]
    assert list(wire["sent"].x) == [5 * 300 / 1000, 5 * 100 / 1000]
    assert list(wire["received"].x) == [5 * 200 / 1000, 0]
    assert "10 kB in 5 messages" in wire["sent"].text[0]
    assert "wire" in fig.layout.title.text


def test_figures_refuse_an_unknown_run(store):
    recorded(store, steps=1)
    for draw in (progress, spent):
        with pytest.raises(RecordError, match="no run 'other'; its runs are 'a-run'"):
            draw(store, "other")


def test_a_figure_writes_to_a_file_that_opens_offline(store, tmp_path):
    recorded(store, steps=5, losses=lambda i: 1.0 / (i + 1))
    path = tmp_path / "progress.html"
    progress(store, "a-run").write_html(path, include_plotlyjs=True)
    page = path.read_text()
    assert "<script src" not in page and "Plotly.newPlot" in page
    assert len(page) > 1_000_000  # plotly.js itself is inside


def test_report_is_one_self_contained_file(store, tmp_path):
    recorded(store, steps=20, losses=lambda i: 1.0 / (i + 1))
    target = tmp_path / "report.html"
    assert report(store, "a-run", target) == str(target)
    page = target.read_text()
    assert page.count("Plotly.newPlot") == 2
    assert "<h2>Progress</h2>" in page and "<h2>Where the time went</h2>" in page
    assert "<script src" not in page
    assert "20 forwards" in page
    assert not (tmp_path / "report.html.tmp").exists()


def test_a_report_of_a_run_without_loss_says_so_and_still_shows_time(store, tmp_path):
    recorded(store, steps=3)
    page = Path(report(store, "a-run", tmp_path / "r.html")).read_text()
    assert "no <code>loss</code> facts" in page and page.count("Plotly.newPlot") == 1


def test_a_report_takes_more_sections(store, tmp_path):
    recorded(store, steps=3)
    extra = [lambda s, r: ("Health", f"<p id='health'>{r} is fine</p>"), lambda s, r: None]
    page = Path(report(store, "a-run", tmp_path / "r.html", sections=extra)).read_text()
    assert "<h2>Health</h2><p id='health'>a-run is fine</p>" in page
    assert "Plotly.newPlot" not in page


def test_a_report_of_an_unknown_run_writes_nothing(store, tmp_path):
    recorded(store, steps=1)
    with pytest.raises(RecordError, match="no run 'nope'"):
        report(store, "nope", tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_figures_are_data_that_plotly_can_serialise(store):
    recorded(store, steps=5, losses=lambda i: 1.0 / (i + 1))
    for fig in (progress(store, "a-run"), spent(store, "a-run")):
        assert json.loads(fig.to_json())["data"]


def test_a_flat_curve_keeps_its_labels_and_no_noise_is_drawn_as_motion(store):
    noise = [1e-9, -2e-9, 3e-9, 0.0, -1e-9]
    recorded(store, steps=40, losses=lambda i: 0.6931471805599453 + noise[i % 5])
    fig = progress(store, "a-run")
    low, high = fig.layout.yaxis.range
    assert low < 0.69 and high > 0.697  # the level with room either side, not the noise
    assert (high - low) > 0.05 * 0.69
    raw, smooth = fig.data
    assert max(smooth.y) - min(smooth.y) < 1e-8 * (high - low) * 1e3  # flat as drawn
    assert "flat" in fig.layout.annotations[0].text
    recorded(store, run="moves", steps=40, losses=lambda i: 1.0 - i / 100)
    assert progress(store, "moves").layout.yaxis.range is None  # a moving curve: plotly's own


def test_spent_keeps_forward_backward_and_the_first_forward_apart(store):
    apart = [{"fact": "ran", "node": "head", "backward": True, "took_us": 7000},
             {"fact": "ran", "node": "far", "host": "w1", "took_us": 5000},
             {"fact": "ran", "node": "far", "host": "w1", "backward": True, "took_us": 9000}]
    recorded(store, steps=10, extra=apart)
    per_node = nodes(store, "a-run")
    for entry in per_node.values():  # the three parts are the whole, and nothing twice
        assert entry["forward_us"] + entry["backward_us"] + entry["first_us"] == entry["total_us"]
    assert per_node["head"]["backward_us"] == 9 * 7000 and per_node["far"]["forward_us"] == 9 * 5000
    assert per_node["far"]["first_us"] == 5000 + 9000  # the first forward's, both ways
    fig = spent(store, "a-run")
    drawn = {}
    for trace in fig.data:
        for node, length, base in zip(trace.y, trace.x, trace.base):
            drawn.setdefault(node, []).append((base, length, trace.name))
    for node, parts in drawn.items():  # end to end along the bar, which sums the node's total
        parts.sort()
        assert parts[0][0] == 0
        for (base, length, _), (after, _, _) in zip(parts, parts[1:]):
            assert after == pytest.approx(base + length)
        assert sum(length for _, length, _ in parts) == pytest.approx(per_node[node]["total_us"] / 1000)
    names = {trace.name for trace in fig.data}
    assert {"backward · here", "forward · on w1", "backward · on w1",
            "first forward (warm-up) · on w1"} <= names
    title = fig.layout.title.text
    here = sum(e["forward_us"] for e in per_node.values() if e["host"] is None)
    from somatize.record._figures import _ms
    assert f"in the nodes forward {_ms(here)} here, {_ms(9 * 5000)} on workers" in title
    assert f"backward {_ms(9 * 7000 + 9 * 9000)} (after the forwards" in title
    assert "after the first" in title and "(warm-up)" in title


def test_on_a_log_axis_the_smoothed_loss_is_averaged_in_logs_and_ticks_are_powers_of_ten(store):
    recorded(store, steps=60, losses=lambda i: 10.0 ** (-i / 7))  # from 1 down to 1e-8.4
    fig = progress(store, "a-run")
    raw, smooth = fig.data
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.exponentformat == "power"
    assert fig.layout.yaxis.dtick == 1
    # It lags the points by about ten forwards' worth (1.4 decades here), as an average
    # does; an average of the values would end near 1e-4, ruled by the first ones.
    assert raw.y[-1] < smooth.y[-1] < raw.y[-1] * 10 ** 1.5
    assert smoothed(curve(store, "a-run"), 0.9)[-1] > smooth.y[-1] * 100


def test_where_the_time_went_keeps_its_legend_clear_of_the_titles(store):
    recorded(store, steps=5)
    legend = spent(store, "a-run").layout.legend
    assert legend.x >= 1 and legend.xanchor == "left"  # right of the bars, not over a title
