"""What the library keeps around a technique where it runs: its Seat.

A technique (``_learning.Learning``) writes ``learn`` and says what it trains and with
which optimizer; everything else a trainer does is the library's, and lives here, one
Seat per Learning, made with it and pickled with it:

- the activation ledger: each forward's leaf and activation, kept until its gradient
  comes (oldest first, for a pipelined step), and let go of when it does;
- the group: how many ``learn`` calls make one update (``every``, the Trainer's
  ``micro``), where the open one stands, and the optimizer, built at first use over
  the parameters that are *there*;
- sharing: the shared trainer it joined on its host (``_shared``), and its own open
  group of gradients, off the node between its turns;
- the audit of its node where the Audit cannot reach, compression of what crosses its
  cut, and eval mode (``Trainer.predict``), where its forwards hold nothing.

The Trainer's driver, the host and the verbs talk to a trainer through its Seat
(``Learning.seat``); a technique reads its step through the Learning's few methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import torch

from .._errors import DeclarationError, OutOfStep
from .._node import Ctx, Opaque
from ._envelope import (
    HEALTH,
    KEY,
    MOST_OWED,
    behind,
    carries,
    closing,
    envelope,
    gradient,
    narrowed,
    widened,
)
from ._tensors import detached, leafed, tensors_in

__all__ = ["Seat", "shared_by"]

# What starts the trainer several clients share (``_shared.Shared``), registered by
# somatize.torch like the answers are: a trainer knows only that it may be shared.
_STARTS: list[Callable[..., Any]] = []


def shared_by(start: Callable[..., Any]) -> None:
    """Has ``start(key, seat, node_id, lock, patience)`` make the trainer that clients
    naming ``key`` share on a host, when the first of them arrives (``Seat.share_on``)."""
    _STARTS[:] = [start]


class Seat:
    """The library's side of one trainer: see the module's docstring. ``learning`` is
    the technique it seats; ``factory`` builds its optimizer; ``every``, ``shared`` and
    ``compress`` are as the technique was declared with them (checked there)."""

    # Read by a rebuilt object before anything sets them (pickle skips __init__).
    node: Any = None  # the node it trains; None until told (``Learning.of``)
    _built: Any = None
    _every: int | None = None
    _held: Any = None
    _given: Any = None
    _taken = 0
    _closing = False
    _owed: Any = None  # [given, held] of every forward still owed a gradient, oldest first
    _audit: Any = None  # an Audit of the node, watched by hand where it runs
    _audited_as = ""
    _pieces = 1  # learn calls that make one of the Trainer's steps (its micro)
    _micro = 1  # the same, as the Trainer said it when it set the steps per update
    _piece = 0
    _group: Any = None  # the Shared it joined on the host it runs on (_shared)
    _label = ""  # its session, as the shared trainer's order names it
    _grads: Any = None  # shared: its own open group's gradients, off the node between steps
    _forgotten: str | None = None  # why its activations were let go of, if they were
    _narrows_out = False  # whether what it makes crosses a cut (the driver says)
    _crossed = False  # whether its input came across a cut narrowed (its gradient goes back so)
    _evaluating = False  # a predict or evaluate is under way: its forwards hold nothing

    def __init__(self, learning: Any, factory: Callable[..., Any], *, every: int | None,
                 shared: str | None, compress: torch.dtype | None):
        self.learning, self.factory = learning, factory
        self._every = every
        self.shared = shared  # the key it shares its node and optimizer under, if any
        self.compress = compress  # the narrower type what crosses its cut travels in, if any

    # -- being put together ----------------------------------------------------------
    def crossing(self, out: bool) -> Seat:
        """Says whether what it makes crosses a cut (nothing beside it takes it where
        it runs), and so goes narrowed when it compresses; the driver knows, it does not."""
        self._narrows_out = bool(out) and self.compress is not None
        return self

    def evaluating(self, on: bool) -> Seat:
        """Says whether what runs through it now is evaluated (``Trainer.predict``):
        then its forwards keep no activation and owe nothing, so a step's state is as
        it was, and what the node makes goes on as it came (``_predicting`` has the
        node's parameters ask for no gradient meanwhile, so no autograd graph is built)."""
        self._evaluating = bool(on)
        return self

    def audited(self, audit: Any, node_id: str, pieces: int = 1) -> Seat:
        """Measures the node it trains with ``audit`` (fresh, unwatched), wherever it
        runs; the health facts ride back on the envelopes it answers."""
        self._audit, self._audited_as, self._pieces = audit, node_id, pieces
        return self

    def accumulating(self, every: int | None, micro: int = 1) -> Seat:
        """How many steps go into one update, unless its technique said already, and
        how many of those (``micro`` pieces) make one of the Trainer's steps."""
        if self._every is None:
            self._every = every
        self._micro = micro
        return self

    @property
    def every(self) -> int | None:
        """The steps per update its technique or its Trainer said; None before either."""
        return self._every

    def steps_per_update(self) -> int:
        """How many ``learn`` calls make one update of its optimizer."""
        return self._every or 1

    def cadence(self) -> Fraction:
        """How many of the Trainer's steps make one update: the update's rhythm as the
        user wrote it, whatever pieces each step is cut into."""
        return Fraction(self.steps_per_update(), self._micro)

    # -- the optimizer ---------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """Its optimizer, built the first time it is asked for, over what is here. A
        shared trainer's is its session's turn at the one optimizer."""
        if self._built is None:
            self._built = (self.fresh_optimizer() if self._group is None
                           else self._group.turn(self._label))
        return self._built

    @property
    def built(self) -> Any:
        """Its optimizer if it has been built, else None; asking builds nothing. A
        shared trainer's is the one optimizer its clients share."""
        return self._built if self._group is None else self._group.built

    def fresh_optimizer(self) -> Any:
        """An optimizer built as its own would be, over what its technique trains here,
        and kept by nobody: what a kept state is checked against, changing nothing."""
        return self.factory(self.learning.training())

    # -- this step, as its technique reads it ------------------------------------------
    def opens(self) -> bool:
        """Whether this step starts a group: gradients are cleared, not added to."""
        return self._taken == 0

    def closes(self) -> bool:
        """Whether this step ends a group: the optimizer moves."""
        return self._closing or self._taken + 1 >= (self._every or 1)

    def waiting(self) -> Any:
        """This step's activation; OutOfStep when there is none, which means the two
        halves are a step apart (a worker that restarted, a backward without forward)."""
        if self._held is None:
            raise OutOfStep(
                f"a gradient arrived for {type(self.node).__qualname__}, whose activation "
                "is not here: " + (self._forgotten or "the forward that made it ran elsewhere "
                                   "or before a restart") + "; start the step again"
            )
        return self._held

    @property
    def held(self) -> Any:
        """This step's activation, what the node produced; None between steps."""
        return self._held

    @property
    def given(self) -> Any:
        """The leaf this step's input became; None between steps."""
        return self._given

    def done(self) -> Any:
        """Lets go of this step's activation and answers what the node was given."""
        given = self._given
        self._held = self._given = None
        return given

    def steps_later(self) -> bool:
        """Whether a technique may step its optimizer after its answer has gone
        (``Ctx.afterwards``): not where the step must be seen first — an Audit measures
        the update it made, and a shared trainer steps among its clients' gradients."""
        return self._audit is None and self._group is None

    # -- what a checkpoint keeps of it, and sets again (_checkpoint) ----------------
    @property
    def standing(self) -> tuple[int, int]:
        """Where its group stands: the steps taken into it, and the ``learn`` calls
        into the Trainer's step (its pieces, which an Audit counts)."""
        return self._taken, self._piece

    def stand(self, taken: int, piece: int, *, rebuilt: bool = False) -> None:
        """Puts its group where a kept ``standing`` says; ``rebuilt`` lets go of its
        optimizer, to be built afresh at first use as it was then. A group further
        along than one update is refused: nothing could close it."""
        every = self.steps_per_update()
        if not 0 <= taken < every:
            raise DeclarationError(f"{type(self.learning).__qualname__} makes one update every "
                                   f"{every} steps, so no group of it stands {taken} steps in; "
                                   "give a standing it answered")
        if rebuilt:
            self._built = None
        self._taken, self._piece = taken, piece

    def answering(self) -> Any:
        """Its own open group of gradients on its node while a verb reads or restores
        them (a shared trainer's; one that shares nothing has no other's to keep off)."""
        return self._own_gradients()

    # -- shared with other clients on purpose (_shared) -----------------------------
    def share_on(self, sharing: Any, nodes: Mapping[str, Any], session: str) -> dict[str, Any] | None:
        """Joins the shared trainer of its key on the host installing its catalog (the
        host calls this, through the position in front, with what it shares,
        ``sharing``, the catalog's nodes and the session's name), starting it if it is
        the first; answers the nodes to put in the catalog instead: the shared node,
        where this catalog has its own copy. A trainer the shared one is not alike to
        is refused (DeclarationError), with nothing changed. None for a trainer not
        asked to share: its session then never waits for anybody else's."""
        if self.shared is None:
            return None
        me = next((n for n, impl in nodes.items() if impl is self.learning), "?")
        group = sharing.table.get(self.shared)
        if group is None:
            if not _STARTS:
                raise DeclarationError(
                    f"node {me!r} is trained shared={self.shared!r}, and nothing in this "
                    "process starts a shared trainer; import somatize.torch on the worker")
            group = sharing.table[self.shared] = _STARTS[0](self.shared, self, me, sharing.lock,
                                                            sharing.patience)
        else:
            group.admit(self, me)
        mine = self.node
        group.join(session, self)
        self._group, self._label, self.node, self._built = group, session, group.node, None
        return {n: group.node for n, impl in nodes.items() if impl is mine and impl is not group.node}

    def unshare(self) -> None:
        """Its session was let go on its host: it owes the shared trainer nothing."""
        if self._group is not None:
            self._group.leave(self._label)

    @property
    def group(self) -> Any:
        """The shared trainer it joined where it runs (``_shared.Shared``), or None."""
        return self._group

    @property
    def label(self) -> str:
        """Its session, as its shared trainer's order names it ("" until it joined)."""
        return self._label

    def in_flight(self) -> bool:
        """Whether a forward of its still waits for its gradient."""
        return bool(self._owed)

    def forget(self, why: str) -> None:
        """Lets go of every activation still owed a gradient, and says why to the
        gradient that comes for one later."""
        if self._owed:
            self._owed.clear()
        self._held = self._given = None
        self._forgotten = why

    # -- the two positions ------------------------------------------------------------
    def entering(self, value: Any, ctx: Ctx) -> Any:
        """In front of the node: the input as a leaf, remembered. Walked back, what
        arrives is passed on to whoever fed the node."""
        if carries(value):
            return value
        if self._evaluating:  # nothing will be walked back: no leaf, nothing remembered
            value = widened(value)
            if isinstance(value, torch.Tensor):
                return Opaque(value.detach())
            return Opaque(detached(value)) if tensors_in(value) else value
        arrived = value
        value = widened(value)
        self._crossed = value is not arrived
        if self._group is not None:
            self._group.enters(self._label, self)
        self._forgotten = None
        if self._audit is not None and self._piece == 0:
            if not self._audit.watching:
                self._audit.by_hand(self._audited_as, self.node)
            self._audit.begin()
        if isinstance(value, torch.Tensor):
            value = value.detach().requires_grad_(value.is_floating_point()
                                                  or value.is_complex())
        else:  # tuples, lists and dicts of them: each floating tensor a leaf of its own
            value = leafed(value)
        self._given = value
        if self._owed is None:
            self._owed = []
        self._owed.append([value, None])
        if len(self._owed) > MOST_OWED:  # failed steps' leftovers, never asked for
            del self._owed[0]
        return Opaque(value) if isinstance(value, torch.Tensor) or tensors_in(value) else value

    def forward(self, value: Any, ctx: Ctx) -> Any:
        """Behind the node: an ordinary value is the activation to keep (what goes on is
        detached); an envelope is dL/d(that activation), for its technique to learn from."""
        if carries(value):
            return self._learn_from(value, ctx)
        if self._evaluating:  # kept by nobody: what it made is all that goes on
            return self._passed_on(value)
        self._held = value
        if self._owed:
            self._owed[-1][1] = value
        if self._group is not None:
            self._group.log(self._label, "forward")
        if self._audit is not None:
            self._audit.saw(value)
        return self._passed_on(value)

    def _passed_on(self, value: Any) -> Any:
        """What goes on from behind the node: what it made, detached (narrowed where it
        crosses a cut that compresses)."""
        if not isinstance(value, torch.Tensor):
            # a structure's tensors go on detached too: the cut is here, whatever its shape
            return Opaque(detached(value)) if tensors_in(value) else value
        return Opaque(narrowed(value, self.compress) if self._narrows_out else value.detach())

    def _owed_to(self, back: int) -> None:
        """Makes the forward ``back`` before the newest this step's, letting go of it
        and of every older one (a failed step's); none at all when there is none."""
        owed = self._owed or []
        at = len(owed) - 1 - back
        if 0 <= at < len(owed):
            self._given, self._held = owed[at]
            del owed[:at + 1]
        else:
            self._given = self._held = None
            owed.clear()

    def _learn_from(self, value: Any, ctx: Ctx) -> Any:
        back, closes, signal = behind(value), closing(value), gradient(value, ctx.device)
        # what trainers below this one said: one envelope (a chain's), or a map of them
        health = list(value.get(HEALTH, ())) if KEY in value else \
            [f for v in value.values() for f in v.get(HEALTH, ())]
        self._owed_to(back)
        self._closing = closes
        stepped = self._held is not None or signal is not None  # not update()'s message
        if self._group is not None and stepped:
            self._group.log(self._label, "gradient")
        if self._group is None:
            answer = self.learning.learn(signal, ctx)
        else:
            with self._own_gradients():
                answer = self.learning.learn(signal, ctx)
        ended = self.closes()
        self._taken = 0 if ended else self._taken + 1
        self._closing = False
        if self._crossed:  # the gradient goes back the way the input came
            answer = narrowed(answer, self.compress)
        said = envelope(answer, closing=closes, behind=back)
        if self._audit is not None and stepped:
            self._piece += 1
            if self._piece >= self._pieces:
                self._piece = 0
                health += self._audit.observed(updated=ended)
        if health:
            said[HEALTH] = health
        return said

    @contextlib.contextmanager
    def _own_gradients(self):
        """A shared trainer's own open group of gradients on the node while it learns
        or answers, and off it after, so no other client's adds to it. (A trainer that
        shares nothing learns without it: a generator made and walked every step.)"""
        group = self._group
        if group is None:
            yield
            return
        group.lend(self._grads)
        try:
            yield
        finally:
            self._grads = group.take()
            group.drain()
