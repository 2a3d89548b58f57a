"""Three more techniques in the Learning hole, each written here as a user would,
each with the control that says it is real (seed 001's table)."""

import warnings

import pytest
import torch
from splitnets import Lin  # the node the split tests share

from somatize import Graph
from somatize.torch import Learning, NoGradient, Trainer, freeze, parameters

mse = torch.nn.functional.mse_loss


# -- local greedy: the node learns to reconstruct its input; nothing crosses back ---------
class Greedy(Learning):
    def __init__(self, width_in, width_out, **how):
        super().__init__(torch.optim.Adam, lr=1e-2, **how)
        self.decoder = torch.nn.Linear(width_out, width_in)
        self.losses = []

    def training(self):
        return super().training() + list(self.decoder.parameters())

    def learn(self, signal, ctx):
        held, given = self.waiting(), self.done()
        loss = mse(self.decoder(held), given.detach())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        return None


def greedy_graph():
    torch.manual_seed(0)
    return Graph.somatize(Lin(8, 8).named("encoder") >> Lin(8, 4).named("body")
                          >> Lin(4, 1, relu=False).named("head"))


def batches(n, rows=32, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(rows, 8), torch.randn(rows, 1)) for _ in range(n)]


def test_local_greedy_learns_its_own_objective():
    g = greedy_graph()
    freeze(g, "encoder")
    trains = {"body": Greedy(8, 4)}
    t = Trainer(g, objective=mse, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=["body", "encoder"]), lr=0.1))
    for batch in batches(60):
        t.step(batch)
    losses = trains["body"].losses
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


def test_what_no_gradient_reaches_by_construction_is_not_warned_about():
    g = greedy_graph()
    trains = {"body": Greedy(8, 4)}
    encoder = [p.detach().clone() for p in g.implementation("encoder").parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = Trainer(g, objective=mse, trains=trains,
                    optimizer=torch.optim.SGD(parameters(g, without=["body", "encoder"]), lr=0.1))
        for batch in batches(5):
            t.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(encoder, g.implementation("encoder").parameters()))


def test_local_greedy_gives_nothing_above_it_and_no_gradient_names_it():
    g = greedy_graph()
    trains = {"body": Greedy(8, 4)}
    t = Trainer(g, objective=mse, trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    with pytest.raises(NoGradient, match="'encoder'"):
        t.step(batches(1)[0])


# -- forward-forward: goodness high on positive data, low on negative -------------------
class ForwardForward(Learning):
    threshold = 2.0

    def learn(self, signal, ctx):
        held = self.waiting()
        self.done()
        goodness = held.pow(2).mean(1)
        half = len(goodness) // 2
        loss = (torch.nn.functional.softplus(self.threshold - goodness[:half]).mean()
                + torch.nn.functional.softplus(goodness[half:] - self.threshold).mean())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return None


def contrast(rows=64, seed=0):
    """Half positive (one pattern), half negative (another), in one batch."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.linspace(-1, 1, 8)
    noise = 0.3 * torch.randn(rows, 8, generator=generator)
    x = torch.cat([pattern + noise[: rows // 2], -pattern + noise[rows // 2:]])
    return x, torch.zeros(rows, 1)


def separation(body):
    x, _ = contrast(seed=99)
    with torch.no_grad():
        goodness = body.lin(x).relu().pow(2).mean(1)
    return (goodness[:32].mean() - goodness[32:].mean()).item()


@pytest.mark.parametrize("rate", [0.05, 0.0])
def test_forward_forward_separates_only_when_it_learns(rate):
    torch.manual_seed(0)
    body = Lin(8, 16)
    g = Graph.somatize(body.named("body"))
    before = separation(body)
    t = Trainer(g, objective=lambda out, y: out.sum() * 0.0,
                trains={"body": ForwardForward(torch.optim.SGD, lr=rate)})
    for step in range(150):
        t.step(contrast(seed=step))
    after = separation(body)
    if rate:
        assert after > 1.0 and after > before + 0.5
    else:
        assert after == before


# -- synthetic gradients: the node learns from a guess; the guess learns the truth -------
class Synthetic(Learning):
    """The node learns from a guess of its gradient; the guesser, from the truth."""

    def __init__(self, width, *, frozen_guesser=False, **how):
        super().__init__(torch.optim.SGD, lr=0.01, **how)
        self.guesser = torch.nn.Linear(width, width)
        torch.nn.init.zeros_(self.guesser.weight)  # a guess of nothing, to start with
        torch.nn.init.zeros_(self.guesser.bias)
        self.guesser.requires_grad_(not frozen_guesser)
        self.frozen_guesser = frozen_guesser
        self.improving = None
        self.errors = []

    def learn(self, signal, ctx):
        held = self.waiting()
        guess = self.guesser(held.detach())
        self.optimizer.zero_grad()
        held.backward(guess.detach())
        given = self.done()
        self.optimizer.step()
        if signal is not None:
            self.errors.append(((guess.detach() - signal).norm() / signal.norm()).item())
            if not self.frozen_guesser:
                if self.improving is None:
                    self.improving = torch.optim.Adam(self.guesser.parameters(), lr=1e-3)
                self.improving.zero_grad()
                torch.nn.functional.mse_loss(guess, signal).backward()
                self.improving.step()
        return given.grad


def synthetic_run(frozen_guesser):
    """An objective whose seam gradient is a function of the activation (drive the
    output to zero), so that a guesser that sees only the activation can learn it."""
    torch.manual_seed(0)
    g = Graph.somatize(Lin(8, 6, relu=False).named("body") >> Lin(6, 1, relu=False).named("head"))
    trains = {"body": Synthetic(6, frozen_guesser=frozen_guesser)}
    t = Trainer(g, objective=lambda out, y: out.pow(2).mean(), trains=trains,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.01))
    torch.manual_seed(3)
    for _ in range(200):
        x = torch.randn(32, 8)
        t.step((x, None))
    return trains["body"].errors


def test_synthetic_gradients_get_closer():
    errors = synthetic_run(frozen_guesser=False)
    assert errors[0] == 1.0  # a guess of nothing, at first
    assert sum(errors[-20:]) / 20 < 0.25 * sum(errors[:20]) / 20


def test_with_the_guesser_frozen_at_zero_the_error_is_exactly_one():
    errors = synthetic_run(frozen_guesser=True)
    assert len(errors) == 200 and all(e == 1.0 for e in errors)
