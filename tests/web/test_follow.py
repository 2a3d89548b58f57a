"""Following: a store as the readers see it, answering what a Store answers, catching
up by reading only what changed, and never writing."""

import secrets
import time

import pytest
from webruns import recorded

from somatize import Graph, Node
from somatize.health import diagnose
from somatize.record import Recorder, curve, facts, forwards, nodes, runs
from somatize.store import DirectoryBackend, Store
from somatize.web import Following
from somatize.web import _follow


class Counted(DirectoryBackend):
    """A real directory backend that counts what it is asked to read."""

    def __init__(self, directory):
        super().__init__(directory, durable=False)
        self.asked = {"read_name": 0, "list_names": 0, "read_object": 0}

    def read_name(self, name):
        self.asked["read_name"] += 1
        return super().read_name(name)

    def list_names(self, prefix):
        self.asked["list_names"] += 1
        return super().list_names(prefix)

    def read_object(self, hexdigest):
        self.asked["read_object"] += 1
        return super().read_object(hexdigest)

    def reset(self):
        self.asked = dict.fromkeys(self.asked, 0)


@pytest.fixture
def counted(tmp_path):
    backend = Counted(tmp_path / "store")
    return Store.over(backend), backend


def test_it_answers_what_the_store_answers(tmp_path):
    store = Store(tmp_path / "store", durable=False)
    recorded(store, "a", 12, health={"step": {"act_zero": 1.0, "grad_norm": 1.0}})
    recorded(store, "b", 5, summarising=())
    following = Following(store)
    for prefix in ("run", "run/a", "run/b"):
        assert [(b.name, b.digest, b.meta) for b in following.bound(prefix)] == \
               [(b.name, b.digest, b.meta) for b in store.bound(prefix)]
    assert following.resolve("run/a/3") == store.resolve("run/a/3")
    for n in range(5):  # inside a batch too: that forward's part of it, as the store says
        assert following.resolve(f"run/b/{n}") == store.resolve(f"run/b/{n}") is not None
    assert following.resolve("run/a/99") is None and following.resolve("run/zz/0") is None
    digest = store.resolve("run/b/0").digest  # its five forwards are one batch
    assert following.get(digest) == store.get(digest)
    assert runs(following) == runs(store)
    for run in ("a", "b"):
        assert curve(following, run) == curve(store, run)
        assert nodes(following, run) == nodes(store, run)
        assert facts(following, run, -1) == facts(store, run, -1)
        assert forwards(following, run) == forwards(store, run)
    assert diagnose(following, "a") == diagnose(store, "a") != []


def test_a_grown_run_costs_the_new_names_not_its_length(counted, tmp_path):
    store, backend = counted
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="long", summarising=["loss"])
    for i in range(300):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": float(i)})
    recorder.flush()
    following = Following(store)
    assert following.runs() == {"long": 300}
    for i in range(3):
        g.forward(i, watching=recorder)
        recorder({"fact": "loss", "value": -1.0 - i})
    recorder.flush()
    backend.reset()
    assert following.follow("long") == 303
    # the one new batch, the miss after it (for which the store reads the batch that
    # ends just before it, since a batch bound again may hold it now), and the old last
    # batch again: no listing
    assert backend.asked == {"read_name": 4, "list_names": 0, "read_object": 0}
    backend.reset()
    assert curve(following, "long")[-3:] == [-1.0, -2.0, -3.0]  # summarised: no record opened
    assert backend.asked == {"read_name": 0, "list_names": 0, "read_object": 0}
    assert forwards(following, "long") == 303
    nodes(following, "long")
    assert backend.asked["read_object"] == 2  # every batch, once...
    nodes(following, "long")
    assert backend.asked["read_object"] == 2  # ...and not again
    assert backend.asked["list_names"] == 0
    recorder.close()


def test_looks_at_one_run_are_spaced(counted):
    store, backend = counted
    recorded(store, "r", 3)
    following = Following(store)
    following.follow("r")
    backend.reset()
    following.follow("r")  # right after the last look: answered from what was read
    assert backend.asked["read_name"] == 0


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def test_a_forward_bound_again_is_read_again(tmp_path):
    """A Trainer's step is written when its loss is in, and again when the facts said
    after it (updated, health) are written as the next step begins."""
    store = Store(tmp_path / "store", durable=False)
    following = Following(store)
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="r")
    g.forward(1, watching=recorder)
    recorder.flush()
    assert following.version("r") is not None
    before = following.resolve("run/r/0").digest
    recorder({"fact": "health", "where": "step", "step": 1, "act_zero": 0.5})
    g.forward(2, watching=recorder)
    recorder.flush()  # binds forward 0's batch again, now holding 1 as well
    time.sleep(_follow.FOLLOW_EVERY)
    following.follow("r")
    assert following.resolve("run/r/0").digest != before
    assert [f["fact"] for f in facts(following, "r", 0)][-1] == "health"
    assert forwards(following, "r") == 2
    recorder.close()


def test_a_run_far_behind_is_listed_whole(counted):
    store, backend = counted
    recorded(store, "r", 2)
    following = Following(store)
    assert following.runs() == {"r": 2}
    recorded(store, "r", _follow.PROBES + 10, batches=True)
    backend.reset()
    following.follow("r")
    assert forwards(following, "r") == _follow.PROBES + 12
    assert backend.asked["list_names"] == 1 and backend.asked["read_name"] <= _follow.PROBES + 2


def test_new_runs_come_with_a_scan_and_scans_are_spaced(counted):
    store, backend = counted
    recorded(store, "first", 2)
    following = Following(store)
    assert list(following.runs()) == ["first"]
    recorded(store, "second", 2)
    backend.reset()
    assert following.scan() is False  # one just ran
    assert backend.asked["list_names"] == 0
    assert following.scan(force=True) is True
    assert sorted(following.runs()) == ["first", "second"]


def test_a_run_the_last_scan_missed_is_found_when_asked_for(tmp_path):
    store = Store(tmp_path / "store", durable=False)
    recorded(store, "old", 1)
    following = Following(store)
    following.runs()
    recorded(store, "new", 4)
    assert forwards(following, "new") == 4
    assert following.version("nothing") is None and following.bound("run/nothing") == []


def test_it_cannot_write(tmp_path):
    following = Following(Store(tmp_path / "store"))
    for method in ("put", "bind", "claim", "keep", "recall"):
        assert not hasattr(following, method)
    with pytest.raises(TypeError, match="no put"):
        Recorder(following)
    with pytest.raises(TypeError, match="reads a Store"):
        Following(object())


def test_objects_are_kept_up_to_a_size(counted):
    store, backend = counted
    recorded(store, "r", 20, summarising=(), batches=True)
    following = Following(store, keep_bytes=8 * 600)  # a few records' worth
    nodes(following, "r")
    backend.reset()
    nodes(following, "r")
    assert 0 < backend.asked["read_object"] <= 20  # some were let go, and read again


def test_a_bucket_store_is_followed_and_left_as_it_was(s3_endpoint, credentials):
    pytest.importorskip("boto3")
    from s3server import make_bucket, raw_client

    from somatize.store.bucket import BucketBackend

    bucket = "soma-web-" + secrets.token_hex(4)
    make_bucket(s3_endpoint, bucket)
    writer = Store.on_bucket(s3_endpoint, bucket)
    recorded(writer, "r", 3)

    def keys():
        listed = raw_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])
        return {item["Key"]: item["ETag"] for item in listed}

    before = keys()
    following = Following(Store.over(BucketBackend(s3_endpoint, bucket)))  # no probe: no write
    assert following.runs() == {"r": 3}
    assert curve(following, "r") == curve(writer, "r")
    assert keys() == before
    recorded(writer, "r", 2)
    time.sleep(_follow.FOLLOW_EVERY)
    following.follow("r")
    assert forwards(following, "r") == 5
