"""The somatize command, run for real (``python -m somatize``) on a fresh store."""

import importlib.util
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
    unsummarised = Recorder(store, run="c-run")  # a loss said, but not summarised
    for i in range(3):
        g.forward(i, watching=unsummarised)
        unsummarised({"fact": "loss", "value": 2.0 - i})
    g.forward(9, watching=unsummarised)  # a last forward that said no loss
    unsummarised.close()
    return where


def test_runs_lists_each_run_with_its_forwards_and_last_loss(store):
    done = somatize_command("runs", store, check_rc=0)
    header, rule, first, second, third = done.stdout.splitlines()
    assert header.split()[:4] == ["run", "forwards", "first", "(UTC)"]
    assert "last loss" in header and set(rule) <= {"-", " "}
    assert first.split()[:2] == ["a-run", "12"] and first.split()[-1] == "0.0833333"
    assert second.split()[:2] == ["b-run", "1"] and len(second.split()) == 6  # said none
    assert third.split()[:2] == ["c-run", "4"] and third.split()[-1] == "0"  # read, not summarised


def test_show_without_a_forward_sums_the_run_per_node(store):
    done = somatize_command("show", store, "a-run", check_rc=0)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run a-run: 12 forwards") and "ms end to end" in lines[0]
    # a node's total may pass the run's end to end (its backward is in it): said beside it
    assert lines[1].startswith("(end to end: the forwards alone") and "backward" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[5:]}
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
    (("show", "{store}", "nope"), "somatize show: the store at {store} has no run 'nope'; its runs are 'a-run', 'b-run', 'c-run'"),
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


def test_what_the_collector_lets_go_of_meanwhile_is_not_said(store, capsys, monkeypatch):
    """An unclosed socket of somebody else's, let go of while a command runs (as the
    cyclic collector may do at any allocation), is no warning of the command's: its
    ResourceWarning is not said, and somatize's own warnings still are."""
    import socket
    import warnings

    from somatize import cli

    listing = cli._runs

    def beside_a_leak(reading):
        socket.socket()  # let go of at once, open: Python warns that it was unclosed
        warnings.warn("somatize says this one", UserWarning, stacklevel=1)
        return listing(reading)

    monkeypatch.setattr(cli, "_runs", beside_a_leak)
    assert cli.main(["runs", str(store)]) == 0
    err = capsys.readouterr().err
    assert "unclosed" not in err
    assert err.splitlines() == ["somatize runs: warning: somatize says this one"]


def test_every_reading_command_reads_a_store_in_a_bucket(s3_endpoint, credentials, tmp_path):
    from s3server import make_bucket  # beside the fixtures, found as conftest.py finds them

    make_bucket(s3_endpoint, "cli-bucket")
    recorder = Recorder(Store.on_bucket(s3_endpoint, "cli-bucket", prefix="exp"), run="far")
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    for i in range(3):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": 0.5})
    recorder.close()
    where = ("s3://cli-bucket/exp", "--endpoint", s3_endpoint)
    runs = somatize_command("runs", *where, check_rc=0).stdout.splitlines()
    assert runs[2].split()[:2] == ["far", "3"] and runs[2].split()[-1] == "0.5"
    assert somatize_command("show", *where, "far", check_rc=0).stdout.startswith(
        "run far: 3 forwards")
    assert somatize_command("show", *where, "far", "-f", "1", check_rc=0).stdout.startswith(
        "run far, forward 1:")
    assert "no findings" in somatize_command("health", *where, "far", check_rc=0).stdout
    if importlib.util.find_spec("plotly") is not None:
        target = tmp_path / "far.html"
        somatize_command("report", *where, "far", "-o", target, check_rc=0)
        assert target.read_text().startswith("<!DOCTYPE html>")


# An extra that is not installed, as Python itself says so: a module set to None in
# sys.modules is one that neither imports nor is found.
WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from somatize.cli import main
sys.exit(main(sys.argv[2:]))
"""


def without(modules, *argv, cwd=None):
    return subprocess.run([sys.executable, "-c", WITHOUT, ",".join(modules), *map(str, argv)],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": SRC})


@pytest.mark.parametrize("modules, argv, said", [
    (["plotly"], ("report", "{store}", "a-run", "-o", "{tmp}/r.html"),
     "somatize report: the report needs plotly, which is not installed: pip install 'somatize[viz]'"),
    (["plotly"], ("demo", "--steps", "2", "--store", "{tmp}/demo", "--report", "{tmp}/r.html"),
     "somatize demo: the demo needs plotly, which is not installed: pip install 'somatize[torch,viz]'"),
    (["torch"], ("demo", "--store", "{tmp}/demo"),
     "somatize demo: the demo needs torch, which is not installed: pip install 'somatize[torch,viz]'"),
    (["tensorboard"], ("export", "tensorboard", "{store}", "a-run", "{tmp}/tb"),
     "somatize export: the tensorboard export needs tensorboard, which is not installed: "
     "pip install 'somatize[trackers]'"),
    (["mlflow"], ("export", "mlflow", "{store}", "a-run"),
     "somatize export: the mlflow export needs mlflow, which is not installed: "
     "pip install 'somatize[trackers]'"),
    (["boto3"], ("runs", "s3://bucket", "--endpoint", "http://127.0.0.1:9"),
     "somatize runs: a store in a bucket (s3://bucket) needs boto3, which is not installed: "
     "pip install 'somatize[s3]'"),
    (["starlette"], ("serve", "{store}", "--port", "0"),
     "somatize serve: the page needs starlette, which is not installed: "
     "pip install 'somatize[web]'"),
])
def test_a_command_names_the_extra_it_lacks_before_it_starts(store, tmp_path, modules, argv, said):
    fill = {"store": store, "tmp": tmp_path}
    done = without(modules, *(a.format(**fill) for a in argv), cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == said.format(**fill)
    assert done.stdout == "" and sorted(os.listdir(tmp_path)) == []  # no work was begun


@pytest.mark.slow
def test_export_mlflow_says_only_what_is_ours_and_leaves_no_mlruns(store, tmp_path):
    pytest.importorskip("mlflow")
    done = subprocess.run([sys.executable, "-m", "somatize", "export", "mlflow", str(store),
                           "a-run", "--tracking-uri", "sqlite:///mlflow.db"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("logged run a-run as MLflow run ")
    assert "warning" not in done.stderr  # MLflow's deprecations are MLflow's to fix
    assert sorted(os.listdir(tmp_path)) == ["mlflow-artifacts", "mlflow.db"]  # no mlruns/
