"""The ``health`` facts of a run, read back from its record: ``seen`` and ``history``
(and, for the rules, its ``loss`` facts).

A run is listed with one scan of names; a record is opened only if it may hold
``health`` facts (a Recorder that summarised ``health`` says in each binding's meta
which do not), or a loss its meta does not hold. What a record held is kept by its digest, so the findings, the
history and the panel of one report open each record once, a run that grew opens
only its new records, and a record bound again is read again — never served stale.
A record that cannot be read is left out, as ``somatize.record.damaged`` tells.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .._errors import RecordError
from ..record._read import listed, readable

__all__ = ["health_facts", "history", "history_of", "judged_facts", "optimizer_of", "places_of",
           "seen"]

_KEPT = 50_000  # records whose health facts are kept, the least recently read going first
_kept: OrderedDict[str, tuple[dict[str, Any], ...]] = OrderedDict()
_lock = threading.Lock()
_NOT_MEASURES = ("fact", "where", "step")


def health_facts(store: Any, run: str) -> list[dict[str, Any]]:
    """Every well-formed ``health`` fact of a run, in the order they were said. The
    facts are shared with later calls: read them, do not change them."""
    found: list[dict[str, Any]] = []
    for _, bound in listed(store, run):  # refuses an unknown run, naming the known ones
        if "health" in bound.meta and bound.meta["health"] is None:
            continue  # summarised, and said none
        found.extend(fact for fact in _of_record(store, bound) if fact["fact"] == "health")
    return found


def judged_facts(store: Any, run: str) -> list[dict[str, Any]]:
    """What the rules read: every ``health`` fact and every ``loss`` fact of a run, in
    the order they were said, and what its ``graph`` fact said of the graph's node ids
    and the optimizer (``{"fact": "graph", "nodes": [...], "optimizer": "SGD"}``), so
    that a where is placed in the node it belongs to and advice fits the optimizer. A
    forward that said no health and summarised its loss is read from its meta alone
    (its last loss, which is a Trainer's only one)."""
    found: list[dict[str, Any]] = []
    for at, (_, bound) in enumerate(listed(store, run)):
        if at > 0 and "health" in bound.meta and bound.meta["health"] is None \
                and "loss" in bound.meta:  # the first is read whole: it says the graph
            if bound.meta["loss"] is not None:
                found.append({"fact": "loss", "value": bound.meta["loss"]})
            continue
        found.extend(_of_record(store, bound))
    return found


def _of_record(store: Any, bound: Any) -> tuple[dict[str, Any], ...]:
    """The health and loss facts of one record, read once: a digest names the bytes, so what was
    read under it is what is there, in any store, for as long as it is kept (a batch holds
    several forwards, so the forward's name is part of what is kept under)."""
    key = (bound.digest, bound.name)
    with _lock:
        kept = _kept.get(key)
        if kept is not None:
            _kept.move_to_end(key)
            return kept
    record = readable(store, bound)
    if record is None:
        return ()  # not kept: damage is noted by the record's reader, and may be mended
    kept = tuple(_graph_said(fact) if fact.get("fact") == "graph" else fact
                 for fact in record["facts"] if type(fact) is dict and (
                     (fact.get("fact") == "health" and isinstance(fact.get("where"), str)
                      and type(fact.get("step")) is int) or fact.get("fact") in ("loss", "graph")))
    with _lock:
        _kept[key] = kept
        while len(_kept) > _KEPT:
            _kept.popitem(last=False)
    return kept


def _graph_said(fact: dict[str, Any]) -> dict[str, Any]:
    """What the rules need of a ``graph`` fact: the node ids, and the optimizer's name."""
    graph = fact.get("graph")
    nodes = graph.get("nodes") if type(graph) is dict else None
    optimizer = fact.get("optimizer")
    return {"fact": "graph",
            "nodes": [n for n in nodes if type(n) is str] if type(nodes) is list else [],
            "optimizer": optimizer if type(optimizer) is str else None}


def places_of(facts: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """``{where: (node, path)}`` for every where the health facts name: the node a where
    is measured in, and the path of the submodule inside it ('' for the node itself).

    A where is ``node`` or ``node.path``, and a node id may hold dots itself (``enc.v2``),
    so the where is not split at its first dot: it is matched against the node ids the
    run's ``graph`` fact names (the longest that it starts with), or, in a run that
    described no graph, against the other wheres (the Audit measures a node itself
    whenever it measures a module inside it)."""
    nodes: set[str] = set()
    wheres: dict[str, None] = {}
    for fact in facts:
        if type(fact) is not dict:
            continue
        if fact.get("fact") == "graph":  # as a Trainer says it, or as judged_facts keeps it
            said = (_graph_said(fact) if "graph" in fact else fact).get("nodes")
            nodes.update(n for n in (said if type(said) is list else ()) if type(n) is str)
        elif fact.get("fact") == "health" and isinstance(fact.get("where"), str):
            wheres[fact["where"]] = None
    if nodes:
        return {where: _in_graph(where, nodes) for where in wheres}
    return {where: _among(where, set(wheres)) for where in wheres}


def _in_graph(where: str, nodes: set[str]) -> tuple[str, str]:
    """The node id ``where`` is, or the longest it starts with (then a dot, then the path)."""
    if where in nodes:
        return where, ""
    cut = len(where)
    while (cut := where.rfind(".", 0, cut)) > 0:
        if where[:cut] in nodes:
            return where[:cut], where[cut + 1:]
    return where, ""


def _among(where: str, wheres: set[str]) -> tuple[str, str]:
    """Without the graph: the shortest other where this one starts with (then a dot) is
    the node it is inside; with none, it is a node itself."""
    cut = 0
    while (cut := where.find(".", cut + 1)) > 0:
        if where[:cut] in wheres:
            return where[:cut], where[cut + 1:]
    return where, ""


def optimizer_of(facts: list[dict[str, Any]]) -> str | None:
    """The optimizer's class name the run's ``graph`` fact says (None if it says none)."""
    for fact in facts:
        if type(fact) is dict and fact.get("fact") == "graph" \
                and type(fact.get("optimizer")) is str and fact["optimizer"]:
            return fact["optimizer"]
    return None


def _measures(fact: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fact.items() if k not in _NOT_MEASURES}


def seen(store: Any, run: str, step: int | None = None) -> dict[str, dict[str, Any]]:
    """``{where: {measure: value}}`` at one measured step — the last by default.

    The same shape ``probe`` answers. A step that was not measured is refused, naming
    the measured steps around it; a run without any ``health`` fact answers ``{}``.
    """
    if step is not None and (type(step) is not int or step < 0):
        raise TypeError(f"step is a step number (an int from 0), not {step!r}")
    facts = health_facts(store, run)
    if not facts:
        return {}
    if step is None:
        step = facts[-1]["step"]
    out: dict[str, dict[str, Any]] = {}
    for fact in facts:
        if fact["step"] == step:
            # a step said twice (a worker's measures, then the leaks measured here):
            # one where's measures, the later winning where both say one
            out.setdefault(fact["where"], {}).update(_measures(fact))
    if not out:
        steps = sorted({fact["step"] for fact in facts})
        below = [s for s in steps if s < step][-3:]
        above = [s for s in steps if s > step][:3]
        raise RecordError(
            f"run {run!r} has no health facts at step {step}; measured steps near it are "
            f"{', '.join(map(str, below + above))} (of {len(steps)}, from {steps[0]} to {steps[-1]})")
    return out


def history_of(facts: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, Any]]]]:
    """The history in ``facts`` (as the Audit says them, or as read from a record)."""
    out: dict[str, dict[str, list[tuple[int, Any]]]] = {}
    for fact in facts:
        if type(fact) is not dict or fact.get("fact") != "health":
            continue
        mine = out.setdefault(fact["where"], {})
        step = fact["step"]
        for measure, value in _measures(fact).items():
            mine.setdefault(measure, []).append((step, value))
    return out


def history(store: Any, run: str) -> dict[str, dict[str, list[tuple[int, Any]]]]:
    """``{where: {measure: [(step, value), ...]}}`` over the whole run, in record order.

    Wheres in the order they were first said; a measure appears only where it was
    measured (``act_saturated`` for bounded activations, histograms on snapshot steps).
    """
    return history_of(health_facts(store, run))
