"""What the nodes of a graph are made of: ``architecture``, ``traced`` and ``kind_of``.

The graph runs once on an example with hooks on every module every node holds, so a
node in the middle is seen with what the nodes above it produced, never with the
graph's own input. Then each module that is opened is asked of ``torch.fx``, one
module at a time (every submodule a leaf, so the seam is always a module boundary):
where fx can trace it and run the trace on the input the hooks caught, its answer
wins — call order, the functional operations (``F.relu``) no hook can see, and their
shapes. Where it cannot (control flow on values, a known torch composite), the parts
are the declared children, in the order the hooks saw them called, with the hooks'
shapes.

An ``Inside`` is a list of ``(path, what)``; ``path`` is relative to the node (the
audit's ``node.path`` keys) and ``what`` a dict of plain data:

============  ============================================================================
``kind``      the role, one of ``LAYER_KINDS`` (see ``kind_of``)
``cls``       the class name (a function's name for a functional part, ``"N more"``
              for the entry that stands for what ``most`` left out)
``shape_in``  the input's shape as a list of ints; a list of them for several inputs;
              None when nothing was seen (no example, a remote node, never called)
``shape_out`` likewise for what it produced (a parameter's own shape for a parameter)
``params``    parameters in one copy
``times``     how many identical consecutive siblings it stands for
``paths``     the paths of those copies (``times`` of them), the first being ``path``
``via``       how it was listed: ``"fx"`` (a trace of its parent), ``"hooks"`` (the
              declared parts, ordered and shaped by the run), ``"declared"`` (nothing
              was seen), ``None`` for the entry that stands for what was left out
``within``    the path of the opened entry it is a part of (``"blocks.0"``), None at
              depth 0: consecutive entries with one ``within`` are one block's parts
============  ============================================================================

Summed as ``params × times``, the entries of a node give the parameters it holds, at
every depth (a module that shares its weights with another is the exception).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from .._engine import Pass
from .._errors import whole_number
from .._node import MADE_WITH, Opaque

__all__ = ["LAYER_KINDS", "Inside", "architecture", "kind_of", "traced"]

Inside = list[tuple[str, dict[str, Any]]]

LAYER_KINDS = ("linear", "conv", "normalisation", "activation", "attention", "embedding",
         "dropout", "pooling", "recurrent", "block", "parameter", "other")

# Classes whose role the suffix rules would miss or get wrong. Looked up along the
# MRO, so a subclass of a known class (MultiheadAttention's out_proj) inherits it.
_TABLE = {
    "Linear": "linear", "Bilinear": "linear", "LazyLinear": "linear",
    "MultiheadAttention": "attention",
    "Embedding": "embedding", "EmbeddingBag": "embedding",
    "RNN": "recurrent", "LSTM": "recurrent", "GRU": "recurrent",
    "RNNCell": "recurrent", "LSTMCell": "recurrent", "GRUCell": "recurrent",
    "LocalResponseNorm": "normalisation", "CrossMapLRN2d": "normalisation",
    "Transformer": "block", "TransformerEncoder": "block", "TransformerDecoder": "block",
    "TransformerEncoderLayer": "block", "TransformerDecoderLayer": "block",
    "Sequential": "block", "ModuleList": "block", "ModuleDict": "block",
    "Identity": "other", "Flatten": "other", "Unflatten": "other",
}
# Tried in order on each class name of the MRO: endings first, then the two names
# that mean the same thing wherever they stand (``Conv…``, ``Pool…``), then endings
# of activations, so that a ConvBNReLU block reads as a convolution.
_SUFFIXES = (
    ("attention", re.compile(r"(Attention|Attn)$")),
    ("normalisation", re.compile(r"(Norm|Normalization|Normalisation)(\d*d)?$")),
    ("embedding", re.compile(r"(Embedding|Embeddings|Embed)(Bag)?$")),
    ("dropout", re.compile(r"(Dropout|DropPath|DropBlock)(\d*d)?$")),
    ("linear", re.compile(r"(Linear|Dense)$")),
    ("recurrent", re.compile(r"(RNN|LSTM|GRU)(Cell)?$")),
    ("conv", re.compile(r"Conv(?![a-z])|Convolution")),
    ("pooling", re.compile(r"Pool(?![a-z])|Pooling")),
    ("activation", re.compile(r"(ReLU\d*|GELU|SiLU|Swish|Mish|Sigmoid|Tanh|Softmax|Activation)$")),
)
_ACTIVATION_FUNCTIONS = frozenset({
    "relu", "relu_", "relu6", "leaky_relu", "leaky_relu_", "prelu", "rrelu", "gelu", "silu",
    "mish", "elu", "elu_", "selu", "celu", "sigmoid", "tanh", "softmax", "log_softmax",
    "softmin", "softplus", "softsign", "hardtanh", "hardtanh_", "hardswish", "hardsigmoid",
    "glu", "logsigmoid", "tanhshrink", "threshold", "hardshrink", "softshrink",
})
_FUNCTION_RULES = (
    ("dropout", re.compile(r"dropout")),
    ("pooling", re.compile(r"pool")),
    ("normalisation", re.compile(r"(_norm|^normalize)$")),
    ("conv", re.compile(r"^conv")),
    ("attention", re.compile(r"attention")),
    ("embedding", re.compile(r"^embedding")),
    ("linear", re.compile(r"^(bi)?linear$")),
)
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict,
               torch.nn.ParameterList, torch.nn.ParameterDict)


# -- kind_of ------------------------------------------------------------------------------
def kind_of(what: Any) -> str:
    """The role of a module, a module class, a function or a class name: one of ``LAYER_KINDS``.

    By role and never by exact class only: a table of torch's classes looked up along
    the MRO, then suffix rules, so a class nobody listed that ends in ``Norm`` is a
    normalisation, and whatever torch defines among its activations is an activation.
    A module with children that no rule names is a ``block``; a leaf, ``other``.
    Functions (what fx finds in a forward) are read by name: ``F.relu`` is an
    activation, ``F.max_pool2d`` pooling.
    """
    if isinstance(what, torch.nn.Parameter):
        return "parameter"
    if isinstance(what, torch.nn.Module):
        found = _class_kind(type(what))
        if found is not None:
            return found
        return "block" if next(what.children(), None) is not None else "other"
    if isinstance(what, type):
        return _class_kind(what) or "other"
    if isinstance(what, str):
        if what[:1].isupper():
            return _name_kind(what) or "other"
        return _function_kind(what)
    if callable(what):
        return _function_kind(getattr(what, "__name__", ""))
    raise TypeError(f"kind_of() takes a module, a module class, a function or a name, not a "
                    f"{type(what).__qualname__}")


def _class_kind(cls: type) -> str | None:
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        if klass.__module__ == "torch.nn.modules.activation" and klass.__name__ not in _TABLE:
            return "activation"
        found = _name_kind(klass.__name__)
        if found is not None:
            return found
    return None


def _name_kind(name: str) -> str | None:
    if name in _TABLE:
        return _TABLE[name]
    for kind, rule in _SUFFIXES:
        if rule.search(name):
            return kind
    return None


def _function_kind(name: str) -> str:
    name = name.lower()
    if name in _ACTIVATION_FUNCTIONS:
        return "activation"
    for kind, rule in _FUNCTION_RULES:
        if rule.search(name):
            return kind
    return "other"


# -- what was seen ------------------------------------------------------------------------
@dataclass
class _Seen:
    """What the one run saw: shapes and first-call order of every module, and the inputs
    of the composites (kept only when something is going to be opened)."""

    shapes: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    order: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, tuple[tuple, dict]] = field(default_factory=dict)

    def hook(self, modules: list[torch.nn.Module], keep_inputs: bool) -> list[Any]:
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(
                self._entering(keep_inputs and next(module.children(), None) is not None),
                with_kwargs=True))
            handles.append(module.register_forward_hook(self._left))
        return handles

    def _entering(self, keep: bool) -> Any:
        def entering(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            key = id(module)
            if key in self.order:
                return
            self.order[key] = len(self.order)
            if keep:  # cloned, because whatever runs next may change it in place
                self.inputs[key] = (_cloned(args), _cloned(kwargs))
        return entering

    def _left(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.shapes.setdefault(id(module), (_shape(args), _shape(output)))


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def _shape(value: Any) -> Any:
    """Shapes as plain data: a list of ints per tensor, one shape for a single value."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        shapes = [_shape(v) for v in value]
        return shapes[0] if len(shapes) == 1 else shapes
    if isinstance(value, dict):
        return {str(k): _shape(v) for k, v in value.items()}
    return None


@contextlib.contextmanager
def _undisturbed(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Runs looking at modules without leaving a trace: buffers (a batch norm's running
    statistics) are put back, and the random streams a dropout draws from are forked."""
    kept = [(b, b.detach().clone()) for m in modules for b in m.buffers(recurse=False)]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


# -- what a node and a module hold --------------------------------------------------------
def _declared(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, Any]]:
    """A module's own parameters, then its children; containers are seen through, since a
    Sequential is how parts are held, not a part."""
    items: list[tuple[str, Any]] = [(prefix + name, p)
                                    for name, p in module.named_parameters(recurse=False)]
    for name, child in module.named_children():
        items += _expanded(prefix + name, child)
    return items


def _expanded(path: str, module: torch.nn.Module) -> list[tuple[str, Any]]:
    return _declared(module, path + ".") if isinstance(module, _CONTAINERS) else [(path, module)]


def _held(node: Any) -> list[tuple[str, Any]]:
    """What a node holds directly: its module attributes (containers opened) and its bare
    parameters; the node itself when it is a module. Something held twice is listed once."""
    if isinstance(node, torch.nn.Module):
        items = _declared(node)
    else:
        items = []
        for name, value in getattr(node, "__dict__", {}).items():
            if name == MADE_WITH:
                continue
            if isinstance(value, torch.nn.Parameter):
                items.append((name, value))
            elif isinstance(value, torch.nn.Module):
                items += _expanded(name, value)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, torch.nn.Module):
                        items += _expanded(f"{name}.{i}", v)
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(k, str) and isinstance(v, torch.nn.Module):
                        items += _expanded(f"{name}.{k}", v)
    once: dict[int, tuple[str, Any]] = {}
    for path, thing in items:
        once.setdefault(id(thing), (path, thing))
    return list(once.values())


# -- parts, folding, opening ---------------------------------------------------------------
@dataclass
class _Part:
    paths: list[str]
    thing: Any  # a module, a parameter, or the name of a function
    what: dict[str, Any]
    same: Any  # what two parts must share to fold into one
    within: str | None = None


class _Function(str):
    """A functional operation found by fx, by its name."""


def _part(path: str, thing: Any, shape_in: Any, shape_out: Any, via: str | None,
          signatures: dict[int, Any]) -> _Part:
    if isinstance(thing, torch.nn.Parameter):
        what = _what("parameter", "Parameter", None, list(thing.shape), thing.numel(), via)
        return _Part([path], thing, what, ("parameter", tuple(thing.shape), thing.dtype))
    if isinstance(thing, _Function):
        what = _what(kind_of(str(thing)), str(thing), shape_in, shape_out, 0, via)
        return _Part([path], thing, what, ("function", str(thing), repr(shape_in), repr(shape_out)))
    params = sum(p.numel() for p in thing.parameters())
    what = _what(kind_of(thing), type(thing).__name__, shape_in, shape_out, params, via)
    return _Part([path], thing, what,
                 ("module", _signature(thing, signatures), repr(shape_in), repr(shape_out)))


def _what(kind: str, cls: str, shape_in: Any, shape_out: Any, params: int,
          via: str | None) -> dict[str, Any]:
    return {"kind": kind, "cls": cls, "shape_in": shape_in, "shape_out": shape_out,
            "params": params, "times": 1, "paths": [], "via": via, "within": None}


def _signature(module: torch.nn.Module, memo: dict[int, Any]) -> Any:
    """What makes two modules the same block: class, configuration, the shapes of what
    they hold, and their children's signatures, recursively."""
    key = id(module)
    if key not in memo:
        own = tuple((name, tuple(t.shape), t.dtype) for name, t in
                    [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
        children = tuple((name, _signature(child, memo)) for name, child in module.named_children())
        memo[key] = (type(module), module.extra_repr(), own, children)
    return memo[key]


def _folded(parts: list[_Part]) -> list[_Part]:
    """Consecutive parts that are the same block (and were seen with the same shapes)
    become one; only consecutive, so the order a figure draws stays the order they run."""
    out: list[_Part] = []
    for part in parts:
        if out and out[-1].same == part.same:
            out[-1].paths += part.paths
        else:
            out.append(part)
    return out


def _items(module: torch.nn.Module, seen: _Seen, args: Any) -> tuple[list[tuple], str]:
    """A module's parts as ``(path, thing, shape_in, shape_out)``, and how they were found."""
    found = _fx_items(module, args, seen)
    if found is not None:
        return found, "fx"
    if id(module) in seen.shapes:
        return _items_seen(module, seen)
    return [(p, t, None, None) for p, t in _declared(module)], "declared"


def _items_seen(module: torch.nn.Module, seen: _Seen) -> tuple[list[tuple], str]:
    """The declared parts in the order the run first called them (own parameters first,
    parts never called last), with the shapes the hooks caught."""
    last = len(seen.order)
    declared = sorted(_declared(module), key=lambda item: -1 if isinstance(
        item[1], torch.nn.Parameter) else seen.order.get(id(item[1]), last))
    return [(p, t, *_seen_shapes(t, seen)) for p, t in declared], "hooks"


def _seen_shapes(thing: Any, seen: _Seen) -> tuple[Any, Any]:
    return seen.shapes.get(id(thing), (None, None))


class _OneLevel(fx.Tracer):
    """Traces one module's own forward: every submodule it calls is a leaf."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


def _fx_items(module: torch.nn.Module, args: Any, seen: _Seen) -> list[tuple] | None:
    """The parts fx finds, in call order, shaped by running the trace on ``args``; None
    when fx cannot trace the module, or its trace cannot run where the module did."""
    try:
        graph = _OneLevel().trace(module)
    except Exception:  # fx's refusals are of many types; any of them means "ask the hooks"
        return None
    if args is None:
        return _fx_listed(module, graph, False, seen)
    inner = _Seen()  # what a container called as one leaf holds is shaped by the hooks
    handles = inner.hook([m for m in module.modules() if m is not module], keep_inputs=False)
    try:
        ShapeProp(fx.GraphModule(module, graph)).propagate(*args)
    except Exception:  # the trace does not run where the module did: the hooks answer
        return None
    finally:
        for handle in handles:
            handle.remove()
    return _fx_listed(module, graph, True, inner)


def _fx_listed(module: torch.nn.Module, graph: fx.Graph, shaped: bool, seen: _Seen) -> list[tuple]:
    items: list[tuple] = []
    covered: set[int] = set()
    for node in graph.nodes:
        shapes = _meta_shapes(node) if shaped else (None, None)
        if node.op == "call_module":
            sub = module.get_submodule(node.target)
            if id(sub) in covered:
                continue
            for path, thing in _expanded(node.target, sub):
                covered.update(id(m) for m in _contents(thing))
                items.append((path, thing, *(shapes if thing is sub else _seen_shapes(thing, seen))))
        elif node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
            if _function_kind(name) != "other":
                items.append((f"{node.name}()", _Function(name), *shapes))
        elif node.op == "get_attr":
            held = _attribute(module, node.target)
            if isinstance(held, torch.nn.Parameter) and id(held) not in covered:
                covered.add(id(held))
                items.append((node.target, held, None, list(held.shape)))
    for path, thing in _declared(module):  # held but never reached by the forward
        if not any(id(m) in covered for m in _contents(thing)):
            items.append((path, thing, *_seen_shapes(thing, seen)))
    return items


def _contents(thing: Any) -> list[Any]:
    if isinstance(thing, torch.nn.Module):
        return [*thing.modules(), *thing.parameters()]
    return [thing]


def _attribute(module: torch.nn.Module, target: str) -> Any:
    held: Any = module
    for name in target.split("."):
        held = getattr(held, name, None)
    return held


def _meta_shapes(node: fx.Node) -> tuple[Any, Any]:
    inputs = [_meta_shape(n.meta.get("tensor_meta")) for n in node.all_input_nodes]
    shape_in = inputs[0] if len(inputs) == 1 else inputs or None
    return shape_in, _meta_shape(node.meta.get("tensor_meta"))


def _meta_shape(meta: Any) -> Any:
    if meta is None:
        return None
    if hasattr(meta, "shape") and hasattr(meta, "stride"):
        return list(meta.shape)
    if isinstance(meta, (list, tuple)):
        return [_meta_shape(m) for m in meta]
    if isinstance(meta, dict):
        return {str(k): _meta_shape(v) for k, v in meta.items()}
    return None


def _positional(module: torch.nn.Module, seen: _Seen) -> list[Any] | None:
    """The input the hooks caught for a module, as the trace's placeholders take it."""
    caught = seen.inputs.get(id(module))
    if caught is None:
        return None
    args, kwargs = caught
    if not kwargs:
        return list(args)
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return list(bound.arguments.values())


def _listing(items: list[tuple], via: str | None, seen: _Seen, levels: int,
             signatures: dict[int, Any]) -> list[_Part]:
    """Parts folded, and each composite opened while ``levels`` lasts; an opened group of N
    copies lists one copy's parts, each standing for N times as many."""
    parts = _folded([_part(p, t, si, so, via, signatures) for p, t, si, so in items])
    out: list[_Part] = []
    for part in parts:
        thing = part.thing
        opens = isinstance(thing, torch.nn.Module) and next(thing.children(), None) is not None
        if levels > 0 and opens:
            inner, how = _items(thing, seen, _positional(thing, seen))
            for sub in _listing(inner, how, seen, levels - 1, signatures):
                sub.paths = [f"{outer}.{path}" for outer in part.paths for path in sub.paths]
                sub.within = part.paths[0] + ("" if sub.within is None else f".{sub.within}")
                out.append(sub)
        else:
            out.append(part)
    return out


def _inside(parts: list[_Part], most: int | None = None) -> Inside:
    """The parts as an Inside, at most ``most`` entries: past that, the last one stands for
    everything left out, with its parameters, so the totals still add up."""
    if most is not None and len(parts) > most:
        dropped = parts[most - 1:]
        rest = _what("other", f"{len(dropped)} more", None, None,
                     sum(p.what["params"] * len(p.paths) for p in dropped), None)
        rest["paths"] = [path for p in dropped for path in p.paths]
        return [_entry(p) for p in parts[:most - 1]] + [("…", rest)]
    return [_entry(p) for p in parts]


def _entry(part: _Part) -> tuple[str, dict[str, Any]]:
    return part.paths[0], {**part.what, "times": len(part.paths), "paths": list(part.paths),
                           "within": part.within}


# -- the two entry points -----------------------------------------------------------------
def architecture(graph: Any, example: Any = None, *, most: int = 48, depth: int = 0,
                 broker: Any = None) -> dict[str, Inside]:
    """What each node holds, as ``{node: Inside}``, ready for ``Graph.figure(inside=...)``.

    With an ``example`` (a tensor is wrapped in ``Opaque`` for you) the graph runs once
    so every module is seen with what actually reaches it. Depth 0 lists what a node
    holds directly; each level of ``depth`` opens the composites one level further,
    torch's own (a TransformerEncoderLayer, MultiheadAttention) included. ``most`` caps
    the entries per node. Without a ``broker`` every node runs here, wherever it is
    placed; with one, the graph runs through it and a node that runs elsewhere is listed
    as declared, without shapes, since the hooks here never see its modules run.
    Nodes that hold no modules or parameters are left out. Nothing is changed: the run
    is in the nodes' own train/eval modes, but buffers are put back and the random
    streams forked.
    """
    most = whole_number(most, "most", least=1, of="architecture()")
    depth = whole_number(depth, "depth", least=0, of="architecture()")
    held = {node_id: _held(graph.implementation(node_id)) for node_id in graph.nodes()}
    held = {node_id: items for node_id, items in held.items() if items}
    modules = list({id(m): m for items in held.values() for _, thing in items
                    if isinstance(thing, torch.nn.Module) for m in thing.modules()}.values())
    seen, signatures = _Seen(), {}
    out: dict[str, Inside] = {}
    # Without an example nothing runs, so there is nothing to put back: a Trainer lists
    # a graph this way, and copying every buffer would be its whole cost.
    with _undisturbed(modules) if example is not None else contextlib.nullcontext():
        if example is not None:
            handles = seen.hook(modules, keep_inputs=depth > 0)
            try:
                wrapped = Opaque(example) if isinstance(example, torch.Tensor) else example
                Pass().run(graph, wrapped, broker=broker, here=broker is None)
            finally:
                for handle in handles:
                    handle.remove()
        for node_id, items in held.items():
            via = "hooks" if any(id(t) in seen.shapes for _, t in items) else "declared"
            found = [(p, t, *_seen_shapes(t, seen)) for p, t in items]
            out[node_id] = _inside(_listing(found, via, seen, depth, signatures), most)
    return out


def traced(module: Any, example: Any = None) -> Inside | None:
    """What one module is made of, one level down: its parts, folded, in the order they run.

    fx if it can trace the module (and, given an ``example``, run the trace on it for
    the shapes); a real forward with hooks on its children if it cannot. Without an
    example only fx can answer, so a module it cannot trace answers None. A tuple
    example is the forward's positional arguments. A forward that raises on the
    example raises here: that is the example's fault, not an absence of parts.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"traced() takes a torch.nn.Module, not a {type(module).__qualname__}; "
                        "for a whole graph use architecture(graph, example)")
    args = None if example is None else list(example) if isinstance(example, tuple) else [example]
    seen, signatures = _Seen(), {}
    with _undisturbed(list(module.modules())):
        found = _fx_items(module, args, seen)
        via = "fx"
        if found is None:
            if args is None:
                return None
            handles = seen.hook(list(module.modules()), keep_inputs=False)
            try:
                module(*args)
            finally:
                for handle in handles:
                    handle.remove()
            found, via = _items_seen(module, seen)
    return _inside(_listing(found, via, seen, 0, signatures))


