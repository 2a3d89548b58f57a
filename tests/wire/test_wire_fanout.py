"""A wave over many hosts: every host is sent its slice before any answer is read, the
answers are the right ones, and a host that fails (or dies) is the one named, while the
others' answers are read and their connections stay good."""

import time

import pytest
import wire_helpers  # noqa: F401  (puts wire_nodes on the workers' path)
from wire_nodes import Add, Boom, Sleep

from somatize import Graph, NodeError, WireError, Worker

HOSTS = 4


@pytest.fixture(scope="module")
def workers():
    started = [Worker.generic() for _ in range(HOSTS)]
    yield started
    for worker in started:
        worker.close()


def wave(nodes):
    piece = nodes[0]
    for node in nodes[1:]:
        piece = piece | node
    return Graph.somatize(piece)


def listing(workers, count=HOSTS):
    return {f"w{i}": workers[i] for i in range(count)}


def test_a_wide_wave_answers_each_host_its_own_value(workers):
    g = wave([Add(i).named(f"add{i}").at(f"w{i}") for i in range(HOSTS)])
    assert g.forward(10, broker=listing(workers)) == {f"add{i}": 10 + i for i in range(HOSTS)}


def test_every_host_computes_at_once(workers):
    g = wave([Sleep(0.5).named(f"s{i}").at(f"w{i}") for i in range(HOSTS)])
    g.forward(0, broker=listing(workers))  # connections and catalogs, out of the timing
    began = time.perf_counter()
    assert g.forward(3, broker=listing(workers)) == {f"s{i}": 3 for i in range(HOSTS)}
    assert time.perf_counter() - began < 0.5 * HOSTS - 0.5  # one after another: 2 s


def test_a_failing_host_is_named_and_the_others_stay_good(workers):
    nodes = [Add(i).named(f"add{i}").at(f"w{i}") for i in range(HOSTS)]
    nodes[2] = Boom().named("boom").at("w2")
    with pytest.raises(NodeError, match="host 'w2'") as failed:
        wave(nodes).forward(1, broker=listing(workers))
    assert failed.value.host == "w2"
    g = wave([Add(i).named(f"add{i}").at(f"w{i}") for i in range(HOSTS)])
    assert g.forward(5, broker=listing(workers)) == {f"add{i}": 5 + i for i in range(HOSTS)}


def test_a_host_that_died_is_named_and_the_others_answer_next_time():
    alive = [Worker.generic() for _ in range(3)]
    dead = Worker.generic()
    try:
        everyone = {"w0": alive[0], "w1": dead, "w2": alive[1], "w3": alive[2]}
        g = wave([Add(i).named(f"add{i}").at(f"w{i}") for i in range(HOSTS)])
        assert g.forward(0, broker=everyone) == {f"add{i}": i for i in range(HOSTS)}
        dead._child.kill()
        dead._child.wait(10)
        with pytest.raises(WireError, match="host 'w1'"):
            g.forward(1, broker=everyone)
        rest = wave([Add(i).named(f"add{i}").at(f"w{i}") for i in (0, 2, 3)])
        live = {"w0": alive[0], "w2": alive[1], "w3": alive[2]}
        assert rest.forward(2, broker=live) == {f"add{i}": 2 + i for i in (0, 2, 3)}
    finally:
        for worker in alive + [dead]:
            worker.close()
