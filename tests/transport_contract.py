"""What every transport promises, as one suite each transport's tests subclass (the way
fsspec's abstract tests are run against every filesystem).

A subclass gives two things: a class-scoped ``place`` fixture (a classmethod: a worker
of its transport, declared with ``mode="network", send=["transport_nodes"]``),
and ``restart(place)``, which makes the host behind it a fresh process (or, in
process, a fresh host), as a restarted worker is. Everything else is the same test
against every transport: slices answer as here, values cross both ways, what cannot
travel stays, failures come back named, sessions keep their own, a lost session is
said, split training is bit for bit the one-piece run, and every verb of a session (what
its owner asks besides a slice) is answered there.
"""

from __future__ import annotations

import pytest
import transport_nodes as nodes

from somatize import (Broker, DeclarationError, Graph, Lost, NodeError, Opaque, StateLost,
                      WireError)


class TransportContract:
    """Subclass it, with a ``place`` fixture and ``restart``."""

    def restart(self, place):  # pragma: no cover  (each transport says how)
        raise NotImplementedError

    # -- slices ---------------------------------------------------------------------
    def test_a_slice_answers_as_here_and_its_facts_name_the_host(self, place):
        g = Graph.somatize(nodes.Twice().named("a") >> nodes.Twice().named("b").at("h"))
        seen = []
        assert g.forward(3, broker={"h": place}, watching=seen.append) == 12
        far = [f for f in seen if f.get("node") == "b" and f["fact"] == "ran"]
        assert far and all(f["host"] == "h" for f in far)
        assert {"sent", "received"} <= {f["fact"] for f in seen if f.get("host") == "h"}

    def test_a_tensor_crosses_both_ways_and_is_its_own_to_write(self, place):
        torch = pytest.importorskip("torch")
        import somatize.torch  # noqa: F401  (the tensor codec)

        g = Graph.somatize(nodes.Twice().named("t").at("h"))
        x = torch.randn(512, 1024)  # 2 MiB: past what any transport keeps inline
        kept = x.clone()
        out = g.forward(Opaque(x), broker={"h": place})
        assert torch.equal(out, kept * 2)
        out += 1  # its own memory: writing it touches nothing else
        assert torch.equal(x, kept) and torch.equal(out, kept * 2 + 1)

    def test_what_cannot_travel_stays_there_and_is_lost_here(self, place):
        inside = Graph.somatize((nodes.Hold().named("hold") >> nodes.Unhold().named("un")).at("h"))
        assert inside.forward("kept", broker={"h": place}) == "kept"
        out = Graph.somatize(nodes.Hold().named("hold").at("h") >> nodes.Unhold().named("un"))
        with pytest.raises(Lost) as caught:
            out.forward("kept", broker={"h": place})
        assert caught.value.node == "hold" and caught.value.host == "h"

    def test_a_node_failing_there_is_a_node_error_with_its_traceback(self, place):
        g = Graph.somatize(nodes.Boom().named("boom").at("h"))
        with pytest.raises(NodeError, match="boom on 7") as caught:
            g.forward(7, broker={"h": place})
        assert caught.value.node == "boom" and caught.value.host == "h"
        assert "ValueError" in str(caught.value.__cause__)

    # -- sessions -------------------------------------------------------------------
    def test_two_graphs_keep_their_own_state_there(self, place):
        a = Graph.somatize(nodes.Count().named("c").at("h"))
        b = Graph.somatize(nodes.Count().named("c").at("h"))  # the same bytes
        said = [g.forward(0, broker={"h": place}) for g in (a, b, a, b, a)]
        assert said == [1, 1, 2, 2, 3]

    def test_work_a_node_leaves_for_afterwards_has_run_before_its_next_slice(self, place):
        g = Graph.somatize(nodes.Later().named("later").at("h"))
        first = g.forward(0, broker={"h": place})  # 0 where the answer went first, 1 if not
        assert [g.forward(0, broker={"h": place}) for _ in range(3)] == [first + 1, first + 2,
                                                                       first + 3]
        failing = Graph.somatize(nodes.Later().named("later").at("h"))
        with pytest.raises(NodeError, match="the work after the answer failed") as caught:
            failing.forward("fail", broker={"h": place})  # here, or in place of the next slice
            failing.forward(0, broker={"h": place})
        assert caught.value.node == "later" and caught.value.host == "h"

    def test_a_session_that_keeps_nothing_takes_another_catalog(self, place):
        session = Broker({"h": place}).session()  # keeps nothing, as a plain graph's
        count = Graph.somatize(nodes.Count().named("c").at("h"))
        twice = Graph.somatize(nodes.Twice().named("t").at("h"))
        assert count.forward(0, broker=session) == 1
        assert twice.forward(3, broker=session) == 6
        assert count.forward(0, broker=session) == 1  # made again from its first copy

    @pytest.mark.parametrize("how, raised", [("exit", "SystemExit"),
                                             ("interrupt", "KeyboardInterrupt")])
    def test_work_left_for_afterwards_that_exits_is_said_and_the_host_serves_on(
            self, place, how, raised):
        g = Graph.somatize(nodes.Later().named("later").at("h"))
        first = g.forward(0, broker={"h": place})
        with pytest.raises(NodeError, match=raised) as caught:
            g.forward(how, broker={"h": place})  # said here, or in place of the next slice
            g.forward(0, broker={"h": place})
        assert caught.value.node == "later" and caught.value.host == "h"
        # the work that exited did not count, and the session serves on
        assert g.forward(0, broker={"h": place}) == first + 1

    def test_a_restart_is_said_to_a_session_that_keeps_state(self, place):
        broker = Broker({"h": place})
        kept, plain = broker.session(keeps=True), broker.session()
        g, h = Graph.somatize(nodes.Count().named("c").at("h")), Graph.somatize(
            nodes.Count().named("c").at("h"))
        assert [g.forward(0, broker=kept), h.forward(0, broker=plain)] == [1, 1]
        self.restart(place)
        with pytest.raises(StateLost) as caught:
            g.forward(0, broker=kept)
        assert caught.value.host == "h" and caught.value.nodes == ["c"]
        assert h.forward(0, broker=plain) == 1  # what kept nothing is made again
        assert g.forward(0, broker=broker.session(keeps=True)) == 1  # a fresh session serves

    # -- training -------------------------------------------------------------------
    @staticmethod
    def _net(torch, host=None, seed=0):
        torch.manual_seed(seed)
        body = nodes.Lin(8, 6).named("body")
        return Graph.somatize(nodes.Lin(8, 8).named("encoder") >> (body.at(host) if host else body)
                              >> nodes.Lin(6, 1, relu=False).named("head"))

    def _split(self, torch, place, **options):
        from somatize.torch import Split, Trainer, parameters

        g = self._net(torch, "h")
        trains = {"body": Split(torch.optim.SGD, lr=0.1)}
        return Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains,
                       broker=Broker.embedded({"h": place}),
                       optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                       **options)

    @staticmethod
    def _batches(torch, n=6):
        generator = torch.Generator().manual_seed(1)
        return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
                for _ in range(n)]

    def test_split_training_there_is_the_one_piece_run_bit_for_bit(self, place):
        torch = pytest.importorskip("torch")
        from somatize.torch import Trainer, parameters

        one = self._net(torch)
        whole = Trainer(one, objective=torch.nn.functional.mse_loss,
                        optimizer=torch.optim.SGD(parameters(one), lr=0.1))
        split = self._split(torch, place)
        data = self._batches(torch)
        assert [whole.step(b) for b in data] == [split.step(b) for b in data]
        far, mine = split.export()["body"], whole.export()["body"]
        assert far.keys() == mine.keys() and all(torch.equal(far[k], mine[k]) for k in far)

    def test_a_pipelined_step_is_the_unpipelined_one_bit_for_bit(self, place):
        torch = pytest.importorskip("torch")
        data = self._batches(torch, 4)
        piped = self._split(torch, place, micro=4, every=2)
        plain = self._split(torch, place, micro=4, every=2, pipeline=False)
        assert [piped.step(b) for b in data] == [plain.step(b) for b in data]
        a, b = piped.export(), plain.export()
        assert all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])

    def test_two_trainers_there_each_train_as_if_alone(self, place):
        torch = pytest.importorskip("torch")
        data = self._batches(torch)
        alone = self._split(torch, place)
        lone = [alone.step(b) for b in data]
        a, b = self._split(torch, place), self._split(torch, place)
        both = [(a.step(x), b.step(x)) for x in data]
        assert [la for la, _ in both] == lone == [lb for _, lb in both]

    # -- verbs ----------------------------------------------------------------------
    def test_a_trainers_verbs_are_answered_where_it_runs(self, place, tmp_path):
        """weights, load, state, restore, random, set_random, seed and shared_order, each
        through the Trainer method that says it, against the run the user means."""
        torch = pytest.importorskip("torch")
        from somatize.torch import Split, Trainer, parameters

        data = self._batches(torch, 4)
        one = self._net(torch)
        whole = Trainer(one, objective=torch.nn.functional.mse_loss,
                        optimizer=torch.optim.SGD(parameters(one), lr=0.1))
        split = self._split(torch, place)
        split.seed(2)  # seed
        assert whole.step(data[0]) == split.step(data[0])
        far = split.export()["body"]  # weights
        assert all(torch.equal(far[k], whole.export()["body"][k]) for k in far)
        split.load(split.export())  # load
        split.checkpoint(tmp_path, "ck")  # state, random
        then = [split.step(b) for b in data[1:]]
        assert then == [whole.step(b) for b in data[1:]]
        assert split.resume(tmp_path, "ck") == 1  # restore, set_random
        assert [split.step(b) for b in data[1:]] == then
        g = self._net(torch, "h")
        shared = Trainer(g, objective=torch.nn.functional.mse_loss,
                         trains={"body": Split(torch.optim.SGD, lr=0.1, shared="contract")},
                         broker=Broker.embedded({"h": place}),
                         optimizer=torch.optim.SGD(parameters(g, without=["body"]), lr=0.1))
        shared.step(data[0])
        told = shared.shared_order("body")  # shared_order
        assert [event for _, event in told["order"]] == ["forward", "gradient", "update"]
        shared.close()

    def test_a_sessions_own_verbs_are_answered_there(self, place):
        """random, seed and mode for any session's nodes; a verb nobody registered, and
        one that fails there, come back named; end lets the session go."""
        torch = pytest.importorskip("torch")
        import somatize.torch  # noqa: F401  (registers the verbs here; the host has them)

        session = Broker({"h": place}).session()
        g = Graph.somatize(nodes.Lin(4, 2).named("lin").at("h"))
        assert g.forward(Opaque(torch.ones(1, 4)), broker=session).shape == (1, 2)
        session.control("h", "seed", {"seed": 5})
        first = session.control("h", "random")
        session.control("h", "seed", {"seed": 5})
        assert torch.equal(session.control("h", "random")["torch"], first["torch"])
        assert session.control("h", "mode", {"train": False}) == ["lin"]
        with pytest.raises(DeclarationError, match="node 'lin' is not trained where it runs"
                                                   r".*on host 'h'"):
            session.control("h", "weights", {"node": "lin"})
        with pytest.raises(WireError, match="answers no verb 'nope'"):
            session.control("h", "nope")
        session.control("h", "end")

    def test_a_verb_to_a_session_the_host_lost_is_state_lost(self, place):
        pytest.importorskip("torch")
        import somatize.torch  # noqa: F401

        kept = Broker({"h": place}).session(keeps=True)
        g = Graph.somatize(nodes.Count().named("c").at("h"))
        assert g.forward(0, broker=kept) == 1
        self.restart(place)
        with pytest.raises(StateLost) as caught:
            kept.control("h", "random")
        assert caught.value.host == "h" and caught.value.nodes == ["c"]
