"""The Audit: what each node of a graph produced, what came back for it, and what the
optimizer did to what it holds — measured, never judged.

A measured step is every ``every``-th, the first included. On it, each ``where`` (a
node, or ``node.path.to.submodule`` with ``inside=``) pools what it produced across
the step's forwards (pieces of a ``micro`` batch, a module called twice) and the
gradients that came back for it, as one population; when the step is over,
``observed`` reads every number at once — one ``tolist()`` per device — and says one
``health`` fact per ``where``. On any other step the hooks return at once.

What a node produced is read whatever shape it has: a tensor, an ``Opaque`` one, or
tuples, lists and dicts of them (three levels deep); every floating tensor in it is
pooled into the one population, since a node that answers ``(output, state)`` made
both. Channels (``dead_channels``) are read from the first of them only, where a
channel is dimension 1. Integer tensors (token ids, masks) are not activations and
are passed over.

A node is hooked by putting a thin callable in front of its ``forward`` (an instance
attribute; the class is never touched), since a node is not a module and the walk
calls ``forward`` directly. Modules inside it get torch forward hooks. Both come off
with ``release``, and several audits on one node share one wrapper, so that each
counts once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._errors import DeclarationError, whole_number
from ._bounded import module_is_bounded
from ._measures import Held, Place, Sink
from ._weights import held, modules_of

__all__ = ["MEASURES", "Audit", "audit_for"]

#: The names a ``health`` fact may carry besides ``fact``, ``where`` and ``step``.
MEASURES = ("act_mean", "act_std", "act_zero", "act_saturated", "grad_norm", "grad_mean",
            "grad_std", "nonfinite", "weight_norm", "update_ratio", "update_norm",
            "dead_channels", "channels", "act_hist", "grad_hist", "leak_norm_auc",
            "leak_norm_classes", "leak_direction_auc", "input_dcor", "input_dcor_corrected")


class Audit:
    """Watches the nodes of a graph and says, every ``every`` steps, what it saw.

    ``snapshot``: every how many measured steps the histograms come too.
    ``channels``: count the channels that stayed zero through the last ``window``
    measured steps. ``groups``: ``{where: {group: channels}}``, the same count kept
    apart per group (and tracked for those wheres even without ``channels``).
    ``inside``: also hook modules within nodes — ``True`` (what each node holds
    directly, as ``architecture`` lists it at depth 0), a depth, ``architecture``'s
    answer, ``{node: [path, ...]}`` or ``["node.path", ...]`` — at most ``most`` per
    node. Refused when watching: a group or path that names nothing there.
    ``leaks``: also measure what a worker could learn from what each trained cut is
    sent — the label-leak AUCs of the gradients and the distance correlation of the
    activations with the input (``_privacy``), taken by the Trainer where the labels are.
    """

    #: ``weight_norm`` and ``update_ratio`` of a tensor larger than this are read off a
    #: fixed random sample of this many of its entries (None: all of them, at the
    #: price of a copy of every weight and two passes over it each measured step).
    sampled: int | None = 4096

    def __init__(self, *, every: int = 1, snapshot: int = 50, channels: bool = False,
                 groups: Mapping[str, Mapping[str, Iterable[int]]] | None = None,
                 window: int = 20, inside: Any = None, most: int = 32, leaks: bool = False):
        self.every = whole_number(every, "every", of="Audit")
        self.snapshot = whole_number(snapshot, "snapshot", of="Audit")
        self.window = whole_number(window, "window", of="Audit")
        self.most = whole_number(most, "most", of="Audit")
        if not isinstance(channels, bool):
            raise TypeError(f"Audit: channels= is True or False, not {channels!r}")
        self.channels = channels
        if not isinstance(leaks, bool):
            raise TypeError(f"Audit: leaks= is True or False, not {leaks!r}")
        self.leaks = leaks
        self.groups = _groups(groups)
        self.inside = inside
        self._graph: Any = None
        self._wheres: list[Place] = []
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, _Wrapper, Place]] = []
        self._step = 1  # the number of the step about to happen
        self._steered = False  # a Trainer says when its steps begin
        self._held: Held | None = None  # the weights of what is watched
        # What the hooks on each watched place (``Place``) read on every call, kept as
        # plain attributes so that reading them costs no call; only the Audit writes them.
        #: Whether the hooks count now: a measured step is under way.
        self.armed = False
        #: How many measured steps have been read; every ``snapshot``-th keeps histograms.
        self.measured_steps = 0
        #: The watched weights as this step found them (``take_weights_before``); None before.
        self.weights_before: Any = None
        #: Where the tensors the watched places produce are kept, for ``probe``; None
        #: unless ``keep_outputs`` asked for it.
        self.kept_outputs: list[torch.Tensor] | None = None
        self.probes = 1  # gradients pooled over this many probes are read as one

    def __repr__(self) -> str:
        watching = f", watching {len(self._wheres)} wheres" if self._graph is not None else ""
        return f"Audit(every={self.every}, snapshot={self.snapshot}{watching})"

    # -- on and off -------------------------------------------------------------------
    def watch(self, graph: Any) -> Audit:
        """Hooks every node of ``graph`` (and, with ``inside=``, modules within them).

        Watching the graph it already watches changes nothing; another graph is
        refused until ``release()``. Nodes sent to another host are not hooked: what
        they produce exists over there. All paths and groups are checked before the
        first hook goes on.
        """
        if self._graph is graph:
            return self
        if self._graph is not None:
            raise DeclarationError("this Audit already watches another graph; release() it "
                                   "first, or give each graph an Audit of its own")
        wheres = self._plan(graph)
        for where in wheres:
            if where.module is not None:
                self._handles.append(where.module.register_forward_hook(where.hook))
            else:
                node = graph.implementation(where.node)
                self._wrapped.append((node, _Wrapper.around(node, where), where))
                self._handles += [module.register_forward_hook(where.mark)
                                  for module in _bounded_inside(node)]
        graph.changed()  # the walk keeps bound forwards; have it look again
        self._graph, self._wheres = graph, wheres
        self._held = Held(wheres, self.sampled)
        self._restart(not self._steered)
        return self

    def check_for(self, graph: Any) -> None:
        """Refuses, before anything is hooked, to be a Trainer's audit of ``graph``: one
        that watches another graph, or is steered by another Trainer, or whose paths
        and groups do not fit this graph."""
        if self._graph is not None and self._graph is not graph:
            raise DeclarationError("the Audit given as auditing= watches another graph; "
                                   "release() it first, or give this Trainer an Audit of its own")
        if self._steered:
            raise DeclarationError("this Audit is already used by another Trainer; give each "
                                   "Trainer an Audit of its own")
        self._plan(graph)

    def by_hand(self, node_id: str, node: Any) -> Audit:
        """Watches one node with no graph and no hook: whoever holds it says what it
        produced (``saw``). That is a trainer on a worker, which sees its node's
        activation and gradient anyway; its facts travel back in its answers."""
        where = Place(self, node_id, node_id, None, held(node, node_id))
        where.tracks = self.channels
        self._handles += [module.register_forward_hook(where.mark)
                          for module in _bounded_inside(node)]
        self._graph, self._wheres = _BY_HAND, [where]
        self._held = Held(self._wheres, self.sampled)
        self._steered = True
        return self

    def saw(self, output: Any) -> None:
        """What the node watched ``by_hand`` produced this step."""
        self._wheres[0].produced(output)

    def release(self) -> None:
        """Takes every hook off, so the graph is as it was and a later ``watch`` starts
        clean. Safe to call twice, and from a finalizer."""
        for handle in self._handles:
            handle.remove()
        for node, wrapper, where in self._wrapped:
            wrapper.drop(node, where)
        graph = self._graph
        self._handles, self._wrapped, self._wheres = [], [], []
        self._graph, self.armed, self.weights_before, self._steered = None, False, None, False
        self._held = None
        if graph is not None:
            graph.changed()

    @property
    def wheres(self) -> list[str]:
        """What is being watched, in the order the facts come: each node, then the
        modules hooked within it."""
        return [where.name for where in self._wheres]

    def _plan(self, graph: Any) -> list[Place]:
        from .._graph import Graph

        if not isinstance(graph, Graph):
            raise TypeError(f"Audit.watch takes a somatize Graph, not a {type(graph).__qualname__}")
        hosts = graph.hosts()
        inside = _inside(graph, self.inside, self.most)
        wheres = []
        for node_id in graph.topological_sort():  # a step's last node is a leaf
            if node_id in hosts:
                continue
            node = graph.implementation(node_id)
            if not hasattr(node, "__dict__"):
                raise DeclarationError(
                    f"node {node_id!r} ({type(node).__qualname__}) keeps no __dict__ (it has "
                    "__slots__), so the Audit cannot put itself in front of its forward; "
                    "give the class a __dict__, or audit without it")
            wheres.append(Place(self, node_id, node_id, None, held(node, node_id)))
            for path, module in inside.get(node_id, []):
                wheres.append(Place(self, f"{node_id}.{path}", node_id, module,
                                     list(module.parameters())))
        names = {where.name: where for where in wheres}
        for name, parts in self.groups.items():
            if name not in names:
                raise DeclarationError(
                    f"groups= names {name!r}, which this Audit does not watch; it watches "
                    f"{', '.join(map(repr, names)) or 'nothing'} (a submodule is watched "
                    "with inside=)")
            names[name].groups = parts
        for where in wheres:
            where.tracks = self.channels or where.groups is not None
        return wheres

    # -- the step ---------------------------------------------------------------------
    def _measuring(self) -> bool:
        return (self._step - 1) % self.every == 0

    @property
    def measuring(self) -> bool:
        """Whether the step under way (until ``observed``) is a measured one."""
        return self._measuring()

    def _restart(self, arm: bool) -> None:
        self.armed = arm and self._measuring() and self._graph is not None
        if self.weights_before is not None:  # a hook ran since the last restart: forget it
            self.weights_before = None
            for where in self._wheres:
                where.clear()

    @property
    def watching(self) -> bool:
        """Whether its hooks are on (a graph, or a node by hand, is being watched)."""
        return self._graph is not None

    def take(self, graph: Any) -> None:
        """A Trainer takes this Audit (``audit_for`` checked that it may): it watches the
        graph, and from now on the hooks count only between the Trainer's ``begin``
        and ``observed``, so nothing another Trainer runs on the same graph meanwhile
        is mistaken for this one's step."""
        self._steered, self.armed = True, False
        self.watch(graph)

    def begin(self, graph: Any = None) -> bool:
        """A Trainer's step begins (on the node it watches by hand, without a graph).
        After ``release`` (a closed Trainer stepping on) the hooks go back on first, and
        the answer is True: what was compiled from the graph has to be taken again."""
        rehooked = False
        if self._graph is None and graph is not None:
            self.watch(graph)
            self._steered = rehooked = True
        self._restart(True)
        return rehooked

    def take_weights_before(self) -> None:
        """Keeps the trainable weights as the step found them, for ``update_ratio``; a
        place's hook calls it the first time it counts in a step (``before`` is None),
        since nothing moves the weights before the optimizer does."""
        self.weights_before = self._held.taken()

    def keep_outputs(self) -> list[torch.Tensor]:
        """From now on, every tensor a watched place produces is kept in the list this
        answers, so that ``probe`` can take its directions back to each of them."""
        self.kept_outputs = []
        return self.kept_outputs

    def observed(self, graph: Any = None, *, updated: bool = True) -> list[dict[str, Any]]:
        """One ``health`` fact per ``where`` for the step that just ended; [] when it
        was not measured. Call it after the optimizer's step, so ``update_ratio`` is
        what the step did; ``updated=False`` (a group of steps still open) leaves
        ``update_ratio`` out rather than calling no update a zero one. ``graph`` is the
        one it watches; None for the node it watches by hand."""
        if graph is None and self._graph is _BY_HAND:
            graph = _BY_HAND
        if graph is not self._graph:
            raise DeclarationError("Audit.observed was handed a graph it does not watch; "
                                   "call watch(graph) first, and observed with that graph")
        step, measured = self._step, self._measuring()
        try:
            facts = self._facts(step, updated) if measured else []
        finally:
            self._step += 1
            if measured:
                self.measured_steps += 1
            self._restart(not self._steered)
        return facts

    def _facts(self, step: int, updated: bool) -> list[dict[str, Any]]:
        if not any(where.acts or where.grads for where in self._wheres):
            return []  # nothing ran under the hooks: a step that was not one
        sink = Sink()
        k = self.measured_steps
        hist = k % self.snapshot == 0
        plans = [where.gather(sink, k, hist) for where in self._wheres]
        weights = self._held.measured(sink, self.weights_before if updated else None)
        sink.read()
        facts = []
        for at, (where, plan) in enumerate(zip(self._wheres, plans)):
            fact = {"fact": "health", "where": where.name, "step": step}
            fact.update(plan(sink))
            fact.update(weights(at))
            if len(fact) > 3:
                facts.append(fact)
        return facts


_BY_HAND = object()  # what an Audit watching one node by hand watches instead of a graph


def _bounded_inside(node: Any) -> list[torch.nn.Module]:
    """The modules within a node whose answers are bounded, once each: a node's output
    that is one of their tensors (or a view of one) is known to be bounded."""
    found = {id(m): m for top in modules_of(node) for m in top.modules() if module_is_bounded(m)}
    return list(found.values())


def audit_for(graph: Any, auditing: Any, watchers: list[Any]) -> Audit | None:
    """What a Trainer's ``auditing=`` asks for, checked but not yet taken: every refusal
    comes before the Trainer changes anything, and ``take`` after it cannot refuse."""
    if auditing is None or auditing is False:
        return None
    audit = Audit() if auditing is True else auditing
    if not isinstance(audit, Audit):
        raise TypeError(f"auditing= is True or an Audit(...), not a {type(auditing).__qualname__}")
    if not watchers:
        raise DeclarationError(
            "auditing= was given but watching= is empty, so every health fact would be "
            "measured for nobody; pass watching=Recorder(store) (or any callable) beside it")
    audit.check_for(graph)
    return audit


# -- one place being watched --------------------------------------------------------------


class _Wrapper:
    """What stands in front of a node's ``forward`` while it is watched: calls it, then
    tells each watching place what it produced. One per node, however many audits."""

    __slots__ = ("inner", "mine", "places")

    def __init__(self, inner: Any, mine: bool):
        self.inner = inner  # what forward was before: the bound method, or an attribute
        self.mine = mine  # whether forward was an instance attribute before us (False)
        self.places: list[Place] = []

    @classmethod
    def around(cls, node: Any, where: Place) -> _Wrapper:
        current = node.__dict__.get("forward")
        wrapper = current if isinstance(current, cls) else None
        if wrapper is None:
            wrapper = cls(node.forward, current is None)
            node.__dict__["forward"] = wrapper
        wrapper.places.append(where)
        return wrapper

    def drop(self, node: Any, where: Place) -> None:
        self.places = [p for p in self.places if p is not where]
        if not self.places and node.__dict__.get("forward") is self:
            if self.mine:
                del node.__dict__["forward"]
            else:
                node.__dict__["forward"] = self.inner

    def __call__(self, input: Any, ctx: Any) -> Any:
        out = self.inner(input, ctx)
        for place in self.places:
            place.produced(out)
        return out


# -- reading the numbers back -------------------------------------------------------------


# -- what is watched ----------------------------------------------------------------------


def _inside(graph: Any, inside: Any, most: int) -> dict[str, list[tuple[str, Any]]]:
    """``{node: [(path, module), ...]}`` for what ``inside=`` asks, at most ``most`` each."""
    if inside is None or inside is False:
        return {}
    if inside is True or (type(inside) is int and inside >= 0):
        from ._architecture import architecture

        asked: dict[str, list[str]] = {
            node: [p for path, what in listed for p in (what.get("paths") or [path])
                   if what.get("kind") != "parameter"]
            for node, listed in architecture(graph, depth=0 if inside is True else inside,
                                             most=10**9).items()}
    elif isinstance(inside, Mapping):
        asked = {node: [_path(item) for item in items] for node, items in inside.items()}
    elif isinstance(inside, Iterable) and not isinstance(inside, (str, bytes)):
        asked = {}
        for name in inside:
            if not isinstance(name, str) or "." not in name:
                raise DeclarationError(f"inside= lists 'node.path' names such as 'body.net.0'; "
                                       f"{name!r} is not one")
            node, path = name.split(".", 1)
            asked.setdefault(node, []).append(path)
    else:
        raise TypeError(f"inside= is True, a depth, {{node: [path, ...]}} (architecture's "
                        f"answer will do) or ['node.path', ...], not {inside!r}")
    out = {}
    for node, paths in asked.items():
        impl = graph.implementation(node) if isinstance(node, str) else None
        if impl is None:
            raise DeclarationError(f"inside= names node {node!r}, which this graph does not "
                                   f"have; its nodes are {', '.join(map(repr, graph.nodes()))}")
        found = [(path, _module_at(impl, node, path)) for path in paths
                 if path != "…" and not path.endswith(")")]
        out[node] = list({id(m): (p, m) for p, m in found}.values())[:most]
    return out


def _path(item: Any) -> str:
    return item[0] if isinstance(item, tuple) else item


def _module_at(node: Any, node_id: str, path: str) -> torch.nn.Module:
    held_here: Any = node
    for part in path.split("."):
        if isinstance(held_here, (list, tuple)) and part.isdigit() and int(part) < len(held_here):
            held_here = held_here[int(part)]
        elif isinstance(held_here, dict) and part in held_here:
            held_here = held_here[part]
        elif isinstance(held_here, torch.nn.Module) and part in held_here._modules:
            held_here = held_here._modules[part]
        elif not isinstance(held_here, torch.nn.Module) and part in getattr(held_here, "__dict__", {}):
            held_here = held_here.__dict__[part]
        else:
            held_here = None
            break
    if not isinstance(held_here, torch.nn.Module):
        raise DeclarationError(
            f"inside= names {node_id}.{path}, and node {node_id!r} holds no module at "
            f"{path!r}; architecture(graph) lists the paths it has")
    return held_here


def _groups(groups: Any) -> dict[str, dict[str, list[int]]]:
    if groups is None:
        return {}
    if not isinstance(groups, Mapping):
        raise TypeError("groups= is {where: {group: channels}}, e.g. "
                        "{'encoder': {'audio': range(0, 64), 'text': range(64, 128)}}")
    out = {}
    for where, parts in groups.items():
        if not isinstance(where, str) or not isinstance(parts, Mapping) or not parts:
            raise TypeError(f"groups= maps a where (a str) to {{group: channels}}; "
                            f"{where!r} maps to {parts!r}")
        out[where] = {}
        for group, channels in parts.items():
            listed = list(channels) if isinstance(channels, Iterable) else None
            if not listed or not all(type(c) is int and c >= 0 for c in listed):
                raise DeclarationError(f"groups= for {where!r}: group {group!r} has to list "
                                       f"channel numbers from 0 up, not {channels!r}")
            out[where][str(group)] = listed
    return out
