"""`somatize demo`, the README's first command, does its whole job (shortened)."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("plotly")


@pytest.mark.slow
def test_the_demo_trains_records_audits_and_reports(tmp_path):
    report = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "demo", "--steps", "48", "--store",
         str(tmp_path / "store"), "--report", str(report)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert "Remote(worker: body)" in said
    assert "48 steps" in said and "loss" in said
    rows = {line.split()[0]: line.split()[1:3] for line in said.splitlines()
            if line.split()[:1] in (["encoder"], ["body"], ["head"])}
    assert rows["encoder"] == ["16", "32"]  # 16 batches: run once each, then recalled
    assert rows["body"] == ["48", "0"] and rows["head"] == ["48", "0"]
    assert "findings:" in said or "finding:" in said
    assert said.splitlines()[-1].endswith(f"somatize serve {tmp_path / 'store'}")  # where to look
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Health" in page and "The graph" in page
    assert "<script src=" not in page and len(page) > 1_000_000  # plotly is inside: offline


def test_the_demo_refuses_a_nonsense_step_count(tmp_path):
    done = subprocess.run([sys.executable, "-m", "somatize", "demo", "--steps", "0",
                           "--store", str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--steps" in done.stderr
