"""Graph: nodes, edges, what each node is declared to be, and the facade over the walk.

Everything a graph knows is declared through these methods and nothing else, so a
compiled form of it (what the walk reads) can be cached and thrown away on the next
change. The queries answer in insertion order, which is the order things were said.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _plan
from ._dsl import Topology, as_piece, snake_case
from ._errors import CycleError, DeclarationError
from ._keys import Unwritable, hexdigest_of
from ._node import made_with

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["Graph", "as_broker", "validate_device", "validate_host"]

_DEVICE = re.compile(
    r"^(cpu|cuda|mps|xpu|xla|meta|hip|hpu|ipu|mtia|maia|ve|lazy|vulkan|fpga|ort|mkldnn|"
    r"opengl|opencl|ideep|privateuseone)(:(0|[1-9][0-9]*))?$"
)
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def validate_device(device: Any, node_id: str) -> str:
    """A torch-style device name, or a DeclarationError naming the node."""
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise DeclarationError(
            f"node {node_id!r} is placed on {device!r}, which is not a device; write it "
            "the way torch does: 'cpu', 'cuda', 'cuda:0', 'mps'"
        )
    return device


def validate_host(host: Any, node_id: str) -> str:
    """A host name (letters, digits, '.', '_', '-'), or a DeclarationError naming the node."""
    if not isinstance(host, str) or not _HOST.match(host):
        raise DeclarationError(
            f"node {node_id!r} is sent to {host!r}, which is not a host name; a host is "
            "a name such as 'w1' or 'gpu-0' (letters, digits, '.', '_', '-'), and where "
            "it is comes from the broker"
        )
    return host


def _valid_id(node_id: Any) -> str:
    if not isinstance(node_id, str) or not node_id or any(ord(c) < 32 for c in node_id):
        raise DeclarationError(f"a node id is a non-empty str without control characters, not {node_id!r}")
    return node_id


class Graph:
    """A computation graph: nodes, the edges between them, and what each one executes.

    Build one from an expression with ``Graph.somatize(A() >> B())``, or by hand with
    ``node`` and ``edge`` when the shape comes from a loop or from outside.
    """

    def __init__(self) -> None:
        self._impl: dict[str, Any] = {}
        self._preds: dict[str, list[str]] = {}
        self._succs: dict[str, list[str]] = {}
        self._edges: list[tuple[str, str]] = []
        self._devices: dict[str, str] = {}
        self._hosts: dict[str, str] = {}
        self._cached: dict[str, str | None] = {}
        self._frozen: dict[str, str | None] = {}
        self._mapped: dict[str, None] = {}
        self._declarations: dict[str, str] = {}
        self._unwritable: dict[str, type] = {}  # declarations that could not be written
        self._fingerprints: dict[str, str] = {}
        self._compiled: Any = None

    # -- building -----------------------------------------------------------------
    @classmethod
    def somatize(cls, topology: Topology) -> Graph:
        """Materializes an expression into a graph; refuses it whole or builds it whole."""
        entries, edges = as_piece(topology).flatten()
        ids = _assign_ids(entries)
        for node_id, (_, _, mods) in zip(ids, entries):
            if "device" in mods:
                validate_device(mods["device"], node_id)
            if "host" in mods:
                validate_host(mods["host"], node_id)
        graph = cls()
        for node_id, (impl, _, mods) in zip(ids, entries):
            graph._add(node_id, impl)
            if "device" in mods:
                graph._devices[node_id] = mods["device"]
            if "host" in mods:
                graph._hosts[node_id] = mods["host"]
            if "cached" in mods:
                graph._cached[node_id] = mods["cached"]
            if "frozen" in mods:
                graph._frozen[node_id] = None
            if "mapped" in mods:
                graph._mapped[node_id] = None
        for a, b in edges:  # acyclic by construction: edges only go forward in the expression
            graph._connect(ids[a], ids[b])
        return graph

    def node(self, *args: Any) -> str:
        """Adds a node, ``node(impl)`` or ``node(id, impl)``, and returns its id."""
        if len(args) == 1:
            impl, node_id = args[0], None
        elif len(args) == 2:
            node_id, impl = _valid_id(args[0]), args[1]
        else:
            raise TypeError("node() takes an implementation, or an id and an implementation")
        piece = as_piece(impl)
        if piece._kind != "one":
            raise DeclarationError("node() takes one node; for an expression use Graph.somatize(...)")
        impl = piece._node
        if node_id is None:
            node_id = _free(snake_case(type(impl).__name__), self._impl)
        elif node_id in self._impl:
            raise DeclarationError(
                f"this graph already has a node {node_id!r} "
                f"({type(self._impl[node_id]).__qualname__}); choose another id"
            )
        self._add(node_id, impl)
        self._changed()
        return node_id

    def _add(self, node_id: str, impl: Any) -> None:
        self._impl[node_id] = impl
        self._preds[node_id] = []
        self._succs[node_id] = []
        made = made_with(impl)
        if made is not None:
            try:
                self._declarations[node_id] = hexdigest_of(("declared", made[0], made[1]))
            except Unwritable as exc:
                self._unwritable[node_id] = exc.what

    def edge(self, source: str, target: str) -> None:
        """Connects two nodes that exist; refuses an edge that would close a cycle."""
        self._known(source)
        self._known(target)
        if target in self._succs[source]:
            raise DeclarationError(f"{source!r} already feeds {target!r}; an edge is said once")
        path = self._path(target, source)
        if path is not None:
            cycle = path + [target]
            raise CycleError(
                f"the edge {source!r} -> {target!r} would close a cycle: "
                + " -> ".join(cycle) + "; a graph here is acyclic",
                cycle,
            )
        self._connect(source, target)
        self._changed()

    def _connect(self, source: str, target: str) -> None:
        self._succs[source].append(target)
        self._preds[target].append(source)
        self._edges.append((source, target))

    def _path(self, start: str, goal: str) -> list[str] | None:
        """The shortest path from start to goal along edges (edge order breaks ties)."""
        if start == goal:
            return [start]
        parent = {start: None}
        frontier = deque([start])
        while frontier:
            n = frontier.popleft()
            for s in self._succs[n]:
                if s in parent:
                    continue
                parent[s] = n
                if s == goal:
                    path = [s]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1]
                frontier.append(s)
        return None

    def _known(self, node_id: str) -> str:
        if node_id not in self._impl:
            known = ", ".join(repr(n) for n in list(self._impl)[:20]) or "none"
            raise DeclarationError(f"this graph has no node {node_id!r}; its nodes are {known}")
        return node_id

    def _changed(self) -> None:
        self._compiled = None

    # -- topology -----------------------------------------------------------------
    def nodes(self) -> list[str]:
        """The ids, in insertion order."""
        return list(self._impl)

    def edges(self) -> list[tuple[str, str]]:
        """The edges as ``(source, target)``, in insertion order."""
        return list(self._edges)

    def predecessors(self, node_id: str) -> list[str]:
        """The nodes feeding into ``node_id``, in edge order."""
        return list(self._preds[self._known(node_id)])

    def successors(self, node_id: str) -> list[str]:
        """The nodes ``node_id`` feeds into, in edge order."""
        return list(self._succs[self._known(node_id)])

    def roots(self) -> list[str]:
        """The nodes with no predecessor: where the input enters."""
        return [n for n, p in self._preds.items() if not p]

    def leaves(self) -> list[str]:
        """The nodes with no successor: what the graph answers with."""
        return [n for n, s in self._succs.items() if not s]

    def topological_sort(self) -> list[str]:
        """Each node after its predecessors; ties kept in insertion order."""
        waiting = {n: len(p) for n, p in self._preds.items()}
        ready = [n for n, count in waiting.items() if count == 0]
        order: list[str] = []
        at = 0
        while at < len(ready):
            batch = ready[at:]
            at = len(ready)
            for n in batch:
                order.append(n)
                for s in self._succs[n]:
                    waiting[s] -= 1
                    if waiting[s] == 0:
                        ready.append(s)
        return order

    # -- declarations -------------------------------------------------------------
    def place(self, node_id: str, device: str) -> None:
        """Places a node on a device (``"cuda:0"``); the primitive behind ``.on``."""
        self._devices[self._known(node_id)] = validate_device(device, node_id)
        self._changed()

    def devices(self) -> dict[str, str]:
        """Where each placed node runs, in declaration order."""
        return {n: self._devices[n] for n in self._impl if n in self._devices}

    def place_at(self, node_id: str, host: str) -> None:
        """Sends a node to a host, by name; what the name means the broker says."""
        self._hosts[self._known(node_id)] = validate_host(host, node_id)
        self._changed()

    def hosts(self) -> dict[str, str]:
        """Which host each node sent away runs on, in declaration order."""
        return {n: self._hosts[n] for n in self._impl if n in self._hosts}

    def cache(self, node_id: str, salt: str | None = None) -> None:
        """Keeps this node's output, with a salt for what the key cannot tell apart."""
        if salt is not None and not isinstance(salt, str):
            raise DeclarationError(f"node {node_id!r}: a salt is a str or None, not {salt!r}")
        self._cached[self._known(node_id)] = salt
        self._changed()

    def cached(self) -> dict[str, str | None]:
        """Which nodes are kept, and under what salt."""
        return {n: self._cached[n] for n in self._impl if n in self._cached}

    def freeze(self, node_id: str, state: str | None = None) -> None:
        """Declares this node settled, at the state with this digest if one is known."""
        if state is not None and not isinstance(state, str):
            raise DeclarationError(f"node {node_id!r}: a frozen state is a digest str or None")
        self._frozen[self._known(node_id)] = state
        self._changed()

    def frozen(self) -> dict[str, str | None]:
        """Which nodes are settled, and at what state (None where none was said)."""
        return {n: self._frozen[n] for n in self._impl if n in self._frozen}

    def mapped(self, node_id: str) -> None:
        """Says this node maps over the items of its input: a list in, as long a list out."""
        self._mapped[self._known(node_id)] = None
        self._changed()

    def mapped_nodes(self) -> list[str]:
        """The nodes that map over items, in declaration order."""
        return [n for n in self._impl if n in self._mapped]

    def declared_as(self, node_id: str, declaration: Any) -> None:
        """Notes what this node was built with; a ``sha256:`` digest is kept as it is,
        anything else is digested. Part of the key, beside the identity."""
        self._known(node_id)
        if isinstance(declaration, str) and declaration.startswith("sha256:"):
            digest = declaration
        else:
            try:
                digest = hexdigest_of(("declared", declaration))
            except Unwritable as exc:
                raise DeclarationError(
                    f"node {node_id!r}: the declaration holds a {exc.what.__qualname__}, "
                    "which cannot be written down; give data or a digest"
                ) from None
        self._declarations[node_id] = digest
        self._unwritable.pop(node_id, None)
        self._changed()

    def declarations(self) -> dict[str, str]:
        """What each node was built with, digested, where it could be said."""
        return {n: self._declarations[n] for n in self._impl if n in self._declarations}

    def written_as(self, node_id: str, fingerprint: str) -> None:
        """Notes the version of the code a node was written against; never in a key."""
        if not isinstance(fingerprint, str):
            raise DeclarationError(f"node {node_id!r}: a fingerprint is a str, not {fingerprint!r}")
        self._fingerprints[self._known(node_id)] = fingerprint
        self._changed()

    def fingerprints(self) -> dict[str, str]:
        """The code version noted for each node, where one was."""
        return {n: self._fingerprints[n] for n in self._impl if n in self._fingerprints}

    def identities(self) -> dict[str, str]:
        """What implements each node: ``module.QualifiedName`` of its class."""
        return {n: identity(impl) for n, impl in self._impl.items()}

    def implementation(self, node_id: str) -> Any:
        """The object registered under ``node_id``, or None."""
        return self._impl.get(node_id)

    # -- plans --------------------------------------------------------------------
    def plan(self) -> Plan:
        """How this graph will be walked: its waves, distributed by host."""
        order = self.topological_sort()
        return _plan.distribute(_plan.waves(order, self._preds), self._hosts)

    def plan_json(self) -> str:
        """The plan as JSON text, for whoever draws it."""
        return json.dumps(_plan.plan_to_json(self.plan()))

    # -- running ------------------------------------------------------------------
    def forward(self, input: Any = None, *, broker: Any = None, store: Any = None,
                watching: Callable[[dict], None] | list[Callable[[dict], None]] | None = None,
                stamping: dict[str, str] | None = None) -> Any:
        """Executes the whole graph and returns what it produced.

        A single leaf answers with its value, several with ``{leaf: value}``. ``store``
        (a Store or a directory) makes ``.cached()`` nodes looked up and kept;
        ``watching`` (a callable or a list of them) is told every fact as it happens;
        ``stamping`` adds its pairs to each fact; ``broker`` says where hosts are.
        """
        from ._engine import execute

        return execute(self, input, broker=broker, store=store, watching=watching,
                       stamping=stamping)

    def foreseen_json(self, input: Any = None, *, store: Any = None) -> str:
        """What each node's output will be called, with nothing executed, as JSON:
        ``{"keys": {node: name}, "unneeded": [node, ...]}``, both ordered by id.

        A ``.mapped()`` node and anything under an input that cannot be written down
        are absent: absence means *cannot tell*, never *did not change*.
        """
        from ._engine import foresee

        return json.dumps(foresee(self, input, store=store), sort_keys=True)

    def provision(self, broker: Any) -> None:
        """Tells each host what it is going to need, before the first node runs: the
        whole graph, one catalog per wire. ``forward`` calls it for you."""
        if broker is None:
            return
        as_broker(broker)._provision_graph(self)

    def figure(self, overlay: Any = None, inside: Any = None) -> Any:
        """The graph drawn as a plotly figure; nothing is executed. Needs ``[viz]``."""
        try:
            from .viz import figure
        except ImportError as exc:  # plotly missing
            raise ImportError(
                "Graph.figure needs plotly: pip install 'somatize[viz]'"
            ) from exc
        return figure(self, overlay=overlay, inside=inside)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled"] = None
        return state

    def __repr__(self) -> str:
        return f"Graph({len(self._impl)} nodes, {len(self._edges)} edges)"


def as_broker(broker: Any) -> Any:
    """A broker, from a Broker or a ``{host: Worker}`` dict (as ``forward`` takes it)."""
    if isinstance(broker, dict):
        from .wire import Broker

        return Broker.embedded(broker)
    return broker


def identity(impl: Any) -> str:
    cls = type(impl)
    return f"{cls.__module__}.{cls.__qualname__}"


def _free(base: str, taken: Any) -> str:
    if base not in taken:
        return base
    n = 2
    while f"{base}_{n}" in taken:
        n += 1
    return f"{base}_{n}"


def _assign_ids(entries: list[tuple[Any, str | None, dict]]) -> list[str]:
    """Chosen ids as they are (a duplicate is refused naming both), defaults around them."""
    chosen: dict[str, int] = {}
    for position, (impl, node_id, _) in enumerate(entries):
        if node_id is None:
            continue
        if node_id in chosen:
            first = type(entries[chosen[node_id]][0]).__qualname__
            raise DeclarationError(
                f"two nodes are named {node_id!r}: a {first} and a {type(impl).__qualname__}; "
                "ids are unique within a graph"
            )
        chosen[node_id] = position
    taken = set(chosen)
    counts: dict[str, int] = {}
    ids = []
    for impl, node_id, _ in entries:
        if node_id is None:
            base = snake_case(type(impl).__name__)
            n = counts.get(base, 0) + 1
            node_id = base if n == 1 else f"{base}_{n}"
            while node_id in taken:
                n += 1
                node_id = f"{base}_{n}"
            counts[base] = n
            taken.add(node_id)
        ids.append(node_id)
    return ids
