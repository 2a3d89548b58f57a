"""Instructions per tiny split step, on each side, beside plain torch over a raw socket.

On a small shared machine the clock of a tiny step swings by half from one run to
the next, so a change of a tenth to what we do per step cannot be seen in it. The
count of instructions each process executes can: valgrind's callgrind counts them in
user space (a syscall's own work in the kernel is not counted, and both contenders
make the same syscalls, two round trips a step), and the same code counts the same to
a few parts in a thousand, run after run.

Two contenders, the tiny model of ``split.py`` (Encoder here >> Body there >> Head
here), each process under callgrind with counting switched on only around the
measured steps:

- ours: a Trainer with the body trained by ``Split`` on a worker process;
- plain: ``split.PlainSplit``, the same step in plain torch over one socket, with its
  body's optimizer in a process of its own; the floor of what a split step does.

With ``--message``, the same count for one message instead of a step: a tiny remote
forward (``wire.py``'s, a string there and back) beside ``wire.RawEcho``, a process
that echoes it with one ``recv`` and one ``sendall`` — the floor of any message.

    python benchmarks/instructions.py            # 200 steps; --steps N for more
    python benchmarks/instructions.py --message  # one message, beside the raw echo
    python benchmarks/instructions.py --audit    # an audited step, beside an unaudited one

With ``--audit``, ``audit.py``'s MLP (256 -> 512 -> 512 -> 10, batch 128) trained by a
Trainer audited at every step, beside the same Trainer unaudited: what the Audit adds
per step, on a clock that does not move. Ten steps by default, none of which keeps a
histogram; ``--steps 50`` counts one that does, as one step in 50 does in a real run.

Needs valgrind (``apt-get install valgrind``); without it, says so and stops.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# an MLP step under callgrind takes seconds: fewer of them for --audit
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else \
    10 if "--audit" in sys.argv else 200
SIZE = sys.argv[sys.argv.index("--size") + 1] if "--size" in sys.argv else "tiny"
MESSAGE = "--message" in sys.argv
AUDIT = "--audit" in sys.argv
WARM = 3 if AUDIT else 30


def callgrind(out: str) -> list[str]:
    """The command prefix that runs a process under callgrind, counting nothing until
    told (``callgrind_control -i on``), its counts written to ``out`` (``%p``: its pid)."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def counting(on: bool, *pids: int) -> None:
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(pid)],
                       capture_output=True, check=False)
    if not on:
        for pid in pids:
            subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=False)


def child_of(parent: int, marker: str) -> int:
    """The pid of the process ``parent`` started whose command line holds ``marker``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().decode(errors="replace")
        except OSError:
            continue
        if ppid == parent and marker in line:
            return int(entry)
    raise RuntimeError(f"no process of {parent} runs {marker!r}")


def inside(which: str, folder: str) -> None:
    """The measured run, in a process callgrind already watches: warm up, count the
    steps here and in the far process, dump both."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(1)
    import split

    width, rows = split.SIZES[SIZE]
    data = [split.batch(width, rows) for _ in range(10)]
    far_out = os.path.join(folder, "far.%p")
    if which in ("forward", "echo"):
        step, far, close = _message(which, far_out)
    elif which in ("audited", "unaudited"):
        step, far, close = _audited(which == "audited")
    elif which == "ours":
        from somatize import Broker, Worker
        from somatize.torch import Split, Trainer, parameters

        worker = Worker.spawn([*callgrind(far_out), sys.executable, "-m", "somatize.worker",
                               "--listen", "127.0.0.1:0", "--quiet"],
                              mode="network", send=["split"], timeout=600)
        cut = split.model(width, "w")
        trains = {"body": Split(torch.optim.SGD, lr=0.01)}
        trainer = Trainer(cut, objective=torch.nn.functional.mse_loss, trains=trains,
                          broker=Broker.embedded({"w": worker}),
                          optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.01))
        trainer.step(data[0])  # the worker is started by the first step
        step, far, close = trainer.step, child_of(os.getpid(), "somatize.worker"), worker.close
    else:
        popen = subprocess.Popen

        def watched(argv, **kwargs):  # the plain body's process, under callgrind too
            return popen([*callgrind(far_out), *argv], **kwargs)
        split.subprocess.Popen = watched
        try:
            plain = split.PlainSplit(width, rows)
        finally:
            split.subprocess.Popen = popen
        step, far, close = plain.step, plain.proc.pid, plain.close
    watched = [os.getpid()] + ([] if far is None else [far])
    for k in range(WARM):
        step(data[k % len(data)])
    counting(True, *watched)
    for k in range(STEPS):
        step(data[k % len(data)])
    counting(False, *watched)
    close()


def _audited(on: bool) -> tuple:
    """audit.py's Trainer, audited at every step or not; its step takes batches of its
    own (the MLP's), whatever it is handed."""
    import itertools

    import torch

    import audit
    from somatize.torch._audit import Audit

    trainer, said = audit.trainer(256, 512, 10, Audit(every=1) if on else None)
    generator = torch.Generator().manual_seed(1)
    batches = itertools.cycle([(torch.randn(128, 256, generator=generator),
                                torch.randint(0, 10, (128,), generator=generator))
                               for _ in range(10)])

    def step(_):
        said.clear()
        trainer.step(next(batches))
    return step, None, lambda: None


def _message(which: str, far_out: str) -> tuple:
    """One tiny message there and back: somatize's remote forward, or the raw echo;
    answers the call that sends it, the far process and how to close it."""
    import wire

    if which == "forward":
        from somatize import Graph, Worker

        worker = Worker.spawn([*callgrind(far_out), sys.executable, "-m", "somatize.worker",
                               "--listen", "127.0.0.1:0", "--quiet"],
                              mode="network", send=["wire"], timeout=600)
        graph, broker, text = Graph.somatize(wire.Same().at("w1")), {"w1": worker}, "hello" * 20
        graph.forward(text, broker=broker)  # the worker is started by the first forward
        return ((lambda _: graph.forward(text, broker=broker)),
                child_of(os.getpid(), "somatize.worker"), worker.close)
    popen = subprocess.Popen

    def watched(argv, **kwargs):  # the echo's process, under callgrind too
        return popen([*callgrind(far_out), *argv], **kwargs)
    wire.subprocess.Popen = watched
    try:
        echo = wire.RawEcho()
    finally:
        wire.subprocess.Popen = popen
    message = memoryview(b"x" * 160)  # about what the tiny forward puts on the wire
    return (lambda _: echo.round_trip(message)), echo.proc.pid, echo.close


def measured(which: str) -> tuple[float, float]:
    """Instructions per step here and on the far side, for one contender."""
    folder = tempfile.mkdtemp(prefix=f"somatize-instructions-{which}-")
    try:
        subprocess.run([*callgrind(os.path.join(folder, "near.%p")), sys.executable, __file__,
                        "--inside", which, folder, "--steps", str(STEPS), "--size", SIZE,
                        *(["--audit"] if AUDIT else [])],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=1800)
        far = 0 if which in ("audited", "unaudited") else _counted(os.path.join(folder, "far.*"))
        return _counted(os.path.join(folder, "near.*")) / STEPS, far / STEPS
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _counted(pattern: str) -> int:
    """What the dumps a process wrote while counting add up to."""
    total = 0
    for path in glob.glob(pattern):
        with open(path) as f:
            for line in f:
                if line.startswith("totals:"):
                    total += int(line.split()[1])
    if not total:
        raise RuntimeError(f"callgrind wrote no counts matching {pattern}")
    return total


def main() -> None:
    if "--inside" in sys.argv:
        at = sys.argv.index("--inside")
        return inside(sys.argv[at + 1], sys.argv[at + 2])
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("needs valgrind (apt-get install valgrind): nothing measured")
        return
    if AUDIT:
        ours, plain = measured("audited"), measured("unaudited")
        print(f"an audited step (audit.py's MLP), instructions per step in user space "
              f"(callgrind, {STEPS} after {WARM})")
        print(f"audited {ours[0]:,.0f}   unaudited {plain[0]:,.0f}   "
              f"{ours[0] / plain[0]:.3f}x   the Audit adds {ours[0] - plain[0]:,.0f} per step")
        return
    if MESSAGE:
        ours, plain = measured("forward"), measured("echo")
        what, floor, each = "tiny remote forward", "raw echo", "message"
    else:
        ours, plain = measured("ours"), measured("plain")
        what, floor, each = f"{SIZE} split step", "plain torch", "step"
    print(f"{what}, instructions per {each} in user space (callgrind, {STEPS} after {WARM})")
    print(f"{'':12}{'here':>14}{'far side':>14}{'both':>14}")
    for name, (near, far) in (("ours", ours), (floor, plain)):
        print(f"{name:12}{near:14,.0f}{far:14,.0f}{near + far:14,.0f}")
    print(f"{'ratio':12}{ours[0] / plain[0]:13.2f}x{ours[1] / plain[1]:13.2f}x"
          f"{sum(ours) / sum(plain):13.2f}x")
    print(f"ours over the {floor}: {ours[0] - plain[0]:,.0f} here and {ours[1] - plain[1]:,.0f} "
          f"on the far side per {each}")


if __name__ == "__main__":
    main()
