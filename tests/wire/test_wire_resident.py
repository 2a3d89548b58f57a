"""A session's own random state on its host (somatize.wire.resident), seen in this
process: a seeded session draws what it would alone whatever other sessions draw in
between, and the client's own generators never see a session's draws."""

import pytest

torch = pytest.importorskip("torch")

import somatize.torch  # noqa: E402,F401  (says how a random state is read and set)
from somatize import Broker, Graph, Node, Opaque, Worker  # noqa: E402


class Draw(Node):
    """Answers four numbers from its process's generator."""

    def forward(self, x, ctx):
        return Opaque(torch.rand(4))


def draws(session, n=3):
    g = Graph.somatize(Draw().named("draw").at("h"))
    return [g.forward(0, broker=session) for _ in range(n)]


def test_a_seeded_session_draws_as_if_alone_and_the_client_draws_its_own():
    with Worker.in_process() as place:
        broker = Broker({"h": place})
        alone = broker.session()
        draws(alone, 1)
        alone.control("h", "seed", {"seed": 9})
        lone = draws(alone)
        torch.manual_seed(1)
        mine_here = [torch.rand(2) for _ in range(3)]

        mine, theirs, plain = broker.session(), broker.session(), broker.session()
        draws(mine, 1)
        mine.control("h", "seed", {"seed": 9})
        draws(theirs, 1)
        theirs.control("h", "seed", {"seed": 5})
        together = []
        for _ in range(3):
            together += draws(mine, 1)
            draws(theirs, 2)  # another seeded session draws in between...
            theirs.control("h", "seed", {"seed": 100})  # ...and seeds its own again
            draws(plain, 1)  # and one that owns no state draws the process's own
        assert all(torch.equal(a, b) for a, b in zip(together, lone))

        torch.manual_seed(1)  # the client's own, while seeded sessions draw meanwhile
        here = []
        for _ in range(3):
            here.append(torch.rand(2))
            draws(mine, 1)
            draws(theirs, 1)
        assert all(torch.equal(a, b) for a, b in zip(here, mine_here))


def test_a_sessions_random_state_is_read_and_set_by_its_verbs():
    with Worker.in_process() as place:
        session = Broker({"h": place}).session()
        draws(session, 1)
        session.control("h", "seed", {"seed": 4})
        kept = session.control("h", "random")
        first = draws(session)
        session.control("h", "set_random", {"state": kept, "host": "h", "check": False})
        assert all(torch.equal(a, b) for a, b in zip(draws(session), first))
