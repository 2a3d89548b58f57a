"""The Learning hole: what trains one node, on the machine that node runs on.

A trainer stands in two positions around the node it trains (``beside``): in front,
where it turns the input into a leaf a gradient can be asked of (``entering``), and
behind, under the node's own id, where it keeps the activation and lets go of it —
what goes on is detached, which is what makes the node's output a cut. Walked back
(``somatize._transpose``), the position behind is handed an envelope holding
dL/d(what the node produced); ``learn`` does what the technique does with it and
answers dL/d(what the node was given), which the position in front passes on.

A technique's author writes ``learn``, and may say what it trains (``training``) and
with which optimizer; what the library does around it — the activation ledger, the
group of steps one update makes, sharing, the audit, compression — is its ``seat``
(``_seat.Seat``), made with it, so the class a technique subclasses stays small and
a technique reads its step through a few methods of its own. What crosses its cut
travels in the forms of ``_envelope``.

Everything here is rebuilt on another machine by pickle, which never calls
``__init__``: what a rebuilt object reads before being told is a class attribute,
and the optimizer is built at first use over the parameters that are *there*.

What a trainer's owner asks of it besides a step
(export and load, a checkpoint kept or taken up) is a verb of its session on its host
(``somatize._verbs``), answered by the module whose feature it is, so a trainer, and
so a technique, knows nothing of exports or checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import OutOfStep, whole_number
from .._node import Ctx, Node
from ._envelope import narrowing
from ._seat import Seat
from ._tensors import gradients_of, paired

__all__ = ["Enters", "Learning", "Split"]


class Learning:
    """What trains one node where it runs. A technique writes ``learn`` and nothing else.

    ``Learning(optimizer, every=None, shared=None, compress=None, **how)``:
    ``optimizer`` is a factory (a class such as ``torch.optim.SGD``) called with
    ``training()`` and ``**how`` the first time it is needed, wherever this object ended
    up. ``every`` is how many steps make one update; a technique that names it wins over
    the Trainer's. ``shared`` is a key: every client whose trainer names it on the same
    host trains one node there, with one optimizer (``somatize.torch._shared``); the
    first to arrive brings the weights. Left out, a trainer is its Trainer's alone.
    ``compress`` ('bf16' or 'fp16') sends the floating tensors that cross the node's cut,
    both ways, in that type: half the bytes, and the rounding that comes with them.

    It stands in the graph in both of its positions (``beside``), which is why it
    answers ``entering`` and ``forward``; its ``seat`` does what they do.
    """

    _soma_position = True
    _seat: Seat | None = None  # set by __init__; a rebuilt object has its own in its state

    def __init__(self, optimizer: Callable[..., Any], *, every: int | None = None,
                 shared: str | None = None, compress: Any = None, **how: Any):
        if not callable(optimizer):
            raise TypeError(f"{type(self).__qualname__} takes an optimizer factory such as "
                            f"torch.optim.SGD, not a {type(optimizer).__qualname__}")
        if every is not None:
            whole_number(every, "every", of=type(self).__qualname__)
        if shared is not None and (type(shared) is not str or not shared):
            raise TypeError(f"{type(self).__qualname__}(shared=...) is the key clients train "
                            f"one trainer under, a non-empty str, not {shared!r}")
        self._seat = Seat(self, functools.partial(optimizer, **how), every=every, shared=shared,
                          compress=narrowing(compress, type(self).__qualname__))

    @property
    def seat(self) -> Seat:
        """What the library keeps around this technique where it runs (``_seat``): the
        node it trains, its activations, its group, sharing, audit and compression."""
        return self._seat

    # -- being put together ----------------------------------------------------------
    def of(self, node: Any) -> Learning:
        """Says which node this trains; only whoever has both can say it."""
        self._seat.node = node
        return self

    def beside(self) -> tuple[Enters, Learning]:
        """Its two positions: the one that leafs the input, and itself."""
        return Enters(self), self

    def accumulating(self, every: int | None, micro: int = 1) -> Learning:
        """How many steps go into one update, unless this technique said already, and
        how many of those (``micro`` pieces) make one of the Trainer's steps."""
        self._seat.accumulating(every, micro)
        return self

    # -- what a technique reads -----------------------------------------------------
    def training(self) -> list[torch.nn.Parameter]:
        """The parameters it updates: the node's (and a technique's own, if it adds them)."""
        node = self._seat.node
        if node is None:
            raise OutOfStep(f"{type(self).__qualname__} was never told which node it trains (of())")
        return list(node.parameters())

    @property
    def optimizer(self) -> Any:
        """Its optimizer, built the first time it is asked for, over what is here. A
        shared trainer's is its session's turn at the one optimizer."""
        return self._seat.optimizer

    def opens(self) -> bool:
        """Whether this step starts a group: gradients are cleared, not added to."""
        return self._seat.opens()

    def closes(self) -> bool:
        """Whether this step ends a group: the optimizer moves."""
        return self._seat.closes()

    def waiting(self) -> Any:
        """This step's activation; OutOfStep when there is none, which means the two
        halves are a step apart (a worker that restarted, a backward without forward)."""
        return self._seat.waiting()

    @property
    def held(self) -> Any:
        """This step's activation, what the node produced; None between steps."""
        return self._seat.held

    @property
    def given(self) -> Any:
        """The leaf this step's input became, so a gradient can be read off it; None
        between steps."""
        return self._seat.given

    def done(self) -> Any:
        """Lets go of this step's activation and answers what the node was given, so a
        gradient can be read off it. Every ``learn`` ends here."""
        return self._seat.done()

    # -- the two positions ------------------------------------------------------------
    def entering(self, value: Any, ctx: Ctx) -> Any:
        """In front of the node: the input as a leaf, remembered. Walked back, what
        arrives is passed on to whoever fed the node."""
        return self._seat.entering(value, ctx)

    def forward(self, value: Any, ctx: Ctx) -> Any:
        """Behind the node: an ordinary value is the activation to keep (what goes on is
        detached); an envelope is dL/d(that activation), to learn from."""
        return self._seat.forward(value, ctx)

    def learn(self, signal: torch.Tensor | None, ctx: Ctx) -> Any:
        """Handed dL/d(what the node produced) — None when nobody owes it anything this
        step — answers dL/d(what it was given), or None. The hole a technique fills.
        Where the node produced (or was given) a tuple, list or dict of tensors, the
        gradient has that shape, None where no gradient belongs (``_tensors.paired``
        pairs it with the tensors it is for; ``gradients_of`` reads one off ``given``)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not say how it learns")

    def __repr__(self) -> str:
        seat = self._seat
        node = seat.node if seat is not None else None
        trains = type(node).__qualname__ if node is not None else "nothing yet"
        every = seat.every if seat is not None else None
        return f"{type(self).__qualname__}(trains {trains}, every={every})"


class Enters(Node):
    """The position in front of a trained node: its Learning's ``entering``. The host
    installing a catalog asks it, as it asks every node that has one, to ``share_on``
    (its Learning's seat joins a shared trainer there) and, when the session goes, to
    ``unshare``."""

    _soma_position = True
    learning: Learning | None = None

    def __init__(self, learning: Learning):
        self.learning = learning

    def forward(self, value: Any, ctx: Ctx) -> Any:
        return self.learning.entering(value, ctx)

    def share_on(self, sharing: Any, nodes: Mapping[str, Any], session: str) -> dict[str, Any] | None:
        return self.learning.seat.share_on(sharing, nodes, session)

    def unshare(self) -> None:
        self.learning.seat.unshare()


class Split(Learning):
    """Split learning: the chain rule carried on from the seam's gradient, a step, and
    the input's gradient handed back. A group of several steps takes the same three
    movements apart: cleared where it opens, added to in between, stepped where it
    closes.

    The input's gradient is all the other side waits for, so on a worker the step comes
    after the answer (``Ctx.afterwards``), while the client walks its own half back.
    Not where the step must be seen before the answer goes: an Audit reads the update
    it made, and a shared trainer steps among its clients' gradients."""

    _cleared = False  # the gradients were cleared after the last step, for the next group

    def learn(self, signal: torch.Tensor | None, ctx: Ctx) -> Any:
        optimizer = self.optimizer
        if self.opens() and not self._cleared:
            optimizer.zero_grad()
        self._cleared = False
        if signal is not None:
            held = self.waiting()
            if isinstance(held, torch.Tensor):
                held.backward(signal)
            else:  # a structure: each of its tensors that asks for a gradient, at once
                tensors, grads = paired(held, signal)
                if tensors:
                    torch.autograd.backward(tensors, grads)
        given = self.done()
        if self.closes():
            if self.seat.steps_later():
                ctx.afterwards(self._step)
            else:
                optimizer.step()
        if isinstance(given, torch.Tensor):
            return given.grad
        return gradients_of(given)

    def _step(self) -> None:
        """The step that closes a group, and the clearing that the next one opens with,
        both after the answer: a group that closes is always followed by one that opens."""
        optimizer = self.optimizer
        optimizer.step()
        optimizer.zero_grad()
        self._cleared = True
