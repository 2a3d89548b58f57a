"""Shape and Losses: a run kept up to date from the follower's log of changes, equal at
every look to what the record's readers say of the whole run."""

import time

from webruns import recorded

from somatize import Graph, Node
from somatize.record import Recorder, curve
from somatize.record._read import run_of
from somatize.store import Store
from somatize.web import Following
from somatize.web import _follow
from somatize.web._seen import Losses, Shape


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def look(following, run, *kept):
    time.sleep(_follow.FOLLOW_EVERY)
    following.follow(run)
    for one in kept:
        one.update(following)


def test_a_growing_run_is_seen_as_the_readers_see_it(tmp_path):
    store = Store(tmp_path / "store", durable=False)
    following = Following(store)
    recorded(store, "r", 4)
    shape, losses = Shape("r"), Losses("r")
    for one in (shape, losses):
        one.update(following)
    assert shape.run_now() == run_of(store, "r")
    assert [v for _, v in losses.after(-1)] == curve(store, "r")
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="r", summarising=["loss", "mark"])
    g.forward(0, watching=recorder)
    recorder({"fact": "mark", "value": "first"})
    recorder({"fact": "loss", "value": 0.25})
    recorder.flush()
    look(following, "r", shape, losses)
    assert shape.run_now() == run_of(store, "r") and shape.run_now().summary["mark"] == "first"
    assert losses.after(3) == [(4, 0.25)] and losses.last() == 0.25
    recorder.close()
    # bound again by somebody else, without the value it summarised: counted afresh
    again = store.resolve("run/r/4")
    time.sleep(0.01)
    store.bind("run/r/4", again.digest, {"loss": 0.25, "mark": None})
    look(following, "r", shape, losses)
    assert shape.run_now() == run_of(store, "r") and "mark" not in shape.run_now().summary


def test_the_log_says_what_changed_after_a_version(tmp_path):
    store = Store(tmp_path / "store", durable=False)
    recorded(store, "r", 3)
    following = Following(store)
    version, changed = following.changed("r", 0)
    assert version == 3 and [i for i, _ in changed] == [0, 1, 2]
    recorded(store, "r", 2)
    time.sleep(_follow.FOLLOW_EVERY)
    following.follow("r")
    later, changed = following.changed("r", version)
    assert later == 5 and [i for i, _ in changed] == [3, 4]
    assert following.changed("r", later) == (later, [])
    assert following.changed("absent", 0) == (0, [])


def test_a_run_without_losses_has_none_to_show(tmp_path):
    store = Store(tmp_path / "store", durable=False)
    g = Graph.somatize(Step().named("step"))
    with Recorder(store, run="bare") as recorder:
        g.forward(1, watching=recorder)
    losses = Losses("bare")
    losses.update(Following(store))
    assert not losses.any() and losses.last() is None and losses.after(-1) == []
    shape = Shape("bare")
    shape.update(Following(store))
    assert shape.rate(20) is None and shape.run_now().forwards == 1
