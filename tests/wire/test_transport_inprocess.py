"""The in-process transport (somatize.wire.inprocess) passes the transport contract:
the smallest transport there is, and the example ``docs/concepts.md`` adds."""

import time

import pytest
from transport_contract import TransportContract

from somatize import Graph, WireError, Worker


class TestInProcess(TransportContract):
    @pytest.fixture(scope="class")
    @classmethod
    def place(cls):
        with Worker.in_process(send=["transport_nodes"]) as place:
            yield place

    def restart(self, place):
        place.restart()


def test_a_call_past_its_deadline_is_a_wire_error_and_the_host_serves_on():
    import transport_nodes as nodes

    from somatize import Node

    class Slow(Node):
        def forward(self, x, ctx):
            time.sleep(1.0)
            return x

    place = Worker.in_process(deadline=0.3)
    began = time.monotonic()
    with pytest.raises(WireError, match="within its deadline of 0.3 s"):
        Graph.somatize(Slow().named("slow").at("h")).forward(1, broker={"h": place})
    assert time.monotonic() - began < 0.9
    time.sleep(1.0)  # the slow slice goes on to its end; the host then serves on
    assert Graph.somatize(nodes.Twice().at("h")).forward(2, broker={"h": place}) == 4


def test_work_left_for_afterwards_runs_within_the_slice_in_process():
    import transport_nodes as nodes

    with Worker.in_process(send=["transport_nodes"]) as place:
        g = Graph.somatize(nodes.Later().named("later").at("h"))
        assert [g.forward(0, broker={"h": place}), g.forward(0, broker={"h": place})] == [1, 2]
