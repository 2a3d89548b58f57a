"""seen and history over a run written by a Recorder into a real directory store."""

import pytest
from healthruns import chain, recorded

from somatize import RecordError
from somatize.health import history, seen
from somatize.health._read import judged_facts
from somatize.store import Store


class Counting(Store):
    """A directory store that counts the objects read from it."""

    gets = 0

    def get(self, digest):
        Counting.gets += 1
        return super().get(digest)


def measures(n):
    return {"act_mean": float(n), "grad_norm": 2.0 * n, "nonfinite": 0}


def test_seen_is_the_last_measured_step_by_default_or_the_one_asked_for(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "r", chain(7, body=measures, head=lambda n: {"act_mean": -n}), every=3)
    assert seen(store, "r") == {"body": measures(7), "head": {"act_mean": -7}}
    assert seen(store, "r", step=4)["body"]["grad_norm"] == 8.0
    with pytest.raises(RecordError, match="no health facts at step 5; measured steps near it "
                                          "are 1, 4, 7"):
        seen(store, "r", step=5)
    with pytest.raises(TypeError, match="step number"):
        seen(store, "r", step="last")


def test_history_is_every_measure_of_every_where_over_the_run(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "r", chain(5, body=measures, head=lambda n: {"act_mean": -n}), every=2)
    said = history(store, "r")
    assert list(said) == ["body", "head"]
    assert said["body"]["grad_norm"] == [(1, 2.0), (3, 6.0), (5, 10.0)]
    assert said["head"] == {"act_mean": [(1, -1), (3, -3), (5, -5)]}


def test_a_run_without_health_facts_reads_empty_and_an_unknown_run_is_refused(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "plain", [{}, {}])
    assert seen(store, "plain") == {} and history(store, "plain") == {}
    with pytest.raises(RecordError, match="no run 'nope'; its runs are 'plain'"):
        history(store, "nope")


def test_records_are_opened_once_and_not_at_all_where_the_names_say_nothing_is_there(tmp_path):
    store = Counting(str(tmp_path))
    recorded(store, "sparse", chain(40, body=measures), every=10, summarising=["loss", "health"])
    Counting.gets = 0
    assert [s for s, _ in history(store, "sparse")["body"]["act_mean"]] == [1, 11, 21, 31]
    assert Counting.gets == 1  # the 40 forwards are one batch, opened once for the 4 with health
    seen(store, "sparse")
    history(store, "sparse")
    assert Counting.gets == 1  # read once, kept by the records' digests
    losses = [f["value"] for f in judged_facts(store, "sparse") if f["fact"] == "loss"]
    assert losses == [1.0 / n for n in range(1, 41)]  # 36 of them from the names' meta
    assert Counting.gets == 1
    recorded(store, "sparse", chain(1, body=measures), summarising=["loss", "health"])
    assert seen(store, "sparse")["body"]["act_mean"] == 1.0  # a new record is read
    assert Counting.gets == 2
