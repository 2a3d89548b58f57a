"""The somatize command, run for real (``python -m somatize``) on a fresh store."""

import os
import subprocess
import sys

import pytest

import somatize
from somatize import Graph, Node
from somatize.record import Recorder
from somatize.store import Store

SRC = os.path.dirname(os.path.dirname(somatize.__file__))


class Body(Node):
    def forward(self, x, ctx):
        return x + 1


class Head(Node):
    def forward(self, x, ctx):
        return x * 2


def somatize_command(*argv, check_rc=None):
    done = subprocess.run([sys.executable, "-m", "somatize", *map(str, argv)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": SRC})
    if check_rc is not None:
        assert done.returncode == check_rc, (done.stdout, done.stderr)
    return done


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    where = tmp_path_factory.mktemp("cli") / "store"
    store = Store(where)
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    recorder = Recorder(store, run="a-run", summarising=["loss"])
    for i in range(12):
        g.forward(i, watching=recorder)
        recorder({"fact": "updated"})
        recorder({"fact": "loss", "value": 1.0 / (i + 1)})
    recorder.close()
    quiet = Recorder(store, run="b-run")
    g.forward(0, watching=quiet)
    quiet.close()
    return where


def test_runs_lists_each_run_with_its_forwards_and_last_loss(store):
    done = somatize_command("runs", store, check_rc=0)
    header, rule, first, second = done.stdout.splitlines()
    assert header.split()[:4] == ["run", "forwards", "first", "(UTC)"]
    assert "last loss" in header and set(rule) <= {"-", " "}
    assert first.split()[:2] == ["a-run", "12"] and first.split()[-1] == "0.0833333"
    assert second.split()[:2] == ["b-run", "1"]


def test_show_without_a_forward_sums_the_run_per_node(store):
    done = somatize_command("show", store, "a-run", check_rc=0)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run a-run: 12 forwards")
    rows = {line.split()[0]: line.split() for line in lines[4:]}
    assert set(rows) == {"body", "head"}
    assert rows["body"][1:4] == ["here", "12", "0"]


def test_show_a_forward_is_an_aligned_table_of_its_facts(store):
    done = somatize_command("show", store, "a-run", "--forward", 3, check_rc=0)
    lines = done.stdout.splitlines()
    assert lines[0] == "run a-run, forward 3: 6 facts"
    table = lines[2:]
    assert table[0].split() == ["#", "fact", "node", "host", "began", "µs", "took", "µs", "more"]
    assert [row.split()[1] for row in table[2:]] == ["began", "ran", "ran", "finished", "updated", "loss"]
    assert table[-1].endswith("value=0.25")
    at, took = table[0].index("fact"), table[0].index("took µs") + len("took µs")
    assert [row[at:].split()[0] for row in table[2:]] == [
        "began", "ran", "ran", "finished", "updated", "loss"]  # one column, aligned
    assert all(row[took - 1].isdigit() for row in table[3:6])  # numbers flush right
    assert somatize_command("show", store, "a-run", "-f", "-1", check_rc=0).stdout.splitlines()[0] \
        == "run a-run, forward -1: 6 facts"


def test_report_writes_one_html_file_that_opens_offline(store, tmp_path):
    pytest.importorskip("plotly")
    target = tmp_path / "report.html"
    done = somatize_command("report", store, "a-run", "-o", target, check_rc=0)
    assert f"wrote {target}" in done.stdout
    page = target.read_text()
    assert page.count("Plotly.newPlot") == 2 and "<script src" not in page


@pytest.mark.parametrize("argv, said", [
    (("show", "{store}", "nope"), "somatize show: the store at {store} has no run 'nope'; its runs are 'a-run', 'b-run'"),
    (("show", "{store}", "a-run", "--forward", "12"), "somatize show: run 'a-run' has forwards 0 to 11"),
    (("report", "{store}", "nope", "-o", "{tmp}/r.html"), "somatize report: the store at {store} has no run 'nope'"),
    (("report", "{store}", "a-run", "-o", "{tmp}/missing/r.html"), "somatize report: cannot write"),
    (("runs", "{tmp}/nowhere"), "somatize runs: there is no store at {tmp}/nowhere"),
    (("runs", "{tmp}"), "somatize runs: {tmp} is a directory but not a store"),
    (("show", "{store}", "a/b"), "somatize show: 'a/b' cannot name a run"),
])
def test_a_mistake_is_one_line_on_stderr_and_exit_status_2(store, tmp_path, argv, said):
    fill = {"store": store, "tmp": tmp_path}
    done = somatize_command(*(a.format(**fill) for a in argv))
    assert done.returncode == 2
    assert done.stderr.startswith(said.format(**fill)), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "r.html").exists()
    assert not os.path.exists(tmp_path / "names")  # reading never makes a store


def test_usage_mistakes_exit_2_too(store):
    done = somatize_command("show", store)
    assert done.returncode == 2 and "the following arguments are required: RUN" in done.stderr
    assert somatize_command("--help", check_rc=0).stdout.startswith("usage: somatize")


def test_worker_is_handed_the_rest_of_the_line():
    done = somatize_command("worker", "--help")
    try:
        import somatize.worker  # noqa: F401
    except ImportError:
        assert done.returncode == 2 and "somatize worker:" in done.stderr
    else:
        assert done.returncode == 0 and "--listen" in done.stdout


def test_main_is_callable_with_an_argv(store, capsys):
    from somatize.cli import main

    assert main(["runs", str(store)]) == 0
    assert "a-run" in capsys.readouterr().out
    assert main(["show", str(store), "zzz"]) == 2
    assert "no run 'zzz'" in capsys.readouterr().err
