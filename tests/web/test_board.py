"""The Board: what the pages show, worked out from a store through a Following."""

import dataclasses
import json
import time

import pytest
from webruns import recorded

from somatize import Graph, Node
from somatize.health import Finding, diagnose
from somatize.record import Recorder, curve
from somatize.store import Store
from somatize.web import Following
from somatize.web import _board, _follow
from somatize.web._board import Board, draw

pytest.importorskip("plotly")

DYING = {"body": {"act_zero": 1.0, "grad_norm": 1.0}, "head": {"grad_norm": 1.0}}


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store", durable=False)


def test_the_runs_newest_first_with_their_findings(store):
    recorded(store, "older", 12, health=DYING)
    time.sleep(0.01)
    recorded(store, "newer", 3, summarising=())
    rows = Board(Following(store)).runs()
    assert [row["name"] for row in rows] == ["newer", "older"]
    newer, older = rows
    assert newer["forwards"] == 3 and newer["loss"] == pytest.approx(1 / 3)  # read from its record
    assert older["loss"] == pytest.approx(1 / 12)  # from the names: it summarised the loss
    assert older["findings"] == [{"where": "body", "what": "dying", "since": 1}]
    assert newer["findings"] == [] and newer["live"] and newer["first"] <= newer["last"]


def test_judging_runs_takes_a_moment_at_most(store, monkeypatch):
    for name in ("a", "b", "c"):
        recorded(store, name, 12, health=DYING)
    monkeypatch.setattr(_board, "DIAGNOSE_FOR", 0.0)
    board = Board(Following(store))
    first = board.runs()
    assert sum(row["findings"] is not None for row in first) == 1  # the newest, then time is up
    board.runs()
    assert all(row["findings"] is not None for row in board.runs())


def test_a_run_now_and_its_losses_after_a_forward(store):
    recorded(store, "r", 5)
    board = Board(Following(store))
    state = board.state("r")
    assert state["forwards"] == 5 and state["points"] == [[i, 1 / (i + 1)] for i in range(5)]
    assert board.state("r", after=3)["points"] == [[4, 0.2]]
    assert state["loss"] == 0.2
    assert state["rate"] is None or state["rate"] > 0
    assert board.state("absent") is None and board.sections("absent") is None
    assert not board.known("absent") and board.known("r")


def test_a_run_that_grows_is_seen_growing(store):
    board = Board(Following(store))
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="live")
    g.forward(1, watching=recorder)
    recorder({"fact": "loss", "value": 2.0})
    recorder.flush()  # said after the forward finished: written by the next, or by this
    first = board.state("live")
    for i in range(3):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": float(i)})
    recorder.flush()
    time.sleep(_follow.FOLLOW_EVERY)
    later = board.state("live", after=first["points"][-1][0])
    assert later["version"] > first["version"] and later["forwards"] == 4
    assert later["points"] == [[1, 0.0], [2, 1.0], [3, 2.0]]
    recorder.close()


def test_a_loss_that_is_not_a_number_is_said_not_drawn(store):
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="nan")
    for value in (1.0, float("nan"), float("inf")):
        g.forward(1, watching=recorder)
        recorder({"fact": "loss", "value": value})
    recorder.close()
    board = Board(Following(store))
    state = board.state("nan")
    assert state["loss"] == "inf" and state["points"] == [[0, 1.0], [1, None], [2, None]]
    text = board.sections("nan")[1]
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))


def test_the_sections_are_the_reports(store):
    recorded(store, "r", 12, health=DYING)
    board = Board(Following(store))
    version, text = board.sections("r")
    sections = {part["key"]: part for part in json.loads(text)["sections"]}
    assert list(sections) == ["progress", "health", "graph", "spent"]
    assert sections["progress"]["figure"]["data"][0]["y"] == pytest.approx(curve(store, "r"))
    found = diagnose(store, "r")
    assert [(f["where"], f["what"], f["since"]) for f in sections["health"]["findings"]] == \
        [(f.where, f.what, f.since) for f in found]
    assert sections["health"]["findings"][0]["evidence"].startswith("act_zero >= 0.9 for 12 steps")
    assert "figure" in sections["health"] and "figure" in sections["spent"]
    assert "did not describe its graph" in sections["graph"]["note"]  # bare forwards: no Trainer
    assert board.sections("r") == (version, text)  # nothing moved: the same drawing


def test_notes_where_there_is_nothing_to_draw(store):
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="bare")
    g.forward(1, watching=recorder)
    recorder.close()
    sections = {part["key"]: part for part in draw(Following(store), "bare", losses=False)}
    assert "no loss facts" in sections["progress"]["note"]
    assert "no health facts" in sections["health"]["note"] and sections["health"]["findings"] == []


def test_drawing_again_waits_until_the_run_moved_and_a_while(store, monkeypatch):
    recorded(store, "r", 3)
    following = Following(store)
    board = Board(following)
    version, _ = board.sections("r")
    recorded(store, "r", 2)
    time.sleep(_follow.FOLLOW_EVERY)
    following.follow("r")
    assert board.sections("r")[0] == version  # drawn just now: the same drawing for a while
    monkeypatch.setattr(_board, "DRAW_EVERY", 0.0)
    monkeypatch.setattr(_board, "DRAW_SHARE", 0)
    assert board.sections("r")[0] == following.version("r") > version


@dataclasses.dataclass(frozen=True)
class Advised(Finding):
    """A Finding that says what to try, as Findings that carry advice do."""

    advice: str = ""


def test_findings_carry_their_advice_when_they_have_one():
    plain = Finding("body", "dying", 3, {"measure": "values", "count": 2})
    advised = Advised("body", "dying", 3, {"measure": "values", "count": 2},
                      advice="lower the learning rate")
    assert _board._finding(plain)["advice"] is None
    assert _board._finding(advised)["advice"] == "lower the learning rate"
