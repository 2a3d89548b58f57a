"""The expression: nodes joined by ``>>`` and ``|``, with modifiers on any part.

An expression is a small immutable tree (one node, a chain, things side by side, or a
part with modifiers over it); ``Graph.somatize`` flattens it in one pass. Modifiers
given on a composite reach every node inside, and where two say different things
(``.on``, ``.at``, a salt) the one written closest to the node wins, so
``(A().on("cuda:0") >> B()).on("cuda:1")`` leaves A on 0 and B on 1.

Ids are the class name in snake_case, ``_2``/``_3`` for repeats in expression order,
or whatever ``.named`` said; a default never takes a name somebody chose.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Collection
from typing import Any

from ._errors import DeclarationError

__all__ = ["Declared", "Piece", "Topology", "as_piece", "assign_ids", "default_id",
           "is_host_name", "snake_case", "valid_device", "valid_host", "valid_id"]

# The modifiers a part can carry. "cached" maps to its salt; presence is what counts.
DEVICE, HOST, CACHED, FROZEN, MAPPED = "device", "host", "cached", "frozen", "mapped"


class Piece:
    """Part of an expression: what ``>>``, ``|`` and the modifiers build."""

    __slots__ = ("_kind", "_parts", "_mods", "_node", "_id")

    def __init__(self, kind: str, parts: tuple = (), mods: dict | None = None,
                 node: Any = None, node_id: str | None = None):
        self._kind = kind  # "one", "chain", "side", "over"
        self._parts = parts
        self._mods = mods or {}
        self._node = node
        self._id = node_id

    # -- combining ---------------------------------------------------------------
    def __rshift__(self, other: Any) -> Piece:
        other = as_piece(other)
        left = self._parts if self._kind == "chain" else (self,)
        right = other._parts if other._kind == "chain" else (other,)
        return Piece("chain", left + right)

    def __rrshift__(self, other: Any) -> Piece:
        return as_piece(other) >> self

    def __or__(self, other: Any) -> Piece:
        other = as_piece(other)
        left = self._parts if self._kind == "side" else (self,)
        right = other._parts if other._kind == "side" else (other,)
        return Piece("side", left + right)

    def __ror__(self, other: Any) -> Piece:
        return as_piece(other) | self

    # -- modifiers -----------------------------------------------------------------
    def _with(self, key: str, value: Any) -> Piece:
        if self._kind == "one":
            if key in self._mods:  # already said closer to the node: it wins
                return self
            return Piece("one", mods={**self._mods, key: value}, node=self._node, node_id=self._id)
        return Piece("over", (self,), {key: value})

    def on(self, device: str) -> Piece:
        """Places every node inside on ``device`` unless one was placed already."""
        if not isinstance(device, str):
            raise DeclarationError(f".on() takes a device name such as 'cuda:0', not {device!r}")
        return self._with(DEVICE, device)

    def at(self, host: str) -> Piece:
        """Sends every node inside to ``host`` unless one was sent somewhere already."""
        if not isinstance(host, str):
            raise DeclarationError(f".at() takes a host name such as 'w1', not {host!r}")
        return self._with(HOST, host)

    def cached(self, salt: str | None = None) -> Piece:
        """Keeps what every node inside produces, under ``salt`` where none was said."""
        if salt is not None and not isinstance(salt, str):
            raise DeclarationError(f".cached() takes a str salt or None, not {salt!r}")
        return self._with(CACHED, salt)

    def frozen(self) -> Piece:
        """Declares every node inside settled."""
        return self._with(FROZEN, True)

    def mapped(self) -> Piece:
        """Makes every node inside map over the items of its input."""
        return self._with(MAPPED, True)

    def named(self, node_id: str) -> Declared:
        """The same single node under ``node_id``; a composite has no one name."""
        if self._kind != "one":
            raise DeclarationError(
                f".named({node_id!r}) was given to a composite of {len(self.flatten()[0])} nodes; "
                "name each node inside it instead, e.g. (A().named('a') >> B().named('b'))"
            )
        return Declared("one", mods=dict(self._mods), node=self._node,
                        node_id=valid_id(node_id))

    # -- materializing ----------------------------------------------------------
    def flatten(self) -> tuple[list[tuple[Any, str | None, dict]], list[tuple[int, int]]]:
        """Every node as ``(object, id or None, modifiers)`` in expression order, and the
        edges between them by position."""
        entries: list[tuple[Any, str | None, dict]] = []
        edges: list[tuple[int, int]] = []
        _flatten(self, {}, entries, edges)
        return entries, edges

    def __repr__(self) -> str:
        if self._kind == "one":
            name = self._id or snake_case(type(self._node).__name__)
            mods = "".join(f".{k}({v!r})" for k, v in self._mods.items())
            return f"{name}{mods}"
        if self._kind == "over":
            mods = "".join(f".{k}({v!r})" for k, v in self._mods.items())
            return f"({self._parts[0]!r}){mods}"
        joint = " >> " if self._kind == "chain" else " | "
        return "(" + joint.join(repr(part) for part in self._parts) + ")"


class Declared(Piece):
    """A single node with the id somebody chose."""

    __slots__ = ()


Topology = Any  # a Piece, or a Node (_node's Node builds on this module, so it is not named)


def as_piece(thing: Any) -> Piece:
    """A node or a piece as a piece; anything else is refused, saying what was found."""
    if isinstance(thing, Piece):
        return thing
    forward = getattr(thing, "forward", None)
    if forward is not None and callable(forward) and not isinstance(thing, type):
        if _a_torch_module_without_ctx(thing, forward):
            raise DeclarationError(
                f"a torch {type(thing).__qualname__} cannot be a node as it is: its forward "
                "takes the input alone, and a node's takes (input, ctx); wrap it as "
                f"somatize.torch.module(m) — its forward is m(x), and its weights and export "
                "keys are m's own"
            )
        return Piece("one", node=thing)
    if isinstance(thing, type) and callable(getattr(thing, "forward", None)):
        raise DeclarationError(
            f"the class {thing.__qualname__} was used where a node goes; instantiate it: "
            f"{thing.__qualname__}()"
        )
    raise DeclarationError(
        f"a {type(thing).__qualname__} cannot be part of a graph: a node is an object with "
        "forward(input, ctx) — subclass somatize.Node"
    )


def _a_torch_module_without_ctx(thing: Any, forward: Any) -> bool:
    """Whether ``thing`` is a ``torch.nn.Module`` whose forward cannot take ``(input,
    ctx)``: used as a node it would fail at its first forward. Told by its classes'
    names, since the core never imports torch; a module written as a node (a
    ``Node`` too, or a forward that takes ctx) is left alone."""
    if not any(c.__name__ == "Module" and c.__module__ == "torch.nn.modules.module"
               for c in type(thing).__mro__):
        return False
    try:
        inspect.signature(forward).bind(None, None)
    except TypeError:
        return True
    except ValueError:  # no signature to be read: nothing certain to refuse
        return False
    return False


def _flatten(piece: Piece, outer: dict, entries: list, edges: list) -> tuple[list[int], list[int]]:
    """Appends the piece's nodes and edges; returns its roots and leaves by position."""
    mods = {**outer, **piece._mods} if piece._mods else outer
    kind = piece._kind
    if kind == "one":
        entries.append((piece._node, piece._id, mods))
        at = len(entries) - 1
        return [at], [at]
    if kind == "over":
        return _flatten(piece._parts[0], mods, entries, edges)
    if kind == "side":
        roots, leaves = [], []
        for part in piece._parts:
            r, l = _flatten(part, mods, entries, edges)
            roots += r
            leaves += l
        return roots, leaves
    roots: list[int] = []
    leaves: list[int] = []
    for position, part in enumerate(piece._parts):
        r, l = _flatten(part, mods, entries, edges)
        if position == 0:
            roots = r
        else:
            edges.extend((a, b) for a in leaves for b in r)
        leaves = l
    return roots, leaves


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(name: str) -> str:
    """``MyHead`` → ``my_head``, ``HTTPFetch`` → ``http_fetch``."""
    return _CAMEL.sub("_", name).lower()


# -- ids, devices, hosts: what a declaration may say -------------------------------------
_DEVICE = re.compile(
    r"^(cpu|cuda|mps|xpu|xla|meta|hip|hpu|ipu|mtia|maia|ve|lazy|vulkan|fpga|ort|mkldnn|"
    r"opengl|opencl|ideep|privateuseone)(:(0|[1-9][0-9]*))?$"
)
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def valid_id(node_id: Any) -> str:
    """A node id as somebody chose it: a non-empty str without control characters.

    Control characters are kept for the ids the library makes itself (a trainer's
    positions), so that those can never be the same as one of the user's.
    """
    if not isinstance(node_id, str) or not node_id or any(ord(c) < 32 for c in node_id):
        raise DeclarationError(f"a node id is a non-empty str without control characters, "
                               f"not {node_id!r}")
    return node_id


def valid_device(device: Any, node_id: str) -> str:
    """A torch-style device name, or a DeclarationError naming the node."""
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise DeclarationError(
            f"node {node_id!r} is placed on {device!r}, which is not a device; write it "
            "the way torch does: 'cpu', 'cuda', 'cuda:0', 'mps'"
        )
    return device


def is_host_name(host: Any) -> bool:
    """Whether this is a host name: letters, digits, '.', '_', '-', at most 253."""
    return isinstance(host, str) and _HOST.match(host) is not None


def valid_host(host: Any, node_id: str) -> str:
    """A host name, or a DeclarationError naming the node."""
    if not is_host_name(host):
        raise DeclarationError(
            f"node {node_id!r} is sent to {host!r}, which is not a host name; a host is "
            "a name such as 'w1' or 'gpu-0' (letters, digits, '.', '_', '-'), and where "
            "it is comes from the broker"
        )
    return host


def default_id(impl: Any, taken: Collection[str], counts: dict[str, int] | None = None) -> str:
    """The id a node gets when nobody chose one: its class in snake_case, then ``_2``,
    ``_3``... never one that is ``taken``. ``counts`` carries on a numbering across calls
    (one expression numbers its repeats in order)."""
    base = snake_case(type(impl).__name__)
    n = (counts or {}).get(base, 0) + 1
    node_id = base if n == 1 else f"{base}_{n}"
    while node_id in taken:
        n += 1
        node_id = f"{base}_{n}"
    if counts is not None:
        counts[base] = n
    return node_id


def assign_ids(entries: list[tuple[Any, str | None, dict]]) -> list[str]:
    """The ids of a flattened expression: chosen ones as they are (a duplicate is
    refused naming both), defaults around them in expression order."""
    chosen: dict[str, int] = {}
    for position, (impl, node_id, _) in enumerate(entries):
        if node_id is None:
            continue
        if node_id in chosen:
            earlier = entries[chosen[node_id]][0]
            if earlier is impl:
                raise DeclarationError(
                    f"the same {type(impl).__qualname__} object is used twice in the "
                    f"expression, named {node_id!r} both times, and one name is one node: "
                    f"for two layers make two objects ({type(impl).__qualname__}(...) twice); "
                    "to run one object's weights twice on purpose, give its second use a "
                    "name of its own (.named(...))"
                )
            raise DeclarationError(
                f"two nodes are named {node_id!r}: a {type(earlier).__qualname__} and a "
                f"{type(impl).__qualname__}; ids are unique within a graph"
            )
        chosen[node_id] = position
    taken = set(chosen)
    counts: dict[str, int] = {}
    ids = []
    for impl, node_id, _ in entries:
        if node_id is None:
            node_id = default_id(impl, taken, counts)
            taken.add(node_id)
        ids.append(node_id)
    _warn_of_reuse(entries, ids)
    return ids


def _warn_of_reuse(entries: list[tuple[Any, str | None, dict]], ids: list[str]) -> None:
    """One object at two places of an expression is two nodes sharing its state: torch
    allows a layer applied twice, and some mean it (tied weights), so it is said, not
    refused; most meant two layers and wrote ``a >> b >> a``."""
    first: dict[int, str] = {}
    for (impl, _, _), node_id in zip(entries, ids):
        if id(impl) not in first:
            first[id(impl)] = node_id
            continue
        warnings.warn(
            f"nodes {first[id(impl)]!r} and {node_id!r} are one {type(impl).__qualname__} "
            "object, used twice in the expression: they share its weights and state. For "
            f"two layers, make two objects ({type(impl).__qualname__}(...) twice); if you "
            "mean them to share, nothing else needs doing",
            UserWarning, stacklevel=_outside())


def _outside() -> int:
    """The stacklevel of the user's call: the first frame that is not somatize's."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("somatize"):
        frame, level = frame.f_back, level + 1
    return level
