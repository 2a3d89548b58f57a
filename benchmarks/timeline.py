"""Where the time of one split step goes: a timeline of marks on both sides.

The tiny model of ``split.py`` (Encoder here >> Body on a worker, trained by Split >>
Head here), one step at a time. Both processes read one clock (``perf_counter_ns`` is
CLOCK_MONOTONIC, shared across processes on one machine); each side marks when it
starts and finishes sending a frame, when it has read one, and the worker when its walk
starts and ends. Every gap between two consecutive marks is charged to whoever was
working (here, the worker) or to the wire and the scheduler (a frame on its way, a
process waking up), and the median over many steps is printed in order. Last, the CPU
each side spends per step (the worker's read from /proc), against the same model in one
piece: a figure the machine's other load does not move.

    python benchmarks/timeline.py          # --quick for fewer steps
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

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


def main() -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from split import batch, model

    from somatize import Broker, Worker
    from somatize.torch import Split, Trainer, parameters

    torch.set_num_threads(1)
    steps = 100 if "--quick" in sys.argv else 400
    path = os.path.join(tempfile.mkdtemp(), "marks.json")
    marking("here")
    mse = torch.nn.functional.mse_loss
    data = [batch(16, 8) for _ in range(50)]
    worker = Worker.spawn([sys.executable, os.path.abspath(__file__), "--worker", path],
                          mode="network", send=["split"])
    with worker:
        cut = model(16, "w")
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        trainer = Trainer(cut, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
        for b in data * 2:
            trainer.step(b)
        windows = []
        for i in range(steps):
            MARKS.clear()
            began = time.perf_counter_ns()
            trainer.step(data[i % len(data)])
            windows.append((began, time.perf_counter_ns(), list(MARKS)))
        cpu = cpu_per_step(trainer, data, worker._child.pid, steps)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    there = [tuple(m) for m in json.load(open(path))]
    report(windows, there)
    whole = model(16)
    one = Trainer(whole, objective=mse, optimizer=torch.optim.SGD(parameters(whole), lr=0.01))
    for b in data:
        one.step(b)
    began = time.process_time()
    for i in range(steps):
        one.step(data[i % len(data)])
    alone = (time.process_time() - began) / steps * 1e6
    here, there = cpu
    print(f"CPU per step (load-proof): split {here:.0f} us here + {there:.0f} us on the worker, "
          f"one piece {alone:.0f} us: the split's fixed cost is {here + there - alone:.0f} us of CPU")


def cpu_per_step(trainer, data, pid: int, steps: int) -> tuple[float, float]:
    """CPU seconds per step, in microseconds, of this process and of the worker (from
    /proc, so whatever else the machine runs is not counted)."""
    tick = os.sysconf("SC_CLK_TCK")

    def worker_cpu() -> float:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick
    began, there = time.process_time(), worker_cpu()
    for i in range(steps * 4):
        trainer.step(data[i % len(data)])
    return ((time.process_time() - began) / steps / 4 * 1e6,
            (worker_cpu() - there) / steps / 4 * 1e6)


def report(windows: list, there: list) -> None:
    shape, gaps, totals = None, [], []
    for began, ended, here in windows:
        marks = sorted([(began, "here: step begins")] + here
                       + [m for m in there if began <= m[0] <= ended] + [(ended, "here: step ends")])
        labels = [label for _, label in marks]
        if shape is None:
            shape, gaps = labels, [[] for _ in labels[1:]]
        if labels != shape:  # a heartbeat, or a mark the other side made late: skip it
            continue
        for k, ((a, _), (b, _)) in enumerate(zip(marks, marks[1:])):
            gaps[k].append((b - a) / 1000)
        totals.append((ended - began) / 1000)
    print(f"one split step of the tiny model, median of {len(totals)} steps "
          f"({statistics.median(totals):.0f} us in all), gap by gap:")
    for (a, b), times in zip(zip(shape, shape[1:]), gaps):
        who = _who(a, b)
        print(f"  {statistics.median(times):8.1f} us  {who:8} {a} -> {b}")
    by = {}
    for (a, b), times in zip(zip(shape, shape[1:]), gaps):
        by[_who(a, b)] = by.get(_who(a, b), 0) + statistics.median(times)
    print("  summed: " + ", ".join(f"{who} {us:.0f} us" for who, us in by.items()))


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
