"""What a walk remembers: keys for one forward, lookups before, keeping after.

Before the first node runs, every key that can be known is known: the input is
hashed once, each node's key is the digest of its prefix (identity, declaration,
salt, frozen state) and its inputs' keys, and each ``.cached()`` node is looked up.
From the hits follows what does not have to run at all (``unneeded``): a node whose
every reader was recalled or is itself unneeded. The refusals happen here too, so a
cache that could lie is refused before anything runs rather than noticed later.

A ``.mapped()`` node is remembered item by item: each item's key comes from the
item's content (the one place an intermediate is hashed), the node is handed only
the items that are missing, and its output's key is the digest of the items' keys,
so what is below it can still be kept.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._codec import dumps, loads
from ._errors import CacheError, StoreError, UnwritableError, walk_error
from ._items import Items
from ._keys import Unwritable, digest_of, node_key, node_prefix
from ._walk import FAR, ONE, ROOT, SKIP, Hooks, gather, mapped_answer, mapped_items
from .store import Store

__all__ = ["Memory", "changing_above", "foreseen", "name_of", "open_store"]


def open_store(store: Any) -> Store:
    """A Store, from a Store or a directory.

    A directory's Store is opened once and handed out again while that directory is
    the one it opened (same device and inode), since opening one costs about as much as
    a cache hit; a directory removed or replaced since is opened afresh."""
    if isinstance(store, Store):
        return store
    if not (isinstance(store, (str, bytes)) or hasattr(store, "__fspath__")):
        raise TypeError(f"store= takes a Store or a directory, not a {type(store).__qualname__}")
    where = os.path.abspath(os.fsdecode(store))
    known = _OPENED.get(where)
    if known is not None and known[1] == _identity(where):
        return known[0]
    opened = Store(where)
    if len(_OPENED) >= _OPENED_KEPT:
        _OPENED.pop(next(iter(_OPENED)))
    _OPENED[where] = (opened, _identity(where))
    return opened


_OPENED: dict[str, tuple[Store, tuple[int, int] | None]] = {}
_OPENED_KEPT = 64


def _identity(where: str) -> tuple[int, int] | None:
    try:
        status = os.stat(where)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def name_of(key: bytes) -> str:
    """The store name a key is kept under."""
    return "key/" + key.hex()


class Static:
    """What remembering needs that only changes with the graph."""

    def __init__(self, prog: Any):
        data = prog.data
        self.prefix = [node_prefix(data.identity(n), data.declarations.get(n),
                                   data.cached.get(n), data.frozen.get(n)) for n in data.ids]
        self.refusal = _refusal(data)


def _refusal(data: Any) -> str | None:
    """Why keeping these nodes could lie, or None: something above a cached node (or the
    node itself) can still change, or a cached node's declaration cannot be written."""
    for n in data.cached:
        if n in data.unwritable:
            return (f"node {n!r} is .cached() but it was built with a "
                    f"{data.unwritable[n]}, which cannot be written down, so two "
                    "different constructions would share one key; build it from data, or say "
                    f"what it is with graph.declared_as({n!r}, ...)")
    changing = changing_above(data, data.frozen, _has_parameters)
    if changing is None:
        return None
    n, above = changing
    return (f"node {n!r} is .cached() but {above!r} "
            f"{'is itself' if above == n else 'is above it and'} has parameters "
            "and is not frozen, so what was kept could stop being what it would "
            f"produce; declare {above!r} .frozen() (and settle it with "
            "somatize.torch.freeze), or drop .cached()")


def changing_above(data: Any, frozen: Any, has_parameters: Any) -> tuple[str, str] | None:
    """The first cached node with something at or above it that can still change (has
    parameters, by ``has_parameters(impl, id)``, and is not in ``frozen``), and that
    something; None when every kept output stays what it would be. The one rule both
    the walk and a Trainer hold a cache to."""
    for n in data.cached:
        seen, stack = [n], [n]
        while stack:
            for p in data.preds[stack.pop()]:
                if p not in seen:
                    seen.append(p)
                    stack.append(p)
        for above in seen:
            if above not in frozen and has_parameters(data.impls[above], above):
                return n, above
    return None


def _has_parameters(impl: Any, node_id: str) -> bool:
    parameters = getattr(impl, "parameters", None)
    if not callable(parameters):
        return False
    try:
        return any(True for _ in parameters())
    except TypeError:
        return False


def _input_key(value: Any) -> tuple[bytes | None, type | None]:
    try:
        return digest_of(value), None
    except Unwritable as exc:
        return None, exc.what


def _keys(prog: Any, route: Any, static: Static, root: bytes | None,
          keys: list[bytes | None]) -> None:
    """Fills in every key that can be known before anything runs."""
    for i in route.order:
        if prog.mapped[i]:
            continue
        kind, source = prog.gathers[i]
        if kind == ROOT:
            inputs = [root]
        elif kind in (ONE, FAR):
            inputs = [keys[source]]
        else:
            inputs = [keys[at] for _, at in source]
        if all(k is not None for k in inputs):
            keys[i] = node_key(static.prefix[i], inputs)


class Memory(Hooks):
    """The remembering half of one forward: the hooks of its cached, mapped, recalled
    and unneeded nodes."""

    def __init__(self, prog: Any, store: Any, static: Static, keys: list, hits: dict,
                 demand: list[bool], emit: Any, input_type: type | None):
        self.prog, self.store, self.static = prog, store, static
        self.keys, self.hits, self.demand, self.emit = keys, hits, demand, emit
        self.input_type = input_type
        self.special = [prog.cached[i] or prog.mapped[i] or not demand[i] or i in hits
                        for i in range(len(prog.ids))]
        self.items: dict[int, Items] = {}  # mapped nodes between before and after

    @classmethod
    def start(cls, prog: Any, route: Any, input: Any, store: Any, wanted: list[int],
              emit: Any) -> Memory:
        store = open_store(store)
        static = prog.routes.get("memory")
        if static is None:
            static = prog.routes["memory"] = Static(prog)
        if static.refusal is not None:
            raise CacheError(static.refusal)
        data = prog.data
        for node in route.sent:
            if node in data.cached:
                raise CacheError(
                    f"node {node!r} is .cached() and sent to host {data.hosts[node]!r}; "
                    "outputs are kept by whoever holds the store, which is here: run "
                    f"{node!r} here, or drop .cached()"
                )
        root, input_type = _input_key(input)
        if input_type is not None:
            needing = [prog.ids[i] for i in route.order if prog.cached[i]]
            if needing:
                raise UnwritableError(
                    f"node {needing[0]!r} is .cached(), so it needs a key, but the input is a "
                    f"{input_type.__module__}.{input_type.__qualname__}, which cannot be written "
                    "down; register a codec for it with somatize.codec(kind, type, dump=, "
                    "load=), or run without store="
                )
        keys: list[bytes | None] = [None] * len(prog.ids)
        _keys(prog, route, static, root, keys)
        hits = {}
        for i in route.order:
            if prog.cached[i] and not prog.mapped[i] and keys[i] is not None:
                bound = store.resolve(name_of(keys[i]))
                if bound is not None:
                    hits[i] = bound
        demand = _demand(prog, route, wanted, hits)
        return cls(prog, store, static, keys, hits, demand, emit, input_type)

    def before(self, i: int, vals: list[Any], value: Any) -> Any:
        prog, emit = self.prog, self.emit
        if not self.demand[i]:
            if emit is not None:
                emit({"fact": "unneeded", "node": prog.ids[i]})
            vals[i] = None
            return SKIP
        if self.keys[i] is None and prog.cached[i] and not prog.mapped[i]:
            key = self.keys[i] = self._late_key(i)
            if key is not None:
                bound = self.store.resolve(name_of(key))
                if bound is not None:
                    self.hits[i] = bound
        if i in self.hits:
            vals[i] = self._recall(i, self.hits[i])
            return SKIP
        x = gather(prog, i, vals, value)
        if not prog.mapped[i]:
            return x
        x = mapped_items(prog, i, x)
        if not prog.cached[i]:
            return x
        items = self.items[i] = Items.looked_up(self.store, prog.ids[i], self.static.prefix[i],
                                                x, emit)
        if not items.missing:
            vals[i] = self._kept_items(i, [])
            return SKIP
        return items.missing_items()

    def after(self, i: int, x: Any, out: Any) -> Any:
        prog = self.prog
        if prog.mapped[i]:
            out = mapped_answer(prog, i, x, out)
            return self._kept_items(i, out) if prog.cached[i] else out
        if prog.cached[i]:
            self._keep(i, self.keys[i], out)
        return out

    def told(self, i: int, x: Any, fact: dict[str, Any]) -> None:
        if self.prog.mapped[i]:
            fact["items"] = len(x)

    def _kept_items(self, i: int, fresh: list[Any]) -> list[Any]:
        items = self.items.pop(i)
        try:
            out = items.kept(fresh)
        except UnwritableError as exc:
            raise walk_error(UnwritableError(
                f"node {self.prog.ids[i]!r}: what it answered for an item cannot be kept: "
                f"{exc}")) from None
        self.keys[i] = items.key
        return out

    def _late_key(self, i: int) -> bytes | None:
        """The key of a node below a mapped one, known only once that one ran."""
        prog = self.prog
        kind, source = prog.gathers[i]
        if kind == ROOT:
            return None
        inputs = ([self.keys[source]] if kind in (ONE, FAR)
                  else [self.keys[at] for _, at in source])
        if any(k is None for k in inputs):
            if self.input_type is not None:
                raise walk_error(UnwritableError(
                    f"node {prog.ids[i]!r} is .cached() but the input is a "
                    f"{self.input_type.__qualname__}, which cannot be written down, so "
                    "nothing under it has a key; register a codec for it with "
                    "somatize.codec(...), or drop .cached()"
                ))
            return None
        return node_key(self.static.prefix[i], inputs)

    def _recall(self, i: int, bound: Any) -> Any:
        node = self.prog.ids[i]
        blob = self.store.get(bound.digest)
        if blob is None:
            raise walk_error(StoreError(
                f"node {node!r}: {bound.name} points at {bound.digest}, which the store "
                "does not have; remove the name, or put the object back"
            ))
        value = loads(blob, f"the object {bound.digest} that {bound.name} (node {node!r}) "
                            "points at")
        kept_as = bound.meta.get("fingerprint") if bound.meta else None
        now = self.prog.data.fingerprints.get(node)
        if kept_as != now:
            print(f"somatize: node {node!r} recalled an output kept by version {kept_as!r}; "
                  f"this graph says {now!r}", file=sys.stderr)
        if self.emit is not None:
            self.emit({"fact": "recalled", "node": node, "key": bound.name})
        return value

    def _keep(self, i: int, key: bytes | None, out: Any) -> None:
        prog = self.prog
        node = prog.ids[i]
        if key is None:
            raise walk_error(UnwritableError(
                f"node {node!r} is .cached() but its input cannot be written down "
                f"(a {(self.input_type or object).__qualname__}), so it has no key; register "
                "a codec for it with somatize.codec(...), or drop .cached()"
            ))
        meta = {"node": node}
        fingerprint = prog.data.fingerprints.get(node)
        if fingerprint is not None:
            meta["fingerprint"] = fingerprint
        try:
            blob = dumps(out)
        except UnwritableError as exc:
            raise walk_error(UnwritableError(
                f"node {node!r} is .cached() but what it returned cannot be kept: {exc}")) from None
        name = name_of(key)
        self.store.bind(name, self.store.put(blob), meta)
        if self.emit is not None:
            self.emit({"fact": "kept", "node": node, "key": name})


def _demand(prog: Any, route: Any, wanted: list[int], hits: dict) -> list[bool]:
    """Which nodes have a reader that needs them: walking back from what is wanted,
    a recalled node stops the need from reaching above it."""
    demand = [False] * len(prog.ids)
    for i in wanted:
        demand[i] = True
    inside = set(route.order)
    for i in reversed(route.order):
        if demand[i]:
            continue
        for s in prog.succs[i]:
            if s in inside and demand[s] and s not in hits:
                demand[i] = True
                break
    return demand


def foreseen(prog: Any, route: Any, input: Any, store: Any) -> dict[str, Any]:
    """The keys and the unneeded of one forward along ``route``, with nothing run."""
    store = open_store(store)
    static = prog.routes.get("memory")
    if static is None:
        static = prog.routes["memory"] = Static(prog)
    root, _ = _input_key(input)
    keys: list[bytes | None] = [None] * len(prog.ids)
    _keys(prog, route, static, root, keys)
    hits = {i: True for i in route.order
            if prog.cached[i] and keys[i] is not None and store.resolve(name_of(keys[i]))}
    demand = _demand(prog, route, route.wanted, hits)
    named = {prog.ids[i]: name_of(keys[i]) for i in route.order if keys[i] is not None}
    unneeded = sorted(prog.ids[i] for i in route.order if not demand[i])
    return {"keys": dict(sorted(named.items())), "unneeded": unneeded}
