"""What the pages draw, looked at in a real headless Chromium: a zero on a log axis is
marked on the axis as a zero, a flat loss keeps its labels, where the time went
compares like with like, and a run followed live has every number and title kept
current, then is said to have stopped. Each page's screenshot is kept in the test's
folder (``SOMATIZE_SCREENSHOTS=DIR`` copies them out) for a person to look at."""

import math
import os
import shutil

import pytest
from webruns import CHROMIUM, FLAGS, served, training

from somatize import Graph, Node
from somatize.record import Recorder
from somatize.store import Store

pytest.importorskip("torch", reason="the run it follows trains with torch")
pytest.importorskip("plotly", reason="the page draws with plotly (the web extra)")
playwright = pytest.importorskip("playwright.sync_api",
                                 reason="the browser test needs playwright (the dev extra)")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium to open the page in "
                                 "(apt-get install chromium)")]
STEPS = 80


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def flat_run(store):
    """A loss that does not move but for float noise (1e-9 of 0.69)."""
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="flat", summarising=["loss"])
    for n in range(60):
        g.forward(n, watching=recorder)
        recorder({"fact": "loss", "value": 0.6931471805599453 + (-1) ** n * 1e-9 * (n % 7)})
    recorder.close()


def kept(page, tmp_path, name):
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    copy = os.environ.get("SOMATIZE_SCREENSHOTS")
    if copy:
        shutil.copy(shot, os.path.join(copy, name))
    return shot


def overlap(a, b):
    return not (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])


def figure(page, key):
    return page.evaluate("(key) => { const d = document.getElementById('figure-' + key);"
                         " return {data: d.data, layout: d.layout}; }", key)


def test_the_pages_say_what_is_so_in_a_browser(tmp_path):
    where = tmp_path / "store"
    store = Store(where)
    flat_run(store)
    with served(str(where)) as url, playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1360, "height": 900})

        # A flat loss: the level with labels either side, and no zigzag drawn from noise.
        page.goto(url + "/run/flat")
        page.wait_for_selector("#figure-progress .main-svg", timeout=30_000)
        labels = page.evaluate("[...document.querySelectorAll('#figure-progress .ytick text')]"
                               ".map((label) => label.textContent)")
        assert len(labels) >= 3 and all(labels), labels
        low, high = figure(page, "progress")["layout"]["yaxis"]["range"]
        assert low < 0.69 < 0.697 < high
        kept(page, tmp_path, "flat-loss.png")

        # A run followed as it trains, in a process of its own.
        trainer = training(str(where), "followed", STEPS, 0.1)
        try:
            page.goto(url + "/")
            page.wait_for_selector("a.run-link:text-is('followed')", timeout=90_000)
            page.goto(url + "/run/followed")
            page.wait_for_selector("#figure-progress .main-svg", timeout=60_000)
            page.wait_for_function("document.getElementById('status').textContent === 'recording'")
            for _ in range(3):  # the title counts what the card counts, as both move
                page.wait_for_timeout(1200)
                said = page.evaluate(
                    "[document.getElementById('forwards').textContent,"
                    " document.getElementById('figure-progress').layout.title.text,"
                    " document.getElementById('figure-progress').data[0].x.length]")
                forwards, title, drawn = int(said[0]), said[1], said[2]
                assert f"loss over {drawn} forwards" in title, (said, title)
                assert abs(forwards - drawn) <= 3, said  # one message apart at most
            kept(page, tmp_path, "followed-live.png")
            out, err = trainer.communicate(timeout=240)
            assert trainer.returncode == 0, err
        finally:
            if trainer.poll() is None:
                trainer.kill()
        page.wait_for_function(f"document.getElementById('forwards').textContent === '{STEPS}'",
                               timeout=30_000)
        page.wait_for_function(  # said within seconds, with nothing new from the store
            "document.getElementById('status').textContent === 'stopped'", timeout=30_000)
        page.wait_for_function(
            f"document.getElementById('figure-progress').layout.title.text.includes("
            f"'loss over {STEPS} forwards')", timeout=30_000)
        page.wait_for_function(
            f"document.getElementById('figure-spent').layout.title.text.includes('{STEPS} "
            "forwards')", timeout=30_000)

        # Zeros on the health panel's log axes: the dead body's gradient and update are 0.
        health = figure(page, "health")
        zeros = [t for t in health["data"] if t.get("mode") == "markers"
                 and t["name"].endswith(": exactly 0")]
        assert zeros and all(t["y"][0] > 0 for t in zeros)
        for trace in zeros:  # on the lower edge of its axis, not at a floor among values
            axis = "yaxis" + trace.get("yaxis", "y")[1:]
            assert abs(math.log10(trace["y"][0])
                       - health["layout"][axis]["range"][0]) < 1e-9
        lines = [t for t in health["data"] if t.get("mode") == "lines" and t["name"] == "body"
                 and t.get("yaxis") in ("y2", "y3")]
        assert lines and all(v is None or v > 0 for t in lines for v in t["y"])
        page.wait_for_selector("#figure-health .annotation-text:text('on the axis: exactly 0')")

        # Log axes with a label a decade, not a crowd of minor ones.
        for axis in ("yaxis2", "yaxis3"):
            spread = health["layout"][axis]["range"]
            if spread[1] - spread[0] >= 2:
                assert health["layout"][axis].get("dtick") == 1

        # Where the time went: forward against forward, backward and warm-up apart.
        spent = figure(page, "spent")["layout"]["title"]["text"]
        assert "forwards end to end" in spent and "after the first" in spent
        assert "in the nodes forward" in spent and "(warm-up)" in spent

        # The toolbar stays off every figure's title, and off its legend (the health
        # panel's stands right of the plot, where an upright toolbar covered it).
        for key in ("progress", "health", "graph", "spent"):
            page.hover(f"#figure-{key} .main-svg")
            bar = page.locator(f"#figure-{key} .modebar").bounding_box()
            title = page.locator(f"#figure-{key} .gtitle").bounding_box()
            if bar and title:
                assert not overlap(bar, title), key
            for legend in page.locator(f"#figure-{key} .legend").all():
                box = legend.bounding_box()
                if bar and box:
                    assert not overlap(bar, box), key
        kept(page, tmp_path, "followed-stopped.png")
        page.goto(url + "/")
        page.wait_for_selector("a.run-link:text-is('followed')")
        assert "recording" not in page.inner_text("tr[data-run='followed']")
        kept(page, tmp_path, "runs.png")
        browser.close()
