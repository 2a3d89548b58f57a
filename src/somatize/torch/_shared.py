"""One trainer on a host that several clients train together, on purpose.

``Split(SGD, lr=0.1, shared="body")`` says that every client whose trainer names the
key ``"body"`` on the same host trains one node there, with one optimizer and its
state: the server half of split learning as its users run it, many data holders and
one server. A session that joins keeps what is its own — its activations waiting for
their gradients, its open group of gradients, where its group stands — and shares the
node and the optimizer (``Shared``).

Exact under concurrency, and how. Every slice of a session that shares runs under the
host's sharing lock (``wire.host.Sharing``), so the shared node computes for one
client at a time. A gradient is always computed through its own client's activation,
at the weights that activation was made with: an update is applied only when no
client still owes a gradient through the current weights (an in-place step would
change what that gradient is computed from), and until then it waits in a queue, in
the order the host received it. A client starting a new step while updates wait is
held back (it waits on the lock, letting the others finish theirs), so the queue
drains and nobody starves. Each forward, gradient and update is logged in the order
it happened (``order``), which is what a single process replays to get the very same
numbers. With clients taking turns nothing ever waits, and this is ordinary training.

A client that stops mid-step (its process died) would hold every other client back;
after the worker's patience (``--shared-patience``, ``PATIENCE`` seconds by default) the
waiting ones move on, and the stalled client's
activations are let go of, so its late gradient is refused as out of step rather
than computed through weights that moved.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import DeclarationError
from .._keys import Unwritable, hexdigest_of
from .._node import made_with
from ._weights import trainer_at

__all__ = ["PATIENCE", "VERBS", "Shared", "Turn", "order_verb"]

PATIENCE = 30.0  # seconds a new step waits for other clients' steps in flight
LOGGED = 1 << 16  # events of the order kept; older ones are counted, not kept


class Shared:
    """The trainer that the sessions of one host naming one key train together: the
    node and optimizer of whichever session came first, and what every session that
    joined since has in flight. Touched only under the host's sharing lock."""

    def __init__(self, key: str, first: Any, node_id: str, lock: Any,
                 patience: float = PATIENCE):
        self.key, self.node_id, self.lock = key, node_id, lock
        self.patience = patience
        self.node = first.node
        self.technique = type(first.learning)
        self.factory = first.factory
        self.every = first.cadence()
        self.shapes = _shapes(first.learning.training())
        self.made = _made(first.node)
        self.members: dict[str, Any] = {}  # session label -> its trainer's Seat
        self.waiting: collections.deque[tuple[str, list[Any]]] = collections.deque()
        self.order: collections.deque[tuple[str, str]] = collections.deque(maxlen=LOGGED)
        self.logged = 0  # events ever logged, the ones dropped from ``order`` included
        self._optimizer: Any = None
        self.used = time.monotonic()

    # -- who trains it ------------------------------------------------------------------
    def admit(self, seat: Any, node_id: str) -> None:
        """Refuses a trainer that would not train this one as it is trained: another
        technique, optimizer or update cadence (the Trainer's steps per update, however
        each step is cut into pieces), or another node: its class, what it was built
        with, its parameters' shapes and dtypes. Both are named; nothing changes then."""
        theirs = (type(seat.learning), _factory_text(seat.factory),
                  seat.cadence(), _shapes(seat.learning.training()))
        ours = (self.technique, _factory_text(self.factory), self.every, self.shapes)
        if theirs[1:] != ours[1:] or theirs[0].__qualname__ != ours[0].__qualname__:
            raise DeclarationError(
                f"shared={self.key!r} on this host is node {self.node_id!r} trained by "
                f"{_described(self.technique, self.factory, self.every, self.shapes)}, and "
                f"node {node_id!r} of the joining client is trained by "
                f"{_described(theirs[0], seat.factory, theirs[2], theirs[3])}; clients "
                "train one shared trainer only alike: declare the same node and the same "
                "Learning, or name another key in shared=")
        if _made(seat.node) != self.made:
            raise DeclarationError(
                f"shared={self.key!r} on this host is node {self.node_id!r}, "
                f"{_built(self.node)}, and node {node_id!r} of the joining client is "
                f"{_built(seat.node)}: a shared trainer computes one function, so a client "
                "joins it only with the same node built the same way; declare it alike, or "
                "name another key in shared=")

    def join(self, label: str, seat: Any) -> None:
        self.members[label] = seat
        self.used = time.monotonic()

    def leave(self, label: str) -> None:
        """A session let go (closed, idle, made room for): its activations owe nothing
        any more, so updates waiting for them may go."""
        if self.members.pop(label, None) is not None:
            self.drain()
            self.lock.notify_all()

    def members_but(self, label: str) -> list[str]:
        """The sessions training it besides ``label``'s, by their labels: whose it is too."""
        return sorted(other for other in self.members if other != label)

    def idle_for(self, now: float) -> float | None:
        """How long nobody has trained it; None while some session holds it."""
        return None if self.members else now - self.used

    # -- a step, as the sessions' trainers take it ----------------------------------------
    @property
    def built(self) -> Any:
        """The optimizer, if it has been built."""
        return self._optimizer

    def optimizer(self) -> Any:
        """The one optimizer, built at first use over the node's parameters."""
        if self._optimizer is None:
            self._optimizer = self.factory(list(self.node.parameters()))
        return self._optimizer

    def turn(self, label: str) -> Turn:
        """What the trainer of session ``label`` holds as its optimizer."""
        return Turn(self, label)

    def enters(self, label: str, seat: Any) -> None:
        """Before a forward of ``label``'s: a new step of its (nothing of it in flight)
        waits while updates do, so they go before its forward reads the weights."""
        if seat.in_flight() or not self.waiting:
            return
        if not self.lock.wait_for(lambda: not self.waiting, timeout=self.patience):
            self._stalled(label)

    def log(self, label: str, event: str) -> None:
        self.order.append((label, event))
        self.logged += 1
        self.used = time.monotonic()

    def lend(self, grads: list[Any] | None) -> None:
        """Puts one session's open group of gradients on the node, for its trainer to
        add to (autograd adds to ``.grad`` as it would were the node its own)."""
        for parameter, grad in zip(self._parameters(), grads or ()):
            parameter.grad = grad

    def take(self) -> list[Any] | None:
        """Takes the session's gradients back off the node (None when there are none),
        so the next session's start from nothing."""
        parameters = self._parameters()
        grads = [p.grad for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        return None if all(g is None for g in grads) else grads

    def update(self, label: str, grads: list[Any] | None) -> None:
        """Queues ``label``'s update and applies every queued one that may go now."""
        self.waiting.append((label, grads or []))
        self.drain()

    def drain(self) -> None:
        """Applies the queued updates, oldest first, once no session owes a gradient
        through the weights as they stand."""
        if not self.waiting or any(m.in_flight() for m in self.members.values()):
            return
        optimizer = self.optimizer()
        parameters = self._parameters()
        while self.waiting:
            label, grads = self.waiting.popleft()
            for parameter, grad in zip(parameters, grads):
                parameter.grad = grad
            optimizer.step()
            for parameter in parameters:
                parameter.grad = None
            self.log(label, "update")
        self.lock.notify_all()

    def _stalled(self, label: str) -> None:
        """Patience ran out: the sessions still owing gradients lose their activations
        (their late gradients are refused), and the queue goes."""
        for other, member in self.members.items():
            if other != label and member.in_flight():
                member.forget(f"the shared trainer {self.key!r} waited {self.patience:g} s "
                              "for this client's gradient while other clients' updates were "
                              "due, and let its activations go (the worker's "
                              "--shared-patience)")
                self.log(other, "dropped")
        self.drain()

    def _parameters(self) -> list[Any]:
        return list(self.node.parameters())


class Turn:
    """A session's turn at a shared trainer's optimizer, which is what its technique
    holds as its optimizer: clearing clears this session's own gradients, a step
    queues this session's update (``Shared.update``), and anything else (a state
    kept or taken up) is the one optimizer's."""

    def __init__(self, shared: Shared, label: str):
        self._shared, self._label = shared, label

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._shared.take()

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise DeclarationError("a shared trainer's optimizer takes no closure: its step "
                                   "waits for the other clients', and a closure could not")
        self._shared.update(self._label, self._shared.take())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not the optimizer's to answer (copy, pickle)
            raise AttributeError(name)
        return getattr(self._shared.optimizer(), name)


def order_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """``shared_order``: what the shared trainer of a node did, in the order it did
    it, as ``[client, event]`` pairs (``forward``, ``gradient``, ``update``, or
    ``dropped``), with which client the asking one is; events past the last
    ``LOGGED`` are counted in ``logged``, not kept."""
    seat = trainer_at(nodes, asked["node"]).seat
    group = seat.group
    if group is None:
        raise DeclarationError("this trainer is not shared (Split(..., shared=key) shares one), "
                               "so there is no order of clients to tell")
    return {"you": seat.label, "key": group.key, "logged": group.logged,
            "order": [list(event) for event in group.order]}


VERBS = {"shared_order": order_verb}


def _shapes(parameters: list[Any]) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in parameters)


def _factory_text(factory: Any, full: bool = True) -> str:
    """An optimizer factory as it would be declared: ``SGD(lr=0.1)``, its module
    before it when ``full`` (which is what two are compared by)."""
    func = getattr(factory, "func", factory)
    keywords = getattr(factory, "keywords", {})
    name = getattr(func, "__qualname__", repr(func))
    module = getattr(func, "__module__", None)
    said = ", ".join(f"{k}={_text(v)}" for k, v in sorted(keywords.items()))
    return f"{module}.{name}({said})" if full and module else f"{name}({said})"


def _text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()!r})" if value.numel() <= 16 else f"tensor{tuple(value.shape)}"
    return repr(value)


def _described(technique: type, factory: Any, every: Any, shapes: Any) -> str:
    weights = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in shapes) or "no parameters"
    return (f"{technique.__qualname__}({_factory_text(factory, full=False)}, "
            f"an update every {every} of the Trainer's steps) over [{weights}]")


def _made(node: Any) -> tuple[str, str | None]:
    """What a node is: its class, and a digest of what it was built with (None where
    that cannot be written down, and then its class alone speaks for it)."""
    cls = type(node)
    made = made_with(node)
    try:
        digest = None if made is None else hexdigest_of(("declared", made[0], made[1]))
    except Unwritable:
        digest = None
    return f"{cls.__module__}.{cls.__qualname__}", digest


def _built(node: Any) -> str:
    """A node as its construction would be written: ``Lin(8, 6, relu=False)``."""
    made = made_with(node) or ((), {})
    said = [_short(v) for v in made[0]] + [f"{k}={_short(v)}" for k, v in made[1].items()]
    return f"{type(node).__module__}.{type(node).__qualname__}({', '.join(said)})"


def _short(value: Any) -> str:
    text = _text(value)
    return text if len(text) <= 40 else text[:37] + "..."