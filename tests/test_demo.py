"""`somatize demo`, the README's first command, does its whole job (shortened)."""

import json
import os
import re
import subprocess
import sys
import urllib.request

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
    run = re.search(r"^run '([^']+)'", said, re.M).group(1)
    served = assert_it_serves(printed, shell, run)  # in the folder the demo ran in
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Health" in page and "The graph" in page
    assert "<script src=" not in page and len(page) > 1_000_000  # plotly is inside: offline
    # The layers inside each node: the demo's report, `somatize report` and the served
    # page draw them alike, each read from the store (encoder and head here, body on
    # the worker), as architecture() lists the demo's graph.
    drawn = graph_figure(page)
    assert parts_of(drawn) == [
        "encoder.project.0", "encoder.project.1", "body.net.0", "body.net.1", "body.net.2",
        "body.net.3", "head.out"]
    assert [a["text"] for a in drawn["layout"]["annotations"] if a["text"] in ("Linear", "ReLU", "Tanh")] \
        == ["Linear", "Tanh", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    written = tmp_path / "cli.html"
    subprocess.run([sys.executable, "-m", "somatize", "report", str(tmp_path / "store"), run,
                    "-o", str(written)], check=True, capture_output=True, timeout=120, env=shell)
    for other in (graph_figure(written.read_text()), served):
        assert other["data"] == drawn["data"]
        assert other["layout"]["annotations"] == drawn["layout"]["annotations"]
        assert other["layout"]["shapes"] == drawn["layout"]["shapes"]


def graph_figure(page: str) -> dict:
    """The figure a report draws under its heading "The graph", as plotly's data."""
    at = page.index("<h2>The graph</h2>")
    at = page.index("Plotly.newPlot(", at) + len("Plotly.newPlot(")
    decoder = json.JSONDecoder()
    _, at = decoder.raw_decode(page, re.compile(r"\s*").match(page, at).end())  # the div's id
    data, at = decoder.raw_decode(page, re.compile(r"\s*,\s*").match(page, at).end())
    layout, _ = decoder.raw_decode(page, re.compile(r"\s*,\s*").match(page, at).end())
    return {"data": data, "layout": layout}


def parts_of(figure: dict) -> list[str]:
    """The ``node.path`` of each part drawn inside a box, from its hover."""
    parts = [trace for trace in figure["data"] if trace.get("name") == "parts"]
    return [re.match(r"<b>(.*?)</b>", text).group(1) for trace in parts for text in trace["hovertext"]]


def test_the_demo_refuses_a_nonsense_step_count(tmp_path):
    done = subprocess.run([sys.executable, "-m", "somatize", "demo", "--steps", "0",
                           "--store", str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--steps" in done.stderr


def assert_it_serves(printed: str, shell: dict, run: str) -> dict:
    """The command the demo printed, typed into a shell as it is (plus a free port),
    serves the store: its first line is the page's address. Answers the figure the page
    draws for ``run``'s graph."""
    server = subprocess.Popen(f"exec {printed} --port 0", shell=True, env=shell,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline()
        assert "http://127.0.0.1:" in first, server.stderr.read() if server.poll() is not None else first
        url = first.split(" at ", 1)[1].split()[0].rstrip("/")
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"{url}/api/run/{run}", timeout=60) as answer:
            sections = json.load(answer)["sections"]["sections"]
        return next(s["figure"] for s in sections if s["key"] == "graph")
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
