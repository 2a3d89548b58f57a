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

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._errors import DeclarationError
from .._node import Done, Opaque
from ._weights import held

__all__ = ["MEASURES", "Audit", "audit_for"]

#: The names a ``health`` fact may carry besides ``fact``, ``where`` and ``step``.
MEASURES = ("act_mean", "act_std", "act_zero", "act_saturated", "grad_norm", "grad_mean",
            "grad_std", "nonfinite", "weight_norm", "update_ratio", "dead_channels",
            "act_hist", "grad_hist")
BINS = 32
_RUN = 64  # neighbouring entries per run of a sampled parameter
_NEAR = 0.01  # "saturated" is within this share of the range from either bound
_HALF = (torch.float16, torch.bfloat16)
_BOUNDED_CLASSES = ((torch.nn.Sigmoid, (0.0, 1.0)), (torch.nn.Tanh, (-1.0, 1.0)),
                    (torch.nn.Softsign, (-1.0, 1.0)), (torch.nn.Hardsigmoid, (0.0, 1.0)))
_BOUNDED_FUNCTIONS = {"SigmoidBackward0": (0.0, 1.0), "TanhBackward0": (-1.0, 1.0),
                      "HardsigmoidBackward0": (0.0, 1.0)}


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
    """

    #: ``weight_norm`` and ``update_ratio`` of a tensor larger than this are read off a
    #: fixed random sample of this many of its entries (None: all of them, at the
    #: price of a copy of every weight and two passes over it each measured step).
    sampled: int | None = 4096

    def __init__(self, *, every: int = 1, snapshot: int = 50, channels: bool = False,
                 groups: Mapping[str, Mapping[str, Iterable[int]]] | None = None,
                 window: int = 20, inside: Any = None, most: int = 32):
        self.every = _whole("every", every)
        self.snapshot = _whole("snapshot", snapshot)
        self.window = _whole("window", window)
        self.most = _whole("most", most)
        if not isinstance(channels, bool):
            raise TypeError(f"Audit: channels= is True or False, not {channels!r}")
        self.channels = channels
        self.groups = _groups(groups)
        self.inside = inside
        self._graph: Any = None
        self._wheres: list[_Where] = []
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, _Wrapper, _Where]] = []
        self._step = 1  # the number of the step about to happen
        self._measured = 0  # how many measured steps have been read
        self._armed = False
        self._steered = False  # a Trainer says when its steps begin
        self._held: _Held | None = None  # the weights of what is watched
        self._before: dict[Any, torch.Tensor] | None = None  # them as this step found them
        self._keep: list[torch.Tensor] | None = None  # probe holds what was produced
        self._probes = 1  # gradients pooled over this many probes are read as one

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
        graph._changed()  # the walk keeps bound forwards; have it look again
        self._graph, self._wheres = graph, wheres
        self._held = _Held(wheres, self.sampled)
        self._restart(not self._steered)
        return self

    def by_hand(self, node_id: str, node: Any) -> Audit:
        """Watches one node with no graph and no hook: whoever holds it says what it
        produced (``saw``). That is a trainer on a worker, which sees its node's
        activation and gradient anyway; its facts travel back in its answers."""
        where = _Where(self, node_id, node_id, None, held(node, node_id))
        where.tracks = self.channels
        self._graph, self._wheres = _BY_HAND, [where]
        self._held = _Held(self._wheres, self.sampled)
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
        self._graph, self._armed, self._before, self._steered = None, False, None, False
        self._held = None
        if graph is not None:
            graph._changed()

    @property
    def wheres(self) -> list[str]:
        """What is being watched, in the order the facts come: each node, then the
        modules hooked within it."""
        return [where.name for where in self._wheres]

    def _plan(self, graph: Any) -> list[_Where]:
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
            wheres.append(_Where(self, node_id, node_id, None, held(node, node_id)))
            for path, module in inside.get(node_id, []):
                wheres.append(_Where(self, f"{node_id}.{path}", node_id, module,
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

    def _restart(self, arm: bool) -> None:
        self._armed = arm and self._measuring() and self._graph is not None
        if self._before is not None:  # a hook ran since the last restart: forget it
            self._before = None
            for where in self._wheres:
                where.clear()

    def _take(self, graph: Any) -> None:
        """A Trainer takes this Audit (``audit_for`` checked that it may): it watches the
        graph, and from now on the hooks count only between the Trainer's ``_begin``
        and ``observed``, so nothing another Trainer runs on the same graph meanwhile
        is mistaken for this one's step."""
        self._steered, self._armed = True, False
        self.watch(graph)

    def _begin(self, graph: Any) -> None:
        """A Trainer's step begins. After ``release`` (a closed Trainer stepping on)
        the hooks go back on first."""
        if self._graph is None:
            self.watch(graph)
            self._steered = True
        self._restart(True)

    def _snapshot(self) -> None:
        """The trainable weights as the step found them, for ``update_ratio``; taken at
        the first hook, since nothing moves them before the optimizer does."""
        self._before = self._held.taken()

    def observed(self, graph: Any, *, updated: bool = True) -> list[dict[str, Any]]:
        """One ``health`` fact per ``where`` for the step that just ended; [] when it
        was not measured. Call it after the optimizer's step, so ``update_ratio`` is
        what the step did; ``updated=False`` (a group of steps still open) leaves
        ``update_ratio`` out rather than calling no update a zero one."""
        if graph is not self._graph:
            raise DeclarationError("Audit.observed was handed a graph it does not watch; "
                                   "call watch(graph) first, and observed with that graph")
        step, measured = self._step, self._measuring()
        try:
            facts = self._facts(step, updated) if measured else []
        finally:
            self._step += 1
            if measured:
                self._measured += 1
            self._restart(not self._steered)
        return facts

    def _facts(self, step: int, updated: bool) -> list[dict[str, Any]]:
        if not any(where.acts or where.grads for where in self._wheres):
            return []  # nothing ran under the hooks: a step that was not one
        sink = _Sink()
        k = self._measured
        hist = k % self.snapshot == 0
        plans = [where.gather(sink, k, hist) for where in self._wheres]
        weights = self._held.measured(sink, self._before if updated else None)
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


def audit_for(graph: Any, auditing: Any, watchers: list[Any]) -> Audit | None:
    """What a Trainer's ``auditing=`` asks for, checked but not yet taken: every refusal
    comes before the Trainer changes anything, and ``_take`` after it cannot refuse."""
    if auditing is None or auditing is False:
        return None
    audit = Audit() if auditing is True else auditing
    if not isinstance(audit, Audit):
        raise TypeError(f"auditing= is True or an Audit(...), not a {type(auditing).__qualname__}")
    if not watchers:
        raise DeclarationError(
            "auditing= was given but watching= is empty, so every health fact would be "
            "measured for nobody; pass watching=Recorder(store) (or any callable) beside it")
    if audit._graph is not None and audit._graph is not graph:
        raise DeclarationError("the Audit given as auditing= watches another graph; "
                               "release() it first, or give this Trainer an Audit of its own")
    if audit._steered:
        raise DeclarationError("this Audit is already used by another Trainer; give each "
                               "Trainer an Audit of its own")
    audit._plan(graph)
    return audit


# -- one place being watched --------------------------------------------------------------
class _Where:
    """A node or a module, and what it saw during the step being measured."""

    def __init__(self, audit: Audit, name: str, node: str, module: Any, params: list[Any]):
        self.audit, self.name, self.node, self.module = audit, name, node, module
        self.params = params
        self.bounds = _class_bounds(module)
        self.groups: dict[str, list[int]] | None = None
        self.tracks = False
        self.group_index: dict[Any, list[torch.Tensor]] = {}
        self.last_fire: torch.Tensor | None = None  # measured step each channel last fired
        self.first: int = 0  # the measured step channels were first seen
        self.clear()

    def clear(self) -> None:
        self.acts: list[tuple[int, int, list[torch.Tensor]]] = []  # count, bounded, scalars
        self.grads: list[tuple[int, list[torch.Tensor]]] = []
        self.alive: torch.Tensor | None = None
        self.kept_acts: list[torch.Tensor] = []
        self.kept_grads: list[torch.Tensor] = []

    def hook(self, module: Any, args: Any, output: Any) -> None:
        self.produced(output)

    def produced(self, output: Any) -> None:
        audit = self.audit
        if not audit._armed:
            return
        if audit._before is None:
            audit._snapshot()
        first = True
        for tensor in _tensors(output, 0):
            self.act(tensor, first)
            first = False
            if tensor.requires_grad:
                tensor.register_hook(self.gradient)
                if audit._keep is not None:
                    audit._keep.append(tensor)

    def act(self, tensor: torch.Tensor, first: bool) -> None:
        x = tensor.detach()
        if x.dtype in _HALF:
            x = x.float()
        flat = x.reshape(-1)
        bounds = self.bounds or _function_bounds(tensor)
        mean = flat.mean()
        parts = [mean, torch.dist(flat, mean)]  # one fused pass, nothing written; squared later
        parts.append(_dot(flat.sign()))  # how many are not zero (NaN if a NaN is)
        parts.append(_nonfinite(flat))
        if bounds is not None:
            low, high = bounds
            past = (flat - (low + high) / 2).abs_().sub_((0.5 - _NEAR) * (high - low)).sign_()
            parts.append((past.sum() + _dot(past)) / 2)  # how many are past the margin
        self.acts.append((x.numel(), x.numel() if bounds is not None else 0, parts))
        if first and self.tracks and x.dim() >= 2:
            alive = x.ne(0).any(dim=0)
            if alive.dim() > 1:
                alive = alive.flatten(1).any(dim=1)
            self.alive = alive if self.alive is None or self.alive.shape != alive.shape \
                else self.alive | alive
        if self.audit._measured % self.audit.snapshot == 0:
            self.kept_acts.append(x.flatten())

    def gradient(self, grad: torch.Tensor) -> None:
        if not self.audit._armed:
            return
        g = grad.detach()
        if g.dtype in _HALF:
            g = g.float()
        flat = g.reshape(-1)
        # The spread is read off E[g²] - E[g]²: a gradient's mean is rarely many times
        # its spread, so the cancellation that rules this out for activations does not
        # bite, and it saves two passes.
        self.grads.append((g.numel(), [flat.sum(), _dot(flat), _nonfinite(flat)]))
        if self.audit._measured % self.audit.snapshot == 0:
            self.kept_grads.append(g.flatten())

    def gather(self, sink: _Sink, k: int, hist: bool) -> Any:
        """Puts this step's device numbers in the sink; answers how to read them back."""
        acts = [(n, b, sink.add(parts)) for n, b, parts in self.acts]
        grads = [(n, sink.add(parts)) for n, parts in self.grads]
        dead = self._dead(sink, k) if self.tracks and self.alive is not None else None
        act_hist = sink.add_vector(_histogram(self.kept_acts)) if hist and self.kept_acts else None
        grad_hist = sink.add_vector(_histogram(self.kept_grads)) if hist and self.kept_grads \
            else None

        def read(sink: _Sink) -> dict[str, Any]:
            out = _pooled_acts([(n, b, sink.get(h)) for n, b, h in acts])
            out.update(_pooled_grads([(n, sink.get(h)) for n, h in grads], self.audit._probes))
            if acts or grads:
                out["nonfinite"] = out.pop("_act_nonfinite", 0) + out.pop("_grad_nonfinite", 0)
            if dead is not None:
                out["dead_channels"] = dead(sink)
            if act_hist is not None:
                out["act_hist"] = _hist_read(sink.get(act_hist))
            if grad_hist is not None:
                out["grad_hist"] = _hist_read(sink.get(grad_hist))
            return out
        return read

    def _dead(self, sink: _Sink, k: int) -> Any:
        alive = self.alive
        if self.last_fire is None or self.last_fire.shape != alive.shape:
            self._check_groups(alive.shape[0])
            self.first = k
            self.last_fire = torch.full(alive.shape, k - 1, dtype=torch.long, device=alive.device)
        self.last_fire = torch.where(alive, k, self.last_fire)
        if k - self.first + 1 < self.audit.window:
            return None  # not a whole window seen yet: nobody can say "the whole window"
        dead = (k - self.last_fire) >= self.audit.window
        if self.groups is None:
            handle = sink.add([dead.sum()])
            return lambda s: int(s.get(handle)[0])
        index = self.group_index[dead.device]
        handle = sink.add([dead[i].sum() for i in index])
        names = list(self.groups)
        return lambda s: {name: int(v) for name, v in zip(names, s.get(handle))}

    def _check_groups(self, width: int) -> None:
        if self.groups is None:
            return
        for group, channels in self.groups.items():
            beyond = [c for c in channels if c >= width]
            if beyond:
                raise DeclarationError(
                    f"groups= for {self.name!r}: group {group!r} names channel {beyond[0]}, and "
                    f"what {self.name!r} produces has {width} channels (dimension 1); name "
                    f"channels 0 to {width - 1}")
        device = self.alive.device
        self.group_index[device] = [torch.tensor(c, dtype=torch.long, device=device)
                                    for c in self.groups.values()]


class _Wrapper:
    """What stands in front of a node's ``forward`` while it is watched: calls it, then
    tells each watching place what it produced. One per node, however many audits."""

    __slots__ = ("inner", "mine", "places")

    def __init__(self, inner: Any, mine: bool):
        self.inner = inner  # what forward was before: the bound method, or an attribute
        self.mine = mine  # whether forward was an instance attribute before us (False)
        self.places: list[_Where] = []

    @classmethod
    def around(cls, node: Any, where: _Where) -> _Wrapper:
        current = node.__dict__.get("forward")
        wrapper = current if isinstance(current, cls) else None
        if wrapper is None:
            wrapper = cls(node.forward, current is None)
            node.__dict__["forward"] = wrapper
        wrapper.places.append(where)
        return wrapper

    def drop(self, node: Any, where: _Where) -> None:
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
class _Sink:
    """Device numbers gathered per device and read back with one ``tolist`` each: the
    scalars a step says (stacked once, rather than once per where) and a few vectors."""

    def __init__(self) -> None:
        self.scalars: dict[Any, list[torch.Tensor]] = {}
        self.vectors: dict[Any, list[torch.Tensor]] = {}
        self.sizes: dict[Any, int] = {}
        self.values: dict[Any, list[float]] = {}

    def add(self, tensors: list[torch.Tensor]) -> tuple[Any, int, int]:
        """Takes 0-dimensional tensors of one device; answers where they will be."""
        device = tensors[0].device
        mine = self.scalars.setdefault(device, [])
        mine.extend(tensors)
        return device, len(mine) - len(tensors), len(tensors)

    def add_vector(self, tensor: torch.Tensor) -> tuple[Any, int, int]:
        """Takes a 1-dimensional tensor; answers where its numbers will be (after every
        scalar of its device, hence the negative start until they are counted)."""
        device = tensor.device
        at = self.sizes.get(device, 0)
        self.vectors.setdefault(device, []).append(tensor)
        self.sizes[device] = at + tensor.shape[0]
        return device, -1 - at, tensor.shape[0]

    def read(self) -> None:
        for device in {*self.scalars, *self.vectors}:
            parts = [torch.stack(self.scalars[device])] if device in self.scalars else []
            joined = torch.cat(parts + self.vectors.get(device, []))  # to the widest dtype
            if device.type != "mps":  # which has no float64
                joined = joined.double()
            self.values[device] = joined.tolist()

    def get(self, handle: tuple[Any, int, int]) -> list[float]:
        device, at, size = handle
        if at < 0:
            at = len(self.scalars.get(device, ())) - 1 - at
        return self.values[device][at:at + size]


def _dot(flat: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a flat tensor. A ``dot`` (or a ``dist``) costs what a ``sum``
    does on a CPU, where torch's ``var_mean`` costs a hundred times more."""
    return torch.dot(flat, flat)


def _nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """How many values are NaN or infinite: those are the ones a zero times them is
    not zero. Read as a float sum, which is far cheaper than a boolean one."""
    return flat.mul(0).nan_to_num_(1.0).sum()


def _pooled_acts(pieces: list[tuple[int, int, list[float]]]) -> dict[str, Any]:
    """Pieces ``(count, bounded count, [mean, distance from it, not zero, nonfinite,
    (saturated)])`` as one population (means and variances combined pairwise)."""
    if not pieces:
        return {}
    if len(pieces) == 1:  # the usual case, said without the combining
        n, bounded, v = pieces[0]
        out = {"act_mean": v[0], "act_std": v[1] / math.sqrt(n), "act_zero": (n - v[2]) / n,
               "_act_nonfinite": round(v[3])}
        if bounded:
            out["act_saturated"] = v[4] / bounded
        return out
    n = sum(p[0] for p in pieces)
    mean, std = _pooled([(count, count * v[0], v[1] ** 2) for count, _, v in pieces], n)
    out = {"act_mean": mean, "act_std": std,
           "act_zero": (n - sum(v[2] for _, _, v in pieces)) / n,
           "_act_nonfinite": round(sum(v[3] for _, _, v in pieces))}
    bounded = sum(b for _, b, _ in pieces)
    if bounded:
        out["act_saturated"] = sum(v[4] for _, b, v in pieces if b) / bounded
    return out


def _pooled_grads(pieces: list[tuple[int, list[float]]], probes: int) -> dict[str, Any]:
    """Pieces ``(count, [sum, sum of squares, nonfinite])`` as one population."""
    if not pieces:
        return {}
    if len(pieces) == 1:
        n, (total, squares, nonfinite) = pieces[0]
    else:
        n = sum(p[0] for p in pieces)
        total, squares, nonfinite = (sum(v[i] for _, v in pieces) for i in range(3))
    mean = total / n
    spread = squares / n - mean * mean
    return {"grad_norm": math.sqrt(squares / probes), "grad_mean": mean,
            "grad_std": math.nan if math.isnan(spread) else math.sqrt(max(spread, 0.0)),
            "_grad_nonfinite": round(nonfinite)}


def _pooled(pieces: list[tuple[int, float, float]], n: int) -> tuple[float, float]:
    """The mean and standard deviation of pieces given as (count, sum, squared
    deviations from their own mean)."""
    mean = sum(total for _, total, _ in pieces) / n
    spread = sum(squares + count * (total / count - mean) ** 2 for count, total, squares in pieces)
    return mean, math.sqrt(spread / n) if spread >= 0 else math.nan


class _Held:
    """The weights of what is watched, once each: what ``weight_norm`` and
    ``update_ratio`` are read off.

    A tensor of more than ``sampled`` entries is read as a fixed random sample of that
    many, in runs of 64 neighbours (a gather of scattered entries costs a cache line
    each), and counts as many times as the entries it stands for: copying every weight
    and passing over it twice, each measured step, would cost a tenth of a step on a
    CPU, and a sample this size puts both numbers within a few percent of the whole.
    What is read of every tensor on one device goes into one flat buffer, so a step
    costs a handful of operations per device however many tensors there are.
    """

    def __init__(self, wheres: list[_Where], sampled: int | None):
        params = list({id(p): p for where in wheres for p in where.params}.values())
        at = {id(p): k for k, p in enumerate(params)}
        self.params = params
        self.sampled = sampled
        self.index = [self._index(p) for p in params]
        self.views: list[torch.Tensor | None] = [None] * len(params)
        self.scale = [p.numel() / (p.numel() if i is None else i.numel() * _RUN)
                      for p, i in zip(params, self.index)]
        self.trained = [p.requires_grad for p in params]
        self.mine = [list(dict.fromkeys(at[id(p)] for p in where.params)) for where in wheres]
        self.devices: dict[Any, tuple[list[int], Any]] = {}
        for k, p in enumerate(params):
            self.devices.setdefault(p.device, ([], None))[0].append(k)
        for device, (ks, _) in self.devices.items():  # how much of the buffer each one is
            self.devices[device] = (ks, [self._read(k).numel() for k in ks])

    def _index(self, p: torch.Tensor) -> torch.Tensor | None:
        """Which runs of ``_RUN`` entries stand for ``p`` (None: all of it)."""
        if self.sampled is None or p.numel() <= self.sampled:
            return None
        generator = torch.Generator().manual_seed(p.numel())
        runs = torch.randperm(p.numel() // _RUN, generator=generator)
        return runs[:max(1, self.sampled // _RUN)].sort().values.to(p.device)

    def _read(self, k: int) -> torch.Tensor:
        """What stands for tensor ``k``: a flat view of it, or its sampled runs (a copy).
        The views are kept between steps, and made again if the tensor's storage was
        swapped (``module.to(...)``, a ``load_state_dict`` that assigns)."""
        p, view = self.params[k], self.views[k]
        if view is None or view.data_ptr() != p.data_ptr() or view.device != p.device:
            flat = p.detach().reshape(-1)
            index = self.index[k]
            if index is not None:
                index = self.index[k] = index.to(p.device)
                flat = flat[:flat.shape[0] - flat.shape[0] % _RUN].view(-1, _RUN)
            view = self.views[k] = flat
        index = self.index[k]
        return view if index is None else view.index_select(0, index).view(-1)

    def taken(self) -> dict[Any, torch.Tensor]:
        """Everything read, as it is now: one flat copy per device, for after the
        update. Empty if a tensor moved to another device since the Audit was made
        (no ratio for that step; ``watch`` again to follow it)."""
        try:
            return {device: torch.cat([self._read(k) for k in ks])
                    for device, (ks, _) in self.devices.items()}
        except RuntimeError:
            return {}

    def measured(self, sink: _Sink, before: dict[Any, torch.Tensor] | None) -> Any:
        """Puts, per tensor, its squared norm now, before and of its change in the
        sink; answers, per where (by position), its numbers."""
        if not self.params:
            return lambda at: {}
        placed: dict[int, tuple[Any, int, int]] = {}  # tensor -> handle, column, columns
        for device, (ks, sizes) in self.devices.items():
            now = torch.cat([self._read(k) for k in ks])
            rows = [now] if before is None or device not in before else \
                [now, before[device], now - before[device]]
            parts = [part for row in rows for part in row.split_with_sizes(sizes)]
            handle = sink.add(list(torch._foreach_norm(parts)))
            for column, k in enumerate(ks):
                placed[k] = (handle, column, len(ks))
        moved = before is not None

        def read(at: int) -> dict[str, Any]:
            mine = self.mine[at]
            if not mine:
                return {}
            now = old = step = 0.0
            changing = False
            for k in mine:
                handle, column, columns = placed[k]
                values, scale = sink.get(handle), self.scale[k]
                now += scale * values[column] ** 2
                if moved and self.trained[k] and len(values) == 3 * columns:
                    changing = True
                    old += scale * values[columns + column] ** 2
                    step += scale * values[2 * columns + column] ** 2
            out = {"weight_norm": math.sqrt(now)}
            if changing:
                out["update_ratio"] = math.sqrt(step / old) if old > 0 else \
                    (0.0 if step == 0 else math.inf)
            return out
        return read


def _histogram(pieces: list[torch.Tensor]) -> torch.Tensor:
    """32 counts and 33 edges over the finite values, computed where they are."""
    x = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    finite = torch.isfinite(x)
    low = torch.where(finite, x, torch.inf).min()
    high = torch.where(finite, x, -torch.inf).max()
    none = ~torch.isfinite(low)
    low, high = torch.where(none, 0.0, low), torch.where(none, 0.0, high)
    width = torch.where(high > low, high - low, torch.ones_like(high))
    at = ((x - low) / width * BINS).nan_to_num(0.0, 0.0, 0.0).floor().clamp(0, BINS - 1).long()
    counts = torch.bincount(at, weights=finite.to(x.dtype), minlength=BINS)
    edges = low + width * torch.arange(BINS + 1, device=x.device, dtype=x.dtype) / BINS
    return torch.cat([counts.to(x.dtype), edges])


def _hist_read(values: list[float]) -> dict[str, list]:
    return {"counts": [round(c) for c in values[:BINS]], "edges": values[BINS:]}


# -- what is watched ----------------------------------------------------------------------
def _tensors(value: Any, depth: int) -> Iterable[torch.Tensor]:
    if type(value) is Opaque or type(value) is Done:
        value = value.value
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel():
            yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def _class_bounds(module: Any) -> tuple[float, float] | None:
    if module is None:
        return None
    if isinstance(module, torch.nn.Hardtanh):  # ReLU6 is one
        return float(module.min_val), float(module.max_val)
    for cls, bounds in _BOUNDED_CLASSES:
        if isinstance(module, cls):
            return bounds
    return None


def _function_bounds(tensor: torch.Tensor) -> tuple[float, float] | None:
    function = tensor.grad_fn
    if function is None:
        return None
    name = type(function).__name__
    if name == "HardtanhBackward0":
        return float(function._saved_min_val), float(function._saved_max_val)
    return _BOUNDED_FUNCTIONS.get(name)


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


def _whole(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise DeclarationError(f"Audit: {name}={value!r}; it is a whole number from 1 up")
    return value


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
