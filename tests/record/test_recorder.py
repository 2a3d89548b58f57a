"""The Recorder against a real directory store: one record per forward, written behind
the run in batches, late facts in the forward they belong to, read here as soon as said,
seen elsewhere whole, and nothing lost at exit."""

import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import somatize
from somatize import Graph, Node, RecordError, UnwritableError
from somatize.record import FORMAT, Recorder, facts, forwards
from somatize.record import _recorder
from somatize.record._read import forwards_of, listed, read
from somatize.store import Store

SRC = os.path.dirname(os.path.dirname(somatize.__file__))


class Body(Node):
    def forward(self, x, ctx):
        return x + 1


class Head(Node):
    def forward(self, x, ctx):
        return x * 2


class Boom(Node):
    def forward(self, x, ctx):
        raise ValueError("no")


def two_nodes():
    return Graph.somatize(Body().named("body") >> Head().named("head"))


def record_of(store, name):
    """One forward's record and binding, as the readers see it (which flushes this
    process's Recorders of the run first)."""
    _, run, index = name.split("/")
    bound = dict(listed(store, run)).get(int(index))
    assert bound is not None, name
    return read(store, bound), bound


def objects(store):
    return [p for p in Path(store.where, "objects").rglob("*") if p.is_file()]


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


def test_one_record_per_forward_written_as_one_batch(store):
    g = two_nodes()
    recorder = Recorder(store, run="r")
    seen = []
    for i in range(3):
        g.forward(i, watching=[recorder, seen.append])
    recorder.flush()
    assert [b.name for b in store.bound("run/r")] == ["run/r/0"]  # one name, one object
    assert len(objects(store)) == 1 and forwards(store, "r") == 3
    for i in range(3):
        record, _ = record_of(store, f"run/r/{i}")
        assert record["format"] == FORMAT and record["run"] == "r" and record["forward"] == i
        kinds = [f["fact"] for f in record["facts"]]
        assert kinds == ["began", "ran", "ran", "finished"]
        assert record["facts"] == seen[4 * i: 4 * i + 4]


def test_a_forward_is_read_here_the_moment_it_returns(store):
    recorder = Recorder(store)
    two_nodes().forward(1, watching=recorder)
    assert facts(store, recorder.run, 0)[-1]["fact"] == "finished"


def test_the_seeds_example_reads_its_own_write_through_the_store(store):
    r = Recorder(store)
    two_nodes().forward(1, watching=r)
    bound = store.resolve(f"run/{r.run}/0")  # what that forward did, at once
    assert bound is not None
    assert json.loads(store.get(bound.digest))["forwards"][0][-1]["fact"] == "finished"
    again = Store(store.where)  # another Store of the same place reads it too
    two_nodes().forward(2, watching=r)
    assert sum(b.meta[""] for b in again.bound(f"run/{r.run}")) == 2


RESOLVING = """
import json, sys
import somatize.record  # what answers a forward's name inside a batch
from somatize.record._read import read
from somatize.store import Store
store = Store(sys.argv[1])
out = []
for n in range(int(sys.argv[3]) + 1):
    bound = store.resolve(f"run/{sys.argv[2]}/{n}")
    out.append(None if bound is None else [bound.name, read(store, bound)["facts"]])
print(json.dumps(out))
"""


def test_every_forwards_name_resolves_to_that_forward_however_it_is_batched(store):
    g = two_nodes()
    r = Recorder(store, summarising=["loss"])
    seen = []

    def forward(i):
        g.forward(i, watching=[r, seen.append])
        said = {"fact": "loss", "value": i / 10}
        r(said)
        seen.append(said)

    for i in range(3):  # the seed's case: three forwards, nothing flushed
        forward(i)
    for n in range(3):  # right after them, each name is that forward's
        bound = store.resolve(f"run/{r.run}/{n}")
        assert bound is not None and bound.name == f"run/{r.run}/{n}"
        assert read(store, bound)["facts"] == seen[5 * n: 5 * n + 5]
        assert forwards_of(bound, n) == [(n, bound)] or n == 0  # a forward's own Bound
        assert forwards_of(bound, n)[0][1].meta == {"loss": n / 10}
    assert store.resolve(f"run/{r.run}/3") is None
    for i in range(3, 9):  # more batches: 3 and 4 alone, then 5 to 8 behind the run
        forward(i)
        if i in (3, 4):
            r.flush()
    assert len(store.bound(f"run/{r.run}")) >= 3  # several batches on disk
    for n in range(9):
        bound = store.resolve(f"run/{r.run}/{n}")
        assert read(store, bound)["facts"] == seen[5 * n: 5 * n + 5], n
    assert store.resolve(f"run/{r.run}/9") is None and store.resolve(f"run/{r.run}/90") is None
    # ...and in another process, which knows nothing of how they were batched
    done = subprocess.run([sys.executable, "-c", RESOLVING, store.where, r.run, "9"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    there = json.loads(done.stdout)
    assert there[9] is None
    assert [facts for _, facts in there[:9]] == [seen[5 * n: 5 * n + 5] for n in range(9)]
    assert [name for name, _ in there[:9]] == [f"run/{r.run}/{n}" for n in range(9)]


def test_a_read_of_other_names_writes_nothing_early(store, monkeypatch):
    # the writer trails by a quarter second, which a busy machine can take between two
    # lines here; two seconds leave this test room to look before it writes
    monkeypatch.setattr(_recorder, "TRAIL", 2.0)
    recorder = Recorder(store, run="r")
    two_nodes().forward(1, watching=recorder)
    store.keep("elsewhere", 1)
    assert store.resolve("elsewhere") is not None and store.resolve("run/other/0") is None
    assert store.backend.read_name("run/r/0") is None  # still behind the run
    recorder.close()


def test_a_forward_is_written_behind_without_being_asked(store):
    recorder = Recorder(store, run="r")
    two_nodes().forward(1, watching=recorder)
    deadline = time.monotonic() + 10  # the writer trails by a quarter second; this is slack
    # read under the Store, as another process would, so nothing is written first
    while store.backend.read_name("run/r/0") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    bound = store.resolve("run/r/0")
    assert bound is not None
    assert json.loads(store.get(bound.digest))["forwards"][0][-1]["fact"] == "finished"


READING = """
import json, sys, time
from somatize.record import facts, forwards
from somatize.store import Store
store, seen, began = Store(sys.argv[1]), [], time.monotonic()
while time.monotonic() - began < 3 and (not seen or seen[-1] < 400):
    try:
        count = forwards(store, "r")
    except Exception as exc:
        if "no run" not in str(exc):
            raise
        continue
    said = facts(store, "r", count - 1)  # whole: it begins and it finished
    assert said[0]["fact"] == "began" and said[-1]["fact"] == "finished", said
    seen.append(count)
print(json.dumps(seen))
"""


def test_a_reader_elsewhere_sees_each_forward_whole_or_not_at_all(store):
    reader = subprocess.Popen([sys.executable, "-c", READING, store.where], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": SRC})
    recorder, g = Recorder(store, run="r"), two_nodes()
    for i in range(400):
        g.forward(i, watching=recorder)
        if i % 50 == 0:
            time.sleep(0.1)  # so the writer writes several batches while it reads
    recorder.close()
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    seen = json.loads(out)
    assert seen and seen == sorted(seen) and seen[-1] <= 400


def test_late_facts_land_in_their_forward_at_the_next_began(store):
    g = two_nodes()
    recorder = Recorder(store, run="r")
    g.forward(1, watching=recorder)
    recorder({"fact": "updated"})
    recorder({"fact": "loss", "value": 0.5})
    g.forward(2, watching=recorder)
    first, _ = record_of(store, "run/r/0")
    second, _ = record_of(store, "run/r/1")
    assert [f["fact"] for f in first["facts"]][-3:] == ["finished", "updated", "loss"]
    assert [f["fact"] for f in second["facts"]] == ["began", "ran", "ran", "finished"]


def test_flush_writes_late_facts_without_a_new_forward(store):
    recorder = Recorder(store, run="r", summarising=["loss"])
    two_nodes().forward(1, watching=recorder)
    recorder({"fact": "loss", "value": 0.25})
    recorder.flush()
    record, bound = record_of(store, "run/r/0")
    assert record["facts"][-1] == {"fact": "loss", "value": 0.25}
    assert bound.meta == {"loss": 0.25}


def test_summarising_copies_the_last_value_into_meta(store):
    g = two_nodes()
    recorder = Recorder(store, run="r", summarising=["loss", "accuracy"])
    g.forward(1, watching=recorder)
    recorder({"fact": "loss", "value": 2.0})
    recorder({"fact": "loss", "value": 1.5})
    recorder({"fact": "accuracy", "value": 0.75, "of": 64})
    g.forward(2, watching=recorder)  # a forward that says neither
    recorder.close()
    assert record_of(store, "run/r/0")[1].meta == {"loss": 1.5, "accuracy": 0.75}
    assert record_of(store, "run/r/1")[1].meta == {"loss": None, "accuracy": None}


def test_a_summarised_fact_without_a_value_keeps_its_fields(store):
    recorder = Recorder(store, run="r", summarising=["health"])
    two_nodes().forward(1, watching=recorder)
    recorder({"fact": "health", "where": "body", "act_mean": 0.5, "shape": (2, 3)})
    recorder.close()
    assert record_of(store, "run/r/0")[1].meta == {
        "health": {"where": "body", "act_mean": 0.5, "shape": [2, 3]}}


def test_default_run_names_are_unique_and_sort_by_time(store):
    names = [Recorder(store).run for _ in range(40)]
    assert len(set(names)) == 40
    assert names == sorted(names)
    assert all(re.fullmatch(r"\d{8}T\d{6}\.\d{6}-[0-9a-f]{6}", n) for n in names)


def test_close_writes_what_is_left_and_then_refuses(store):
    recorder = Recorder(store, run="r")
    two_nodes().forward(1, watching=recorder)
    recorder({"fact": "loss", "value": 1.0})
    recorder.close()
    record, _ = record_of(store, "run/r/0")
    assert record["facts"][-1]["fact"] == "loss"
    with pytest.raises(RecordError, match="'r' is closed"):
        recorder({"fact": "loss", "value": 2.0})
    recorder.close()  # closing twice is harmless


def test_what_was_not_written_is_written_at_interpreter_exit(tmp_path):
    where = tmp_path / "store"
    script = textwrap.dedent(f"""
        from somatize import Graph, Node
        from somatize.record import Recorder
        from somatize.store import Store

        class Body(Node):
            def forward(self, x, ctx):
                return x + 1

        recorder = Recorder(Store({str(where)!r}), run="exiting")
        g = Graph.somatize(Body())
        for i in range(3):
            g.forward(i, watching=recorder)
            recorder({{"fact": "loss", "value": i / 10}})
        # no close(), no flush(): the interpreter just ends
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": SRC}, check=False)
    assert done.returncode == 0, done.stderr
    store = Store(where)
    last, _ = record_of(store, "run/exiting/2")
    assert last["facts"][-1] == {"fact": "loss", "value": 0.2}


def test_a_collected_recorder_writes_what_it_held(store):
    recorder = Recorder(store, run="r")
    two_nodes().forward(1, watching=recorder)
    recorder({"fact": "loss", "value": 3.0})
    del recorder
    gc.collect()
    record, _ = record_of(store, "run/r/0")
    assert record["facts"][-1]["fact"] == "loss"


def test_facts_from_many_threads_are_all_kept_once(store):
    recorder = Recorder(store, run="r")
    g = two_nodes()
    threads, per_thread = 6, 150

    def talk(t):
        for i in range(per_thread):
            recorder({"fact": "note", "thread": t, "i": i})

    workers = [threading.Thread(target=talk, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for i in range(40):
        g.forward(i, watching=recorder)
    for w in workers:
        w.join()
    recorder.close()
    notes, began = [], 0
    for index, bound in listed(store, "r"):
        record = read(store, bound)
        assert record["forward"] == index
        notes += [(f["thread"], f["i"]) for f in record["facts"] if f["fact"] == "note"]
        began += sum(f["fact"] == "began" for f in record["facts"])
    assert sorted(notes) == [(t, i) for t in range(threads) for i in range(per_thread)]
    assert began == 40


def test_a_run_that_exists_is_continued_after_its_last_forward(store):
    g = two_nodes()
    first = Recorder(store, run="r")
    g.forward(1, watching=first)
    g.forward(2, watching=first)
    first.close()
    again = Recorder(store, run="r")
    g.forward(3, watching=again)
    assert [index for index, _ in listed(store, "r")] == [0, 1, 2]
    assert [b.name for b in store.bound("run/r")] == ["run/r/0", "run/r/2"]  # two batches
    assert record_of(store, "run/r/2")[0]["forward"] == 2


def test_a_forward_index_taken_meanwhile_is_skipped_not_overwritten(store):
    g = two_nodes()
    one, two = Recorder(store, run="shared"), Recorder(store, run="shared")
    g.forward(10, watching=one, stamping={"by": "one"})
    one.flush()
    g.forward(20, watching=two, stamping={"by": "two"})
    two.flush()  # it meant to take 0 as well
    zero, _ = record_of(store, "run/shared/0")
    taken, _ = record_of(store, "run/shared/1")
    assert zero["forward"] == 0 and {f["by"] for f in zero["facts"]} == {"one"}
    assert taken["forward"] == 1 and {f["by"] for f in taken["facts"]} == {"two"}


def test_stamping_and_a_failing_forward_are_recorded(store):
    recorder = Recorder(store, run="r")
    g = Graph.somatize(Body() >> Boom())
    with pytest.raises(somatize.NodeError):
        g.forward(1, watching=recorder, stamping={"epoch": "3"})
    record, _ = record_of(store, "run/r/0")
    assert all(f["epoch"] == "3" for f in record["facts"])
    assert [f["fact"] for f in record["facts"]] == ["began", "ran", "failed", "finished"]
    assert record["facts"][-1]["failed"] is True


def test_a_directory_is_a_store_and_a_durable_one_is_written_without_fsync(tmp_path):
    by_path = Recorder(str(tmp_path / "a"), run="r")
    two_nodes().forward(1, watching=by_path)
    assert facts(Store(tmp_path / "a"), "r", 0)[-1]["fact"] == "finished"
    durable = Store(tmp_path / "b")
    recorder = Recorder(durable, run="r")
    assert recorder.store.backend.durable is False and durable.backend.durable is True
    assert recorder.store.where == durable.where


def test_values_with_a_tolist_are_written_plainly(store):
    numpy = pytest.importorskip("numpy")
    recorder = Recorder(store, run="r", summarising=["loss"])
    two_nodes().forward(1, watching=recorder)
    recorder({"fact": "loss", "value": numpy.float32(0.5), "per_class": numpy.arange(3)})
    recorder.close()
    record, bound = record_of(store, "run/r/0")
    assert record["facts"][-1] == {"fact": "loss", "value": 0.5, "per_class": [0, 1, 2]}
    assert bound.meta == {"loss": 0.5}


def test_an_unwritable_fact_is_refused_and_changes_nothing(store):
    recorder = Recorder(store, run="r")
    g = two_nodes()
    g.forward(1, watching=recorder)
    with pytest.raises(UnwritableError, match=r"'loss' fact holds 'value' = builtins.object"):
        recorder({"fact": "loss", "value": object()})
    with pytest.raises(UnwritableError, match=r"has the key \(1, 2\)"):
        recorder({"fact": "loss", (1, 2): 3})
    recorder.flush()
    record, _ = record_of(store, "run/r/0")
    assert [f["fact"] for f in record["facts"]] == ["began", "ran", "ran", "finished"]


@pytest.mark.parametrize("fact, message", [
    ("loss", "a fact is a dict"),
    ({"value": 1.0}, "names itself with a str under 'fact'"),
    ({"fact": 3}, "names itself with a str under 'fact'"),
])
def test_what_is_not_a_fact_is_refused(store, fact, message):
    recorder = Recorder(store, run="r")
    with pytest.raises(TypeError, match=message):
        recorder(fact)
    assert store.bound("run/r") == []


@pytest.mark.parametrize("run", ["a/b", "", "..", "tab\there"])
def test_a_run_name_must_be_one_word(store, run):
    with pytest.raises(RecordError, match="cannot name a run"):
        Recorder(store, run=run)


def test_bad_arguments_are_refused_by_name(store):
    with pytest.raises(TypeError, match="a run is named by a str"):
        Recorder(store, run=3)
    with pytest.raises(TypeError, match=r"\['loss'\], not a str"):
        Recorder(store, summarising="loss")
    with pytest.raises(TypeError, match="not a dict: it has no put"):
        Recorder({}, run="r")


def test_facts_said_before_the_first_forward_open_it(store):
    recorder = Recorder(store, run="r")
    recorder({"fact": "note", "said": "before"})
    two_nodes().forward(1, watching=recorder)
    record, _ = record_of(store, "run/r/0")
    assert [f["fact"] for f in record["facts"]] == ["note", "began", "ran", "ran", "finished"]
    alone = Recorder(store, run="alone")
    alone({"fact": "note"})
    alone.close()
    assert record_of(store, "run/alone/0")[0]["facts"] == [{"fact": "note"}]


def test_a_trainers_step_is_ready_once_its_loss_is_in(tmp_path):
    store = Store(tmp_path / "s")
    recorder = Recorder(store, run="steps")
    for step in range(1, 4):
        for fact in ({"fact": "began", "at_us": 1, "step": step},
                     {"fact": "ran", "node": "a", "began_us": 0, "took_us": 1},
                     {"fact": "finished", "took_us": 2}):
            recorder(fact)
        time.sleep(0.4)  # past the writer's quarter second: still not written
        # not written, read under the Store (a read through it would write it first)
        assert store.backend.read_name(f"run/steps/{step - 1}") is None  # its loss is coming
        recorder({"fact": "updated"})
        recorder({"fact": "loss", "value": float(step)})
        assert facts(store, "steps", step - 1)[-1] == {"fact": "loss", "value": float(step)}
    assert len(objects(store)) == 3  # one write per step, none rewritten
    # a bare forward (no step in its began) is ready the moment it finishes
    recorder({"fact": "began", "at_us": 1})
    recorder({"fact": "finished", "took_us": 1})
    assert facts(store, "steps", 3)[-1] == {"fact": "finished", "took_us": 1}


# -- a store that cannot be written


TRAINING = """
import json, os, resource, signal, sys, warnings
sys.path.insert(0, sys.argv[3])
import torch
from trainnets import batches, graph
from somatize.record import Recorder, facts
from somatize.store import Store
from somatize.torch import Trainer, parameters

where, how = sys.argv[1:3]

def trainer(watching):
    g, _, _ = graph(seed=3)
    return Trainer(g, objective=torch.nn.functional.mse_loss,
                   optimizer=torch.optim.SGD(parameters(g), lr=0.05), watching=watching)

data = batches(10)
recorder = Recorder(Store(where), run="full", summarising=["loss"])
recorded, plain = trainer(recorder), trainer(None)
if how == "rlimit":  # from here the kernel refuses this process every write to a file
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
losses = [recorded.step(batch) for batch in data[:5]]
recorder.flush()  # refused: the disk is full
print(json.dumps({"lost": recorder.lost}), flush=True)
sys.stdin.readline()  # the disk has room again
if how == "rlimit":
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
losses += [recorded.step(batch) for batch in data[5:]]
recorder({"fact": "said last"})
print(json.dumps({"lost": recorder.lost, "repr": repr(recorder),
                  "same": losses == [plain.step(batch) for batch in data]}), flush=True)
# not closed: what is left is written at exit
"""


def test_a_full_disk_does_not_break_training_and_recording_resumes(full_disk):
    pytest.importorskip("torch")
    where = full_disk.where / "s"
    Store(where)
    full_disk.fill()
    child = subprocess.Popen(
        [sys.executable, "-c", TRAINING, str(where), full_disk.how,
         str(Path(__file__).resolve().parents[1] / "torch")],
        env={**os.environ, "PYTHONPATH": SRC}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(child.stdout.readline() or "null")
        assert first is not None, child.communicate(timeout=60)[1]
        full_disk.free()
        out, err = child.communicate("go on\n", timeout=120)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert err.count("UserWarning") == 1, err
    reason = "No space left on device" if full_disk.how == "tmpfs" else "File too large"
    assert "could not write forward 0" in err and reason in err and "Recorder.lost" in err
    last = json.loads(out.splitlines()[-1])
    # kept while refused, and written once the disk had room again: nothing lost
    assert first["lost"] == 0 and last["lost"] == 0 and "lost" not in last["repr"]
    assert last["same"] is True
    assert [index for index, _ in listed(Store(where), "full")] == list(range(10))
    assert facts(Store(where), "full", 9)[-1]["fact"] == "said last"  # written at exit


def test_a_long_wait_is_written_as_several_batches_each_bound_once(store, monkeypatch):
    from somatize.record import _recorder

    monkeypatch.setattr(_recorder, "PER_OBJECT", 3)
    recorder, g = Recorder(store, run="r", summarising=["loss"]), two_nodes()
    for i in range(7):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": float(i)})
    recorder.flush()
    assert [b.name for b in store.bound("run/r")] == ["run/r/0", "run/r/3", "run/r/6"]
    assert len(objects(store)) == 3
    assert [(i, b.meta["loss"]) for i, b in listed(store, "r")] == [(i, float(i)) for i in range(7)]
    recorder({"fact": "note"})  # the last forward hears more: its batch is bound again
    recorder.close()
    assert [b.name for b in store.bound("run/r")] == ["run/r/0", "run/r/3", "run/r/6"]
    assert facts(store, "r", 6)[-1] == {"fact": "note"}
