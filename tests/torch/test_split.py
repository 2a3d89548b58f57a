"""Split training, here: bit for bit against the same net trained in one piece."""

import threading
from dataclasses import fields, replace

import pytest
import torch
from splitnets import Lin  # the node the split tests share

from somatize import CacheError, DeclarationError, Graph, Node, Opaque
from somatize._graph import DECLARATIONS, GraphData
from somatize.torch import Learning, NoGradient, Split, Trainer, parameters
from somatize.torch._staged import rewired

mse = torch.nn.functional.mse_loss


def net(seed=0, with_encoder=False):
    torch.manual_seed(seed)
    parts = [Lin(8, 8).named("encoder")] if with_encoder else []
    parts += [Lin(8, 6).named("body"), Lin(6, 1, relu=False).named("head")]
    piece = parts[0]
    for p in parts[1:]:
        piece = piece >> p
    return Graph.somatize(piece)


def batches(n=10, rows=16, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(rows, 8), torch.randn(rows, 1)) for _ in range(n)]


def weights(g):
    return [p.detach().clone() for n in g.nodes() for p in g.implementation(n).parameters()]


def whole(g, every=1, micro=1):
    return Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                   every=every, micro=micro)


def split(g, every=1, micro=1, **kw):
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    return Trainer(g, objective=mse, every=every, micro=micro, trains=trains,
                   optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1), **kw)


@pytest.mark.parametrize("every,micro", [(1, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("with_encoder", [False, True])
def test_split_equals_one_piece_bit_for_bit(every, micro, with_encoder):
    one, cut = net(with_encoder=with_encoder), net(with_encoder=with_encoder)
    assert all(torch.equal(a, b) for a, b in zip(weights(one), weights(cut)))
    a, b = whole(one, every, micro), split(cut, every, micro)
    losses_a = [a.step(batch) for batch in batches()]
    losses_b = [b.step(batch) for batch in batches()]
    assert losses_a == losses_b
    assert all(torch.equal(x, y) for x, y in zip(weights(one), weights(cut)))
    # ...and it trained: the encoder above the cut moved too
    assert not all(torch.equal(x, y) for x, y in zip(weights(net(with_encoder=with_encoder)),
                                                     weights(cut)))


def test_update_across_a_cut_closes_the_trainers_group_too():
    one, cut = net(), net()
    a, b = whole(one, every=4), split(cut, every=4)
    for batch in batches(6):
        a.step(batch)
        b.step(batch)
    assert a.update() and b.update()
    assert not b.update()
    assert all(torch.equal(x, y) for x, y in zip(weights(one), weights(cut)))


def test_the_graph_is_the_same_graph_after_training():
    g = net(with_encoder=True)
    g.place("head", "cpu")
    before = (g.nodes(), g.edges(), repr(g.plan()), g.devices(), g.hosts())
    t = split(g)
    for batch in batches(2):
        t.step(batch)
    assert (g.nodes(), g.edges(), repr(g.plan()), g.devices(), g.hosts()) == before


def test_facts_make_one_forward_per_step():
    seen = []
    t = split(net(), watching=seen.append)
    t.step(batches(1)[0])
    said = [(f["fact"], f.get("node"), f.get("backward", False)) for f in seen]
    assert said[0][0] == "graph" and seen[0]["graph"]["nodes"] == ["body", "head"]
    said = said[1:]
    assert said[0][0] == "began" and ("finished", None, False) in said
    # the record speaks of the user's graph: body ran (not body:computes), then its
    # trainer walked back through it; the positions' own passes are not nodes
    assert [s for s in said if s[0] == "ran"] == [
        ("ran", "body", False), ("ran", "head", False), ("ran", "body", True)]
    assert [f for f, *_ in said].count("began") == 1
    assert said[-2:] == [("updated", None, False), ("loss", None, False)]


def test_everything_trained_elsewhere_takes_no_optimizer():
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 1, relu=False).named("body"))
    t = Trainer(g, objective=mse, trains={"body": Split(torch.optim.SGD, lr=0.1)})
    before = weights(g)
    losses = [t.step(batch) for batch in batches(5)]
    assert losses[-1] < losses[0] and not torch.equal(before[0], weights(g)[0])


def test_with_nothing_handed_back_the_far_half_stays_where_it_was():
    class Deaf(Split):  # the control: the seam's gradient never arrives
        def learn(self, signal, ctx):
            return super().learn(None, ctx)

    g = net()
    before = [p.detach().clone() for p in g.implementation("body").parameters()]
    trains = {"body": Deaf(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    for batch in batches(5):
        t.step(batch)
    after = g.implementation("body").parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_above_a_trainer_that_hands_nothing_back_gets_no_gradient():
    class Silent(Split):
        def learn(self, signal, ctx):
            super().learn(signal, ctx)
            return None

    g = net(with_encoder=True)
    trains = {"body": Silent(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    with pytest.raises(NoGradient, match="'encoder'"):
        t.step(batches(1)[0])


def test_a_users_id_that_reads_like_a_position_stays_the_users():
    """The trainer's positions beside ``body`` are made ids, not ``body:in`` and
    ``body:computes``: nodes the user called so train beside it as any others would."""
    def beside(seed=0):
        torch.manual_seed(seed)
        return Graph.somatize(Lin(8, 8).named("body:in") >> Lin(8, 6).named("body")
                              >> Lin(6, 1, relu=False).named("body:computes"))

    one, cut = beside(), beside()
    a, b = whole(one), split(cut)
    assert [a.step(x) for x in batches()] == [b.step(x) for x in batches()]
    assert all(torch.equal(x, y) for x, y in zip(weights(one), weights(cut)))
    assert cut.nodes() == ["body:in", "body", "body:computes"]


# -- refusals when the Trainer is built ----------------------------------------------------
def test_the_same_weights_in_two_optimizers_are_refused():
    g = net()
    with pytest.raises(DeclarationError, match="updated twice.*parameters\\(g, without=trains\\)"):
        Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                trains={"body": Split(torch.optim.SGD, lr=0.1)})


def test_trains_naming_nobody_frozen_trained_and_silent_nodes_are_refused():
    g = net()
    opt = torch.optim.SGD(parameters(g, without=["body"]), lr=0.1)
    with pytest.raises(DeclarationError, match="'nobody', which is not a node"):
        Trainer(g, objective=mse, optimizer=opt, trains={"nobody": Split(torch.optim.SGD)})
    g.freeze("body")
    with pytest.raises(DeclarationError, match="frozen and trained"):
        Trainer(g, objective=mse, optimizer=opt, trains={"body": Split(torch.optim.SGD)})

    class Mute(Node):
        def forward(self, x, ctx):
            return x

    g = Graph.somatize(Mute().named("mute") >> Lin(8, 1).named("head"))
    with pytest.raises(DeclarationError, match="does not say what its parameters are"):
        Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                trains={"mute": Split(torch.optim.SGD)})
    with pytest.raises(TypeError, match="is a str"):
        Trainer(g, objective=mse, optimizer=torch.optim.SGD(parameters(g), lr=0.1),
                trains={"head": "split"})


def test_cached_after_a_cut_is_refused(tmp_path):
    class Fixed(Node):  # nothing to train: a cache over it is honest on its own
        def forward(self, x, ctx):
            return Opaque(x * 2)

    class Join(Node):
        def forward(self, x, ctx):
            return Opaque(x["body"].sum(1, keepdim=True) + x["kept"].sum(1, keepdim=True))

    torch.manual_seed(0)
    far = Fixed().named("far").at("w1") >> Fixed().named("kept").cached()
    g = Graph.somatize((Lin(8, 6).named("body") | far) >> Join())
    with pytest.raises(CacheError, match="'kept' is .cached\\(\\) after a cut"):
        Trainer(g, objective=mse, trains={"body": Split(torch.optim.SGD)}, store=tmp_path)


class AsThePageSays(Learning):
    """Split learning written from the reference page: through held and given."""

    def learn(self, signal, ctx):
        if self.opens():
            self.optimizer.zero_grad()
        if signal is not None:
            self.held.backward(signal)
        given = self.given
        self.done()
        if self.closes():
            self.optimizer.step()
        return given.grad


def test_a_technique_written_with_held_and_given_works_as_written():
    one, two = net(), net()
    a = {"body": Split(torch.optim.SGD, lr=0.1)}
    b = {"body": AsThePageSays(torch.optim.SGD, lr=0.1)}
    ta = Trainer(one, objective=mse, trains=a,
                 optimizer=torch.optim.SGD(parameters(one, without=a), lr=0.1))
    tb = Trainer(two, objective=mse, trains=b,
                 optimizer=torch.optim.SGD(parameters(two, without=b), lr=0.1))
    assert [ta.step(x) for x in batches()] == [tb.step(x) for x in batches()]
    assert all(torch.equal(p, q) for p, q in zip(weights(one), weights(two)))


def test_load_of_an_export_continues_bit_for_bit_with_a_trainer_here():
    g = net(with_encoder=True)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, objective=mse, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    data = batches(8)
    for x in data[:4]:
        t.step(x)
    taken = t.export()
    first = [t.step(x) for x in data[4:]]
    t.load(taken)
    assert [t.step(x) for x in data[4:]] == first


class Locked(Node):
    """Built with something that cannot be written down, so it cannot be kept honestly."""

    def __init__(self, lock):
        self.lock = lock

    def forward(self, x, ctx):
        return Opaque(x * 2)


def test_a_cached_node_that_cannot_be_written_down_is_refused_under_split_training(tmp_path):
    torch.manual_seed(0)
    g = Graph.somatize(Locked(threading.Lock()).named("a").cached() >> Lin(8, 6).named("body")
                       >> Lin(6, 1, relu=False).named("head"))
    t = split(g, store=tmp_path)
    with pytest.raises(CacheError, match="'a' is .cached\\(\\) but it was built with a lock"):
        t.step(batches(1)[0])


def test_every_declaration_of_a_graph_survives_rewiring():
    """Whatever ``GraphData`` declares, read off its fields so that one added later is
    held to this too, is carried to the rewired copy: on an untrained node as it was,
    and on a trained one at least under the user's id."""
    torch.manual_seed(0)
    data = Graph.somatize(Lin(8, 6).named("body") >> Lin(6, 1).named("head")).data()
    said = {}
    for field in fields(GraphData):
        if field.name in DECLARATIONS:
            members = {"body", "head"}
            said[field.name] = (frozenset(members) if isinstance(field.default, frozenset)
                                else {n: f"{field.name} of {n}" for n in members})
    data = replace(data, **said)
    private, _ = rewired(data, {"body": Split(torch.optim.SGD)})
    assert set(DECLARATIONS) == {f.name for f in fields(GraphData)} - {"ids", "impls", "edges",
                                                                          "memo"}
    for name, table in said.items():
        carried = getattr(private, name)
        for n in ("body", "head"):
            assert n in carried, f"rewired drops {name!r} of {n!r}"
            if isinstance(table, dict):
                assert carried[n] == table[n]


def test_a_value_taken_by_a_trainer_and_by_an_output_made_here_trains_bit_for_bit():
    """The encoder feeds the trained body and an untrained output beside it: its graph
    is walked back once, with both gradients (twice would be an autograd error)."""
    def branched():
        torch.manual_seed(0)
        return Graph.somatize(Lin(8, 8).named("encoder")
                              >> (Lin(8, 1).named("body") | Lin(8, 1).named("side")))
    both = lambda out, y: mse(out["body"], y) + mse(out["side"], y)
    one, cut = branched(), branched()
    a = Trainer(one, objective=both, optimizer=torch.optim.SGD(parameters(one), lr=0.1))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    b = Trainer(cut, objective=both, trains=trains,
                optimizer=torch.optim.SGD(parameters(cut, without=trains), lr=0.1))
    assert [a.step(batch) for batch in batches()] == [b.step(batch) for batch in batches()]
    assert all(torch.equal(x, y) for x, y in zip(weights(one), weights(cut)))
