"""How a round's parts become one export: ``fedavg``, the weighted mean, and averages
that a few bad clients cannot steer: the coordinate-wise median and trimmed
mean, Krum (and multi-Krum) and Bulyan, each with ``fedavg``'s signature.

They answer what Flower's ``aggregate_median``, ``aggregate_trimmed_avg``,
``aggregate_krum`` and ``aggregate_bulyan`` answer on the same weights, down to the
order ties are broken in, so that a run moved from Flower keeps its numbers. As in
``fedavg``, only floating-point tensors are combined; anything else is copied from the
first export. Unlike ``fedavg`` they need every export at once (a median cannot be
taken one export at a time), so a generator is read into a list first.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

from .._errors import DeclarationError

__all__ = ["bulyan", "fedavg", "fedmedian", "fedtrimmedavg", "krum"]

Export = dict[str, dict[str, Any]]


# -- the arithmetic ----------------------------------------------------------------------
def fedavg(exports: Iterable[Mapping[str, Mapping[str, Any]]],
           sizes: Sequence[float] | None = None) -> Export:
    """The weighted average of several exports, weight for weight: FedAvg.

    ``sizes`` (how much data each export was trained on; any positive numbers) weigh
    them, and without it they weigh the same. Only floating-point (and complex) tensors
    are averaged; anything else — a ``num_batches_tracked`` is a count, and the mean
    of two counts is not one — is copied from the first export.

    The sum is taken in place, one export at a time, in the tensors' own precision
    (float32 and float64 as they are; half precision in float32, where a weighted sum
    would overflow or round away the smaller clients), then divided by the total
    weight, as Flower does. So the answer is one new export and never more: hand it a
    generator and it holds no export but the one it is adding. Exports that disagree
    on nodes, keys, shapes or dtypes are refused, naming which.
    """
    weights = _sizes(sizes)
    if weights is not None and isinstance(exports, Sequence) and len(exports) != len(weights):
        raise ValueError(f"fedavg() got {len(exports)} exports and {len(weights)} sizes; give "
                         "one size per export")
    total, result, first = 0.0, None, None
    at = 0  # counted by hand: enumerate() keeps the export it last gave in its own tuple
    for export in exports:
        if weights is not None and at >= len(weights):
            raise ValueError(f"fedavg() got more exports than the {len(weights)} sizes given; "
                             "give one size per export")
        weight = 1.0 if weights is None else weights[at]
        _check_export(export, f"export {at}")
        if first is None:
            first, result = _layout(export), _started(export, weight)
        else:
            _check_alike(first, export, at)
            _accumulate(result, export, weight)
        total += weight
        at += 1
        del export  # let it go before the next one is made, if it comes from a generator
    if at == 0:
        raise ValueError("fedavg() was given no exports; average at least one")
    if weights is not None and at != len(weights):
        raise ValueError(f"fedavg() got {at} exports and {len(weights)} sizes; give one "
                         "size per export")
    return _finished(result, first, total)


def _sizes(sizes: Any) -> list[float] | None:
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes, Mapping)) or not isinstance(sizes, Iterable):
        raise TypeError(f"sizes= is a sequence of numbers, one per export, not a "
                        f"{type(sizes).__qualname__}")
    sizes = list(sizes)
    for at, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, Real):
            raise TypeError(f"sizes[{at}] is a {type(size).__qualname__}; a size is a number "
                            "(how many samples that export was trained on)")
        if not (math.isfinite(size) and size > 0):
            raise ValueError(f"sizes[{at}] is {size!r}; a size is a positive, finite number — "
                             "leave out an export that saw no data rather than weigh it 0")
    return [float(size) for size in sizes]


def _averaged(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _summed_in(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.complex64 if dtype.is_complex else torch.float32)


def _check_export(export: Any, what: str) -> None:
    if not isinstance(export, Mapping):
        raise TypeError(f"{what} is a {type(export).__qualname__}; an export is "
                        "{node: {key: tensor}}, as Trainer.export() gives it")
    for node, weights in export.items():
        if not isinstance(weights, Mapping):
            raise TypeError(f"{what}, node {node!r}: its weights are a "
                            f"{type(weights).__qualname__}, not {{key: tensor}}")


def _layout(export: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """What every other export has to match: per node and key, (shape, dtype) or a type."""
    return {node: {key: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                   for key, v in weights.items()} for node, weights in export.items()}


def _check_alike(first: dict[str, dict[str, Any]], export: Mapping, at: int) -> None:
    """Refuses an export that is not laid out as export 0 is, naming what differs."""
    if set(export) != set(first):
        raise DeclarationError(_differ(f"export {at}", "node", list(first), list(export)))
    for node, layout in first.items():
        weights = export[node]
        if set(weights) != set(layout):
            raise DeclarationError(_differ(f"export {at}, node {node!r}", "key", list(layout),
                                           list(weights)))
        for key, expected in layout.items():
            value = weights[key]
            if not isinstance(expected, tuple):
                if isinstance(value, torch.Tensor):
                    raise DeclarationError(f"node {node!r}, key {key!r}: export 0 holds a "
                                           f"{expected.__qualname__} and export {at} a tensor")
                continue
            if not isinstance(value, torch.Tensor):
                raise DeclarationError(f"node {node!r}, key {key!r}: export 0 holds a tensor "
                                       f"and export {at} a {type(value).__qualname__}")
            shape, dtype = expected
            if tuple(value.shape) != shape:
                raise DeclarationError(
                    f"node {node!r}, key {key!r}: export 0 has shape {shape} and export {at} "
                    f"has {tuple(value.shape)}; only exports of models built alike average")
            if value.dtype != dtype:
                raise DeclarationError(
                    f"node {node!r}, key {key!r}: export 0 is {dtype} and export {at} is "
                    f"{value.dtype}; convert them to one dtype before averaging")


def _differ(where: str, what: str, expected: list[str], found: list[str]) -> str:
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    said = []
    if missing:
        said.append(f"lacks the {what}s {', '.join(map(repr, missing[:5]))}")
    if extra:
        said.append(f"has the {what}s {', '.join(map(repr, extra[:5]))}, which export 0 lacks")
    return f"{where} {' and '.join(said)}; only exports of models built alike average"


def _started(export: Mapping[str, Mapping[str, Any]], weight: float) -> Export:
    """The running sum, made from the first export: its tensors weighted, copied once."""
    result: Export = {}
    for node, weights in export.items():
        result[node] = {}
        for key, value in weights.items():
            if _averaged(value):
                total = value.detach().to(_summed_in(value.dtype), copy=True)
                result[node][key] = total.mul_(weight) if weight != 1.0 else total
            elif isinstance(value, torch.Tensor):
                result[node][key] = value.detach().clone()
            else:
                result[node][key] = copy.deepcopy(value)
    return result


@torch.no_grad()
def _accumulate(result: Export, export: Mapping[str, Mapping[str, Any]], weight: float) -> None:
    for node, weights in result.items():
        given = export[node]
        for key, total in weights.items():
            value = given[key]
            if _averaged(value):
                # add_ with alpha multiplies and adds in one pass, with no temporary.
                total.add_(value.detach().to(total.device), alpha=weight)


def _finished(result: Export, first: dict[str, dict[str, Any]], total: float) -> Export:
    for node, weights in result.items():
        for key, value in weights.items():
            if _averaged(value):
                value.div_(total)
                dtype = first[node][key][1]
                if value.dtype != dtype:
                    weights[key] = value.to(dtype)
    return result




def fedmedian(exports: Iterable[Mapping[str, Mapping[str, Any]]],
              sizes: Sequence[float] | None = None) -> Export:
    """The coordinate-wise median of several exports (FedMedian).

    ``sizes`` is taken for ``fedavg``'s signature and checked, but a median weighs no
    client more than another (as Flower's does not). With an even number of exports
    each weight is the mean of the two middle ones.
    """
    exports, _ = _given(exports, sizes, "fedmedian")
    return _combined(exports, lambda stacked: _median(stacked))


def fedtrimmedavg(exports: Iterable[Mapping[str, Mapping[str, Any]]],
                  sizes: Sequence[float] | None = None, beta: float = 0.2) -> Export:
    """The coordinate-wise mean after cutting the ``beta`` share of the lowest and of
    the highest values of each weight (FedTrimmedAvg); ``int(beta * len(exports))`` go
    at each end. ``sizes`` is checked and does not weigh, as in Flower."""
    if isinstance(beta, bool) or not isinstance(beta, Real) or not 0.0 <= beta < 0.5:
        raise ValueError(f"beta={beta!r} is refused: it is the share cut at each end, at "
                         "least 0 and below 0.5 (0.2 cuts the lowest and highest fifth)")
    exports, _ = _given(exports, sizes, "fedtrimmedavg")
    cut = int(beta * len(exports))

    def trimmed(stacked: torch.Tensor) -> torch.Tensor:
        ordered = stacked.sort(dim=0).values
        return ordered[cut:len(exports) - cut].mean(dim=0)

    return _combined(exports, trimmed)


def krum(exports: Iterable[Mapping[str, Mapping[str, Any]]],
         sizes: Sequence[float] | None = None, *, byzantine: int, keep: int = 0) -> Export:
    """The export closest to its ``n - byzantine - 2`` nearest others (Krum), or with
    ``keep=m`` the ``sizes``-weighted mean of the ``m`` closest so (multi-Krum).

    Distances are squared Euclidean over every float weight at once; a client whose
    update is far from the crowd scores high and is never chosen.
    """
    exports, weights = _given(exports, sizes, "krum")
    _counts(len(exports), byzantine, keep)
    scores = _krum_scores(exports, byzantine)
    if keep > 0:
        chosen = np.argsort(scores)[::-1][len(scores) - keep:]  # Flower's order of ties
        return _rest_from(exports[0], fedavg(
            [exports[i] for i in chosen], None if weights is None else [weights[i] for i in chosen]))
    return _rest_from(exports[0], _copied(exports[int(np.argmin(scores))]))


def bulyan(exports: Iterable[Mapping[str, Mapping[str, Any]]],
           sizes: Sequence[float] | None = None, *, byzantine: int) -> Export:
    """Bulyan (El Mhamdi et al., 2018): Krum picks ``n - 2 * byzantine`` exports one by
    one, and each weight is the mean of the ``n - 4 * byzantine`` picked values nearest
    their coordinate-wise median. It needs ``n >= 4 * byzantine + 3`` exports."""
    exports, _ = _given(exports, sizes, "bulyan")
    _counts(len(exports), byzantine, 0)
    if len(exports) < 4 * byzantine + 3:
        raise ValueError(f"bulyan() got {len(exports)} exports and byzantine={byzantine}; it "
                         f"needs at least 4 * byzantine + 3 = {4 * byzantine + 3}: lower "
                         "byzantine= or use krum() or fedmedian()")
    left = list(exports)
    picked = []
    for _ in range(len(exports) - 2 * byzantine):
        best = int(np.argmin(_krum_scores(left, byzantine)))
        picked.append(left.pop(best))
    nearest = len(picked) - 2 * byzantine

    def around_median(stacked: torch.Tensor) -> torch.Tensor:
        distance = (stacked - _median(stacked)).abs()
        order = distance.argsort(dim=0, stable=True)[:nearest]
        return stacked.gather(0, order).mean(dim=0)

    return _rest_from(exports[0], _combined(picked, around_median))


# -- shared steps ----------------------------------------------------------------------
def _given(exports: Any, sizes: Any, who: str) -> tuple[list, list[float] | None]:
    """The exports as a list, checked alike, and their sizes, checked."""
    weights = _sizes(sizes)
    exports = list(exports)
    if not exports:
        raise ValueError(f"{who}() was given no exports; combine at least one")
    if weights is not None and len(weights) != len(exports):
        raise ValueError(f"{who}() got {len(exports)} exports and {len(weights)} sizes; give "
                         "one size per export")
    _check_export(exports[0], "export 0")
    first = _layout(exports[0])
    for at, export in enumerate(exports[1:], 1):
        _check_export(export, f"export {at}")
        _check_alike(first, export, at)
    return exports, weights


def _counts(clients: int, byzantine: Any, keep: Any) -> None:
    for name, value in (("byzantine", byzantine), ("keep", keep)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name}={value!r} is refused: it is a whole number, 0 or more")
    if keep > clients:
        raise ValueError(f"keep={keep} is more than the {clients} exports given; multi-Krum "
                         "keeps at most all of them")


def _median(stacked: torch.Tensor) -> torch.Tensor:
    """numpy's median along the first axis: the mean of the middle two when even
    (torch.median would answer the lower one)."""
    count = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    middle = count // 2
    if count % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _combined(exports: list, combine: Any) -> Export:
    """A new export: each float weight ``combine``d over the exports stacked, in a
    precision that does not overflow, and turned back to its own dtype; the rest
    copied from the first."""
    result: Export = {}
    for node, weights in exports[0].items():
        result[node] = {}
        for key, value in weights.items():
            if _averaged(value):
                stacked = torch.stack([e[node][key].detach().to(
                    device=value.device, dtype=_summed_in(value.dtype)) for e in exports])
                result[node][key] = combine(stacked).to(value.dtype)
            elif isinstance(value, torch.Tensor):
                result[node][key] = value.detach().clone()
            else:
                result[node][key] = copy.deepcopy(value)
    return result


def _copied(export: Mapping[str, Mapping[str, Any]]) -> Export:
    return {node: {key: value.detach().clone() if isinstance(value, torch.Tensor)
                   else copy.deepcopy(value) for key, value in weights.items()}
            for node, weights in export.items()}


def _rest_from(first: Mapping[str, Mapping[str, Any]], result: Export) -> Export:
    """``result`` with what is not averaged copied from ``first``, as fedavg does."""
    for node, weights in first.items():
        for key, value in weights.items():
            if not _averaged(value):
                result[node][key] = (value.detach().clone() if isinstance(value, torch.Tensor)
                                     else copy.deepcopy(value))
    return result


def _krum_scores(exports: list, byzantine: int) -> list[float]:
    """Each export's sum of squared distances to its ``n - byzantine - 2`` nearest."""
    flat = torch.stack([torch.cat([v.detach().reshape(-1).to("cpu", torch.float64)
                                   for w in e.values() for v in w.values() if _averaged(v)])
                        for e in exports])
    # A difference's norm, pair by pair, as Flower takes it: cdist rounds otherwise.
    distances = np.array([[float(torch.linalg.vector_norm(a - b)) ** 2 for b in flat]
                          for a in flat])
    closest = max(1, len(exports) - byzantine - 2)
    return [float(np.sum(row[np.argsort(row)[1:closest + 1]])) for row in distances]
