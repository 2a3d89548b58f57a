"""What crosses a cut may be a structure: tuples, lists and dicts of tensors, with
plain data beside them. Split across a real worker process, each floating tensor
gets its gradient back and an integer one none, and training is bit for bit the
model trained in one piece."""

import importlib.util

import pytest
import torch
from structnets import Blocks, Decoder, Embed, Encoder, LMHead, Masked, MaskedHead

from somatize import Graph, Worker
from somatize.torch import Split, Trainer, parameters
from somatize.torch._tensors import gradients_of, leafed, paired, summed

mse = torch.nn.functional.mse_loss


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["structnets"]) as w:
        yield w


def weights(g, nodes):
    return [p.detach().clone() for n in nodes for p in g.implementation(n).parameters()]


def same_export(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained_both_ways(net, data, worker, far, objective=mse, optimizer=torch.optim.SGD,
                      host="gpu", **how):
    """The losses of ``net()`` trained in one piece by a plain Trainer, and split with
    ``far`` trained by Split on the worker (here, with ``host=None``); then both
    Trainers and both graphs."""
    one = net(None)
    whole = Trainer(one, objective=objective, optimizer=optimizer(parameters(one), **how))
    cut = net(host)
    trains = {far: Split(optimizer, **how)}
    split = Trainer(cut, objective=objective, trains=trains,
                    workers={"gpu": worker} if host else None,
                    optimizer=optimizer(parameters(cut, without=trains), **how))
    return [whole.step(b) for b in data], [split.step(b) for b in data], whole, split, one, cut


def test_a_structures_gradient_has_its_shape_and_none_for_integers():
    h = torch.randn(3, 2)
    crossing = leafed({"pair": (h, (h > 0).long()), "rows": 3})
    hidden, mask = crossing["pair"]
    assert hidden.requires_grad and hidden.is_leaf and not mask.requires_grad
    (hidden * mask).sum().backward()
    grad = gradients_of(crossing)
    assert torch.equal(grad["pair"][0], mask.float()) and grad["pair"][1] is None
    assert grad["rows"] is None
    assert gradients_of(leafed((h, 1))) is None  # nothing reached it: owed nothing
    tensors, grads = paired(crossing, summed(grad, grad))
    assert tensors == [hidden] and torch.equal(grads[0], 2 * mask.float())


@pytest.mark.parametrize("shape", ["tuple", "list", "dict"])
def test_a_mask_beside_the_activation_out_of_a_worker_trains_the_encoder_above(worker, shape):
    def net(host):
        torch.manual_seed(0)
        body = Masked(8, 6, shape).named("body")
        return Graph.somatize(Encoder(8, 8).named("encoder") >> (body.at(host) if host else body)
                              >> MaskedHead(6, 1).named("head"))

    torch.manual_seed(1)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(6)]
    ours, theirs, whole, split, one, cut = trained_both_ways(net, data, worker, "body",
                                                   optimizer=torch.optim.Adam, lr=0.05)
    assert ours == theirs
    here = ["encoder", "head"]
    assert all(torch.equal(a, b) for a, b in zip(weights(one, here),
                                                 weights(cut, here)))
    assert same_export(whole.export()["body"], split.export()["body"])
    # the encoder above the cut learnt (it got the gradient of the activation)
    assert not torch.equal(weights(net(None), ["encoder"])[0], weights(cut, ["encoder"])[0])


@pytest.mark.parametrize("host", ["gpu", None])
def test_a_decoder_on_a_worker_hands_each_of_its_two_inputs_its_gradient(worker, host):
    def net(host):
        torch.manual_seed(0)
        decoder = Decoder(8).named("decoder")
        return Graph.somatize((Encoder(5, 8, pick=0).named("encoder") | Encoder(3, 8, pick=1).named("embed"))
                              >> (decoder.at(host) if host else decoder)
                              >> Encoder(8, 2).named("head"))

    torch.manual_seed(2)
    data = [((torch.randn(16, 5), torch.randn(16, 3)), torch.randn(16, 2)) for _ in range(6)]
    ours, theirs, whole, split, one, cut = trained_both_ways(net, data, worker, "decoder", host=host,
                                                   lr=0.1)
    assert ours == theirs
    here = ["encoder", "embed", "head"]
    assert all(torch.equal(a, b) for a, b in zip(weights(one, here),
                                                 weights(cut, here)))
    assert same_export(whole.export()["decoder"], split.export()["decoder"])
    first = net(None)
    for node in ("encoder", "embed"):  # both producers learnt from the decoder's gradient
        assert not torch.equal(weights(first, [node])[0], weights(cut, [node])[0])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install transformers)")
def test_gpt2s_blocks_on_a_worker_train_as_the_model_in_one_piece(worker):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, attn_implementation="eager")

    def net(host):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)  # random weights: nothing is downloaded
        blocks = Blocks(model).named("blocks")
        return Graph.somatize(Embed(model).named("embed") >> (blocks.at(host) if host else blocks)
                              >> LMHead(model).named("head"))

    def next_token(logits, target):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50),
                                                 target[:, 1:].reshape(-1), ignore_index=-100)

    torch.manual_seed(3)
    data = []
    for _ in range(4):
        ids = torch.randint(0, 50, (4, 12))
        mask = torch.ones_like(ids)
        mask[0, 9:] = 0  # one padded row: its padding is masked out and not learnt from
        data.append(((ids, mask), ids.masked_fill(mask == 0, -100)))
    ours, theirs, whole, split, one, cut = trained_both_ways(net, data, worker, "blocks",
                                                   objective=next_token,
                                                   optimizer=torch.optim.Adam, lr=1e-3)
    assert ours == theirs and ours[-1] < ours[0]
    here = ["embed", "head"]
    assert all(torch.equal(a, b) for a, b in zip(weights(one, here),
                                                 weights(cut, here)))
    assert same_export(whole.export()["blocks"], split.export()["blocks"])
