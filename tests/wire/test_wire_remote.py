"""Slices run by real workers: the seed's examples, both modes, fan-in, waves, what
cannot travel, facts, and provisioning once per catalog."""

import os
import time

import pytest
from wire_helpers import TOKEN, standing  # noqa: F401  (a fixture)
from wire_nodes import (Add, Clean, Const, Count, Echo, Hold, Join, Shout, Sleep, Twice,
                        Unhold, UnholdJoin, Where)

import somatize
from somatize import Broker, Graph, Lost, Node, Opaque, UnwritableError, WireError, Worker


class Local(Node):  # defined here, so a worker can only have it by value
    def __init__(self, scale):
        self.scale = scale

    def forward(self, x, ctx):
        return {"scaled": x * self.scale, "pid": os.getpid()}


@pytest.fixture(scope="module")
def generic():
    with Worker.generic() as worker:
        yield worker


def test_the_seed_example_against_a_worker_started_from_the_command_line(standing):
    worker = standing()
    assert worker.first_line == f"listening on {worker.addr}\n"
    g = Graph.somatize(Clean() >> Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:
        broker = Broker.embedded({"w1": w1})
        assert g.forward("  hello  ", broker=broker) == "HELLO"
        assert g.forward("  again ", broker=broker) == "AGAIN"
        assert g.forward("  dict  ", broker={"w1": w1}) == "DICT"
    log = worker.wait_log("closed by the client")
    assert log.count("provisioned") == 1, log  # one catalog, sent once, kept between forwards
    assert "slice ['shout'] ran in" in log


def test_the_slice_runs_in_the_worker_process_and_is_one_round_trip(generic):
    g = Graph.somatize((Add(1) >> Where().on("cpu")).at("w1"))
    facts = []
    out = g.forward(1, broker={"w1": generic}, watching=facts.append)
    assert out["pid"] != os.getpid() and out["input"] == 2 and out["device"] == "cpu"
    assert [f["fact"] for f in facts if f.get("host") == "w1"] == ["sent", "ran", "ran", "received"]
    ran = [f for f in facts if f["fact"] == "ran"]
    assert [f["node"] for f in ran] == ["add", "where"] and all(f["host"] == "w1" for f in ran)
    sent = next(f for f in facts if f["fact"] == "sent")
    assert sent["bytes"] > 48 and sent["took_us"] >= 0
    assert [f["fact"] for f in facts].count("began") == 1  # the worker's own bracket stays there


def test_generic_children_end_with_their_with_block():
    with Worker.generic() as worker:
        g = Graph.somatize(Where().at("w1"))
        pid = g.forward(None, broker={"w1": worker})["pid"]
        child = worker._child
    assert child.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_network_mode_sends_a_class_of_this_module_by_value():
    g = Graph.somatize(Local(3).at("w1"))
    with Worker.generic(mode="network", send=[__name__]) as worker:
        out = g.forward(5, broker={"w1": worker})
    assert out["scaled"] == 15 and out["pid"] != os.getpid()


def test_project_mode_refuses_a_class_the_worker_cannot_import(generic):
    g = Graph.somatize(Local(3).at("w1"))
    with pytest.raises(WireError) as caught:
        g.forward(5, broker={"w1": generic})
    message = str(caught.value)
    assert "'w1'" in message and repr(__name__) in message and "mode='network'" in message


def test_state_lives_on_the_worker_between_forwards(generic):
    count = Count()
    g = Graph.somatize(count.at("w1"))
    broker = Broker.embedded({"w1": generic})
    assert [g.forward(None, broker=broker) for _ in range(3)] == [1, 2, 3]
    assert count.calls == 0  # the client's copy never ran


def test_fan_in_across_hosts_is_keyed_and_ordered_as_here(generic):
    with Worker.generic() as other:
        g = Graph.somatize((Add(1).at("w1") | Add(2).at("w2") | Add(3)) >> Join())
        assert g.forward(10, broker={"w1": generic, "w2": other}) == {
            "order": ["add", "add_2", "add_3"], "values": [11, 12, 13]}
        there = Graph.somatize((Add(1) | Add(2).at("w2")) >> Join().at("w1"))
        assert there.forward(10, broker={"w1": generic, "w2": other}) == {
            "order": ["add", "add_2"], "values": [11, 12]}


def test_two_remotes_in_one_wave_run_at_once(generic):
    with Worker.generic() as other:
        broker = Broker.embedded({"w1": generic, "w2": other})
        g = Graph.somatize(Sleep(0.8).at("w1") | Sleep(0.8).at("w2"))
        g.forward(0, broker=broker)  # connections and catalogs, out of the timing
        began = time.perf_counter()
        assert g.forward(7, broker=broker) == {"sleep": 7, "sleep_2": 7}
        assert time.perf_counter() - began < 1.4


def test_what_cannot_travel_stays_and_is_named_when_read_here(generic):
    g = Graph.somatize(Hold().at("w1"))
    with pytest.raises(Lost) as caught:
        g.forward(1, broker={"w1": generic})
    assert caught.value.node == "hold" and caught.value.host == "w1"
    assert "'hold'" in str(caught.value) and "'w1'" in str(caught.value)


def test_a_later_slice_on_the_same_worker_reads_what_stayed(generic):
    g = Graph.somatize((Hold().at("w1") | Const("here")) >> UnholdJoin().at("w1"))
    assert g.forward(41, broker={"w1": generic}) == [41, "here"]


def test_what_stayed_on_one_worker_cannot_be_read_on_another(generic):
    with Worker.generic() as other:
        g = Graph.somatize(Hold().at("w1") >> Unhold().at("w2"))
        with pytest.raises(Lost) as caught:
            g.forward(1, broker={"w1": generic, "w2": other})
    assert caught.value.node == "hold" and caught.value.host == "w1"
    assert "'unhold'" in str(caught.value) and "'w2'" in str(caught.value)


def test_an_opaque_inside_a_stretch_does_not_stop_it(generic):
    g = Graph.somatize((Hold() >> Unhold()).at("w1"))
    assert g.forward("kept", broker={"w1": generic}) == "kept"


def test_two_hosts_on_one_worker_get_one_catalog_the_union(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as shared:
        broker = Broker.embedded({"a": shared, "b": shared})
        assert broker.token_for("a") == broker.token_for("b")
        g = Graph.somatize(Add(1).at("a") >> Add(10) >> Add(100).at("b"))
        g.provision(broker)
        assert "connection" not in worker.log()  # staged: nothing sent yet
        assert g.forward(0, broker=broker) == 111
    log = worker.wait_log("closed by the client")
    assert log.count("provisioned") == 1 and "add, add_3 (1 session held)" in log, log


def test_hosts_at_one_address_share_a_wire_and_others_do_not(standing):
    worker = standing()
    one, two = Worker.at(worker.addr, token=TOKEN), Worker.at(worker.addr, token=TOKEN)
    broker = Broker.embedded({"a": one, "b": two, "c": Worker.generic()})
    try:
        assert broker.token_for("a") == broker.token_for("b") != broker.token_for("c")
        assert broker.token_for("nobody") is None
        assert broker.worker_for("b") is two
        with pytest.raises(WireError, match="'nobody'"):
            broker.worker_for("nobody")
    finally:
        for w in (one, two, broker.worker_for("c")):
            w.close()


def test_a_second_client_finds_the_catalog_already_there(standing):
    worker = standing()
    g = Graph.somatize(Shout().at("w1"))
    for _ in range(2):
        with Worker.at(worker.addr, token=TOKEN) as w1:
            assert g.forward("x", broker={"w1": w1}) == "X"
    log = worker.wait_log("connection 2 from")
    assert log.count("provisioned") == 1, log


def test_an_unknown_host_is_named_when_needed_not_before(generic):
    g = Graph.somatize(Add(1).at("w1") >> Add(1).at("w9"))
    broker = Broker.embedded({"w1": generic})
    g.provision(broker)  # w9 is nobody's yet, and that is not an error here
    with pytest.raises(WireError) as caught:
        g.forward(0, broker=broker)
    assert caught.value.host == "w9" and "'w9'" in str(caught.value) and "'w1'" in str(caught.value)


def test_tuples_and_bytes_cross_as_they_are(generic):
    echo = Graph.somatize(Echo().at("w1"))
    value = {"t": (1, b"\x00\xff", "s"), "f": [1.5, float("inf"), None, True]}
    assert echo.forward(value, broker={"w1": generic}) == value


class Box:
    def __init__(self, raw):
        self.raw = raw


def test_an_opaque_the_worker_has_no_codec_for_is_refused_by_name(generic):
    somatize.codec("test.wire.box", Box, dump=lambda b: b.raw, load=lambda raw: Box(bytes(raw)))
    g = Graph.somatize(Echo().at("w1"))
    with pytest.raises(UnwritableError) as caught:
        g.forward(Opaque(Box(b"abc")), broker={"w1": generic})
    assert "test.wire.box" in str(caught.value) and "'w1'" in str(caught.value)


def test_a_large_catalog_is_sealed_and_sent_once(standing):
    worker = standing()
    g = Graph.somatize(Const(b"\x01" * (6 << 20)).at("w1") >> Add(b"!").at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:
        for _ in range(2):
            out = g.forward(None, broker={"w1": w1})
            assert len(out) == (6 << 20) + 1 and out.endswith(b"\x01!")
    log = worker.wait_log("closed by the client")
    assert log.count("provisioned") == 1 and "(629" in log, log


def test_a_walk_back_runs_there_as_one_transposed_slice(generic):
    from somatize._engine import Pass

    def walk(g, broker=None):
        facts = []
        back = Pass(facts.append, framed=False).back
        out = back(g, ["twice", "echo", "twice_2"], {"twice_2": 3}, ["twice"], broker=broker)
        return out["twice"], facts

    here, _ = walk(Graph.somatize(Twice() >> Echo() >> Twice()))
    there, facts = walk(Graph.somatize((Twice() >> Echo() >> Twice()).at("w1")),
                        Broker.embedded({"w1": generic}))
    assert here["doubled"] == there["doubled"] == 12
    assert here["pid"] == os.getpid() != there["pid"]
    ran = [f for f in facts if f["fact"] == "ran"]
    assert [f["node"] for f in ran] == ["twice_2", "twice"]
    assert all(f["host"] == "w1" and f["backward"] for f in ran)
