"""Every way a worker can fail a client, each against a real worker process: nothing
hangs, and every error names the host."""

import signal
import socket
import threading
import time

import pytest
from wire_helpers import TOKEN, standing  # noqa: F401  (a fixture)
from wire_nodes import Add, Behind, Boom, Count, Echo, Shout, Sleep

from somatize import Broker, Graph, NodeError, Silent, Unauthorised, WireError, Worker
from somatize._errors import OutOfStep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_named_at_first_need_not_at_declaration():
    port = free_port()
    worker = Worker.at(f"127.0.0.1:{port}", timeout=2)  # declaring opens nothing
    g = Graph.somatize(Shout().at("w1"))
    with pytest.raises(WireError) as caught:
        g.forward("x", broker={"w1": worker})
    assert caught.value.host == "w1"
    assert "'w1'" in str(caught.value) and f"127.0.0.1:{port}" in str(caught.value)
    assert "python -m somatize.worker --listen" in str(caught.value)


def test_a_worker_killed_mid_slice_is_an_error_at_once(standing):
    worker = standing()
    g = Graph.somatize(Echo().at("w1") >> Sleep(20).at("w1"))
    with Worker.at(worker.addr, token=TOKEN, timeout=30) as w1:
        threading.Timer(0.5, worker.signal, args=(signal.SIGKILL,)).start()
        began = time.monotonic()
        with pytest.raises(WireError) as caught:
            g.forward(1, broker={"w1": w1})
        assert time.monotonic() - began < 5  # not the 30 s timeout, not the 20 s sleep
    message = str(caught.value)
    assert caught.value.host == "w1" and "'w1'" in message and "['echo', 'sleep']" in message


def test_a_stopped_worker_is_silent_past_the_timeout_never_a_hang(standing):
    worker = standing()
    g = Graph.somatize(Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN, timeout=1.5) as w1:
        assert g.forward("a", broker={"w1": w1}) == "A"
        worker.pause()
        try:
            began = time.monotonic()
            with pytest.raises(Silent) as caught:
                g.forward("b", broker={"w1": w1})
            assert 1.4 < time.monotonic() - began < 6
            assert caught.value.host == "w1" and "1.5 s" in str(caught.value)
            assert isinstance(caught.value, TimeoutError)
        finally:
            worker.signal(signal.SIGCONT)
        deadline = time.monotonic() + 10  # it wakes up, and answers the slice nobody awaits
        while worker.log().count("slice ['shout']") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g.forward("c", broker={"w1": w1}) == "C"  # and the next forward reconnects


def test_a_long_computation_outlives_the_timeout_on_heartbeats(standing):
    worker = standing()
    g = Graph.somatize(Sleep(2.5).at("w1"))
    with Worker.at(worker.addr, token=TOKEN, timeout=0.8) as w1:
        assert g.forward("slow", broker={"w1": w1}) == "slow"


def test_the_timeout_comes_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("SOMATIZE_TIMEOUT", "2.5")
    assert Worker.at("127.0.0.1:9", token=TOKEN).timeout == 2.5
    assert Worker.at("127.0.0.1:9", token=TOKEN, timeout=4).timeout == 4.0
    monkeypatch.setenv("SOMATIZE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SOMATIZE_TIMEOUT"):
        Worker.at("127.0.0.1:9")


def test_a_worker_restarted_between_forwards_is_provisioned_again(standing):
    first = standing()
    g = Graph.somatize(Count().at("w1") >> Add(100))
    with Worker.at(first.addr, token=TOKEN) as w1:
        broker = Broker.embedded({"w1": w1})
        assert [g.forward(None, broker=broker) for _ in range(2)] == [101, 102]
        first.signal(signal.SIGKILL)
        first.proc.wait(5)
        second = standing(listen=f"127.0.0.1:{first.port}")
        assert g.forward(None, broker=broker) == 101  # a new process: its count starts over
        assert g.forward(None, broker=broker) == 102
    assert second.wait_log("closed by the client").count("provisioned") == 1


def test_a_node_raising_over_there_names_itself_its_kind_and_the_host(standing):
    worker = standing()
    g = Graph.somatize(Add(1) >> Boom().at("w1"))
    facts = []
    with Worker.at(worker.addr, token=TOKEN) as w1:
        with pytest.raises(NodeError) as caught:
            g.forward(1, broker={"w1": w1}, watching=facts.append)
        error = caught.value
        assert (error.node, error.host, error.kind) == ("boom", "w1", "ValueError")
        assert "boom on 2" in str(error) and "'w1'" in str(error)
        failed = [f for f in facts if f["fact"] == "failed"]
        assert failed and failed[0]["host"] == "w1" and failed[0]["node"] == "boom"
        assert Graph.somatize(Shout().at("w1")).forward("ok", broker={"w1": w1}) == "OK"


def test_one_of_our_errors_over_there_is_the_same_cause_as_here(standing):
    worker = standing()
    g = Graph.somatize(Behind().at("w1"))
    with pytest.raises(NodeError) as here:
        Graph.somatize(Behind()).forward(3)
    with Worker.at(worker.addr, token=TOKEN) as w1, pytest.raises(NodeError) as there:
        g.forward(3, broker={"w1": w1})
    for caught in (here, there):
        assert caught.value.kind == "OutOfStep" and isinstance(caught.value.__cause__, OutOfStep)
        assert "no activation waits for step 3" in str(caught.value.__cause__)
    assert there.value.host == "w1"


def test_a_wrong_token_is_unauthorised_and_the_worker_serves_on(standing):
    worker = standing()
    g = Graph.somatize(Shout().at("w1"))
    with pytest.raises(Unauthorised) as caught:
        g.forward("x", broker={"w1": Worker.at(worker.addr, token="not-the-token")})
    assert caught.value.host == "w1" and worker.addr in str(caught.value)
    with pytest.raises(Unauthorised, match="has none"):
        g.forward("x", broker={"w1": Worker.at(worker.addr)})
    worker.wait_log("wrong token")
    with Worker.at(worker.addr, token=TOKEN) as good:
        assert g.forward("x", broker={"w1": good}) == "X"


def test_a_client_with_a_token_refuses_a_worker_without_one(standing):
    worker = standing(token=None)
    with pytest.raises(Unauthorised, match="does not ask for a token"):
        Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": Worker.at(worker.addr, token=TOKEN)})
    with Worker.at(worker.addr) as open_one:  # both without: loopback, by choice
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": open_one}) == "X"
