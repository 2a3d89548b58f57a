"""What recording costs, side by side with not recording and with TensorBoard.

1. A 2-node forward, unwatched and watched by a Recorder, interleaved in one run,
   the Recorder's writing included: each block of forwards ends with ``flush()``, and
   its time is divided by the forwards (target: recording adds at most 40 µs per
   forward). Then the same over a sustained second of forwards, so that the writer
   thread writes behind the run as it would, and one ``flush()`` at the end.
2. A training-shaped step: that forward plus the trainer's ``updated`` and ``loss``
   after its ``finished`` (so each record is bound twice), against TensorBoard's
   ``SummaryWriter.add_scalar`` for the same step (target: at most 1.5x its cost).
   TensorBoard is measured two ways: the loss alone, and every number the record
   holds (the loss, each node's time, the forward's time) as one scalar each; and
   with ``flush()`` after each step, the point at which its file holds the step as a
   Recorder's store does the moment a forward finishes.
3. ``progress`` over a run of 10,000 forwards summarising the loss (target: < 2 s).
4. ``store.resolve`` of a forward's name (seed 004: every forward's name answers it):
   a forward inside a batch, and the name just past the run's end, beside the anchor,
   a name that is bound (a batch's first forward): one name read.

    python benchmarks/record.py
    python benchmarks/record.py --against ../other/src   # 1. beside another checkout

``--against SRC`` measures 1. for another checkout's ``src`` (the code before a change,
say) and for this one, each block of rounds in a process of its own, the two
alternated in this one run, and prints the medians side by side; ``--quick`` runs
fewer rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from somatize import Graph, Node
from somatize._engine import Pass
from somatize.record import Recorder, curve, progress
from somatize.store import Store

from _bench import interleaved

BLOCK = 200  # forwards per timed block
ROUNDS = 15  # blocks of each kind, interleaved
LONG = 10_000


class Body(Node):
    def forward(self, x, ctx):
        return x + 1


class Head(Node):
    def forward(self, x, ctx):
        return x * 2


def forward_costs(g):
    store = Store(tempfile.mkdtemp(prefix="somatize-bench-"))
    recorder = Recorder(store, run="bench")
    listed = []

    def listing(fact):
        listed.append(fact)
        if len(listed) > 10_000:
            listed.clear()

    def recorded(i):
        g.forward(i, watching=recorder)
        if i == BLOCK - 1:  # the block's last forward: everything it said is written
            recorder.flush()

    return interleaved({
        "unwatched": lambda i: g.forward(i),
        "watched by list.append": lambda i: g.forward(i, watching=listing),
        "watched by Recorder, + flush()": recorded,
    }, ROUNDS, BLOCK)


def sustained(g, seconds=1.0):
    """``(wall, cpu)`` seconds per forward over about ``seconds`` of forwards, then one
    ``flush()``; cpu is the whole process's, the writer thread's included."""
    store = Store(tempfile.mkdtemp(prefix="somatize-bench-"))
    out = {}
    for name in ("unwatched", "watched by Recorder, + flush()"):
        recorder = Recorder(store, run=f"sustained-{len(out)}") if out else None
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            for i in range(100):
                g.forward(i, watching=recorder)
            count += 100
        if recorder is not None:
            recorder.flush()
        out[name] = ((time.perf_counter() - start) / count, (time.process_time() - cpu) / count)
    return out


def step_costs(g):
    store = Store(tempfile.mkdtemp(prefix="somatize-bench-"))
    recorder = Recorder(store, run="steps", summarising=["loss"])

    def recorded(i):
        # As a Trainer steps: its began says the step, then updated and loss follow.
        with Pass(recorder, opening={"step": i}) as one:
            one.run(g, i)
        recorder({"fact": "updated"})
        recorder({"fact": "loss", "value": 1.0 / (i + 1)})
        if i == BLOCK - 1:
            recorder.flush()

    contenders = {"plain step": lambda i: g.forward(i), "Recorder step": recorded}
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("(torch.utils.tensorboard is not importable: TensorBoard left out)")
        return interleaved(contenders, ROUNDS, BLOCK)
    writer = SummaryWriter(tempfile.mkdtemp(prefix="somatize-bench-tb-"))
    step = [0]

    def tensorboard(every_number, flush):
        def one(i):
            began = time.perf_counter_ns()
            g.forward(i)
            took = (time.perf_counter_ns() - began) // 1000
            step[0] += 1
            writer.add_scalar("loss", 1.0 / (i + 1), step[0])
            if every_number:
                writer.add_scalar("node/body_us", took / 2, step[0])
                writer.add_scalar("node/head_us", took / 2, step[0])
                writer.add_scalar("forward_us", took, step[0])
            if flush:
                writer.flush()
        return one

    contenders.update({
        "TensorBoard, loss": tensorboard(False, False),
        "TensorBoard, loss + flush": tensorboard(False, True),
        "TensorBoard, same numbers": tensorboard(True, False),
        "TensorBoard, same numbers + flush": tensorboard(True, True),
    })
    try:
        return interleaved(contenders, ROUNDS, BLOCK)
    finally:
        writer.close()


def long_run():
    store = Store(tempfile.mkdtemp(prefix="somatize-bench-"))
    g = Graph.somatize(Body() >> Head())
    recorder = Recorder(store, run="long", summarising=["loss"])
    start = time.perf_counter()
    for i in range(LONG):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": 1.0 / (i + 1)})
    recorder.close()
    built = time.perf_counter() - start
    start = time.perf_counter()
    values = curve(store, "long")
    read = time.perf_counter() - start
    assert len(values) == LONG
    start = time.perf_counter()
    fig = progress(store, "long")
    drawn = time.perf_counter() - start
    assert len(fig.data[0].x) == LONG
    return built, read, drawn


def resolving():
    """Per-call seconds of ``store.resolve`` for a batch's own name, a forward inside a
    batch, and the name past the run's end, over a run of 1,000 forwards in batches of
    100 (the listing that learns where they begin is made before timing)."""
    store = Store(tempfile.mkdtemp(prefix="somatize-bench-"))
    g = Graph.somatize(Body() >> Head())
    recorder = Recorder(store, run="names")
    for i in range(1000):
        g.forward(i, watching=recorder)
        if i % 100 == 99:
            recorder.flush()
    recorder.close()
    assert store.resolve("run/names/550").name == "run/names/550"  # learnt, once
    return interleaved({
        "a batch's own name (anchor)": lambda i: store.resolve(f"run/names/{(i % 10) * 100}"),
        "a forward inside a batch": lambda i: store.resolve(f"run/names/{(i % 10) * 100 + 57}"),
        "the name past the end": lambda i: store.resolve("run/names/1000"),
    }, ROUNDS, 50)


def forward_added(g):
    """What 1. measures, in µs per forward: recording's cost over blocks with a flush,
    over a sustained second, and by CPU time; and the unwatched forward's own."""
    found = forward_costs(g)
    (plain_wall, plain_cpu), (ours_wall, ours_cpu) = sustained(g).values()
    return {"unwatched": found["unwatched"] * 1e6,
            "blocks": (found["watched by Recorder, + flush()"] - found["unwatched"]) * 1e6,
            "sustained": (ours_wall - plain_wall) * 1e6,
            "sustained, CPU": (ours_cpu - plain_cpu) * 1e6}


_ONE = """
import json, record
from somatize import Graph
print(json.dumps(record.forward_added(Graph.somatize(record.Body() >> record.Head()))))
"""


def against(other: str, rounds: int) -> None:
    """1. for ``other`` (a checkout's src) and for this checkout, alternated."""
    here = Path(__file__).resolve().parent
    trees = {"other": str(Path(other).resolve()), "this": str(here.parent / "src")}
    found: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, src in order:
            done = subprocess.run([sys.executable, "-c", _ONE], capture_output=True, text=True,
                                  cwd=here, check=True,
                                  env={**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{here}"})
            found[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"Recording's cost per forward, {rounds} alternated processes each, medians (µs):")
    print(f"  {'':8s} {'unwatched':>10s} {'blocks':>10s} {'sustained':>10s} {'CPU':>10s}")
    for name, src in trees.items():
        med = {k: statistics.median(run[k] for run in found[name]) for k in found[name][0]}
        print(f"  {name:8s} {med['unwatched']:10.1f} {med['blocks']:10.1f} "
              f"{med['sustained']:10.1f} {med['sustained, CPU']:10.1f}   {src}")


def main():
    if "--against" in sys.argv:
        against(sys.argv[sys.argv.index("--against") + 1], 4 if "--quick" in sys.argv else 10)
        return
    g = Graph.somatize(Body() >> Head())
    print(f"A 2-node forward, {ROUNDS} interleaved blocks of {BLOCK}, median per forward:")
    found = forward_costs(g)
    plain = found["unwatched"]
    for name, seconds in found.items():
        print(f"  {name:34s} {seconds * 1e6:8.1f} µs   {seconds / plain:6.2f}x unwatched")
    added = (found["watched by Recorder, + flush()"] - plain) * 1e6
    print(f"  recording adds {added:.1f} µs per forward, its writing included "
          f"(target <= 40 µs): {'met' if added <= 40 else 'NOT met'}")
    long = sustained(g)
    (plain_wall, plain_cpu), (ours_wall, ours_cpu) = long.values()
    added = (ours_wall - plain_wall) * 1e6
    print(f"  over a sustained second, one flush() at the end: unwatched {plain_wall * 1e6:.1f} µs,"
          f" recorded {ours_wall * 1e6:.1f} µs: adds {added:.1f} µs (target <= 40 µs): "
          f"{'met' if added <= 40 else 'NOT met'}")
    print(f"    by CPU time (the writer thread's included): unwatched {plain_cpu * 1e6:.1f} µs, "
          f"recorded {ours_cpu * 1e6:.1f} µs: adds {(ours_cpu - plain_cpu) * 1e6:.1f} µs")
    print()
    print("A training-shaped step (forward, then updated and loss), median per step:")
    steps = step_costs(g)
    plain, ours = steps["plain step"], steps["Recorder step"]
    print(f"  {'Recorder step':34s} {ours * 1e6:8.1f} µs   adds {(ours - plain) * 1e6:7.1f} µs")
    for name, seconds in steps.items():
        if name.startswith("TensorBoard"):
            cost = seconds - plain
            print(f"  {name:34s} {seconds * 1e6:8.1f} µs   adds {cost * 1e6:7.1f} µs   "
                  f"Recorder/TensorBoard added cost {(ours - plain) / cost:5.2f}x")
    print("  (target: at most 1.5x TensorBoard's cost per step)")
    print()
    print("store.resolve of a forward's name, a run of 1,000 forwards in batches of 100:")
    names = resolving()
    anchor = names["a batch's own name (anchor)"]
    for name, seconds in names.items():
        print(f"  {name:34s} {seconds * 1e6:8.1f} µs   {seconds / anchor:6.2f}x the anchor")
    print()
    built, read, drawn = long_run()
    print(f"A run of {LONG:,} forwards summarising loss (written in {built:.2f} s):")
    print(f"  curve    {read:6.3f} s")
    print(f"  progress {drawn:6.3f} s   (target < 2 s): {'met' if drawn < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
