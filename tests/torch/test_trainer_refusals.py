"""What the Trainer refuses, when it refuses it, and that a refusal changes nothing."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trainnets import batches, graph, weights

from somatize import CacheError, DeclarationError, Graph, Node, Opaque, Worker
from somatize.torch import Trainer, freeze, parameters

SRC = Path(__file__).resolve().parents[2] / "src"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def unchanged(g, body):
    """Nothing a Trainer makes true was made true."""
    return all(p.requires_grad for p in body.net.parameters()) and all(
        state is None for state in g.frozen().values())


@pytest.mark.parametrize("build", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
])
def test_a_frozen_nodes_parameters_in_the_optimizer_never_move(build):
    g, body, head = graph(body=lambda b: b.frozen())
    before, head_before = weights(body), weights(head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # harmless, so not even a warning
        t = Trainer(g, objective=F.mse_loss, optimizer=build(parameters(g)))
        for batch in batches(5):
            t.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body)))
    assert not all(torch.equal(a, b) for a, b in zip(head_before, weights(head)))


def test_a_node_frozen_by_hand_after_the_optimizer_was_built_stays_put():
    g, body, _ = graph()
    optimizer = torch.optim.SGD(parameters(g), lr=0.1, momentum=0.9)
    t = Trainer(g, objective=F.mse_loss, optimizer=optimizer)
    t.step(batches(1)[0])  # the body has a gradient and momentum now
    freeze(g, "body")
    before = weights(body)
    for batch in batches(3, seed=2):
        Trainer(g, objective=F.mse_loss, optimizer=optimizer).step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body)))


@pytest.mark.parametrize("modifiers, culprit", [
    ((lambda b: b.cached(), lambda h: h), "'body' is .cached\\(\\) but 'body' is itself"),
    ((lambda b: b, lambda h: h.frozen().cached()), "'head' is .cached\\(\\) but 'body' is above"),
])
def test_a_cache_over_something_still_training_is_refused_when_built(modifiers, culprit):
    g, body, _ = graph(body=modifiers[0], head=modifiers[1])
    with pytest.raises(CacheError, match=culprit):
        Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g, without=g.frozen())))
    assert unchanged(g, body)


def test_no_optimizer_while_nodes_have_parameters_is_refused_naming_them():
    g, _, _ = graph()
    with pytest.raises(DeclarationError, match=r"no optimizer.*'body', 'head'"):
        Trainer(g, objective=F.mse_loss)


class Plain(Node):
    def forward(self, x, ctx):
        return Opaque(x * 2)


def test_nothing_to_train_is_refused():
    g = Graph.somatize(Plain() >> Plain())
    with pytest.raises(DeclarationError, match="nothing to train: no optimizer"):
        Trainer(g, objective=F.mse_loss)
    with pytest.raises(DeclarationError, match="nothing to train: the optimizer holds no"):
        Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD([{"params": []}], lr=0.1))


def test_parameters_the_optimizer_leaves_out_are_a_warning_and_training_goes_on():
    g, body, head = graph()
    before, head_before = weights(body), weights(head)
    t = Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g, without=["body"])))
    assert unchanged(g, body)
    with pytest.warns(UserWarning, match=r"node 'body' \(4 parameters\) got gradients.*"
                                         r"freeze\(g, 'body'\)") as said:
        t.step(batches(1)[0])
    assert len([w for w in said if issubclass(w.category, UserWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again at every step
        for batch in batches(3, seed=2):
            t.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(body)))
    assert not all(torch.equal(a, b) for a, b in zip(head_before, weights(head)))


@pytest.mark.parametrize("name, value", [("every", 0), ("every", 1.5), ("every", True),
                                         ("micro", -1), ("micro", "2")])
def test_every_and_micro_are_whole_numbers_from_one(name, value):
    g, _, _ = graph()
    with pytest.raises(DeclarationError, match=f"{name}={value!r}"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)), **{name: value})


def test_an_objective_that_cannot_be_called_is_refused():
    g, _, _ = graph()
    with pytest.raises(DeclarationError, match="objective= is a str"):
        Trainer(g, objective="mse", optimizer=sgd(parameters(g)))


def test_a_host_nobody_said_anything_about_is_refused_when_built_naming_workers():
    g, body, _ = graph(head=lambda h: h.at("gpu"))
    optimizer = sgd(parameters(g, without=["head"]))
    with pytest.raises(DeclarationError, match=r"node 'head' runs on host 'gpu' \(.at\('gpu'\)\)"
                                               r".*Trainer\(..., workers=\{'gpu': Worker.at"):
        Trainer(g, objective=F.mse_loss, optimizer=optimizer)
    assert unchanged(g, body)
    with pytest.raises(DeclarationError, match=r"^workers= is empty, and this graph runs node "
                                               r"'head' on 'gpu'; .*workers=\{'gpu': Worker"):
        Trainer(g, objective=F.mse_loss, optimizer=optimizer, workers={})
    with pytest.raises(DeclarationError, match=r"^workers= says nothing about host 'gpu'"):
        Trainer(g, objective=F.mse_loss, optimizer=optimizer, workers={"cpu": object()})
    assert unchanged(g, body)


def test_a_forward_with_no_broker_names_both_ways_to_say_where_a_host_is():
    g, _, _ = graph(head=lambda h: h.at("gpu"))
    with pytest.raises(DeclarationError, match=r"host 'gpu' and no broker was given.*"
                                               r"forward\(..., broker=.*Trainer\(..., workers="):
        g.forward(Opaque(torch.randn(4, 8)))


class Silent(Node):
    """A head that holds a module but does not say so: parameters(g) cannot see it."""

    def __init__(self):
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, ctx):
        return Opaque(self.out(x))


def test_a_node_without_parameters_is_told_to_say_them_not_to_use_parameters_g():
    g = Graph.somatize(graph()[1].named("body") >> Silent().named("head"))
    t = Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)))  # what the user wrote
    with pytest.warns(UserWarning) as said:
        t.step(batches(1)[0])
    (warning,) = [str(w.message) for w in said if issubclass(w.category, UserWarning)]
    assert "node 'head' (2 parameters) got gradients" in warning
    assert "'head' (Silent) has no parameters() method" in warning
    assert "def parameters(self)" in warning and "build the optimizer over" not in warning


def test_the_wrong_arguments_are_refused_by_type():
    g, _, _ = graph()
    with pytest.raises(TypeError, match="somatize Graph"):
        Trainer(object(), objective=F.mse_loss)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        Trainer(g, objective=F.mse_loss, optimizer=[1])
    with pytest.raises(TypeError, match="watching"):
        Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)), watching=[1])
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)))
    with pytest.raises(TypeError, match="pair"):
        trainer.step(torch.zeros(3, 8))


def test_fit_refuses_an_iterator_for_more_than_one_epoch_before_any_step():
    g, body, _ = graph()
    seen = []
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)), watching=seen.append)
    before = weights(body.net)
    data = batches(3)
    with pytest.raises(TypeError, match="used up by the first epoch"):
        trainer.fit((batch for batch in data), epochs=2)
    assert seen == [] and all(torch.equal(a, b) for a, b in zip(before, weights(body.net)))
    assert len(trainer.fit((batch for batch in data), epochs=1).history) == 3
    with pytest.raises(DeclarationError, match="epochs=0"):
        trainer.fit(data, epochs=0)


def test_no_progress_bar_when_nobody_is_watching_a_terminal(capfd):
    g, _, _ = graph()
    trainer = Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g)))
    trainer.fit(batches(3), epochs=2)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_progress_bar_with_the_loss_on_a_terminal():
    import fcntl
    import pty
    import struct
    import termios

    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(SRC)!r}, {str(Path(__file__).parent)!r}]
        import torch, torch.nn.functional as F
        from somatize.torch import Trainer, parameters
        from trainnets import batches, graph
        g, _, _ = graph()
        t = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
        t.fit(batches(4), epochs=2)
    """)
    leader, follower = pty.openpty()
    # A fresh pseudo-terminal is 0 columns wide, where a bar has no room at all.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=follower, close_fds=True)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the child is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert child.wait(timeout=60) == 0, shown.decode(errors="replace")
    text = shown.decode(errors="replace")
    assert "8/8" in text and "loss=" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_a_node_on_cuda_where_there_is_none_is_warned_of_by_name():
    g, _, _ = graph(body=lambda b: b.on("cuda:0"), head=lambda h: h.at("w"))
    with pytest.warns(UserWarning, match=r"node 'body' is \.on\('cuda:0'\).*sees no CUDA device"
                                         r".*runs on the CPU.*drop \.on") as said:
        Trainer(g, objective=F.mse_loss, optimizer=sgd(parameters(g, without=["head"])),
                workers={"w": Worker.at("127.0.0.1:9")})  # declared: nothing is opened
    assert [str(w.message).split()[1] for w in said if "CUDA" in str(w.message)] == ["'body'"]
    assert said[0].filename == __file__  # the head, on a worker, is the worker's to judge
