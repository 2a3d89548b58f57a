"""The notebooks beside the code run as written, each in a real kernel, from a folder
that is not theirs, and leave their stores in ./runs of that folder, not in /tmp.

Notebook 03 has its own test with its seed's exact expectations (tests/torch)."""

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


def run(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    notebook = jupytext.read(ROOT / "notebooks" / name)
    # from a folder of its own, not notebooks/: a notebook runs from wherever it is opened
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    runs = tmp_path / "runs"
    stores = sorted(p.name for p in runs.iterdir()) if runs.exists() else []
    assert all(store.startswith(name[:2] + "-") for store in stores), stores
    printed = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                printed.append(output["text"])
    return "".join(printed)


@pytest.mark.slow
def test_the_federated_notebook(tmp_path, monkeypatch):
    printed = run("04_federated.py", tmp_path, monkeypatch)
    assert list((tmp_path / "runs").iterdir())  # its store, here: not in /tmp
    assert "round 4: weights" in printed
    assert "every client ends with the same weights: yes" in printed
    assert "fed/nb/2/average" in printed


@pytest.mark.slow
def test_the_split_learning_notebook(tmp_path, monkeypatch):
    printed = run("05_split.py", tmp_path, monkeypatch)
    assert "losses equal, step for step: True" in printed
    assert "body's weights equal: True" in printed


@pytest.mark.slow
def test_the_health_notebook(tmp_path, monkeypatch):
    printed = run("06_health.py", tmp_path, monkeypatch)
    assert list((tmp_path / "runs").iterdir())  # its store, here: not in /tmp
    assert "l2 dying 1" in printed  # found from the store alone, in another process
    assert "same findings: True" in printed
    assert "'l2': ['dying'" in printed
    assert "Most of what l2 produces is exactly 0" in printed  # each finding with its advice
    assert "loss plateau since step 1" in printed  # the run's own symptom: shuffled labels
    assert "= ln 3, a uniform guess over 3 classes" in printed


@pytest.mark.slow
def test_the_privacy_notebook(tmp_path, monkeypatch):
    printed = run("07_privacy.py", tmp_path, monkeypatch)
    assert "the gradient defence hides the labels: True" in printed
    assert "nopeek sends less of the input: True" in printed
