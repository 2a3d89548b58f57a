"""Where the time of one split step goes: a timeline of marks on both sides, beside the
same marks made by the plain split.

The tiny model of ``split.py`` (Encoder here >> Body on a worker, trained by Split >>
Head here), one step at a time. Both processes read one clock (``perf_counter_ns`` is
CLOCK_MONOTONIC, shared across processes on one machine); each side marks when it
starts and finishes sending a frame, when it has read one, and the worker when its walk
starts and ends. Every gap between two consecutive marks is charged to whoever was
working (here, the worker) or to the wire and the scheduler (a frame on its way, a
process waking up), and the median over many steps is printed in order.

Beside each gap, the same gap of ``split.py``'s plain split (plain torch over one raw
socket, the floor of a split step), in blocks of steps interleaved with ours: its body
marks the same moments at the lines of ``split.PLAIN`` that say ``# mark:``, and its
client around its sends and reads. What ours spends beyond it, gap by gap, is where
the fixed cost of a split step goes. Last, the CPU each side spends per step (the far
process's read from /proc), against the same model in one piece: a figure the
machine's other load does not move.

    python benchmarks/timeline.py          # --quick for fewer steps
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from _bench import cpu_seconds

os.environ.setdefault("OMP_NUM_THREADS", "1")

MARKS: list[tuple[int, str]] = []


def marking(side: str) -> None:
    """Marks every frame this process sends and reads, and (on a worker) every walk."""
    from somatize.wire import channel

    try:  # where a worker runs a slice: the host code shared with Ray, or before it
        from somatize.wire import host as runner
    except ImportError:
        from somatize.wire import connection as runner

    send, recv = channel.Channel.send, channel.Channel.recv

    def marked_send(self, kind, *args, **kwargs):
        MARKS.append((time.perf_counter_ns(), f"{side} sends {kind}"))
        size = send(self, kind, *args, **kwargs)
        MARKS.append((time.perf_counter_ns(), f"{side} sent {kind}"))
        return size

    def marked_recv(self, *args, **kwargs):
        frame = recv(self, *args, **kwargs)
        MARKS.append((time.perf_counter_ns(), f"{side} read {frame.kind}"))
        return frame
    channel.Channel.send, channel.Channel.recv = marked_send, marked_recv
    if side == "worker":
        run_slice = runner.run_slice

        def marked_run(*args, **kwargs):
            MARKS.append((time.perf_counter_ns(), "worker walks"))
            out = run_slice(*args, **kwargs)
            MARKS.append((time.perf_counter_ns(), "worker walked"))
            return out
        runner.run_slice = marked_run


def worker_main(path: str) -> None:
    """A worker that writes its marks to ``path`` when it is told to stop."""
    marking("worker")
    from somatize.worker import main

    try:
        main(["--listen", "127.0.0.1:0", "--quiet"])  # until it is told to stop
    finally:
        with open(path + ".part", "w") as out:
            json.dump(MARKS[-20000:], out)
        os.replace(path + ".part", path)


def marked_plain(path: str) -> str:
    """``split.PLAIN``, the plain split's body, marking its moments where its lines say
    ``# mark:``, and writing the marks to ``path`` when the client hangs up."""
    from split import PLAIN

    lines = ["import atexit, json, os, time", "MARKS = []",
             "def _written():",
             f"    json.dump(MARKS[-20000:], open({path + '.part'!r}, 'w'))",
             f"    os.replace({path + '.part'!r}, {path!r})",
             "atexit.register(_written)"]
    for line in PLAIN.splitlines():
        code, marked, labels = line.partition("  # mark: ")
        lines.append(code)
        indent = code[:len(code) - len(code.lstrip())]
        lines += [f"{indent}MARKS.append((time.perf_counter_ns(), {label!r}))"
                  for label in labels.split(", ") if marked]
    return "\n".join(lines) + "\n"


def plain_marked(width: int, rows: int, path: str):
    """``split.PlainSplit`` marking the moments ours does: its sends and reads here (in
    ``MARKS``), and its body's there (``marked_plain``, written to ``path``)."""
    from split import PlainSplit

    class MarkedPlain(PlainSplit):
        server = marked_plain(path)

        def _send(self, tensor):
            MARKS.append((time.perf_counter_ns(), "here sends slice"))
            super()._send(tensor)
            MARKS.append((time.perf_counter_ns(), "here sent slice"))

        def _fill(self):
            buf = super()._fill()
            MARKS.append((time.perf_counter_ns(), "here read done"))
            return buf

    return MarkedPlain(width, rows)


def main() -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from split import batch, model

    from somatize import Broker, Worker
    from somatize.torch import Split, Trainer, parameters

    torch.set_num_threads(1)
    steps = 100 if "--quick" in sys.argv else 400
    folder = tempfile.mkdtemp()
    ours_at, plain_at = os.path.join(folder, "ours.json"), os.path.join(folder, "plain.json")
    marking("here")
    mse = torch.nn.functional.mse_loss
    data = [batch(16, 8) for _ in range(50)]
    worker = Worker.spawn([sys.executable, os.path.abspath(__file__), "--worker", ours_at],
                          mode="network", send=["split"])
    plain = plain_marked(16, 8, plain_at)
    windows: dict[str, list] = {"ours": [], "plain": []}
    with worker:
        cut = model(16, "w")
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        trainer = Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
        contenders = {"ours": trainer.step, "plain": plain.step}
        for b in data * 2:
            for step in contenders.values():
                step(b)
        for block in range(4):  # interleaved, so both see the same machine
            for name, step in contenders.items():
                for i in range(steps // 4):
                    MARKS.clear()
                    began = time.perf_counter_ns()
                    step(data[i % len(data)])
                    windows[name].append((began, time.perf_counter_ns(), list(MARKS)))
        cpu = {"ours": cpu_per_step(trainer.step, data, worker._child.pid, steps),
               "plain": cpu_per_step(plain.step, data, plain.proc.pid, steps)}
    plain.close()
    report({name: timeline(windows[name], far_marks(path))
            for name, path in (("ours", ours_at), ("plain", plain_at))})
    whole = model(16)
    one = Trainer(whole, objective=mse, optimizer=torch.optim.SGD(parameters(whole), lr=0.01))
    for b in data:
        one.step(b)
    began = time.process_time()
    for i in range(steps):
        one.step(data[i % len(data)])
    alone = (time.process_time() - began) / steps * 1e6
    print(f"CPU per step (load-proof), one piece {alone:.0f} us:")
    for name, (here, there) in cpu.items():
        print(f"  {name:5}  {here:4.0f} us here + {there:4.0f} us on the far side: "
              f"{here + there - alone:4.0f} us of CPU over one piece")


def far_marks(path: str) -> list[tuple[int, str]]:
    """The marks the far process wrote when it ended."""
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(path) as f:
        return [tuple(m) for m in json.load(f)]


def cpu_per_step(step, data, pid: int, steps: int) -> tuple[float, float]:
    """CPU seconds per step, in microseconds, of this process and of the far one (from
    /proc, so whatever else the machine runs is not counted)."""
    began, there = time.process_time(), cpu_seconds(pid)
    for i in range(steps * 4):
        step(data[i % len(data)])
    return ((time.process_time() - began) / steps / 4 * 1e6,
            (cpu_seconds(pid) - there) / steps / 4 * 1e6)


def timeline(windows: list, there: list) -> tuple[list[str], list[float], float, int]:
    """The marks of the steps, both sides merged, in the order most steps made them:
    their labels, the median of each gap between two, the median step and how many
    steps had that order (one with a heartbeat, or a mark the other side made late,
    has another)."""
    seen: dict[tuple[str, ...], list[list[float]]] = {}
    totals: dict[tuple[str, ...], list[float]] = {}
    for began, ended, here in windows:
        marks = sorted([(began, "here: step begins")] + here
                       + [m for m in there if began <= m[0] <= ended] + [(ended, "here: step ends")])
        labels = tuple(label for _, label in marks)
        seen.setdefault(labels, []).append([(b - a) / 1000 for (a, _), (b, _) in zip(marks, marks[1:])])
        totals.setdefault(labels, []).append((ended - began) / 1000)
    labels = max(seen, key=lambda shape: len(seen[shape]))
    gaps = [statistics.median(each) for each in zip(*seen[labels])]
    return list(labels), gaps, statistics.median(totals[labels]), len(seen[labels])


def report(lines: dict[str, tuple[list[str], list[float], float, int]]) -> None:
    (labels, ours, whole, count), (theirs, plain, plain_whole, plain_count) = lines["ours"], lines["plain"]
    print(f"one split step of the tiny model, gap by gap: ours ({whole:.0f} us in all, median of "
          f"{count} steps) beside plain torch over a raw socket ({plain_whole:.0f} us, of "
          f"{plain_count}), the same moments marked in both")
    same = labels == theirs
    if not same:  # the two made their marks in different orders: ours alone
        plain = [float("nan")] * len(ours)
    print(f"  {'ours':>8} {'plain':>8} {'beyond':>8}")
    by: dict[str, list[float]] = {}
    for (a, b), mine, floor in zip(zip(labels, labels[1:]), ours, plain):
        who = _who(a, b)
        print(f"  {mine:8.1f} {floor:8.1f} {mine - floor:8.1f}  {who:8} {a} -> {b}")
        total = by.setdefault(who, [0.0, 0.0])
        total[0] += mine
        total[1] += floor
    print("  summed, ours (plain): " + ", ".join(
        f"{who} {mine:.0f} us ({floor:.0f})" for who, (mine, floor) in by.items()))


def _who(a: str, b: str) -> str:
    """Who the time between two marks is spent by."""
    if "sends" in a and "sent" in b:
        return "sending"
    if a.startswith("here") and b.startswith("here") and "sent" not in a:
        return "here"
    if a.startswith("worker") and b.startswith("worker") and "sent" not in a:
        return "worker"
    return "wire"


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
