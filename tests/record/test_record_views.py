"""Reading a run back: facts, forwards, nodes, curve, runs — and every way of asking
for something that is not there."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import somatize
from somatize import CorruptObject, Graph, Node, RecordError
from somatize.record import Recorder, curve, facts, forwards, nodes, runs
from somatize.record._read import damaged
from somatize.store import Store

SRC = os.path.dirname(os.path.dirname(somatize.__file__))


class Source(Node):
    def forward(self, x, ctx):
        return [x, x + 1]


class Sum(Node):
    def forward(self, x, ctx):
        return sum(x)


class Counting:
    """A real Store, counting the records it is asked to open."""

    def __init__(self, store):
        self.store, self.opened = store, 0
        self.where = store.where

    def get(self, digest):
        self.opened += 1
        return self.store.get(digest)

    def __getattr__(self, name):
        return getattr(self.store, name)


def train_like(store, run, steps, summarising=("loss",)):
    """Forwards of a two-node graph, each followed by a loss as a trainer says it."""
    g = Graph.somatize(Source().named("source") >> Sum().named("sum"))
    recorder = Recorder(store, run=run, summarising=list(summarising))
    seen = []
    for i in range(steps):
        g.forward(i, watching=[recorder, seen.append])
        for fact in ({"fact": "updated"}, {"fact": "loss", "value": 10.0 / (i + 1)}):
            recorder(fact)
            seen.append(fact)
    recorder.close()
    return seen


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


def test_facts_are_what_the_watchers_were_told(store):
    seen = train_like(store, "a-run", 12)
    per_forward = [seen[6 * i: 6 * i + 6] for i in range(12)]
    assert facts(store, run="a-run", forward=10) == per_forward[10]
    assert facts(store, "a-run", -1) == per_forward[-1]
    assert [f["fact"] for f in facts(store, "a-run", 0)] == [
        "began", "ran", "ran", "finished", "updated", "loss"]


def test_forwards_and_runs(store):
    train_like(store, "a-run", 7)
    train_like(store, "b-run", 3, summarising=())
    assert forwards(store, "a-run") == 7
    listed = runs(store)
    assert [(r.name, r.forwards) for r in listed] == [("a-run", 7), ("b-run", 3)]
    assert listed[0].summary == {"loss": 10.0 / 7} and listed[1].summary == {}
    assert listed[0].first <= listed[0].last


def test_nodes_counts_runs_recalls_and_time(store, tmp_path):
    g = Graph.somatize(Source().named("source").cached() >> Sum().named("sum"))
    recorder = Recorder(store, run="cached")
    seen = []
    for _ in range(3):
        g.forward(5, store=tmp_path / "cache", watching=[recorder, seen.append])
    per_node = nodes(store, "cached")
    assert list(per_node) == ["source", "sum"]
    assert per_node["source"]["ran"] == 1 and per_node["source"]["kept"] == 1
    assert per_node["source"]["recalled"] == 2
    assert per_node["sum"]["ran"] == 3 and per_node["sum"]["recalled"] == 0
    took = sum(f["took_us"] for f in seen if f["fact"] == "ran" and f["node"] == "sum")
    assert per_node["sum"]["total_us"] == took
    assert per_node["sum"]["mean_us"] == pytest.approx(took / 3)
    assert per_node["sum"]["host"] is None


def test_a_summarised_curve_opens_no_record(store):
    train_like(store, "a-run", 30)
    counting = Counting(store)
    values = curve(counting, "a-run")
    assert values == [10.0 / (i + 1) for i in range(30)]
    assert counting.opened == 0


def test_an_unsummarised_curve_reads_the_records_and_agrees(store):
    train_like(store, "plain", 30, summarising=())
    counting = Counting(store)
    assert curve(counting, "plain") == [10.0 / (i + 1) for i in range(30)]
    assert counting.opened == 1  # the 30 forwards were written as one batch, read once


def test_a_curve_of_another_number(store):
    seen = train_like(store, "a-run", 5)
    assert curve(store, "a-run", "finished", field="took_us") == [
        f["took_us"] for f in seen if f["fact"] == "finished"]
    assert curve(store, "a-run", "nothing-said") == []


def test_an_unknown_run_is_refused_naming_the_runs_there_are(store):
    with pytest.raises(RecordError, match="has no run 'a-run'; it holds no runs yet"):
        forwards(store, "a-run")
    train_like(store, "real", 2)
    for ask in (lambda: forwards(store, "typo"), lambda: facts(store, "typo", 0),
                lambda: nodes(store, "typo"), lambda: curve(store, "typo")):
        with pytest.raises(RecordError, match="has no run 'typo'; its runs are 'real'"):
            ask()


def test_a_forward_out_of_range_says_the_range(store):
    train_like(store, "a-run", 4)
    for forward in (4, 100, -5):
        with pytest.raises(RecordError, match=f"forwards 0 to 3 .*no forward {forward}"):
            facts(store, "a-run", forward)
    with pytest.raises(TypeError, match="forward is an index"):
        facts(store, "a-run", "1")


def put_record(store, name, data):
    store.bind(name, store.put(data))


def test_a_record_of_a_future_format_is_refused_naming_both_versions(store):
    train_like(store, "a-run", 2)
    put_record(store, "run/a-run/2", json.dumps({"format": 3, "run": "a-run", "forward": 2,
                                                 "facts": []}).encode())
    with pytest.raises(RecordError, match=r"run/a-run/2 was written in record format 3.*up to 2"):
        facts(store, "a-run", 2)
    # A reader of the whole run reads the rest, and says what it left out and why.
    assert nodes(store, "a-run")["sum"]["ran"] == 2
    assert "record format 3" in damaged(store, "a-run")["run/a-run/2"]


def test_a_record_that_is_not_json_is_refused_by_name(store):
    train_like(store, "a-run", 2, summarising=())
    put_record(store, "run/a-run/1", b"\x00garbage")
    with pytest.raises(RecordError, match=r"record run/a-run/1 in .* is not JSON"):
        facts(store, "a-run", 1)
    assert curve(store, "a-run")[0] == 10.0  # the rest of the run, drawn
    assert "is not JSON" in damaged(store, "a-run")["run/a-run/1"]
    put_record(store, "run/a-run/1", b"[1, 2]")
    with pytest.raises(RecordError, match="run/a-run/1 .* JSON but not a record"):
        facts(store, "a-run", 1)


def test_a_value_that_is_not_a_number_is_left_out_and_said(store):
    recorder = Recorder(store, run="words")
    Graph.somatize(Sum()).forward([1], watching=recorder)
    recorder({"fact": "loss", "value": "high"})
    recorder.close()
    assert curve(store, "words") == []
    assert "the 'loss' fact's 'value' is 'high', not a number" in damaged(store, "words")[
        "run/words/0"]


def test_names_beside_the_forwards_are_not_forwards(store):
    train_like(store, "a-run", 3)
    store.keep("run/a-run/graph", {"nodes": ["source", "sum"]})
    assert forwards(store, "a-run") == 3
    assert [r.name for r in runs(store)] == ["a-run"]


def test_reading_a_run_needs_no_plotly_and_drawing_says_what_is_missing(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'plotly':
                    raise ImportError('blocked for this test: ' + name)
        sys.meta_path.insert(0, Block())
        from somatize import Graph, Node
        from somatize.record import Live, Recorder, facts, progress
        from somatize.store import Store

        class Body(Node):
            def forward(self, x, ctx):
                return x + 1

        store = Store({str(tmp_path / "store")!r})
        recorder = Recorder(store, run="r")
        live = Live()
        Graph.somatize(Body()).forward(1, watching=[recorder, live])
        assert [f["fact"] for f in facts(store, "r", 0)] == ["began", "ran", "finished"]
        assert not [m for m in sys.modules if m.startswith("plotly")]
        try:
            progress(store, "r")
        except ImportError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "drawing a record needs plotly: pip install 'somatize[viz]'"


def test_a_reader_here_sees_what_a_recorder_here_still_holds(store):
    g = Graph.somatize(Source() >> Sum())
    recorder = Recorder(Store(store.where), run="open", summarising=["loss"])
    for i in range(3):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": float(i)})
    assert curve(store, "open") == [0.0, 1.0, 2.0]  # the last loss, not yet rewritten
    assert facts(store, "open", 2)[-1] == {"fact": "loss", "value": 2.0}
    g.forward(3, watching=recorder)  # and the recorder goes on as before
    assert forwards(store, "open") == 4


# -- records whose bytes are anything at all


WILD = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
        | st.text(max_size=5) | st.integers(-3, 3).map(lambda n: [n] * abs(n)))
FACTS = st.one_of(
    WILD,
    st.dictionaries(
        st.sampled_from(["fact", "node", "host", "took_us", "began_us", "items", "at_us",
                         "value", "failed", "backward", "bytes", "step"]),
        WILD | st.sampled_from(["ran", "finished", "sent", "received", "loss", "began",
                                "failed", "kept", "n"]),
        max_size=6),
)
RECORD_BYTES = st.one_of(
    st.binary(max_size=80),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.recursive(WILD, lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.text(max_size=4), inner, max_size=3)).map(
        lambda doc: json.dumps(doc).encode()),
    st.lists(FACTS, max_size=8).map(lambda said: json.dumps({"format": 1, "facts": said})
                                    .encode()),
    st.fixed_dictionaries({"format": st.sampled_from([1, 1, 1, 2, 0, "1", None]),
                           "facts": st.lists(FACTS, max_size=6) | WILD}).map(
        lambda doc: json.dumps(doc).encode()),
)


@pytest.mark.slow
def test_a_record_of_any_bytes_reads_or_is_refused_never_a_traceback(tmp_path, capsys):
    from somatize.cli import _show, main

    store = Store(tmp_path / "s", durable=False)
    outcomes = {"read": 0, "refused": 0}

    @settings(max_examples=1000, deadline=None, database=None)
    @given(RECORD_BYTES)
    def check(record):
        run = f"fuzz{sum(outcomes.values())}"  # a run of its own: nothing rewritten in place
        store.bind(f"run/{run}/0", store.put(record), {"loss": None})
        try:
            facts(store, run, 0)
            nodes(store, run)
            curve(store, run)
            curve(store, run, "finished", field="took_us")
            _show(store, run, None)  # what `somatize show` prints, with and without -f
            _show(store, run, 0)
        except RecordError as exc:  # CorruptRecord among them: a CorruptObject too
            outcomes["refused"] += 1
            assert f"run/{run}/0" in str(exc)
        else:
            outcomes["read"] += 1
        if sum(outcomes.values()) % 20 == 0:  # and the command itself, now and then
            assert main(["show", store.where, run, "-f", "0"]) in (0, 2)
            capsys.readouterr()

    check()
    tried = sum(outcomes.values())
    print(f"records: {tried} tried, {outcomes}, 0 other errors")
    assert tried >= 900 and min(outcomes.values()) > 0


def test_a_corrupt_record_is_said_by_somatize_show_and_the_rest_is_shown(store):
    train_like(store, "a-run", 2)
    put_record(store, "run/a-run/1", b"[" * 100_000)
    done = subprocess.run([sys.executable, "-m", "somatize", "show", store.where, "a-run"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run a-run: ") and "1 damaged (left out)" in lines[0]
    assert any(line.startswith("sum ") for line in lines)  # the forward that could be read
    damage = [line for line in lines if line.startswith("damaged: record run/a-run/1 in ")]
    assert len(damage) == 1 and "is not JSON" in damage[0]
    with pytest.raises(CorruptObject, match="run/a-run/1"):
        facts(store, "a-run", 1)
    done = subprocess.run([sys.executable, "-m", "somatize", "show", store.where, "a-run",
                           "-f", "1"], capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 2 and "Traceback" not in done.stderr  # the one forward asked for
    assert done.stderr.startswith("somatize show: record run/a-run/1 in ")
