"""The Learning hole: what trains one node, on the machine that node runs on.

A trainer stands in two positions around the node it trains (``beside``): in front,
where it turns the input into a leaf a gradient can be asked of (``entering``), and
behind, under the node's own id, where it keeps the activation and lets go of it —
what goes on is detached, which is what makes the node's output a cut. Walked back
(``somatize._transpose``), the position behind is handed an envelope holding
dL/d(what the node produced); ``learn`` does what the technique does with it and
answers dL/d(what the node was given), which the position in front passes on.

Everything here is rebuilt on another machine by pickle, which never calls
``__init__``: what a rebuilt object reads before being told is a class attribute,
and the optimizer is built at first use over the parameters that are *there*.

An envelope is one reserved key, ``__soma_envelope__``, holding ``[gradient or None,
closing]``: a dict, so it is data and crosses an edge and a wire as any value does,
and telling one from an input is one dict lookup. A pipelined step (``_pipeline``)
runs several forwards before the first gradient comes back, so a trainer keeps every
activation still owed a gradient, oldest first, and an envelope may carry a third
item, ``behind``: how many forwards ran after the one it is for (none, the newest,
unless said). Older ones are a failed step's leftovers and are let go of.

A trainer may be told to ``compress`` what crosses its cut: the activation it is given
and the gradient it answers, what it makes and the gradient it is handed, each sent in
a narrower floating type (bf16 or fp16) and widened back on arrival to the type it had.
A narrowed tensor travels as ``{"__soma_narrowed__": [tensor, "float32"]}``, so the
side that receives it tells it from a value by one dict lookup, as an envelope is told.
Where narrowing to float16 made infinities of finite values, a third item says how
many (``overflowed``): the side that narrowed may be a worker, whose warnings nobody
reads, so the Trainer's driver warns its user wherever the overflow happened.
Both ends round the same way whether the node runs here or on a worker, so a run here
and the same run there stay ``==``; against full precision they differ by the rounding,
which is why it is never on unless asked for.

Nothing else travels that way: what a trainer's owner asks of it besides a step
(export and load, a checkpoint kept or taken up) is a verb of its session on its host
(``somatize._verbs``), answered by the module whose feature it is, so a trainer, and
so a technique, knows nothing of exports or checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import torch

from .._errors import DeclarationError, OutOfStep, whole_number
from .._node import Ctx, Node, Opaque
from ._tensors import detached, gradients_of, leafed, moved, paired, summed, tensors_in

__all__ = ["Enters", "Learning", "Split", "carries", "envelope", "gradient",
           "is_envelope", "narrowed", "narrowing", "overflowed", "widened"]

KEY = "__soma_envelope__"
HEALTH = "__soma_health__"  # beside an envelope: the health facts of the trainers it passed
MOST_OWED = 256  # forwards a trainer keeps waiting for their gradient; a pipeline runs fewer
RESERVED = "__soma_"  # how every key somatize itself puts in a value begins
NARROWED = "__soma_narrowed__"  # a tensor sent in a narrower type, and the type it had
# What compress= takes, by name or as the torch dtype itself.
_NARROWER = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}

# What starts the trainer several clients share (``_shared.Shared``), registered by
# somatize.torch like the answers are: a trainer knows only that it may be shared.
_STARTS: list[Callable[..., Any]] = []


def shared_by(start: Callable[..., Any]) -> None:
    """Has ``start(key, learning, node_id, lock)`` make the trainer that clients naming
    ``key`` share on a host, when the first of them arrives (see ``share_on``)."""
    _STARTS[:] = [start]


def narrowing(compress: Any, of: str = "Learning") -> torch.dtype | None:
    """The floating type ``compress=`` names (None for None); anything else is refused,
    naming what is taken."""
    if compress is None:
        return None
    try:
        return _NARROWER[compress]
    except (KeyError, TypeError):
        raise TypeError(f"{of}(compress=...) sends what crosses the cut in a narrower type: "
                        f"'bf16' or 'fp16' (or torch.bfloat16, torch.float16), not "
                        f"{compress!r}") from None


def narrowed(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` as it crosses a cut that compresses to ``dtype``: a floating tensor
    wider than ``dtype`` goes narrowed, marked with the type it had (and how many of its
    finite values became inf, if any did); anything else (a tensor already as narrow,
    integers, None) goes as it is."""
    if (dtype is None or not isinstance(value, torch.Tensor) or not value.is_floating_point()
            or value.element_size() <= dtype.itemsize):
        return value
    narrow = value.detach().to(dtype)
    carried = [Opaque(narrow), str(value.dtype).removeprefix("torch.")]
    # float16 ends at 65504 and what lies beyond becomes inf; a finite sum says none did,
    # in one cheap pass (an infinite one may be the sum's own overflow, so count)
    if dtype is torch.float16 and not math.isfinite(narrow.sum().item()):
        lost = int((torch.isinf(narrow) & torch.isfinite(value.detach())).sum())
        if lost:
            carried.append(lost)
    return {NARROWED: carried}


def overflowed(value: Any) -> int:
    """How many finite values became inf where ``value`` (what ``narrowed`` made, or an
    envelope carrying it) was narrowed to float16; 0 for anything else."""
    if type(value) is dict and KEY in value:
        value = value[KEY][0]
        value = value.value if type(value) is Opaque else value
    if type(value) is not dict or NARROWED not in value:
        return 0
    carried = value[NARROWED]
    lost = carried[2] if isinstance(carried, (list, tuple)) and len(carried) > 2 else 0
    return lost if type(lost) is int else 0  # a count, or nothing said


def widened(value: Any) -> Any:
    """What ``narrowed`` sent, back in the type it had; any other value as it is."""
    if type(value) is not dict or NARROWED not in value:
        return value
    carried, name = value[NARROWED][:2]
    tensor = carried.value if type(carried) is Opaque else carried
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"a narrowed tensor names {name!r} as the type it had, which is not "
                        "a floating torch dtype; both ends must run the same somatize")
    return tensor.to(dtype)


def envelope(gradient: Any, closing: bool = False, behind: int = 0) -> dict[str, Any]:
    """A gradient in its envelope, the way one crosses an edge. ``closing`` says this
    one ends a group of accumulated steps, so whoever accumulates applies what it has;
    ``behind`` says how many forwards ran after the one this gradient is for."""
    carried = [None if gradient is None else Opaque(gradient), bool(closing)]
    if behind:
        carried.append(int(behind))
    return {KEY: carried}


def behind(value: Any) -> int:
    """How many forwards ran after the one an envelope (or a map of them) is for."""
    if type(value) is not dict:
        return 0
    if KEY in value:  # one envelope, the common case: read at once
        carried = value[KEY]
        return int(carried[2]) if len(carried) > 2 else 0
    for one in value.values():
        if is_envelope(one) and len(one[KEY]) > 2:
            return int(one[KEY][2])
    return 0


def is_envelope(value: Any) -> bool:
    return type(value) is dict and KEY in value


def carries(value: Any) -> bool:
    """Whether a value is a backward message: an envelope, or a map of them."""
    return type(value) is dict and (KEY in value or (
        bool(value) and all(type(v) is dict and KEY in v for v in value.values())))


def _inside(value: Any) -> Any:
    carried = value[KEY][0]
    return widened(carried.value if type(carried) is Opaque else carried)


def gradient(value: Any, device: str | torch.device | None = None) -> torch.Tensor | None:
    """What an envelope carries, or the sum of what a map of them carries, as a tensor
    on ``device`` (a structure's gradient: tensors on ``device`` in its shape). None for a value that is not a backward message at all, and for an
    envelope (or a map of them) carrying nothing."""
    if type(value) is dict and KEY in value:  # one envelope, the common case: read at once
        return moved(_inside(value), device)
    if not carries(value):
        return None
    carried = [_inside(value)] if KEY in value else [_inside(v) for v in value.values()]
    total = None
    for g in carried:
        if g is None:
            continue
        if device is not None:
            g = moved(g, device)
        total = g if total is None else summed(total, g)
    return total


def closing(value: Any) -> bool:
    """Whether any envelope in ``value`` closes a group."""
    if is_envelope(value):
        return bool(value[KEY][1])
    if type(value) is dict:
        return any(is_envelope(v) and v[KEY][1] for v in value.values())
    return False


class Learning(Node):
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
    """

    _soma_position = True
    # Read by a rebuilt object before anything sets them (pickle skips __init__).
    _factory: Callable[..., Any] | None = None
    _every: int | None = None
    _node: Any = None
    _held: Any = None
    _given: Any = None
    _built: Any = None
    _taken = 0
    _closing = False
    _owed: Any = None  # [given, held] of every forward still owed a gradient, oldest first
    _audit: Any = None  # an Audit of the node, watched by hand where it runs
    _audited_as = ""
    _pieces = 1  # learn calls that make one of the Trainer's steps (its micro)
    _micro = 1  # the same, as the Trainer said it when it set the steps per update
    _piece = 0
    _shared: str | None = None  # the key it shares its node and optimizer under, if any
    _group: Any = None  # the Shared it joined on the host it runs on (_shared)
    _label = ""  # its session, as the shared trainer's order names it
    _grads: Any = None  # shared: its own open group's gradients, off the node between steps
    _forgotten: str | None = None  # why its activations were let go of, if they were
    _compress: Any = None  # the narrower type what crosses its cut travels in, if any
    _narrows_out = False  # whether what it makes crosses a cut (the driver says)
    _crossed = False  # whether its input came across a cut narrowed (its gradient goes back so)
    _evaluating = False  # a predict or evaluate is under way: its forwards hold nothing

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
        self._compress = narrowing(compress, type(self).__qualname__)
        self._factory = functools.partial(optimizer, **how)
        self._every = every
        self._shared = shared

    # -- being put together ----------------------------------------------------------
    def of(self, node: Any) -> Learning:
        """Says which node this trains; only whoever has both can say it."""
        self._node = node
        return self

    def beside(self) -> tuple[Enters, Learning]:
        """Its two positions: the one that leafs the input, and itself."""
        return Enters(self), self

    @property
    def compress(self) -> torch.dtype | None:
        """The narrower type what crosses its cut travels in, or None: full precision."""
        return self._compress

    def crossing(self, out: bool) -> Learning:
        """Says whether what it makes crosses a cut (nothing beside it takes it where
        it runs), and so goes narrowed when it compresses; the driver knows, it does not."""
        self._narrows_out = bool(out) and self._compress is not None
        return self

    def evaluating(self, on: bool) -> Learning:
        """Says whether what runs through it now is evaluated (``Trainer.predict``):
        then its forwards keep no activation and owe nothing, so a step's state is as
        it was, and what the node makes goes on as it came (``_predicting`` has the
        node's parameters ask for no gradient meanwhile, so no autograd graph is built)."""
        self._evaluating = bool(on)
        return self

    def audited(self, audit: Any, node_id: str, pieces: int = 1) -> Learning:
        """Measures the node it trains with ``audit`` (fresh, unwatched), wherever it
        runs; the health facts ride back on the envelopes it answers."""
        self._audit, self._audited_as, self._pieces = audit, node_id, pieces
        return self

    def accumulating(self, every: int | None, micro: int = 1) -> Learning:
        """How many steps go into one update, unless this technique said already, and
        how many of those (``micro`` pieces) make one of the Trainer's steps."""
        if self._every is None:
            self._every = every
        self._micro = micro
        return self

    def steps_per_update(self) -> int:
        """How many ``learn`` calls make one update of its optimizer."""
        return self._every or 1

    def cadence(self) -> Fraction:
        """How many of the Trainer's steps make one update: the update's rhythm as the
        user wrote it, whatever pieces each step is cut into."""
        return Fraction(self.steps_per_update(), self._micro)

    # -- what a technique reads -----------------------------------------------------
    def training(self) -> list[torch.nn.Parameter]:
        """The parameters it updates: the node's (and a technique's own, if it adds them)."""
        if self._node is None:
            raise OutOfStep(f"{type(self).__qualname__} was never told which node it trains (of())")
        return list(self._node.parameters())

    @property
    def optimizer(self) -> Any:
        """Its optimizer, built the first time it is asked for, over what is here. A
        shared trainer's is its session's turn at the one optimizer."""
        if self._built is None:
            self._built = (self._factory(self.training()) if self._group is None
                           else self._group.turn(self._label))
        return self._built

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
                f"a gradient arrived for {type(self._node).__qualname__}, whose activation "
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
        """The leaf this step's input became, so a gradient can be read off it; None
        between steps."""
        return self._given

    def done(self) -> Any:
        """Lets go of this step's activation and answers what the node was given, so a
        gradient can be read off it. Every ``learn`` ends here."""
        given = self._given
        self._held = self._given = None
        return given

    # -- what a checkpoint keeps of it, and sets again (_checkpoint) ----------------
    @property
    def node(self) -> Any:
        """The node it trains; None until told (``of``)."""
        return self._node

    @property
    def built(self) -> Any:
        """Its optimizer if it has been built, else None; asking builds nothing. A
        shared trainer's is the one optimizer its clients share."""
        return self._built if self._group is None else self._group.built

    @property
    def factory(self) -> Callable[..., Any]:
        """What builds its optimizer from the parameters it trains."""
        return self._factory

    @property
    def shared(self) -> str | None:
        """The key it shares its node and optimizer under on its host, or None."""
        return self._shared

    # -- shared with other clients on purpose (_shared) -----------------------------
    def share_on(self, sharing: Any, nodes: Mapping[str, Any], session: str) -> dict[str, Any] | None:
        """Joins the shared trainer of its key on the host installing its catalog (the
        host calls this with what it shares, ``sharing``, the catalog's nodes and the
        session's name), starting it if it is the first; answers the nodes to put in
        the catalog instead: the shared node, where this catalog has its own copy. A
        trainer the shared one is not alike to is refused (DeclarationError), with
        nothing changed. None for a trainer not asked to share: its session then never
        waits for anybody else's."""
        if self._shared is None:
            return None
        me = next((n for n, impl in nodes.items() if impl is self), "?")
        group = sharing.table.get(self._shared)
        if group is None:
            if not _STARTS:
                raise DeclarationError(
                    f"node {me!r} is trained shared={self._shared!r}, and nothing in this "
                    "process starts a shared trainer; import somatize.torch on the worker")
            group = sharing.table[self._shared] = _STARTS[0](self._shared, self, me, sharing.lock,
                                                             sharing.patience)
        else:
            group.admit(self, me)
        mine = self._node
        group.join(session, self)
        self._group, self._label, self._node, self._built = group, session, group.node, None
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

    def fresh_optimizer(self) -> Any:
        """An optimizer built as its own would be, over what is here, and kept by
        nobody: what a kept state is checked against without changing anything."""
        return self._factory(self.training())

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
            raise DeclarationError(f"{type(self).__qualname__} makes one update every {every} "
                                   f"steps, so no group of it stands {taken} steps in; give "
                                   "a standing it answered")
        if rebuilt:
            self._built = None
        self._taken, self._piece = taken, piece

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
                self._audit.by_hand(self._audited_as, self._node)
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
        detached); an envelope is dL/d(that activation), to learn from."""
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
        return Opaque(narrowed(value, self._compress) if self._narrows_out else value.detach())

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
            answer = self.learn(signal, ctx)
        else:
            with self._own_gradients():
                answer = self.learn(signal, ctx)
        ended = self.closes()
        self._taken = 0 if ended else self._taken + 1
        self._closing = False
        if self._crossed:  # the gradient goes back the way the input came
            answer = narrowed(answer, self._compress)
        said = envelope(answer, closing=closes, behind=back)
        if self._audit is not None and stepped:
            self._piece += 1
            if self._piece >= self._pieces:
                self._piece = 0
                health += self._audit.observed(updated=ended)
        if health:
            said[HEALTH] = health
        return said

    def answering(self) -> Any:
        """Its own open group of gradients on its node while a verb reads or restores
        them (a shared trainer's; one that shares nothing has no other's to keep off)."""
        return self._own_gradients()

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

    def learn(self, signal: torch.Tensor | None, ctx: Ctx) -> Any:
        """Handed dL/d(what the node produced) — None when nobody owes it anything this
        step — answers dL/d(what it was given), or None. The hole a technique fills.
        Where the node produced (or was given) a tuple, list or dict of tensors, the
        gradient has that shape, None where no gradient belongs (``_tensors.paired``
        pairs it with the tensors it is for; ``gradients_of`` reads one off ``given``)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not say how it learns")

    def __repr__(self) -> str:
        trains = type(self._node).__qualname__ if self._node is not None else "nothing yet"
        return f"{type(self).__qualname__}(trains {trains}, every={self._every})"


class Enters(Node):
    """The position in front of a trained node: its Learning's ``entering``."""

    _soma_position = True
    learning: Learning | None = None

    def __init__(self, learning: Learning):
        self.learning = learning

    def forward(self, value: Any, ctx: Ctx) -> Any:
        return self.learning.entering(value, ctx)


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
            if self._audit is None and self._group is None:
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
