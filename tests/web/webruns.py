"""What the web tests look at: runs recorded into real stores, a real ``somatize serve``
process, and a snapshot of a store to show that serving it changed nothing.

Run as a script, it trains a small torch net with a Recorder and an Audit, in a
process of its own, while a test watches the page:

    python webruns.py (DIR | s3://BUCKET ENDPOINT) RUN STEPS PAUSE
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from somatize import Graph, Node
from somatize.record import Recorder

HERE = Path(__file__).resolve().parent

# Debian's Chromium, where it is (.ci/run installs it), and how the browser tests start it.
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             "/usr/bin/chromium") if p and os.path.exists(p)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def recorded(store, run, steps, *, summarising=("loss",), health=None, batches=False):
    """``steps`` bare forwards, each followed by a loss (and ``health`` facts, a dict of
    ``{where: measures}`` said after each one) as a Trainer says them; with ``batches``,
    each forward written as a batch of its own, as a slow run's are."""
    g = Graph.somatize(Step().named("step") >> Step().named("next"))
    recorder = Recorder(store, run=run, summarising=list(summarising))
    for number in range(1, steps + 1):
        g.forward(number, watching=recorder)
        recorder({"fact": "loss", "value": 1.0 / number})
        for where, measures in (health or {}).items():
            recorder({"fact": "health", "where": where, "step": number, **measures})
        if batches:
            recorder.flush()
    recorder.close()
    return recorder


def snapshot(directory) -> dict[str, tuple[int, str]]:
    """Every file under a store's directory: its size, bytes' digest and modification
    time, so that anything written, added or removed shows."""
    out = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            out[str(path.relative_to(directory))] = (
                len(data), hashlib.sha256(data).hexdigest(), path.stat().st_mtime_ns)
    return out


@contextlib.contextmanager
def served(*arguments: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``somatize serve ARGUMENTS --port 0`` as a process of its own; yields its URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "somatize", "serve", *arguments, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout],
                     daemon=True).start()
    try:
        try:
            first = lines.get(timeout=60)
        except queue.Empty:
            raise AssertionError("somatize serve said nothing within 60 s") from None
        assert first.startswith("serving "), first + server.stderr.read()
        yield first.split(" at ", 1)[1].split()[0].rstrip("/")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def training(where: str, run: str, steps: int, pause: float, *,
             endpoint: str | None = None) -> subprocess.Popen:
    """This file run as a script: a torch run training in another process."""
    place = [where] + ([endpoint] if endpoint else [])
    return subprocess.Popen([sys.executable, str(HERE / "webruns.py"), *place, run,
                             str(steps), str(pause)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _train(store, run: str, steps: int, pause: float) -> None:
    """A body whose ReLU never fires (so the audit has something to find) before a head,
    trained by a Trainer with an Audit and a Recorder."""
    import torch

    from somatize import Opaque
    from somatize.torch import Trainer, parameters

    class Body(Node):
        def __init__(self):
            self.lin = torch.nn.Linear(8, 16)
            with torch.no_grad():
                self.lin.bias.fill_(-10.0)  # every unit below zero: dead from the start

        def forward(self, x, ctx):
            return Opaque(torch.relu(self.lin(x)))

        def parameters(self):
            return list(self.lin.parameters())

    class Head(Node):
        def __init__(self):
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x, ctx):
            return Opaque(self.out(x))

        def parameters(self):
            return list(self.out.parameters())

    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = Graph.somatize(Body().named("body") >> Head().named("head"))
    recorder = Recorder(store, run=run, summarising=["loss"])
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05),
                      watching=[recorder], auditing=True)
    x = torch.randn(16, 8)
    y = x.sum(1, keepdim=True)
    for _ in range(steps):
        trainer.step((x, y))
        time.sleep(pause)
    trainer.close()
    recorder.close()


if __name__ == "__main__":
    from somatize.store import Store

    if sys.argv[1].startswith("s3://"):
        opened = Store.on_bucket(sys.argv[2], sys.argv[1].removeprefix("s3://"))
        rest = sys.argv[3:]
    else:
        opened, rest = Store(sys.argv[1], durable=False), sys.argv[2:]
    _train(opened, rest[0], int(rest[1]), float(rest[2]))
