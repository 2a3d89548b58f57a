"""A cut that compresses (``Split(..., compress="bf16")``): what crosses it, both ways,
travels in the narrower type, against the same model written in plain torch with the
same four roundings by hand; the bytes that cross a real worker's socket; and the
record saying so."""

import re
import warnings

import pytest
import torch
from splitnets import Lin, Loud, LoudBack

from somatize import Broker, Graph, Worker
from somatize.torch import Split, Trainer, parameters

mse = torch.nn.functional.mse_loss
WIDE = 64  # wide enough that the activations, not the frames' headers, are the bytes


def net(host=None, width=8):
    torch.manual_seed(0)
    body = Lin(width, width).named("body")
    body = body.at(host) if host else body
    return Graph.somatize(Lin(8, width).named("encoder") >> body
                          >> Lin(width, 1, relu=False).named("head"))


def batches(n=8):
    torch.manual_seed(1)
    return [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(n)]


def trainer(g, compress, worker=None, **kw):
    trains = {"body": Split(torch.optim.SGD, lr=0.1, compress=compress)}
    where = {"broker": Broker.embedded({"w": worker})} if worker is not None else {}
    return Trainer(g, objective=mse, trains=trains, **kw, **where,
                   optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))


def by_hand(dtype, data):
    """The model in plain torch, rounding to ``dtype`` exactly where the cut is crossed:
    the activation out, the body's output back, the gradient out, the gradient back."""
    g = net()
    encoder, body, head = (g.implementation(n).lin for n in ("encoder", "body", "head"))
    here = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    there = torch.optim.SGD(body.parameters(), lr=0.1)
    cross = lambda t: t.detach().to(dtype).to(t.dtype)
    losses = []
    for x, y in data:
        here.zero_grad()
        there.zero_grad()
        sent = torch.relu(encoder(x))
        given = cross(sent).requires_grad_()
        made = torch.relu(body(given))
        back = cross(made).requires_grad_()
        loss = mse(head(back), y)
        loss.backward()
        made.backward(cross(back.grad))
        sent.backward(cross(given.grad))
        here.step()
        there.step()
        losses.append(loss.item())
    return losses, [p.detach() for m in (encoder, body, head) for p in m.parameters()]


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["splitnets"]) as w:
        yield w


@pytest.mark.parametrize("compress, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_compressed_cut_rounds_exactly_where_it_is_crossed(worker, compress, dtype):
    data = batches()
    expected, weights = by_hand(dtype, data)
    cut = net("w")
    split = trainer(cut, compress, worker)
    assert [split.step(b) for b in data] == expected
    far = split.export()
    mine = [far[n][k] for n in ("encoder", "body", "head") for k in ("lin.weight", "lin.bias")]
    assert all(torch.equal(a, b) for a, b in zip(mine, weights))
    # and it is not full precision: rounding four tensors a step moves the numbers
    assert expected != by_hand(torch.float32, data)[0]


def test_here_and_there_and_every_schedule_round_alike(worker):
    data = batches()
    here = trainer(net(), "bf16")
    there = trainer(net("w"), "bf16", worker)
    assert [here.step(b) for b in data] == [there.step(b) for b in data]
    piped = trainer(net("w"), "bf16", worker, micro=4, pipeline=True)
    unpiped = trainer(net("w"), "bf16", worker, micro=4, pipeline=False)
    assert [piped.step(b) for b in data] == [unpiped.step(b) for b in data]


def test_compressing_halves_the_bytes_on_the_wire_and_the_record_says_so(worker):
    data = [(x, y) for x, y in batches(4)]
    sent = {}
    for compress in (None, "bf16"):
        facts = []
        split = trainer(net("w", WIDE), compress, worker, watching=facts.append)
        split.step(data[0])  # the catalog goes out with the first step
        before = worker.link.traffic()
        for b in data[1:]:
            split.step(b)
        after = worker.link.traffic()
        sent[compress] = [after[k] - before[k] for k in ("sent", "received")]
        said = [f for f in facts if f.get("fact") == "graph"]
        assert said and said[0].get("compressed") == (
            {"body": "bfloat16"} if compress else None)
    # two tensors of 16 x 64 each way a step, at 4 bytes an element or 2; what a narrowed
    # tensor says of itself (its mark, the type it had) is a few dozen bytes
    for way in (0, 1):
        halved = 3 * 2 * 16 * WIDE * 2
        saved = sent[None][way] - sent["bf16"][way]
        assert halved - 3 * 2 * 64 < saved < halved, (sent, way)
        assert sent["bf16"][way] < 0.6 * sent[None][way], sent


def test_a_cut_only_compresses_what_only_the_trainer_takes():
    """A value the trained node and an untrained one both take goes whole: narrowing it
    would round the input of a node that never asked for it."""
    def first_loss(compress):
        torch.manual_seed(0)
        g = Graph.somatize(Lin(8, 8).named("encoder")
                           >> (Lin(8, 8).named("body") | Lin(8, 8).named("side")))
        trains = {"body": Split(torch.optim.SGD, lr=0.1, compress=compress)}
        t = Trainer(g, objective=lambda out, y: mse(out["side"], y) + 0 * out["body"].sum(),
                    trains=trains, optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
        return t.step((batches(1)[0][0], torch.ones(16, 8)))
    assert first_loss("bf16") == first_loss(None)


def test_compress_names_what_it_takes():
    with pytest.raises(TypeError, match=r"compress=.*'bf16' or 'fp16'.*'int8'"):
        Split(torch.optim.SGD, lr=0.1, compress="int8")
    assert Split(torch.optim.SGD, lr=0.1).seat.compress is None
    assert Split(torch.optim.SGD, lr=0.1, compress=torch.float16).seat.compress is torch.float16


def test_fp16_says_so_when_what_crosses_is_beyond_its_range_and_bf16_carries_it(worker):
    torch.manual_seed(0)
    g = Graph.somatize(Loud(8, 8).named("encoder") >> Lin(8, 8).at("w").named("body")
                       >> Lin(8, 1, relu=False).named("head"))
    with pytest.warns(RuntimeWarning, match=r"given to node 'body' \(on host 'w'\).*beyond "
                      r"float16's range.*compress='bf16'"):
        trainer(g, "fp16", worker).step(batches(1)[0])
    torch.manual_seed(0)
    g = Graph.somatize(Loud(8, 8).named("encoder") >> Lin(8, 8).at("w").named("body")
                       >> Lin(8, 1, relu=False).named("head"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 has float32's range: nothing to say
        trainer(g, "bf16", worker).step(batches(1)[0])


@pytest.mark.parametrize("body, said", [
    (Loud, "the output of node 'body' (on host 'w')"),
    (LoudBack, "the gradient answered by node 'body' (on host 'w')")])
def test_fp16_overflow_where_the_worker_narrows_is_said_here_naming_node_and_host(worker, body,
                                                                                said):
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 8).named("encoder") >> body(8, 8).at("w").named("body")
                       >> Lin(8, 1, relu=False).named("head"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(g, "fp16", worker).step(batches(1)[0])
    told = [w for w in caught if said in str(w.message)]
    assert len(told) == 1 and told[0].category is RuntimeWarning
    assert told[0].filename == __file__  # at the user's own call, not inside somatize
    assert re.search(r"\d+ values of .*beyond float16's range.*compress='bf16'.*compress out",
                     str(told[0].message))


def test_a_narrowed_tensor_naming_no_floating_type_is_refused_not_looked_up():
    from somatize.torch._envelope import NARROWED, widened
    half = torch.ones(2, dtype=torch.bfloat16)
    assert widened({NARROWED: [half, "float32"]}).dtype == torch.float32
    for name in ("load", "int64", 3):
        with pytest.raises(TypeError, match="not a floating torch dtype"):
            widened({NARROWED: [half, name]})
