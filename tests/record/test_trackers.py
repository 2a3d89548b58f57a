"""A run in TensorBoard and MLflow, written with each project's own library and read
back with it: the export after the fact, the watchers while a run trains, and the
command line."""

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import somatize
from somatize import Graph, Node, RecordError
from somatize.health import diagnose, findings_of, history
from somatize.record import (Recorder, curve, export_mlflow, export_tensorboard, facts, forwards,
                             to_mlflow, to_tensorboard)
from somatize.record._trackers import _key
from somatize.store import Store

SRC = os.path.dirname(os.path.dirname(somatize.__file__))
pytestmark = pytest.mark.filterwarnings(  # MLflow's own use of SQLAlchemy, not ours
    "ignore::DeprecationWarning:mlflow.*")
STEPS = 12
DYING = {"body": {"act_zero": 1.0, "grad_norm": 1.0}, "head": {"grad_norm": 1.0}}


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def needs(name):
    return pytest.importorskip(name, reason=f"{name} is the trackers extra's")


def float32(value):
    """What a TensorBoard scalar keeps of a number (it stores 32 bits)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def dying_run(store, run="dying"):
    """Bare forwards with the health facts an Audit would say of a dead layer."""
    g = Graph.somatize(Step().named("body") >> Step().named("head"))
    recorder = Recorder(store, run=run)
    for number in range(1, STEPS + 1):
        g.forward(number, watching=recorder)
        recorder({"fact": "loss", "value": 1.0 / number})
        for where, measures in DYING.items():
            recorder({"fact": "health", "where": where, "step": number, **measures,
                      "act_hist": {"counts": [1, 2], "edges": [0, 1, 2]}})
    recorder.close()


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    store = Store(root / "store", durable=False)
    dying_run(store)
    return root, store


@pytest.fixture(scope="module")
def mlflow_uri(place):
    needs("mlflow")
    from mlflow import MlflowClient

    root, _ = place
    uri = f"sqlite:///{root / 'mlflow.db'}"
    # Where the artifacts go is the experiment's to say; here, beside the database.
    MlflowClient(tracking_uri=uri).create_experiment(
        "somatize", artifact_location=(root / "artifacts").as_uri())
    return uri


@pytest.fixture(scope="module")
def trained(place, request):
    """A real torch run, recorded, and streamed to both trackers as it trained (to
    MLflow where it is installed)."""
    torch = pytest.importorskip("torch")
    needs("tensorboard")
    try:
        mlflow_uri = request.getfixturevalue("mlflow_uri")
    except pytest.skip.Exception:
        mlflow_uri = None
    from somatize import Opaque
    from somatize.torch import Trainer, parameters

    class Lin(Node):
        def __init__(self, a, b):
            self.lin = torch.nn.Linear(a, b)

        def forward(self, x, ctx):
            return Opaque(torch.relu(self.lin(x)))

        def parameters(self):
            return list(self.lin.parameters())

    root, store = place
    torch.manual_seed(0)
    g = Graph.somatize(Lin(4, 8).named("body") >> Lin(8, 1).named("head"))
    recorder = Recorder(store, run="trained")
    live_tb = to_tensorboard(root / "live-tb", judge=findings_of)
    live_ml = to_mlflow(tracking_uri=mlflow_uri, run_name="trained", judge=findings_of) if mlflow_uri else None
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05),
                      watching=[w for w in (recorder, live_tb, live_ml) if w], auditing=True)
    x = torch.randn(16, 4)
    trainer.fit([(x, x.sum(1, keepdim=True))] * STEPS)
    trainer.close()
    for watcher in (recorder, live_tb, live_ml):
        if watcher is not None:
            watcher.close()
    return "trained", live_tb, live_ml


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    read = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    return read, texts


def node_ms(store, run, node):
    """Per forward, the ms a node ran, summed from its ``ran`` facts."""
    out = []
    for index in range(forwards(store, run)):
        said = [f["took_us"] for f in facts(store, run, index)
                if f["fact"] == "ran" and f.get("node") == node and not f.get("backward")]
        out.append(sum(said) / 1000)
    return out


# -- TensorBoard ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensorboard_reads_back_what_the_record_holds(place, trained, tmp_path):
    _, store = place
    run = trained[0]
    folder = export_tensorboard(store, run, tmp_path / "logs", findings=diagnose(store, run))
    assert folder == str(tmp_path / "logs" / run)
    read, texts = scalars(folder)
    assert read["loss"] == [(step, float32(v)) for step, v in zip(range(1, STEPS + 1), curve(store, run))]
    for node in ("body", "head"):
        assert [v for _, v in read[f"time/{node}"]] == [float32(ms) for ms in node_ms(store, run, node)]
    assert [s for s, _ in read["time/forward"]] == list(range(1, STEPS + 1))
    measured = history(store, run)
    for where in ("body", "head"):
        for measure in ("grad_norm", "act_zero", "update_ratio", "weight_norm"):
            assert read[f"health/{where}/{measure}"] == \
                [(step, float32(v)) for step, v in measured[where][measure]]
    assert texts["findings"][0][0] == STEPS


@pytest.mark.slow
def test_tensorboard_live_writes_what_the_export_writes(place, trained, tmp_path):
    root, store = place
    exported = scalars(export_tensorboard(store, trained[0], tmp_path / "logs", findings=diagnose(store, trained[0])))
    assert scalars(root / "live-tb") == exported
    assert trained[1].where == str(root / "live-tb")


def test_the_findings_reach_tensorboard_as_a_table(place, tmp_path):
    needs("tensorboard")
    _, store = place
    read, texts = scalars(export_tensorboard(store, "dying", tmp_path / "logs", findings=diagnose(store, "dying")))
    (step, table), = texts["findings"]
    assert step == STEPS
    assert "| body | dying | 1 | act_zero >= 0.9 for 12 steps (median 1, worst 1) |" in table
    assert read["health/body/act_zero"] == [(s, 1.0) for s in range(1, STEPS + 1)]
    assert read["loss"][0] == (0, 1.0)  # bare forwards say no step: their index is one
    assert "health/body/act_hist" not in read  # a histogram is not one number


def test_exporting_again_replaces_its_own_files_only(place, tmp_path):
    needs("tensorboard")
    _, store = place
    folder = Path(export_tensorboard(store, "dying", tmp_path / "logs", findings=diagnose(store, "dying")))
    theirs = folder / "events.out.tfevents.0.elsewhere"
    theirs.write_bytes(b"")
    export_tensorboard(store, "dying", tmp_path / "logs", findings=diagnose(store, "dying"))
    ours = sorted(p.name for p in folder.iterdir() if p.name.endswith(".somatize"))
    assert len(ours) == 1 and theirs.exists()
    theirs.unlink()
    assert scalars(folder)[0]["loss"] == [(s - 1, float32(1 / s)) for s in range(1, STEPS + 1)]


def test_an_unknown_run_is_refused_before_anything_is_written(place, tmp_path):
    _, store = place
    with pytest.raises(RecordError, match="no run 'nope'"):
        export_tensorboard(store, "nope", tmp_path / "logs")
    assert not (tmp_path / "logs").exists()
    with pytest.raises(RecordError, match="no run 'nope'"):
        export_mlflow(store, "nope", tracking_uri="sqlite:///never-opened.db")
    assert not Path("never-opened.db").exists()


def test_a_live_watcher_refuses_a_nonsense_flush(tmp_path):
    with pytest.raises(ValueError, match="flush_secs"):
        to_tensorboard(tmp_path, flush_secs=0)


# -- MLflow -----------------------------------------------------------------------------------
def metrics(uri, run_id):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id)
    return {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
            for key in logged.data.metrics}, logged


def artifact(uri, run_id, path):
    from mlflow import MlflowClient

    where = MlflowClient(tracking_uri=uri).download_artifacts(run_id, path)
    return Path(where).read_text()


@pytest.mark.slow
def test_mlflow_reads_back_what_the_record_holds(place, trained, mlflow_uri):
    _, store = place
    run = trained[0]
    run_id = export_mlflow(store, run, findings=diagnose(store, run), tracking_uri=mlflow_uri)
    logged, info = metrics(mlflow_uri, run_id)
    assert logged["loss"] == list(zip(range(1, STEPS + 1), curve(store, run)))  # 64 bits: exact
    assert [v for _, v in logged["time/head"]] == node_ms(store, run, "head")
    measured = history(store, run)
    assert logged["health/body/grad_norm"] == measured["body"]["grad_norm"]
    assert info.info.status == "FINISHED" and info.info.run_name == run
    assert info.data.tags["somatize.run"] == run and info.data.tags["somatize.store"] == store.where
    assert json.loads(artifact(mlflow_uri, run_id, "findings.json")) == \
        [f.as_dict() for f in diagnose(store, run)]


@pytest.mark.slow
def test_mlflow_live_logs_what_the_export_logs(place, trained, mlflow_uri):
    _, store = place
    exported, _ = metrics(mlflow_uri, export_mlflow(store, trained[0], findings=diagnose(store, trained[0]), tracking_uri=mlflow_uri))
    live_id = trained[2].where.rsplit(" ", 1)[1]
    live, info = metrics(mlflow_uri, live_id)
    assert live == exported and info.info.status == "FINISHED"
    assert info.data.tags["somatize.run"] == "trained"


@pytest.mark.slow
def test_the_findings_reach_mlflow(place, mlflow_uri):
    _, store = place
    run_id = export_mlflow(store, "dying", findings=diagnose(store, "dying"), tracking_uri=mlflow_uri, experiment="somatize")
    found = json.loads(artifact(mlflow_uri, run_id, "findings.json"))
    assert [(f["where"], f["what"], f["since"]) for f in found] == [("body", "dying", 1)]
    assert "| body | dying | 1 |" in artifact(mlflow_uri, run_id, "findings.md")
    _, info = metrics(mlflow_uri, run_id)
    assert info.data.tags["somatize.findings"] == "dying at body since step 1"


def test_mlflow_keys_are_what_mlflow_takes():
    assert _key("time/body") == "time/body"
    assert _key("health/a:b c/..") == "health/a_b c/_"
    assert _key("wire/h\u00e9te//x") == "wire/h\u00e9te/_/x"
    assert len(_key("x" * 400)) == 250


# -- without the extra, and from the command line --------------------------------------------
def test_without_the_trackers_the_record_still_reads(place):
    _, store = place
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('tensorboard', 'mlflow', 'torch'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from somatize.record import curve, export_tensorboard, to_mlflow
        from somatize.store import Store
        store = Store({str(store.where)!r}, durable=False)
        assert len(curve(store, 'dying')) == {STEPS}
        for call in (lambda: export_tensorboard(store, 'dying', {str(store.where)!r} + '/tb'),
                     lambda: to_mlflow()):
            try:
                call()
            except ImportError as exc:
                print(exc)
        print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'tensorboard', 'mlflow'}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert "writing for TensorBoard needs tensorboard" in said[0] and "somatize[trackers]" in said[0]
    assert "writing to MLflow needs mlflow" in said[1] and "somatize[trackers]" in said[1]
    assert said[2] == "[]"


def somatize_cli(*arguments, cwd=None):
    return subprocess.run([sys.executable, "-m", "somatize", *arguments], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env={**os.environ, "PYTHONPATH": SRC})


@pytest.mark.slow
def test_the_export_commands(place, mlflow_uri, tmp_path):
    needs("tensorboard")
    _, store = place
    done = somatize_cli("export", "tensorboard", store.where, "dying", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stderr
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in done.stdout
    assert scalars(tmp_path / "logs" / "dying")[0]["loss"][-1] == (STEPS - 1, float32(1 / STEPS))
    done = somatize_cli("export", "mlflow", store.where, "dying", "--tracking-uri", mlflow_uri)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split("as MLflow run ")[1].split()[0]
    assert metrics(mlflow_uri, run_id)[0]["loss"][-1] == (STEPS - 1, 1 / STEPS)
    done = somatize_cli("export", "tensorboard", store.where, "nope", str(tmp_path / "x"))
    assert done.returncode == 2 and "no run 'nope'" in done.stderr and "Traceback" not in done.stderr
    done = somatize_cli("export", "mlflow", store.where, "dying", "--tracking-uri", "nonsense://x")
    assert done.returncode == 2 and "MLflow refused it" in done.stderr, done.stderr


def test_an_export_to_a_new_database_keeps_its_artifacts_beside_it(place, tmp_path, monkeypatch):
    needs("mlflow")
    from somatize.record import runs

    _, store = place
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)  # where the export runs from: nothing may be left in it
    database = tmp_path / "elsewhere" / "tracking.db"
    database.parent.mkdir()
    run = runs(store)[0].name
    run_id = export_mlflow(store, run, tracking_uri=f"sqlite:///{database}", findings=[])
    assert list(here.iterdir()) == []  # no mlruns/ in the current directory
    assert json.loads(artifact(f"sqlite:///{database}", run_id, "findings.json")) == []
    assert (tmp_path / "elsewhere" / "tracking-artifacts").is_dir()
