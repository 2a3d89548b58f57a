"""The documentation: every public name is in it, and it builds with no broken reference."""

import html
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["somatize", "somatize.torch", "somatize.record", "somatize.health", "somatize.web"]


def documented() -> dict[str, object]:
    """Every ``::: dotted.path`` in the API pages, resolved to its object."""
    found = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            module, _, name = path.rpartition(".")
            found[path] = getattr(importlib.import_module(module), name)
    return found


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_documented(module):
    pytest.importorskip("torch")
    pytest.importorskip("plotly")
    pytest.importorskip("starlette")  # somatize.web's page is among the documented
    there = importlib.import_module(module)
    objects = documented()
    missing = [name for name in there.__all__ if name != "__version__"
               and not any(obj is getattr(there, name) and path.endswith("." + name)
                           for path, obj in objects.items())]
    assert not missing, f"{module}.__all__ names {missing}, which the API pages do not document"
    # ...and nothing is documented that is not public
    for path in objects:
        home, _, name = path.rpartition(".")
        if home in MODULES:
            assert name in importlib.import_module(home).__all__, path


def test_the_documentation_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    # Not -q: it hides the warnings, and strict mode then has none to abort on.
    done = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "torch" / "index.html").exists()
    pages = {name: html.unescape(re.sub(r"<[^>]+>", "", (tmp_path / "site" / "api" / name /
                                                        "index.html").read_text()))
             for name in ("torch", "somatize", "record")}
    # each class shows what it is called with, where it is named, not only in prose
    for page, signature in [("torch", "Trainer(graph: Graph, *, objective"),
                            ("torch", "Split(optimizer"), ("somatize", "Store("),
                            ("record", "Recorder(")]:
        assert signature.replace(" ", "") in "".join(pages[page].split()), (page, signature)
    # and only public names: what other modules of ours call is not the user's API
    for internal in ("stand", "take_weights_before"):
        assert not re.search(rf"\b{internal}\(", pages["torch"]), internal
