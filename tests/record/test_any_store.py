"""Every reader of the record over a store that holds anything at all: the views, the
health, the report, every ``somatize`` command that reads, and every route of
``somatize serve``. A run whose records are damaged is said to be, with the reason;
the good run beside it is still listed and drawn; nothing raises but a one-line
refusal of the one forward asked for, and nothing answers 500."""

import contextlib
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import somatize
from somatize import Graph, Node, RecordError
from somatize._errors import CorruptObject
from somatize._graph import describe
from somatize.cli import main
from somatize.health import diagnose, findings_told, history, judged_facts, seen
from somatize.health import report as health_report
from somatize.record import Recorder, curve, facts, nodes, runs
from somatize.record._read import damaged
from somatize.store import Store

pytest.importorskip("plotly")
starlette_testclient = pytest.importorskip("starlette.testclient")
httpx = pytest.importorskip("httpx")

from somatize.web import application  # noqa: E402

SRC = os.path.dirname(os.path.dirname(somatize.__file__))
GOOD = "good"
DOTTED = ("enc.v2", "layer.1", "héad ü")  # node ids a where must never be split at


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def good_run(store, steps=12):
    """A run as a Trainer with an Audit writes one, by hand: a graph of dotted node ids,
    said once, then per step a forward, its loss and a health fact per where."""
    g = Graph.somatize(Step().named(DOTTED[0]) >> Step().named(DOTTED[1])
                       >> Step().named(DOTTED[2]))
    recorder = Recorder(store, run=GOOD, summarising=["loss"])
    recorder({"fact": "graph", "graph": describe(g.data()), "optimizer": "SGD"})
    for n in range(1, steps + 1):
        g.forward(n, watching=recorder)
        recorder({"fact": "loss", "value": 1.0 / n})
        for where in (*DOTTED, "enc.v2.layer"):
            recorder({"fact": "health", "where": where, "step": n, "grad_norm": 0.0 if
                      where == "layer.1" else 0.5, "update_ratio": 1e-3, "weight_norm": 1.0,
                      "act_zero": 1.0 if where.startswith("enc") else 0.2, "nonfinite": 0})
    recorder.close()


# -- what a store may hold ----------------------------------------------------------------
_EDGES = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e308, 5e-324, 2**63, -1]
EDGES = st.integers(0, len(_EDGES) - 1).map(_EDGES.__getitem__)  # often: each is a case
WILD = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | EDGES
        | st.text(max_size=5) | st.integers(-3, 3).map(lambda n: [n] * abs(n)))
NUMBER = EDGES | EDGES | st.floats(0, 2) | st.integers(0, 5)  # what a measure mostly is
WHERE = st.sampled_from([*DOTTED, "enc.v2.layer", "", "a.b.c", "loss"]) | st.text(max_size=6)
MEASURES = st.fixed_dictionaries({}, optional={
    measure: NUMBER | NUMBER | WILD | st.dictionaries(st.sampled_from(["a", "b"]), NUMBER | WILD,
                                                      max_size=2)
    for measure in ("act_zero", "grad_norm", "update_ratio", "update_norm", "weight_norm",
                    "nonfinite", "act_saturated", "dead_channels", "channels")})
HEALTH = st.builds(lambda where, step, measures: {"fact": "health", "where": where,
                                                  "step": step, **measures},
                   WHERE | WHERE | WILD, st.integers(-3, 60) | st.integers(-3, 60) | WILD,
                   MEASURES)
GRAPH = st.builds(lambda graph, optimizer: {"fact": "graph", "graph": graph,
                                            "optimizer": optimizer},
                  WILD | st.fixed_dictionaries({"nodes": st.lists(WHERE | WILD, max_size=4),
                                                "edges": st.lists(st.lists(WHERE, max_size=3),
                                                                  max_size=3)}),
                  WILD | st.sampled_from(["SGD", "Adam"]))
OTHER = st.dictionaries(
    st.sampled_from(["fact", "node", "host", "took_us", "began_us", "items", "at_us", "value",
                     "failed", "backward", "bytes", "step"]),
    WILD | st.sampled_from(["ran", "finished", "sent", "received", "loss", "began", "failed",
                            "kept", "n"]), max_size=6)
LOSS = st.builds(lambda v: {"fact": "loss", "value": v}, NUMBER | WILD)
FACT = st.one_of(WILD, OTHER, HEALTH, HEALTH, HEALTH, GRAPH, LOSS, LOSS)
RECORD = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(1, 3000)),
    st.builds(lambda said: json.dumps({"format": 1, "facts": said}).encode(),
              st.lists(FACT, max_size=8)),
    st.builds(lambda first, held: json.dumps({"format": 2, "run": "x", "forward": first,
                                              "forwards": held}).encode(),
              st.integers(-2, 6) | WILD, st.lists(st.lists(FACT, max_size=6) | WILD, max_size=4)),
    # many steps of measures, as an Audit says them: what the rules read at length
    st.builds(lambda wheres, steps, loss: json.dumps({"format": 1, "facts": [
        fact for n, measures in enumerate(steps, 1) for fact in (
            [{"fact": "health", "where": where, "step": n, **measures} for where in wheres]
            + [{"fact": "loss", "value": loss if n % 3 else 1.0 / n}])]}).encode(),
        st.lists(WHERE, min_size=1, max_size=3), st.lists(MEASURES, min_size=6, max_size=40),
        NUMBER | WILD),
)
META = st.dictionaries(
    st.sampled_from(["", "loss", "health", "accuracy"]),
    WILD | st.integers(0, 10**13) | st.lists(WILD | st.dictionaries(
        st.sampled_from(["loss", "health"]), WILD, max_size=2), max_size=3),
    max_size=3)
BINDINGS = st.lists(st.tuples(st.integers(0, 6), RECORD, META), min_size=1, max_size=4)


def bound(store, run, bindings):
    for index, record, meta in bindings:
        try:
            store.bind(f"run/{run}/{index}", store.put(record), meta)
        except (TypeError, ValueError):  # meta no store takes (a NaN, say): not a record's
            pass


def served(store):
    """The application ``somatize serve`` serves, asked in this process as from loopback."""
    return starlette_testclient.TestClient(application(store), base_url="http://127.0.0.1")


@contextlib.contextmanager
def serving(store):
    """``somatize serve`` over ``store`` as a process of its own, and a client of it."""
    server = subprocess.Popen([sys.executable, "-m", "somatize", "serve", store.where,
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": SRC})
    try:
        first = server.stdout.readline()
        assert first.startswith("serving "), first + server.stderr.read()
        url = first.split(" at ", 1)[1].split()[0].rstrip("/")
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            yield client
    finally:
        server.terminate()
        server.wait(timeout=20)
        assert "Traceback" not in server.stderr.read()


def first_event(client, url):
    """The first event a stream sends, read and let go of."""
    with client.stream("GET", url) as answer:
        assert answer.status_code == 200, url
        said = []
        for line in answer.iter_lines():
            said.append(line)
            if line.startswith("data:"):
                return json.loads(line[5:])
    raise AssertionError(f"{url} ended without an event: {said}")


# -- the readers, read over it --------------------------------------------------------------
def read_everything(store, run):
    """What every reader of a whole run answers: none may raise."""
    listed = {r.name: r for r in runs(store)}
    assert listed[GOOD].forwards == 12
    nodes(store, run)
    curve(store, run)
    curve(store, run, "finished", field="took_us")
    judged = judged_facts(store, run)
    found = diagnose(store, run)
    history(store, run)
    try:
        seen(store, run)
    except RecordError as exc:  # no health at the last step: said, naming the steps
        assert "has no health facts at step" in str(exc)
    findings_told(run, judged, {})
    try:
        facts(store, run, 0)
    except (RecordError, CorruptObject) as exc:  # the one forward asked for: refused, why
        assert f"run/{run}/" in str(exc) or "forwards 0 to" in str(exc)
    assert all(isinstance(why, str) and why for why in damaged(store, run).values())
    return found


@pytest.mark.slow
def test_every_reader_and_command_reads_a_store_holding_anything(tmp_path, capsys):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    tried = {"damaged": 0, "clean": 0}
    names = itertools.count()  # a run of its own for every call, a failing one's too

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(BINDINGS)
    def check(bindings):
        run = f"fuzz{next(names)}"
        bound(store, run, bindings)
        if not any(r.name == run for r in runs(store)):
            return  # every binding was refused by the store: nothing of it to read
        read_everything(store, run)
        tried["damaged" if damaged(store, run) else "clean"] += 1
        for argv in (["runs", store.where], ["show", store.where, run],
                     ["health", store.where, run]):
            assert main(argv) == 0, (argv, capsys.readouterr().err)
        assert main(["show", store.where, run, "-f", "0"]) in (0, 2)
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.splitlines()) <= 1

    check()
    print(f"runs read: {tried}")
    assert min(tried.values()) > 20  # both kinds were read, many times


@pytest.mark.slow
def test_the_report_and_every_route_of_serve_over_a_store_holding_anything(tmp_path, capsys):
    with contextlib.ExitStack() as stack:
        _report_and_routes(tmp_path, capsys, stack)


def _report_and_routes(tmp_path, capsys, stack):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    tried = [0]
    client = stack.enter_context(serving(store))

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(BINDINGS)
    def check(bindings):
        run = f"fuzz{tried[0]}"
        tried[0] += 1
        bound(store, run, bindings)
        if not any(r.name == run for r in runs(store)):
            return
        out = tmp_path / f"{run}.html"
        assert main(["report", store.where, run, "-o", str(out)]) == 0, capsys.readouterr().err
        assert out.read_text().count("<section") >= 3
        for url in ("/", f"/run/{run}", "/api/runs", f"/api/run/{run}", "/static/page.js"):
            answer = client.get(url)
            assert answer.status_code == 200, (url, answer.text[:300])
        listed = {row["name"]: row for row in client.get("/api/runs").json()}
        assert listed[GOOD]["forwards"] == 12 and listed[GOOD]["damaged"] == []
        state = first_event(client, f"/events/run/{run}")
        assert state["run"] == run
        assert any(row["name"] == GOOD for row in first_event(client, "/events/runs"))

    check()
    assert tried[0] >= 20


# -- the cases of issue 30, one by one --------------------------------------------------------
def test_a_meta_claiming_a_trillion_forwards_is_not_believed(tmp_path, capsys):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    store.bind("run/huge/0", store.put(b'{"format": 2, "forwards": [[]]}'), {"": 10**12})
    listed = {r.name: r.forwards for r in runs(store)}
    assert listed == {GOOD: 12, "huge": 1}  # named after one forward: what it is bound as
    assert main(["runs", store.where]) == 0
    assert "huge" in capsys.readouterr().out
    from somatize.web._follow import Following

    following = Following(store)
    following.scan(force=True)  # what `somatize serve` does before it starts
    assert following.runs().keys() == {GOOD, "huge"}


def test_a_run_whose_record_is_not_json_is_listed_damaged_and_the_rest_as_ever(tmp_path,
                                                                              capsys):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    store.bind("run/broken/0", store.put(b"\x00 not json"))
    assert main(["health", store.where, "broken"]) == 0
    told = capsys.readouterr().out.splitlines()
    assert told[-1].startswith("damaged (left out): record run/broken/0 in ")
    with served(store) as client:
        answer = client.get("/api/runs")
        assert answer.status_code == 200
        rows = {row["name"]: row for row in answer.json()}
        assert rows[GOOD]["forwards"] == 12 and rows[GOOD]["loss"] == pytest.approx(1 / 12)
        assert "is not JSON" in rows["broken"]["damaged"][0]
        page = client.get("/api/run/broken").json()
        said = {part["key"]: part for part in page["sections"]["sections"]}
        assert "is not JSON" in said["damaged"]["note"]


def test_facts_that_are_not_dicts_make_a_report_and_a_page_all_the_same(tmp_path, capsys):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    store.bind("run/ints/0", store.put(json.dumps({"format": 1, "facts": [1, 2, [3]]}).encode()))
    out = tmp_path / "ints.html"
    assert main(["report", store.where, "ints", "-o", str(out)]) == 0, capsys.readouterr().err
    assert "Where the time went" in out.read_text()
    with served(store) as client:
        assert client.get("/api/run/ints").status_code == 200


def test_node_ids_with_dots_make_the_page_and_the_report_and_advice_names_them(tmp_path, capsys):
    store = Store(tmp_path / "s", durable=False)
    good_run(store)
    found = diagnose(store, GOOD)
    assert {(f.node, f.path, f.what) for f in found} >= {
        ("enc.v2", "", "dying"), ("enc.v2", "layer", "dying")}
    dying = next(f for f in found if f.where == "enc.v2.layer" and f.what == "dying")
    assert "enc.v2.layer" in dying.advice
    out = tmp_path / "good.html"
    assert main(["report", store.where, GOOD, "-o", str(out)]) == 0, capsys.readouterr().err
    page = out.read_text()
    assert "The graph" in page and "could not be drawn" not in page
    written = health_report(store, GOOD, tmp_path / "again.html")
    assert written.endswith("again.html")
    with served(store) as client:
        assert client.get(f"/run/{GOOD}").status_code == 200
        sections = client.get(f"/api/run/{GOOD}").json()["sections"]["sections"]
        graph = next(part for part in sections if part["key"] == "graph")
        assert "figure" in graph
    assert not math.isnan(curve(store, GOOD)[-1])


@pytest.mark.slow
def test_every_measure_at_every_edge_value_is_judged_and_drawn(tmp_path):
    """What a random draw reaches only now and then, every time: each measure of a
    health fact, and the loss, at each value a float or an int can be at its edges,
    held over enough steps for every rule to read it."""
    from somatize.health import panel

    store = Store(tmp_path / "s", durable=False)
    measures = ("act_zero", "grad_norm", "update_ratio", "update_norm", "weight_norm",
                "nonfinite", "act_saturated", "dead_channels", "channels", "loss")
    for measure in measures:
        for at, edge in enumerate(_EDGES + [{"a": math.inf, "b": 0}, "x", None, True]):
            run = f"{measure}-{at}"
            said = []
            for n in range(1, 25):
                healthy = {"grad_norm": 0.5, "update_ratio": 1e-3, "update_norm": 1e-3,
                           "weight_norm": 1.0, "act_zero": 0.2, "nonfinite": 0,
                           "dead_channels": {"a": 1}, "channels": {"a": 4}}
                value = edge if n > 3 else healthy.get(measure, 0.5)
                said.append({"fact": "loss", "value": value if measure == "loss" else 1.0 / n})
                for where in ("enc.v2", "enc.v2.layer", "head"):
                    said.append({"fact": "health", "where": where, "step": n, **healthy,
                                 **({measure: value} if measure != "loss" else {})})
            store.bind(f"run/{run}/0", store.put(json.dumps({"format": 1, "facts": said}).encode()))
            found = diagnose(store, run)
            assert all(f.advice and f.brief for f in found), run
            panel(store, run, found).to_json()
            findings_told(run, judged_facts(store, run), {})
