"""`somatize demo`, the README's first command, does its whole job (shortened)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("plotly")


@pytest.mark.slow
def test_the_demo_trains_records_audits_and_reports(tmp_path):
    report = tmp_path / "report.html"
    shell = {**os.environ, "PATH": "/usr/bin:/bin"}  # a newcomer's: .venv/bin not activated
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "demo", "--steps", "48", "--store",
         str(tmp_path / "store"), "--report", str(report)],
        capture_output=True, text=True, timeout=300, env=shell)
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
    assert "activate" in said.splitlines()[-2]
    printed = said.splitlines()[-1].split(": ", 1)[1]
    assert_it_serves(printed, shell)  # in the folder the demo ran in
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Health" in page and "The graph" in page
    assert "<script src=" not in page and len(page) > 1_000_000  # plotly is inside: offline


def test_the_demo_refuses_a_nonsense_step_count(tmp_path):
    done = subprocess.run([sys.executable, "-m", "somatize", "demo", "--steps", "0",
                           "--store", str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--steps" in done.stderr


def assert_it_serves(printed: str, shell: dict) -> None:
    """The command the demo printed, typed into a shell as it is (plus a free port),
    serves the store: its first line is the page's address."""
    server = subprocess.Popen(f"exec {printed} --port 0", shell=True, env=shell,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline()
        assert "http://127.0.0.1:" in first, server.stderr.read() if server.poll() is not None else first
    finally:
        server.terminate()
        server.wait(timeout=30)
        server.stdout.close()
        server.stderr.close()


def test_every_place_that_says_how_long_the_demo_takes_says_the_same(capsys):
    """The README, the command's overview and ``somatize demo --help`` give one figure
    (measured: see TAKES), in plain words rather than reStructuredText's markup."""
    from pathlib import Path

    from somatize import cli
    from somatize.torch import _demo

    with pytest.raises(SystemExit):
        _demo.main(["--help"])
    helped = capsys.readouterr().out
    seconds = _demo.TAKES.split(" on ")[0]  # "about 20 s"
    assert _demo.TAKES in " ".join(helped.split()) and "``" not in helped
    assert f"in {seconds}" in cli.__doc__
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"`make demo` takes {_demo.TAKES}" in readme
