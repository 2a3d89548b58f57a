"""The Trainer's two drivers: one interface, chosen once, and the one-piece driver is
the hand-written loop (the staged one is held to it in test_split*.py)."""

import inspect

import torch
import torch.nn.functional as F
from trainnets import batches, graph

from somatize.torch import Split, Trainer, parameters
from somatize.torch._one_piece import InOnePiece
from somatize.torch._staged import StagedDriver


def _calls(cls):
    return {name: inspect.signature(member) for name, member in vars(cls).items()
            if not name.startswith("_") and callable(member)}


def test_the_staged_driver_answers_every_call_of_the_one_piece_driver_alike():
    one, staged = _calls(InOnePiece), _calls(StagedDriver)
    missing = sorted(set(one) - set(staged))
    assert not missing, f"StagedDriver lacks {missing}"
    for name, signature in one.items():  # the same parameters, by name, in order
        assert list(signature.parameters) == list(staged[name].parameters), name


def test_a_trainer_picks_its_driver_once_by_what_it_trains_where_it_runs():
    g, _, _ = graph(seed=0)
    whole = Trainer(g, objective=F.mse_loss, optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    assert type(whole._driver) is InOnePiece and whole._driver.trains == {}
    g, _, _ = graph(seed=0)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    cut = Trainer(g, objective=F.mse_loss, trains=trains,
                  optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1))
    assert type(cut._driver) is StagedDriver and set(cut._driver.trains) == {"body"}
    for driver in (whole._driver, cut._driver):  # what both hold, besides their calls
        assert driver.health == [] and driver.privacy is None


def test_in_one_piece_a_step_is_the_hand_written_loop_and_update_moves_nothing_more():
    g, body, head = graph(seed=0)
    _, hand_body, hand_head = graph(seed=0)
    trainer = Trainer(g, objective=F.mse_loss, every=2,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05))
    by_hand = torch.optim.SGD([*hand_body.net.parameters(), *hand_head.out.parameters()],
                              lr=0.05)
    data = batches(3)
    by_hand.zero_grad()
    theirs = []
    for k, (x, y) in enumerate(data):
        loss = F.mse_loss(hand_head.out(hand_body.net(x)), y)
        (loss / 2).backward()
        theirs.append(loss.item())
        if k % 2 == 1:
            by_hand.step()
            by_hand.zero_grad()
    by_hand.step()  # the open group, as update() applies it
    ours = [trainer.step(b) for b in data]
    assert trainer.update() and not trainer.update()
    assert ours == theirs
    mine = [*body.net.parameters(), *head.out.parameters()]
    hand = [*hand_body.net.parameters(), *hand_head.out.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, hand))
