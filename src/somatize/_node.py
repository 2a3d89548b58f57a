"""What a graph is made of: Node, what it is told (Ctx), and the two wrappers.

A node's ``__init__`` belongs to whoever wrote the subclass, and the examples never
call ``super().__init__()``; so nothing here may depend on it having run. What a node
was built with is caught in ``__new__`` instead, which every construction passes
through — pickle included, whose state then overwrites it with the original.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ._dsl import as_piece
from ._errors import MissingForward
from ._opaque import Done, Opaque

__all__ = ["Ctx", "Done", "Node", "Opaque"]

MADE_WITH = "_soma_made_with"
# Where the work nodes leave for after their answer goes, in a thread that promised to
# run it then (``afterwards_held_here``); nowhere, and so run at once, elsewhere.
_AFTERWARDS = threading.local()


class Node:
    """What a graph node executes: subclass it and write ``forward(input, ctx)``.

    A subclass without ``forward`` cannot be instantiated. The DSL methods
    (``>>``, ``|``, ``.named``, ``.on``, ``.at``, ``.cached``, ``.frozen``,
    ``.mapped``) make an expression that ``Graph.somatize`` materializes.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Node:
        if cls.forward is Node.forward:
            raise MissingForward(
                f"{cls.__qualname__} does not define forward(self, input, ctx), so it "
                "cannot be a node; write the method that says what it computes"
            )
        self = super().__new__(cls)
        try:
            self.__dict__[MADE_WITH] = (args, kwargs)
        except AttributeError:  # __slots__ without __dict__: nothing to note it in
            pass
        return self

    def forward(self, input: Any, ctx: Ctx) -> Any:
        """Takes what arrived along the edges and returns what it produced.

        ``ctx.device`` is where this node was placed (``"cuda:0"``) or None.
        """
        raise NotImplementedError

    forward.__isabstractmethod__ = True  # type: ignore[attr-defined]

    # The expression. Each returns a new piece; the node itself is never changed.
    def __rshift__(self, other: Any) -> Any:
        return as_piece(self) >> other

    def __rrshift__(self, other: Any) -> Any:
        return as_piece(other) >> self

    def __or__(self, other: Any) -> Any:
        return as_piece(self) | other

    def __ror__(self, other: Any) -> Any:
        return as_piece(other) | self

    def named(self, node_id: str) -> Any:
        """The same node, under the id you say."""
        return as_piece(self).named(node_id)

    def on(self, device: str) -> Any:
        """The same piece, placed on a device; the innermost ``.on`` wins."""
        return as_piece(self).on(device)

    def at(self, host: str) -> Any:
        """The same piece, sent to a host by name; the innermost ``.at`` wins."""
        return as_piece(self).at(host)

    def cached(self, salt: str | None = None) -> Any:
        """The same piece, worth keeping: looked up before it runs, kept after."""
        return as_piece(self).cached(salt)

    def frozen(self) -> Any:
        """The same piece, declared settled: its state does not change while it runs."""
        return as_piece(self).frozen()

    def mapped(self) -> Any:
        """The same piece, mapping over the items of a list: one answer per item."""
        return as_piece(self).mapped()


def made_with(node: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """What a Node was constructed with, or None for an object that is not one."""
    return getattr(node, "__dict__", {}).get(MADE_WITH)


class Ctx:
    """What a node knows beyond its input: ``device`` (torch-style, or None) and its id
    (``node``); and, through ``afterwards``, where to leave work for once its answer is
    out."""

    __slots__ = ("device", "node")

    def __init__(self, device: str | None = None, node: str | None = None):
        self.device = device
        self.node = node

    def afterwards(self, work: Callable[[], Any]) -> None:
        """Runs ``work`` (called with no arguments) once the answer this node is part of
        has gone out, rather than before it.

        On a worker the reply to the slice is sent first and ``work`` runs right after,
        so what it costs (an optimizer's step, say) overlaps what the client does next
        instead of adding to the round trip. Nothing else reaches the node in between:
        the next slice of the same session, a checkpoint's read, a request on another
        connection, all wait until ``work`` has run. Should it raise, the session's next
        slice is answered with that failure, naming this node, and does not run.
        Wherever nobody waits for an answer (a graph run here, the in-process and Ray
        transports), ``work`` runs at once, inside this call."""
        held = getattr(_AFTERWARDS, "work", None)
        if held is None:
            work()
        else:
            held.append((self.node, work))

    def __repr__(self) -> str:
        return f"Ctx(device={self.device!r}, node={self.node!r})"


def afterwards_held_here() -> list[tuple[str | None, Callable[[], Any]]]:
    """The list where the work nodes leave for after their answer (``Ctx.afterwards``)
    waits in this thread, as ``(node, work)`` in order, from now on. The thread that asks
    for it promises, for its whole life, to take what it holds after each answer and run
    it once that answer has gone: a socket worker's connection does."""
    held = getattr(_AFTERWARDS, "work", None)
    if held is None:
        held = _AFTERWARDS.work = []
    return held
