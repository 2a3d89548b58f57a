"""What keeping a checkpoint costs, side by side with the training step it rides on.

The ~10 ms MLP of ``benchmarks/split.py`` (three 512-wide dense layers, batches of
256), trained with Adam in one piece here, and with its body on a worker trained by
``Split(Adam)``. For each: the checkpoint's size (weights, both optimizers' moments,
random states), the time to keep one into a durable directory store and into one
without fsyncs, and the median training step. Target: taken every 100 steps, keeping
one costs less than one training step (keep/step < 1), so the run loses under 1%.
``fit`` takes the snapshot between two steps and writes it on a thread; the columns say
what each part costs, since on a machine with no core to spare the writing is paid
by the steps it overlaps.

    python benchmarks/checkpoint.py            # --quick for fewer repeats
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from somatize import Broker, Worker  # noqa: E402
from somatize.store import Store  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402
from somatize._codec import dumps  # noqa: E402
from somatize.torch._checkpoint import Keeper, gather  # noqa: E402

from _bench import best, cycled, median
from split import batch, model

QUICK = "--quick" in sys.argv
STEPS = 20 if QUICK else 60
KEEPS = 5 if QUICK else 15
BLOCK = 10  # steps a checkpoint's writing may overlap
WIDTH, ROWS = 512, 256


def trainer(worker=None):
    mse = torch.nn.functional.mse_loss
    if worker is None:
        g = model(WIDTH)
        return Trainer(g, objective=mse, optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    g = model(WIDTH, "w")
    trains = {"body": Split(torch.optim.Adam, lr=1e-3)}
    return Trainer(g, objective=mse, trains=trains, broker=Broker.embedded({"w": worker}),
                   optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-3))


def size_of(store, digest):
    """Bytes of the manifest and every object it names."""
    from somatize._codec import loads

    manifest = loads(store.get(digest))
    digests = [digest, manifest["here"], *manifest["trainers"].values()]
    return sum(len(store.get(d)) for d in digests)


def measure(t, folder):
    data = [batch(WIDTH, ROWS) for _ in range(8)]
    step = median(cycled(t.step, data), STEPS, warm=5)
    durable, quick = Store(os.path.join(folder, "d")), Store(os.path.join(folder, "q"),
                                                              durable=False)
    figures = {"step": step}
    for label, store in (("durable", durable), ("no fsync", quick)):
        def keep():
            t.step(data[0])  # the weights move, so each checkpoint is new bytes
            return t.checkpoint(store, "ck")
        keep_and_step = median(keep, KEEPS, warm=2)
        figures[label] = keep_and_step - step
    figures["size"] = size_of(durable, durable.resolve("ck").digest)
    figures["fit"] = overlapped(t, data, durable)
    figures["snapshot"] = best(lambda: gather(t._run()), KEEPS * 2, quantile=0.5)
    parts = gather(t._run())
    here = {k: parts[k] for k in ("weights", "grads", "optimizer")}
    # What the writing thread does holding the GIL: encoding (hashing, writing and
    # fsync let go of it). With a core to spare, the steps pay this and the snapshot.
    figures["gil"] = figures["snapshot"] + best(
        lambda: [dumps(v) for v in (here, *parts["trainers"].values())], KEEPS * 2, 0.5)
    return figures


def overlapped(t, data, store):
    """What a checkpoint costs the training thread the way ``fit`` keeps one: snapshot
    here, written on a thread while the next steps go on. Blocks of BLOCK steps with
    one kept at their start against blocks without, interleaved; the difference of
    the medians."""
    keeper = Keeper(store, "ck", None)

    def plain():
        for b in data[:BLOCK]:
            t.step(b)

    def keeping():
        keeper.keep(t._run())  # what fit(checkpoint_every=) does when one is due
        plain()
        keeper.wait()

    withs, withouts = [], []
    for _ in range(KEEPS):
        withouts.append(median(plain, 1, warm=0))
        withs.append(median(keeping, 1, warm=0))
    return statistics.median(withs) - statistics.median(withouts)


def main():
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        rows.append(("one piece, Adam", measure(trainer(), folder)))
        with Worker.generic(mode="network", send=["split"]) as worker:
            rows.append(("Split(Adam) on a worker", measure(trainer(worker), folder)))
    print(f"checkpoint of the ~10 ms MLP ({WIDTH} wide, batch {ROWS}); median of {KEEPS} keeps, "
          f"steps median of {STEPS}")
    print(f"{'run':26}{'size':>9}{'step':>10}{'keep':>10}{'/step':>7}"
          f"{'no fsync':>10}{'/step':>7}{'as fit keeps it':>17}{'/step':>7}"
          f"{'snapshot':>10}{'/step':>7}{'+ GIL part':>12}{'/step':>7}")
    for name, f in rows:
        print(f"{name:26}{f['size'] / 2**20:7.2f}MB{f['step'] * 1e3:8.2f}ms"
              f"{f['durable'] * 1e3:8.2f}ms{f['durable'] / f['step']:6.2f}x"
              f"{f['no fsync'] * 1e3:8.2f}ms{f['no fsync'] / f['step']:6.2f}x"
              f"{f['fit'] * 1e3:15.2f}ms{f['fit'] / f['step']:6.2f}x"
              f"{f['snapshot'] * 1e3:8.2f}ms{f['snapshot'] / f['step']:6.2f}x"
              f"{f['gil'] * 1e3:10.2f}ms{f['gil'] / f['step']:6.2f}x")
    print("keep: Trainer.checkpoint() on the training thread, durable store (fsync) and not;")
    print(f"as fit keeps it: snapshot here, written on a thread over the next {BLOCK} steps,")
    print("  the extra time those steps took (the median block with one, less without);")
    print("  snapshot: the copies of every tensor taken between two steps; + GIL part: and")
    print("  the encoding the writer does holding the GIL, which is what the steps pay when")
    print("  the writer has a core of its own (hashing, writing, fsync let go of the GIL);")
    print("  on a machine with no core to spare the writing competes with the steps instead")
    print("target: /step < 1, so a checkpoint every 100 steps costs under 1% of the run")


if __name__ == "__main__":
    main()
