"""The page in a real headless Chromium, driven by Playwright, while a torch run trains
in a process of its own: the run appears in the list, its page opens, and its forward
count rises without a reload; then the report's sections are there, and the store is
as it was. The screenshot it takes is kept (``SOMATIZE_SCREENSHOTS=DIR`` copies it out)
for a person to look at."""

import os
import shutil
import time

import pytest
from webruns import CHROMIUM, FLAGS, served, snapshot, training

from somatize.store import Store

pytest.importorskip("torch", reason="the run it watches trains with torch")
pytest.importorskip("plotly", reason="the page draws with plotly (the web extra)")
playwright = pytest.importorskip("playwright.sync_api",
                                 reason="the browser test needs playwright (the dev extra)")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium to open the page in "
                                 "(.ci/run installs Debian's; apt-get install chromium)")]
STEPS = 150


def number(page, selector):
    text = page.inner_text(selector)
    return int(text) if text.isdigit() else -1


def rises(page, selector, since, within):
    """The value at ``selector`` once it is above ``since``, waiting up to ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        now = number(page, selector)
        if now > since:
            return now
        page.wait_for_timeout(100)
    raise AssertionError(f"{selector} stayed at {number(page, selector)} for {within} s")


def test_a_run_seen_live_in_a_browser(tmp_path):
    where = tmp_path / "store"
    Store(where)
    with served(str(where)) as url, playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        page.goto(url + "/")
        page.wait_for_selector("text=No runs yet")
        trainer = training(str(where), "seen-live", STEPS, 0.06)
        try:
            page.wait_for_selector("a.run-link:text-is('seen-live')", timeout=90_000)
            page.click("a.run-link:text-is('seen-live')")
            page.wait_for_url(url + "/run/seen-live")
            page.wait_for_function("/^[0-9]+$/.test(document.getElementById('forwards').textContent)")
            first = number(page, "#forwards")
            assert first < STEPS, "the run ended before the page could watch it"
            later = rises(page, "#forwards", first, within=10)  # no reload: the stream did it
            rises(page, "#forwards", later, within=10)
            assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
            out, err = trainer.communicate(timeout=240)
            assert trainer.returncode == 0, err
        finally:
            if trainer.poll() is None:
                trainer.kill()
        page.wait_for_function(f"document.getElementById('forwards').textContent === '{STEPS}'",
                               timeout=30_000)
        for key in ("progress", "health", "graph", "spent"):  # each drawn by plotly
            page.wait_for_selector(f"#figure-{key} .main-svg", timeout=30_000)
        page.wait_for_function(  # the loss curve holds every step, added live or redrawn
            f"document.getElementById('figure-progress').data[0].x.length === {STEPS}",
            timeout=30_000)
        page.wait_for_function(  # and the sections were drawn again once the run was over
            f"document.getElementById('figure-spent').layout.title.text.includes('{STEPS} forwards')",
            timeout=30_000)
        findings = page.inner_text("#findings")
        assert "dying" in findings and "body" in findings  # its ReLU never fires
        assert page.inner_text("#status") in ("recording", "stopped")
        # The layers inside each node, drawn from what the Trainer recorded: one Linear
        # in the body, one in the head, each a row of its own box.
        drawn = page.locator("#figure-graph .annotation-text").all_text_contents()
        assert [text for text in drawn if text == "Linear"] == ["Linear", "Linear"]
        shot = tmp_path / "run.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000  # a page of figures, not a blank one
        kept = os.environ.get("SOMATIZE_SCREENSHOTS")
        if kept:
            shutil.copy(shot, os.path.join(kept, "serve-run.png"))

        # Looking again at a run that is over writes nothing to its store.
        before = snapshot(where)
        page.goto(url + "/")
        page.wait_for_selector("a.run-link:text-is('seen-live')")
        assert "dying · body" in page.inner_text("#runs")
        page.goto(url + "/run/seen-live")
        page.wait_for_selector("#figure-spent .main-svg", timeout=30_000)
        browser.close()
    assert snapshot(where) == before
