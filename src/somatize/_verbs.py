"""What a session on a host may be asked besides running a slice: its verbs.

A slice carries values through a session's nodes; everything else its owner asks of
what the session holds there — a trainer's weights and state, loading or restoring
them, the session's random state, train or eval mode, a shared trainer's order — is a
verb: a name, and a handler the host calls with the session's nodes and the verb's
arguments, ``handler(nodes, args) -> answer``. The core knows no verb but ``end``
(which the host answers itself); the layer that gives the nodes their meaning
registers the rest (``somatize.torch`` registers its own when imported, which a worker
does before it can rebuild a trainer), so nothing below it imports torch.

The same layer says how the process's random state is read and set (``draws``): a
host runs each session's slices and verbs with a random state of the session's own,
swapped in around them (``wire.host``), and needs only those two calls to do it.

Who fills ``VERBS`` and ``RANDOM`` is declared in ``_registries``, with every other
registry the package keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._errors import DeclarationError

__all__ = ["END", "RANDOM", "SEEDING", "VERBS", "draws", "verb"]

END = "end"  # answered by the host itself: the session's owner is done with it

#: Each verb's handler, ``handler(nodes, args)``: ``nodes`` are the session's nodes on
#: the host by id, ``args`` what the owner sent (plain data and tensors).
VERBS: dict[str, Callable[[Mapping[str, Any], Any], Any]] = {}

#: The verbs that give a session a random state of its own (seeding it, or setting a
#: kept one): from then on it draws from that state alone.
SEEDING: set[str] = set()

#: How the process's random state is read and set, ``[(take, put)]``: empty until the
#: layer that draws (``somatize.torch``) says, and then sessions swap nothing.
RANDOM: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []


def verb(name: str, handler: Callable[[Mapping[str, Any], Any], Any], *,
         seeds: bool = False) -> None:
    """Has every host answer the verb ``name`` with ``handler``; a name another
    handler answers already is refused, and so is ``end``, which the host keeps.
    ``seeds`` says that what it sets in the process's random state is the session's
    own from then on (``SEEDING``)."""
    if type(name) is not str or not name or name == END:
        raise DeclarationError(f"{name!r} cannot name a verb: give a name of its own "
                               f"(not {END!r}, which every host answers itself)")
    if VERBS.get(name, handler) is not handler:
        raise DeclarationError(f"the verb {name!r} is answered by {VERBS[name].__qualname__} "
                               f"already; give {handler.__qualname__} a name of its own")
    VERBS[name] = handler
    if seeds:
        SEEDING.add(name)


def draws(take: Callable[[], Any], put: Callable[[Any], None]) -> None:
    """Says how this process's random state is read (``take``) and set (``put``)."""
    RANDOM[:] = [(take, put)]
