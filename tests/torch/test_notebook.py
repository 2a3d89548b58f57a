"""The training notebook runs as written, in a real kernel, and says what it should."""

import os
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03_training.py"


def outputs(cell, answered=True):
    """Everything a cell printed (and, with ``answered``, what it answered), as text."""
    text = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            text.append(output["text"])
        elif answered and "data" in output:
            text.append(output["data"].get("text/plain", ""))
    return "".join(text)


@pytest.mark.slow
def test_the_training_notebook_runs_as_written(tmp_path, monkeypatch):
    # The kernel is a child process: it finds somatize the way this one does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    notebook = jupytext.read(NOTEBOOK)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell, if any cell fails
    assert sorted("-".join(p.name.split("-")[:2]) for p in (tmp_path / "runs").iterdir()) \
        == ["03-frozen", "03-training"]  # its stores, here: none left in /tmp

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    printed = "\n".join(outputs(cell) for cell in code)
    assert "losses : 8" in printed
    assert "updates: 2 — eight steps, two updates" in printed
    assert "fingerprints: {}" in printed
    assert "frozen at: {'body': '" in printed  # the weights' digest the comment speaks of
    frozen = next(outputs(c, answered=False) for c in code if "first time" in outputs(c))
    # `began` is our engine's (SPEC section 7); the seed's printout predates it.
    assert [line.split() for line in frozen.splitlines()
            if line.startswith("  ") and line.split() != ["began"]] == [
        ["ran", "body"], ["kept", "body"], ["ran", "head"], ["finished"],
        ["recalled", "body"], ["ran", "head"], ["finished"],
        ["ran", "body"], ["kept", "body"], ["ran", "head"], ["finished"],
    ]
    assert "kept as sha256:" in printed
    assert "nodes  : ['body', 'head']" in printed
    step = next(outputs(c) for c in code if "facts_of_a_step(" in c.source)
    for fact in ("'ran'", "'finished'", "'updated'", "'loss'"):
        assert fact in step
