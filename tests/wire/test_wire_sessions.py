"""Sessions on a worker (somatize.wire.host.SessionsHere, broker.Session): what a client
provisions is its own, side by side with everybody else's; a session that keeps state
is never given its first copy again; what a worker lets go of is said; and a node's
Ctrl-C, a slow slice or many clients at once do not take a worker down."""

import gc
import threading
import time
import weakref

import pytest
from wire_helpers import TOKEN, standing  # noqa: F401  (a fixture)
from wire_nodes import Add, Count, Interrupt, Later, Shout, Sleep

from somatize import Broker, DeclarationError, Graph, NodeError, StateLost, WireError, Worker


def counting(name="count"):
    return Graph.somatize(Count().named(name).at("w"))


def test_two_graphs_on_one_worker_keep_their_own_state(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        a, b = counting(), counting()  # the same bytes, two graphs
        broker = {"w": w}
        assert [a.forward(0, broker=broker), b.forward(0, broker=broker),
                a.forward(0, broker=broker), b.forward(0, broker=broker)] == [1, 1, 2, 2]
    with Worker.at(worker.addr, token=TOKEN) as other:  # another client, the same graph
        assert counting().forward(0, broker={"w": other}) == 1
    with Worker.at(worker.addr, token=TOKEN) as w:
        assert a.forward(0, broker={"w": w}) == 3  # a's session outlived its connection


def test_a_session_that_keeps_state_is_never_provisioned_again(standing):
    worker = standing("--max-sessions", "2")
    with Worker.at(worker.addr, token=TOKEN) as w:
        broker = Broker({"w": w})
        kept = broker.session(keeps=True)
        g = counting()
        assert [g.forward(0, broker=kept) for _ in range(3)] == [1, 2, 3]
        plain = counting()
        assert plain.forward(0, broker=broker) == 1
        # a third session: the one that keeps nothing goes first, and is made again
        counting().forward(0, broker=broker)
        worker.wait_log("to make room")
        assert g.forward(0, broker=kept) == 4
        assert plain.forward(0, broker=broker) == 1
        # once every session held keeps state, the oldest idle one goes, and says so
        for _ in range(2):
            counting().forward(0, broker=broker.session(keeps=True))
        with pytest.raises(StateLost, match="--max-sessions") as caught:
            g.forward(0, broker=kept)
        assert caught.value.host == "w" and caught.value.nodes == ["count"]


def test_a_session_idle_past_the_lease_is_let_go_and_said(standing):
    worker = standing("--session-lease", "0.5")
    with Worker.at(worker.addr, token=TOKEN) as w:
        kept = Broker({"w": w}).session(keeps=True)
        g = counting()
        assert g.forward(0, broker=kept) == 1
        time.sleep(1.0)
        with pytest.raises(StateLost, match="--session-lease"):
            g.forward(0, broker=kept)


def test_another_catalog_for_a_session_with_state_is_refused_and_changes_nothing(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        kept = Broker({"w": w}).session(keeps=True)
        g = counting()
        assert g.forward(0, broker=kept) == 1
        other = Graph.somatize(Count().named("count").at("w") >> Add(1).named("more").at("w"))
        with pytest.raises(DeclarationError, match="keeps one catalog once it has state"):
            other.forward(0, broker=kept)
        assert g.forward(0, broker=kept) == 2  # what it held is as it was


def test_many_clients_at_once_each_get_their_own_answers(standing):
    worker = standing()
    errors, counts = [], {}

    def client(k):
        try:
            with Worker.at(worker.addr, token=TOKEN) as w:
                g = Graph.somatize(Count().named("count").at("w") >> Add(k).named("add").at("w"))
                counts[k] = [g.forward(0, broker={"w": w}) for _ in range(40)]
        except Exception as exc:  # noqa: BLE001  (said below, with the client)
            errors.append((k, exc))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert counts == {k: [n + k for n in range(1, 41)] for k in range(6)}
    assert worker.proc.poll() is None


@pytest.mark.parametrize("kind, raised", [("interrupt", "KeyboardInterrupt"),
                                          ("exit", "SystemExit")])
def test_a_node_that_interrupts_on_a_worker_is_a_node_error_and_the_worker_serves_on(
        standing, kind, raised):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        g = Graph.somatize(Interrupt(kind).named("stop").at("w"))
        with pytest.raises(NodeError, match=raised) as caught:
            g.forward(0, broker={"w": w})
        assert caught.value.node == "stop" and caught.value.host == "w"
        assert "serves on" in str(caught.value)
        assert counting().forward(0, broker={"w": w}) == 1
    assert worker.proc.poll() is None


def test_a_call_past_its_deadline_is_a_wire_error_and_the_worker_serves_on(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN, deadline=0.5) as w:
        slow = Graph.somatize(Sleep(3).named("slow").at("w"))
        began = time.monotonic()
        with pytest.raises(WireError, match=r"slice \['slow'\] did not answer within its "
                                            r"deadline of 0.5 s") as caught:
            slow.forward(0, broker={"w": w})
        assert time.monotonic() - began < 2.5 and caught.value.host == "w"
        assert counting().forward(0, broker={"w": w}) == 1  # a new connection, served
    with pytest.raises(DeclarationError, match="deadline is a positive number"):
        Worker.at(worker.addr, token=TOKEN, deadline=0)


def test_work_a_node_leaves_for_afterwards_runs_after_its_answer_and_before_the_next(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        g, broker = Graph.somatize(Later(1.5).named("later").at("w")), {"w": w}
        began = time.monotonic()
        assert g.forward(0, broker=broker) == 0  # answered before its work ran...
        assert time.monotonic() - began < 1.0
        assert g.forward(0, broker=broker) == 1  # ...which ran before the next slice
        assert time.monotonic() - began >= 1.5
        # the connection serves on: another graph's slice, once this one's work is done
        assert counting().forward(0, broker=broker) == 1


def test_a_client_asking_while_work_left_for_afterwards_runs_hears_heartbeats(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN, timeout=0.6) as w:  # a beat every 0.15 s
        g, broker = Graph.somatize(Later(2.0).named("later").at("w")), {"w": w}
        assert g.forward(0, broker=broker) == 0
        began = time.monotonic()  # past the timeout, the work goes on: the client hears
        assert g.forward(0, broker=broker) == 1  # it is alive, and waits rather than fail
        assert time.monotonic() - began >= 1.5
        time.sleep(2.5)  # idle while the second work runs: no beat may come meanwhile,
        assert g.forward(0, broker=broker) == 2  # or this would find a closing connection
        assert "connection 2 " not in worker.log()  # one connection all along


def test_work_left_for_afterwards_that_fails_is_the_next_slices_error_naming_the_node(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        g, broker = Graph.somatize(Later().named("later").at("w")), {"w": w}
        assert g.forward("fail", broker=broker) == 0  # its answer went before the work failed
        with pytest.raises(NodeError, match=r"node 'later' left work for after its answer "
                                            r"\(Ctx.afterwards\), and it raised ValueError: the "
                                            r"work after the answer failed; the slice after it "
                                            r"did not run") as caught:
            g.forward(0, broker=broker)
        assert caught.value.node == "later" and caught.value.host == "w"
        assert caught.value.kind == "ValueError"
        # said once: the slice refused did not run, and the next ones do
        assert [g.forward(0, broker=broker), g.forward(0, broker=broker)] == [0, 1]
    assert "the work it left for after its answer failed" in worker.wait_log("ValueError")


def test_a_socket_link_counts_the_bytes_each_way(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        assert w.link.traffic() == {"sent": 0, "received": 0}
        g = counting()
        g.forward(0, broker={"w": w})
        first = w.link.traffic()
        assert first["sent"] > 0 and first["received"] > 0
        big = bytes(200_000)
        g.forward(big, broker={"w": w})
        then = w.link.traffic()
        # what was sent grew by at least the value, and the answer came back small
        assert then["sent"] - first["sent"] >= len(big)
        assert then["received"] - first["received"] < 2_000
        assert w.traffic() == then  # the place counts every link it has: here, one
    assert Worker.in_process().link.traffic() is None  # a link that counts nothing says so


def test_a_broker_lets_go_of_a_graph_its_user_let_go_of():
    broker = Broker({"w": Worker.in_process()})  # one broker for the whole run, as a user's
    forms = []
    for text in ("a", "b"):
        g = Graph.somatize(Shout().at("w"))
        assert g.forward(text, broker=broker) == text.upper()
        forms.append(weakref.ref(g.data()))
    del g
    gc.collect()
    # a session per graph, kept as long as the graph lives: the last one included
    assert [form() for form in forms] == [None, None]
    assert Graph.somatize(Shout().at("w")).forward("c", broker=broker) == "C"


def test_a_session_lives_as_long_as_its_owner_not_its_graph(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w:
        broker = Broker({"w": w})
        g = counting()
        sessions = []
        for _ in range(3):  # short-lived sessions, one graph that outlives them all
            session = broker.session()
            assert g.forward(0, broker=session) == 1
            sessions.append(weakref.ref(session))
        del session
        gc.collect()
        assert [s() for s in sessions] == [None, None, None]
        assert g.forward(0, broker=broker.session()) == 1
