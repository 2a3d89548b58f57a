"""Graph: nodes, edges, what each node is declared to be, and the facade over the walk.

A graph has one data form, ``GraphData``: plain fields, every declaration among them,
and nothing else. Whatever copies, rewires, serialises, sends or rebuilds a graph goes
through it — the catalog a worker receives, the ``graph`` fact a record keeps, the
copy a trainer rewires — with the pure functions below (``describe``, ``undescribed``,
``assembled``), never through the ``Graph``'s own fields. The ``Graph`` is the mutable
builder around it: everything it knows is declared through its methods, and its data
form is taken once per version of it and thrown away on the next change.

The queries answer in insertion order, which is the order things were said.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from . import _plan
from ._dsl import (
    Topology,
    as_piece,
    assign_ids,
    default_id,
    valid_device,
    valid_host,
    valid_id,
)
from ._errors import CycleError, DeclarationError
from ._keys import Unwritable, hexdigest_of
from ._node import made_with
from ._optional import optional

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["DECLARATIONS", "Graph", "GraphData", "assembled", "describe", "generated",
           "hand_down", "identity", "made_from", "undescribed", "user_ids", "validate_device",
           "validate_host"]

validate_device = valid_device
validate_host = valid_host

# What the library inserts into a graph it makes for itself (a trainer's positions)
# is named with a separator no id somebody chose can hold (``valid_id``), so a made
# id is never one of the user's, whatever the user's ids look like.
_MADE = "\x1f"


def generated(base: str, role: str) -> str:
    """An id the library makes beside node ``base``; never equal to a user's id."""
    return f"{base}{_MADE}{role}"


def made_from(node_id: str) -> str:
    """The user's id an id stands for: itself, or the node a made id stands beside."""
    return node_id.split(_MADE, 1)[0]


def user_ids(ids: Iterable[str]) -> list[str]:
    """``ids`` as the user knows them, in order, each once: what a message names."""
    return list(dict.fromkeys(map(made_from, ids)))


@dataclass(frozen=True, eq=False)
class GraphData:
    """A graph as plain data: ids in order, what implements each, the edges, and every
    declaration. Read, never written: a changed graph is a new ``GraphData``.

    ``unwritable`` names, by qualified type name, the nodes whose construction could not
    be written down (so they cannot be kept). ``memo`` holds what is derived from the
    rest (successors, the order, the compiled walk), computed once per data form.
    """

    ids: tuple[str, ...] = ()
    impls: Mapping[str, Any] = field(default_factory=dict)
    edges: tuple[tuple[str, str], ...] = ()
    devices: Mapping[str, str] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)
    cached: Mapping[str, str | None] = field(default_factory=dict)
    frozen: Mapping[str, str | None] = field(default_factory=dict)
    mapped: frozenset[str] = frozenset()
    declarations: Mapping[str, str] = field(default_factory=dict)
    unwritable: Mapping[str, str] = field(default_factory=dict)
    fingerprints: Mapping[str, str] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def preds(self) -> Mapping[str, tuple[str, ...]]:
        """Each node's predecessors, in edge order."""
        return self._derived("preds", lambda: _neighbours(self.ids, self.edges, 0))

    @property
    def succs(self) -> Mapping[str, tuple[str, ...]]:
        """Each node's successors, in edge order."""
        return self._derived("succs", lambda: _neighbours(self.ids, self.edges, 1))

    @property
    def order(self) -> tuple[str, ...]:
        """Each node after its predecessors; ties kept in insertion order."""
        return self._derived("order", lambda: _topological(self.ids, self.preds, self.succs))

    def identity(self, node_id: str) -> str:
        """What implements this node: ``module.QualifiedName`` of its class."""
        return identity(self.impls[node_id])

    def known(self, node_id: Any) -> str:
        """The id, if this graph has that node; else a DeclarationError listing some."""
        return _known(self.impls, node_id)

    def _derived(self, name: str, compute: Callable[[], Any]) -> Any:
        value = self.memo.get(name)
        if value is None:
            value = self.memo[name] = compute()
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["memo"] = {}  # what is derived is derived again where it lands
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


# The fields of ``GraphData`` that say something about single nodes, as opposed to the
# shape (ids, impls, edges) and what is derived from it (memo). Read off the class, so
# whatever copies declarations field by field (``assembled``) sees one added later too.
DECLARATIONS = tuple(f.name for f in fields(GraphData)
                     if f.name not in ("ids", "impls", "edges", "memo"))
# The declarations that are sets of ids rather than a value per id.
_SETS = frozenset(f.name for f in fields(GraphData) if isinstance(f.default, frozenset))


def _neighbours(ids: tuple[str, ...], edges: tuple[tuple[str, str], ...],
                side: int) -> dict[str, tuple[str, ...]]:
    """Each node's neighbours along ``edges``: its sources (``side`` 0, the
    predecessors) or its targets (``side`` 1, the successors), in edge order."""
    found: dict[str, list[str]] = {n: [] for n in ids}
    for edge in edges:
        found[edge[1 - side]].append(edge[side])
    return {n: tuple(found[n]) for n in ids}


def _topological(ids: tuple[str, ...], preds: Mapping[str, tuple[str, ...]],
                 succs: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    waiting = {n: len(preds[n]) for n in ids}
    ready = [n for n in ids if waiting[n] == 0]
    at = 0
    while at < len(ready):
        for s in succs[ready[at]]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
        at += 1
    return tuple(ready)


def assembled(ids: Iterable[str], impls: Mapping[str, Any], edges: Iterable[tuple[str, str]],
              **declarations: Any) -> GraphData:
    """A ``GraphData`` from its parts; each declaration keeps only nodes it knows, in id
    order, so a part taken from another graph cannot smuggle a stranger in. A name that
    is no declaration of ``GraphData`` (``DECLARATIONS``) is a TypeError, not dropped."""
    ids = tuple(ids)
    known = set(ids)
    strangers = set(declarations) - set(DECLARATIONS)
    if strangers:
        raise TypeError(f"assembled() got {sorted(strangers)}, which GraphData does not declare")
    for a, b in edges:
        if a not in known or b not in known:
            raise DeclarationError(f"an edge {a!r} -> {b!r} between nodes this graph lacks")
    tables = {name: frozenset(declarations.get(name, ())) & known if name in _SETS
              else _ordered(ids, declarations.get(name, {})) for name in DECLARATIONS}
    return GraphData(ids=ids, impls={n: impls[n] for n in ids},
                     edges=tuple((a, b) for a, b in edges), **tables)


def describe(data: GraphData) -> dict[str, Any]:
    """The graph as JSON-able data: everything but the objects, which are named by
    identity. What a ``graph`` fact carries and what a worker's catalog is built from."""
    return {
        "nodes": list(data.ids),
        "edges": [list(edge) for edge in data.edges],
        "identities": {n: data.identity(n) for n in data.ids},
        "devices": dict(data.devices),
        "hosts": dict(data.hosts),
        "cached": dict(data.cached),
        "frozen": dict(data.frozen),
        "mapped": [n for n in data.ids if n in data.mapped],
        "declarations": dict(data.declarations),
        "fingerprints": dict(data.fingerprints),
    }


def undescribed(description: Any, impl_of: Callable[[str, str], Any]) -> GraphData:
    """The mirror of ``describe``: ``impl_of(node, identity)`` answers each node's object.

    A description is checked whole first (it may come from a record on disk or from a
    peer), and a malformed one is a ValueError saying which part.
    """
    _check_description(description)
    ids = description["nodes"]
    identities = description.get("identities", {})
    impls = {n: impl_of(n, identities.get(n, "unknown.Unknown")) for n in ids}
    tables = {key: description.get(key, {}) for key in
              ("devices", "hosts", "cached", "frozen", "declarations", "fingerprints")}
    return assembled(ids, impls, [tuple(e) for e in description["edges"]],
                     mapped=description.get("mapped", []), **tables)


def _check_description(description: Any) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(f"a graph description that is malformed: {what}")

    if type(description) is not dict:
        raise bad("not a map")
    ids = description.get("nodes")
    if type(ids) is not list or not all(type(n) is str for n in ids) or len(set(ids)) != len(ids):
        raise bad("nodes")
    known = set(ids)
    edges = description.get("edges")
    if type(edges) is not list or not all(
            type(e) is list and len(e) == 2 and e[0] in known and e[1] in known for e in edges):
        raise bad("edges")
    for key in ("identities", "devices", "hosts", "declarations", "fingerprints"):
        table = description.get(key, {})
        if type(table) is not dict or not all(k in known and type(v) is str for k, v in table.items()):
            raise bad(key)
    for key in ("cached", "frozen"):
        table = description.get(key, {})
        if type(table) is not dict or not all(
                k in known and (v is None or type(v) is str) for k, v in table.items()):
            raise bad(key)
    mapped = description.get("mapped", [])
    if type(mapped) is not list or not all(n in known for n in mapped):
        raise bad("mapped")
    pairs = tuple(map(tuple, edges))
    if len(_topological(tuple(ids), _neighbours(tuple(ids), pairs, 0),
                        _neighbours(tuple(ids), pairs, 1))) != len(ids):
        raise bad("the edges close a cycle")


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
        self._mapped: set[str] = set()
        self._declarations: dict[str, str] = {}
        self._unwritable: dict[str, str] = {}  # declarations that could not be written
        self._fingerprints: dict[str, str] = {}
        self._away: dict[str, str] = {}  # nodes whose weights live elsewhere: why forward refuses
        self._data: GraphData | None = None

    # -- building -----------------------------------------------------------------
    @classmethod
    def somatize(cls, topology: Topology) -> Graph:
        """Materializes an expression into a graph; refuses it whole or builds it whole."""
        entries, edges = as_piece(topology).flatten()
        ids = assign_ids(entries)
        for node_id, (_, _, mods) in zip(ids, entries):
            if "device" in mods:
                valid_device(mods["device"], node_id)
            if "host" in mods:
                valid_host(mods["host"], node_id)
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
                graph._mapped.add(node_id)
        for a, b in edges:  # acyclic by construction: edges only go forward in the expression
            graph._connect(ids[a], ids[b])
        return graph

    @classmethod
    def from_data(cls, data: GraphData) -> Graph:
        """A graph that is this data form; changing it later changes a copy, not ``data``."""
        graph = cls()
        graph._impl.update(data.impls)
        graph._preds.update({n: list(p) for n, p in data.preds.items()})
        graph._succs.update({n: list(s) for n, s in data.succs.items()})
        graph._edges.extend(data.edges)
        graph._devices.update(data.devices)
        graph._hosts.update(data.hosts)
        graph._cached.update(data.cached)
        graph._frozen.update(data.frozen)
        graph._mapped.update(data.mapped)
        graph._declarations.update(data.declarations)
        graph._unwritable.update(data.unwritable)
        graph._fingerprints.update(data.fingerprints)
        graph._data = data
        return graph

    def data(self) -> GraphData:
        """This graph as data, as it is now; the same object until the graph changes."""
        data = self._data
        if data is None:
            ids = tuple(self._impl)
            data = self._data = GraphData(
                ids=ids, impls=dict(self._impl), edges=tuple(self._edges),
                devices=_ordered(ids, self._devices), hosts=_ordered(ids, self._hosts),
                cached=_ordered(ids, self._cached), frozen=_ordered(ids, self._frozen),
                mapped=frozenset(self._mapped), declarations=_ordered(ids, self._declarations),
                unwritable=_ordered(ids, self._unwritable),
                fingerprints=_ordered(ids, self._fingerprints))
        return data

    def node(self, *args: Any) -> str:
        """Adds a node, ``node(impl)`` or ``node(id, impl)``, and returns its id."""
        if len(args) == 1:
            impl, node_id = args[0], None
        elif len(args) == 2:
            node_id, impl = valid_id(args[0]), args[1]
        else:
            raise TypeError("node() takes an implementation, or an id and an implementation")
        piece = as_piece(impl)
        if piece._kind != "one":
            raise DeclarationError("node() takes one node; for an expression use Graph.somatize(...)")
        impl = piece._node
        if node_id is None:
            node_id = default_id(impl, self._impl)
        elif node_id in self._impl:
            raise DeclarationError(
                f"this graph already has a node {node_id!r} "
                f"({type(self._impl[node_id]).__qualname__}); choose another id"
            )
        self._add(node_id, impl)
        self.changed()
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
                self._unwritable[node_id] = exc.what.__qualname__

    def edge(self, source: str, target: str) -> None:
        """Connects two nodes that exist; refuses an edge that would close a cycle."""
        _known(self._impl, source)
        _known(self._impl, target)
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
        self.changed()

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

    def changed(self) -> None:
        """Says that running a node now means something else (a hook was put on its
        ``forward``): what was taken from this graph is taken again before the next walk."""
        self._data = None

    # -- topology -----------------------------------------------------------------
    def nodes(self) -> list[str]:
        """The ids, in insertion order."""
        return list(self._impl)

    def edges(self) -> list[tuple[str, str]]:
        """The edges as ``(source, target)``, in insertion order."""
        return list(self._edges)

    def predecessors(self, node_id: str) -> list[str]:
        """The nodes feeding into ``node_id``, in edge order."""
        return list(self._preds[_known(self._impl, node_id)])

    def successors(self, node_id: str) -> list[str]:
        """The nodes ``node_id`` feeds into, in edge order."""
        return list(self._succs[_known(self._impl, node_id)])

    def roots(self) -> list[str]:
        """The nodes with no predecessor: where the input enters."""
        return [n for n, p in self._preds.items() if not p]

    def leaves(self) -> list[str]:
        """The nodes with no successor: what the graph answers with."""
        return [n for n, s in self._succs.items() if not s]

    def topological_sort(self) -> list[str]:
        """Each node after its predecessors; ties kept in insertion order."""
        return list(self.data().order)

    # -- declarations -------------------------------------------------------------
    def place(self, node_id: str, device: str) -> None:
        """Places a node on a device (``"cuda:0"``); the primitive behind ``.on``."""
        self._devices[_known(self._impl, node_id)] = valid_device(device, node_id)
        self.changed()

    def devices(self) -> dict[str, str]:
        """Where each placed node runs, in declaration order."""
        return dict(self.data().devices)

    def place_at(self, node_id: str, host: str) -> None:
        """Sends a node to a host, by name; what the name means the broker says."""
        self._hosts[_known(self._impl, node_id)] = valid_host(host, node_id)
        self.changed()

    def hosts(self) -> dict[str, str]:
        """Which host each node sent away runs on, in declaration order."""
        return dict(self.data().hosts)

    def cache(self, node_id: str, salt: str | None = None) -> None:
        """Keeps this node's output, with a salt for what the key cannot tell apart."""
        if salt is not None and not isinstance(salt, str):
            raise DeclarationError(f"node {node_id!r}: a salt is a str or None, not {salt!r}")
        self._cached[_known(self._impl, node_id)] = salt
        self.changed()

    def cached(self) -> dict[str, str | None]:
        """Which nodes are kept, and under what salt."""
        return dict(self.data().cached)

    def freeze(self, node_id: str, state: str | None = None) -> None:
        """Declares this node settled, at the state with this digest if one is known."""
        if state is not None and not isinstance(state, str):
            raise DeclarationError(f"node {node_id!r}: a frozen state is a digest str or None")
        self._frozen[_known(self._impl, node_id)] = state
        self.changed()

    def trained_away(self, node_id: str, said: str) -> None:
        """Says that ``node_id`` learns where it runs, held by something outside this
        graph (a Trainer), so its object here keeps the weights it started with:
        ``forward`` through a broker then refuses with ``said`` (which names who holds
        the weights) rather than answer with weights that never learnt anything."""
        if not isinstance(said, str) or not said:
            raise DeclarationError(f"node {node_id!r}: say in words where its weights are")
        self._away[_known(self._impl, node_id)] = said

    def frozen(self) -> dict[str, str | None]:
        """Which nodes are settled, and at what state (None where none was said)."""
        return dict(self.data().frozen)

    def mapped(self, node_id: str) -> None:
        """Says this node maps over the items of its input: a list in, as long a list out."""
        self._mapped.add(_known(self._impl, node_id))
        self.changed()

    def mapped_nodes(self) -> list[str]:
        """The nodes that map over items, in declaration order."""
        return [n for n in self._impl if n in self._mapped]

    def declared_as(self, node_id: str, declaration: Any) -> None:
        """Notes what this node was built with; a ``sha256:`` digest is kept as it is,
        anything else is digested. Part of the key, beside the identity."""
        _known(self._impl, node_id)
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
        self.changed()

    def declarations(self) -> dict[str, str]:
        """What each node was built with, digested, where it could be said."""
        return dict(self.data().declarations)

    def written_as(self, node_id: str, fingerprint: str) -> None:
        """Notes the version of the code a node was written against; never in a key."""
        if not isinstance(fingerprint, str):
            raise DeclarationError(f"node {node_id!r}: a fingerprint is a str, not {fingerprint!r}")
        self._fingerprints[_known(self._impl, node_id)] = fingerprint
        self.changed()

    def fingerprints(self) -> dict[str, str]:
        """The code version noted for each node, where one was."""
        return dict(self.data().fingerprints)

    def identities(self) -> dict[str, str]:
        """What implements each node: ``module.QualifiedName`` of its class."""
        return {n: identity(impl) for n, impl in self._impl.items()}

    def implementation(self, node_id: str) -> Any:
        """The object registered under ``node_id``, or None."""
        return self._impl.get(node_id)

    # -- plans --------------------------------------------------------------------
    def plan(self) -> Plan:
        """How this graph will be walked: its waves, distributed by host."""
        data = self.data()
        return _plan.distribute(_plan.waves(data.order, data.preds), data.hosts)

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
        ``stamping`` adds its pairs to each fact; ``broker`` says where hosts are (a
        Broker, or ``{host: Worker}``).
        """
        away = getattr(self, "_away", None)  # a graph pickled before it had one has none
        if away and broker is not None:
            raise DeclarationError(next(iter(away.values())))
        return _above["execute"](self, input, broker=broker, store=store,
                                 watching=watching, stamping=stamping)

    def foreseen_json(self, input: Any = None, *, store: Any = None) -> str:
        """What each node's output will be called, with nothing executed, as JSON:
        ``{"keys": {node: name}, "unneeded": [node, ...]}``, both ordered by id.

        A ``.mapped()`` node and anything under an input that cannot be written down
        are absent: absence means *cannot tell*, never *did not change*.
        """
        return json.dumps(_above["foresee"](self, input, store=store), sort_keys=True)

    def provision(self, broker: Any) -> None:
        """Tells each host what it is going to need, before the first node runs: the
        whole graph, one catalog per wire. ``forward`` calls it for you."""
        if broker is None:
            return
        _above["runner_of"](broker).prepare(self.data())

    def figure(self, overlay: Any = None, inside: Any = None) -> Any:
        """The graph drawn as a plotly figure; nothing is executed. Needs ``[viz]``."""
        return optional("somatize.viz", "viz", "Graph.figure").figure(
            self.data(), overlay=overlay, inside=inside)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_data"] = None
        return state

    def __repr__(self) -> str:
        return f"Graph({len(self._impl)} nodes, {len(self._edges)} edges)"


# The walk sits a layer above the graph and hands its functions down as it loads (the
# package imports it), so that the graph's facade reaches it without importing upwards
# (the ``graph's walk`` registry of ``_registries``).
_above: dict[str, Callable[..., Any]] = {}


def hand_down(**functions: Callable[..., Any]) -> None:
    """Called once by the walk's module with ``execute``, ``foresee`` and ``runner_of``."""
    _above.update(functions)


def identity(impl: Any) -> str:
    """``module.QualifiedName`` of an object's class."""
    cls = type(impl)
    return f"{cls.__module__}.{cls.__qualname__}"


def _known(impls: Mapping[str, Any], node_id: Any) -> str:
    """``node_id``, if ``impls`` holds that node; else a DeclarationError listing some."""
    if node_id not in impls:
        some = ", ".join(repr(n) for n in list(impls)[:20]) or "none"
        raise DeclarationError(f"this graph has no node {node_id!r}; its nodes are {some}")
    return node_id


def _ordered(ids: tuple[str, ...], table: Mapping[str, Any]) -> dict[str, Any]:
    return {n: table[n] for n in ids if n in table}
