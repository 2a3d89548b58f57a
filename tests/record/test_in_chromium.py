"""A report and a graph drawing opened in a real headless Chromium, and the screenshot
looked at: not blank, and coloured where plotly draws. Skipped without chromium."""

import os
import shutil
import struct
import subprocess
import zlib

import pytest

pytest.importorskip("plotly")

from somatize import Graph, Node
from somatize.record import Recorder, report
from somatize.store import Store

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             "/usr/bin/chromium") if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium to open the file in")


def screenshot(page, png, tmp_path, size="1400,1000"):
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
         f"--window-size={size}", "--virtual-time-budget=5000", f"file://{page}"],
        capture_output=True, timeout=120, check=True,
    )
    return pixels(png.read_bytes())


def pixels(data):
    """The RGB triples of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks, header = 8, [], None
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and interlace == 0 and colour in (2, 6), header
    step = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * step
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - step] if x >= step else 0
            up, corner = previous[x], previous[x - step] if x >= step else 0
            if kind == 1:
                line[x] = (line[x] + left) & 255
            elif kind == 2:
                line[x] = (line[x] + up) & 255
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                near = min((abs(guess - left), 0, left), (abs(guess - up), 1, up),
                           (abs(guess - corner), 2, corner))[2]
                line[x] = (line[x] + near) & 255
        rows.append(bytes(line))
        previous = line
    return [(row[x], row[x + 1], row[x + 2]) for row in rows[::4] for x in range(0, stride, step * 4)]


def test_a_report_renders_with_both_figures(tmp_path):
    store = Store(tmp_path / "store")

    class Body(Node):
        def forward(self, x, ctx):
            return x + 1

    recorder = Recorder(store, run="seen", summarising=["loss"])
    g = Graph.somatize(Body().named("body") >> Body().named("head"))
    for i in range(60):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": 3.0 / (1 + i)})
    recorder.close()
    page = tmp_path / "report.html"
    report(store, "seen", page)
    seen = screenshot(page, tmp_path / "report.png", tmp_path)
    inked = [p for p in seen if p != (255, 255, 255)]
    assert len(inked) > 0.02 * len(seen)  # text, axes, lines and bars, not a white page
    blue = [p for p in inked if p[2] > 150 and p[0] < 120]  # the curve and the bars
    assert len(blue) > 200


def test_a_graph_drawing_renders_its_boxes_and_lanes(tmp_path):
    class Step(Node):
        def forward(self, x, ctx):
            raise AssertionError("nothing runs to draw")

    g = Graph.somatize(Step().named("a") >> (Step().named("b") | Step().named("c").at("w1"))
                       >> Step().named("d"))
    page = tmp_path / "graph.html"
    g.figure(overlay={"b": ["dying"]}).write_html(page, include_plotlyjs=True)
    seen = screenshot(page, tmp_path / "graph.png", tmp_path, size="1000,600")
    inked = [p for p in seen if p != (255, 255, 255)]
    assert len(inked) > 0.05 * len(seen)
    red = [p for p in inked if p[0] > 180 and p[1] < 90 and p[2] < 90]  # the flagged box
    orange_lane = [p for p in inked if p[0] > 240 and 235 < p[1] < 250 and p[2] < 240]
    assert len(red) > 20 and len(orange_lane) > 200
