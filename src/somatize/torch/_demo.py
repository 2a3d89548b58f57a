"""``somatize demo``: the whole job of the library in one run of about 20 s.

A graph of three nodes — an encoder that is frozen and cached, a body sent to a
worker this process spawns and trained there by ``Split``, a head trained here — is
trained on a made-up classification task, recorded and audited into a store. Then it
says what happened: the loss before and after, what was recalled instead of run,
where the time went, what the audit found, and a report that opens offline.

The nodes live in this module, so the worker (which imports code in ``project``
mode) finds them in its own installation, exactly as it would on another machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from typing import Any

import torch

from .. import health, record
from .._graph import Graph
from .._node import Node, Opaque
from ..record import Recorder
from ..store import Store
from ..wire import Broker, Worker
from ._learning import Split
from ._trainer import Trainer
from ._weights import parameters

__all__ = ["main"]

FEATURES, HIDDEN, CLASSES = 32, 64, 4
TAKES = "about 20 s on two cores"  # 11-23 s measured, torch's import included; README says so


class Encoder(Node):
    """A fixed random projection: settled from the start, so its output can be kept."""

    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN):
        torch.manual_seed(7)
        self.project = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh())

    def forward(self, x: Any, ctx: Any) -> Any:
        return Opaque(self.project(x))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.project.parameters())


class Body(Node):
    """The half that runs on the worker."""

    def __init__(self, hidden: int = HIDDEN):
        torch.manual_seed(8)
        self.net = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU())

    def forward(self, x: Any, ctx: Any) -> Any:
        return Opaque(self.net(x))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.net.parameters())


class Head(Node):
    """The classifier, trained here."""

    def __init__(self, hidden: int = HIDDEN, classes: int = CLASSES):
        torch.manual_seed(9)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, x: Any, ctx: Any) -> Any:
        return Opaque(self.out(x))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.out.parameters())


def task(batches: int = 16, rows: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Points around four centres in 32 dimensions, with noise: learnable, not trivial."""
    generator = torch.Generator().manual_seed(0)
    centres = 0.3 * torch.randn(CLASSES, FEATURES, generator=generator)
    out = []
    for _ in range(batches):
        labels = torch.randint(0, CLASSES, (rows,), generator=generator)
        points = centres[labels] + torch.randn(rows, FEATURES, generator=generator)
        out.append((points, labels))
    return out


def build() -> Graph:
    return Graph.somatize(Encoder().named("encoder").frozen().cached()
                          >> Body().named("body").at("worker")
                          >> Head().named("head"))


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; answers the process's exit code."""
    parser = argparse.ArgumentParser(prog="somatize demo", description=(
        f"The whole job of the library in one run of {TAKES}: train a graph split "
        "between this process and a worker it starts, record, audit and report."))
    parser.add_argument("--store", default="demo-store", help="where the run is kept")
    parser.add_argument("--steps", type=int, default=320, help="how many training steps")
    parser.add_argument("--report", default="demo-report.html", help="the report to write")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps is a whole number from 1 up")
    began = time.perf_counter()
    torch.set_num_threads(1)
    store = Store(args.store)
    data = task()
    epochs = max(1, -(-args.steps // len(data)))
    g = build()
    say(f"the graph  {g.plan()}   (body on a worker started here; encoder frozen and cached)")
    log = os.path.join(store.where, "worker.log")  # the worker's chatter, kept aside
    with Worker.spawn([sys.executable, "-m", "somatize.worker", "--listen", "127.0.0.1:0",
                       "--log", log]) as worker:
        trains = {"body": Split(torch.optim.Adam, lr=3e-3)}
        recorder = Recorder(store, summarising=["loss"])
        trainer = Trainer(
            g, objective=torch.nn.functional.cross_entropy, trains=trains,
            optimizer=torch.optim.Adam(parameters(g, without=[*trains, *g.frozen()]), lr=3e-3),
            broker=Broker.embedded({"worker": worker}), store=store,
            watching=[recorder], auditing=True)
        batches = (data * epochs)[: args.steps]
        result = trainer.fit(batches)
        trainer.close()
        recorder.close()
    report(store, recorder.run, result.history, args.report, g, time.perf_counter() - began)
    return 0


def report(store: Store, run: str, history: list[float], path: str, g: Graph,
           took: float) -> None:
    """The table at the end, and the report beside it."""
    ran = record.nodes(store, run)
    findings = health.diagnose(store, run)
    first, last = _mean(history[:10]), _mean(history[-10:])
    say("")
    say(f"run {run!r} in {os.path.abspath(store.where)}: {len(history)} steps")
    say(f"loss           {first:.3f} over the first 10 steps  ->  {last:.3f} over the last 10")
    say(f"{'node':10} {'ran':>5} {'recalled':>9} {'time spent':>12}")
    for node, said in ran.items():
        say(f"{node:10} {said.get('ran', 0):5d} {said.get('recalled', 0):9d} "
            f"{said.get('total_us', 0) / 1e3:10.1f}ms")
    if findings:
        for finding in findings:
            say(f"finding: {finding.what} at {finding.where} since step {finding.since}")
    else:
        say("findings: none (the audit saw nothing unhealthy)")
    # The graph as it ran, opened with the layers the Trainer recorded: what `somatize
    # report` and `serve` draw for this run, from the store alone.
    health.report(store, run, path, graph=g)
    say(f"report: {os.path.abspath(path)} (opens offline)   done in {took:.0f} s")
    say(f"the worker's log: {os.path.join(os.path.abspath(store.where), 'worker.log')}")
    somatize = command()
    if somatize.endswith("/somatize"):  # installed, but not on this shell's PATH
        say(f"(`. {os.path.dirname(somatize)}/activate` once, and `somatize` alone will do)")
    say(f"to look at it in a browser: {somatize} serve {shlex.quote(os.path.abspath(store.where))}")


def command() -> str:
    """How to call this installation's ``somatize`` so that it works as printed: its bare
    name where the shell's PATH finds this very script, else its path (relative where it
    lies under the working directory, as ``.venv/bin/somatize`` after ``make``), else
    ``python -m somatize`` with this interpreter."""
    beside = os.path.join(os.path.dirname(sys.executable), "somatize")  # no realpath: a venv's
    if not os.path.isfile(beside):                                        # python is a link
        return f"{shlex.quote(sys.executable)} -m somatize"
    found = shutil.which("somatize")
    if found and os.path.samefile(found, beside):
        return "somatize"
    near = os.path.relpath(beside)
    return shlex.quote(beside if near.startswith("..") else near)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
