"""Live where it runs: silent in a pipe, one rewritten line on a real terminal (a pty),
a live figure in a real Jupyter kernel — running notebook 03's record cells as written."""

import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest

import somatize
from somatize import Graph, Node
from somatize.record import Live

SRC = os.path.dirname(os.path.dirname(somatize.__file__))


class Body(Node):
    def forward(self, x, ctx):
        return x + 1


def test_live_is_silent_where_nobody_can_see_it(capfd):
    live = Live(title="training")
    assert live.mode is None
    g = Graph.somatize(Body() >> Body())
    for i in range(5):
        g.forward(i, watching=live)
        live({"fact": "loss", "value": 1.0 / (i + 1)})
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert live.forwards == 5
    assert live.losses == [(i, 1.0 / (i + 1)) for i in range(5)]
    assert live.line().startswith("training · 5 forwards · loss 0.2 · ")
    assert live.line().endswith(" ms/forward")


def test_live_figure_is_the_loss_so_far():
    pytest.importorskip("plotly")
    live = Live()
    for i in range(3):
        live({"fact": "finished", "took_us": 100})
        live({"fact": "loss", "value": float(3 - i)})
    raw, _ = live.figure().data
    assert list(raw.x) == [0, 1, 2] and list(raw.y) == [3.0, 2.0, 1.0]
    assert "3 forwards" in live.figure().layout.title.text
    assert "Plotly" in live._repr_html_()
    with pytest.raises(TypeError, match="a Live title is a str"):
        Live(title=3)


def test_on_a_terminal_live_rewrites_one_line_and_ends_it_at_exit():
    script = textwrap.dedent("""
        import time
        from somatize import Graph, Node
        from somatize.record import Live

        class Body(Node):
            def forward(self, x, ctx):
                return x + 1

        live = Live(title="training")
        assert live.mode == "terminal", live.mode
        g = Graph.somatize(Body() >> Body())
        for i in range(12):
            g.forward(i, watching=live)
            live({"fact": "loss", "value": 1.0 / (i + 1)})
            time.sleep(0.03)
    """)
    leader, follower = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=follower,
                             env={**os.environ, "PYTHONPATH": SRC})
    os.close(follower)
    said = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        said += chunk
    os.close(leader)
    assert child.wait(timeout=30) == 0, said
    text = said.decode()
    assert text.count("\r") >= 2  # rewritten in place, not one line per fact
    final = text.rstrip("\r\n").split("\r")[-1].strip()
    assert final.startswith("training · 12 forwards · loss 0.083333 · "), text
    assert text.endswith("\n")  # the line was ended at exit
    assert child.stdout.read() == b""


NOTEBOOK = [
    """
    import tempfile
    from somatize import Graph, Node, Opaque, Recorder, Store
    from somatize.record import Live, curve, forwards, nodes, progress, spent

    class Body(Node):
        def forward(self, x, ctx):
            return Opaque([v * 0.9 for v in x])

    class Head(Node):
        def forward(self, x, ctx):
            return Opaque(sum(x))

    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    store = Store(tempfile.mkdtemp())
    live = Live(title="training")
    recorder = Recorder(store, run="a-run", summarising=["loss"])
    watching = [recorder, live]
    for step in range(40):  # what Trainer.step does, without torch
        out = g.forward([1.0, 2.0], watching=watching)
        for fact in ({"fact": "updated"}, {"fact": "loss", "value": out / (step + 1)}):
            for watcher in watching:
                watcher(fact)
    """,
    "live",
    """
    facts_of_a_step = __import__("somatize.record", fromlist=["facts"]).facts
    facts_of_a_step(store, run="a-run", forward=10)
    """,
    'progress(store, run="a-run")',
    'spent(store, run="a-run")',
]


def test_notebook_03s_record_cells_run_as_written(monkeypatch):
    pytest.importorskip("plotly")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(textwrap.dedent(cell)) for cell in NOTEBOOK]
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nbclient.NotebookClient(book, timeout=120, kernel_name="python3").execute()
    loop, shown, said, drawn, spent_cell = (cell.outputs for cell in book.cells)
    plotly = "application/vnd.plotly.v1+json"
    # The training cell showed a live figure and kept it up to date: one output, which
    # ends holding every loss of the loop.
    live_outputs = [o for o in loop if plotly in o.get("data", {})]
    assert len(live_outputs) == 1
    assert len(live_outputs[0]["data"][plotly]["data"][0]["x"]) == 40
    # `live` as a cell's last expression shows the final curve: all forty losses.
    final = [o for o in shown if plotly in o.get("data", {})]
    assert len(final) == 1
    raw = final[0]["data"][plotly]["data"][0]
    assert len(raw["x"]) == 40
    assert final[0]["data"][plotly]["layout"]["title"]["text"].startswith(
        "<b>training</b> — 40 forwards · loss ")
    text = said[0]["data"]["text/plain"]
    assert "'fact': 'began'" in text and "'fact': 'loss'" in text and "'fact': 'updated'" in text
    assert plotly in drawn[0]["data"] and plotly in spent_cell[0]["data"]
    # The recorder was never closed, and progress still has the last step's loss.
    assert len(drawn[0]["data"][plotly]["data"][0]["x"]) == 40
