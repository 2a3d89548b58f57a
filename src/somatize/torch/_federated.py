"""Federated averaging with nobody in charge: ``fedavg`` is the arithmetic, ``gather``
one round of it through a Store that every client reaches.

A round leaves these names in the store, under ``fed/{run}/{round}/``::

    client/{k}       client k's export, with its size in the meta (claimed: first one counts)
    averaging        who took on the averaging (claimed), and when
    averaging/2 ...  a successor, claimed when the one before went quiet for a lease
    average          the average (claimed: the first one written is the answer)

Nothing coordinates: every client keeps its part and polls. Whoever sees the round
complete claims ``averaging`` and writes the average; the others wait for it. A
client's part and the average are both claimed rather than bound, so a round's inputs
never change once written and its answer never changes once given — which is what
makes a restarted client get the same answer, and what makes it safe for a successor
to average again when the first averager died between its claim and its write.

Whoever may write the store decides what the clients get: a part or an average is
only a name, and anybody who can bind names can plant one. With ``secret=``, every
part and every average carries in its meta a MAC of its name, its digest and the rest
of its meta, keyed by the secret (through scrypt, so that a weak one is slow to
guess); a client refuses a part or an average whose MAC is missing or wrong, naming
it. A writer without the secret can then stall a round (delete names, claim them
first) but cannot choose its answer. The object's bytes are tied to its digest by the
store, and parts are read by the digest that was checked, never by name again.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import hmac
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from numbers import Real
from typing import Any

import torch

from .._codec import dumps, loads
from .._errors import BadName, DeclarationError, StoreError
from ..store import Bound, Store
from ..store._store import check_name

__all__ = ["fedavg", "gather"]

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


# -- the round ---------------------------------------------------------------------------
class _Round:
    """The names one round is kept under."""

    def __init__(self, run: str, round: int):
        self.run, self.round = run, round
        self.base = f"fed/{run}/{round}"
        self.average = f"{self.base}/average"

    def client(self, k: int) -> str:
        return f"{self.base}/client/{k}"

    def averaging(self, turn: int) -> str:
        return f"{self.base}/averaging" if turn == 1 else f"{self.base}/averaging/{turn}"


class _Turns:
    """Who this client has seen take on the averaging, and since when.

    Times are this machine's own (monotonic): another machine's clock is not to be
    trusted to say how long ago it claimed something.
    """

    def __init__(self) -> None:
        self.turn, self.since = 1, None

    def take(self, store: Store, names: _Round, lease: float, me: tuple[str, dict]) -> bool:
        """True if this client now holds the averaging: the turn was free, or the one who
        held it has been quiet for longer than a lease."""
        while store.resolve(names.averaging(self.turn + 1)) is not None:
            self.turn, self.since = self.turn + 1, None  # somebody already moved on
        if self.since is not None:
            if time.monotonic() - self.since < lease:
                return False
            self.turn, self.since = self.turn + 1, None
        digest, meta = me
        if store.claim(names.averaging(self.turn), digest, dict(meta, at=time.time())):
            return True
        self.since = time.monotonic()
        return False

    def holders(self, store: Store, names: _Round) -> list[str]:
        found = []
        for turn in range(1, self.turn + 1):
            bound = store.resolve(names.averaging(turn))
            if bound is not None:
                found.append(f"{bound.meta.get('by', '?')} (client {bound.meta.get('client')})")
        return found


def gather(store: Store, what: Mapping[str, Mapping[str, Any]], *, run: str, round: int,
           clients: int, mine: int, size: float | None = None, within: float = 600.0,
           asking: float = 1.0, lease: float | None = None,
           secret: str | bytes | None = None, nonfinite: str = "refuse") -> Export:
    """Keeps this client's export for the round, waits for the other clients', and
    answers the round's average, which every client gets bit for bit the same.

    ``run`` names the training run (one name part), ``round`` counts from 0,
    ``clients`` is how many take part and ``mine`` which one this is, from 0. ``size``
    weighs this export (how many samples it saw): all clients give one or none does.
    The store is asked every ``asking`` seconds; after ``within`` seconds a
    ``TimeoutError`` names the clients that never turned up, or who claimed the
    averaging and never finished it.

    Asked again for a round it already took part in — a restarted client — it answers
    the same average; the export it kept the first time is the one that counts. An
    averager that is quiet for ``lease`` seconds (default ``max(5 * asking, 10)``) is
    taken over by the next client to notice, so a crash between claiming the
    averaging and writing it costs a lease, not the round.

    ``secret`` (a str or bytes every client of the run is given; ``secrets.token_urlsafe
    (32)`` makes a good one) signs this client's part and the average it may write,
    and makes it refuse, with a ``StoreError`` naming the name, any part or average
    that is not signed with it: a writer of the store who lacks the secret cannot
    choose what the round answers.

    A part holding a NaN or an infinity would make every weight it touches NaN in the
    average every client gets, so ``nonfinite="refuse"`` (the default) refuses it with a
    ``ValueError`` naming the client, node and key: this client's own before it is
    kept (the others then wait for a part that never comes, and time out naming it),
    and another's before anything is averaged. ``nonfinite="warn"`` warns the same and
    averages it all the same.
    """
    lease = _checked(store, what, run, round, clients, mine, size, within, asking, lease)
    if nonfinite not in ("refuse", "warn"):
        raise ValueError(f"nonfinite={nonfinite!r} is refused: it is 'refuse' (a part "
                         "holding NaN or inf is refused) or 'warn' (it is averaged, with a "
                         "warning)")
    key = None if secret is None else _key(_secret(secret), run)
    names = _Round(run, round)
    deadline = time.monotonic() + within
    answer = _answer(store, names, key)
    if answer is not None:
        return answer
    _finite(what, mine, run, round, nonfinite)  # before it is kept, where it would count
    written = dumps(what)  # first: what has no codec is refused before anything is put
    who = f"{socket.gethostname()}/{os.getpid()}"
    me = (store.put(who.encode()), {"client": mine, "by": who})
    part = store.put(written)
    store.claim(names.client(mine), part, _signed(key, names.client(mine), part, {
        "client": mine, "clients": clients, "size": size, "by": who}))
    seen: dict[int, Bound] = {}
    turns = _Turns()
    while True:
        answer = _answer(store, names, key)
        if answer is not None:
            return answer
        _look(store, names, clients, seen, key)
        if len(seen) == clients:
            sizes = _agreed(seen, clients, run, round)
            if turns.take(store, names, lease, me):
                return _average(store, names, seen, sizes, who, turns.turn, key, nonfinite)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(_late(store, names, run, round, clients, seen, turns, within))
        time.sleep(min(asking, left))


def _look(store: Store, names: _Round, clients: int, seen: dict[int, Bound],
          key: bytes | None) -> None:
    """Adds the clients whose part is now kept; once kept (and checked), a part is
    read by that digest, whatever the name is bound to later."""
    for k in range(clients):
        if k not in seen:
            bound = store.resolve(names.client(k))
            if bound is not None:
                seen[k] = _checked_mac(store, bound, key)


def _answer(store: Store, names: _Round, key: bytes | None) -> Export | None:
    """The round's average if it is written (and, with a key, signed with it)."""
    bound = store.resolve(names.average)
    return None if bound is None else _value(store, _checked_mac(store, bound, key))


def _value(store: Store, bound: Bound) -> Any:
    blob = store.get(bound.digest)
    if blob is None:
        raise StoreError(f"{bound.name} is bound to {bound.digest}, which {store.where} does "
                         "not have; the round cannot be read — remove the name and run it again")
    return loads(blob, f"the object {bound.digest} bound to {bound.name!r} in {store.where}")


# -- the secret ----------------------------------------------------------------------------
_SHORT = 16  # bytes: a secret shorter than this can be guessed from the MACs in the store


def _secret(secret: Any) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"secret= is a str or bytes that every client is given, not a "
                        f"{type(secret).__qualname__}")
    if not secret:
        raise ValueError("secret= is empty; give every client the same long random secret "
                         "(python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
                         "or None to sign nothing")
    if len(secret) < _SHORT:
        warnings.warn(f"secret= is {len(secret)} bytes; anybody who can read the store can "
                      "try guesses against the MACs kept there, so use one of 32 random bytes "
                      "or more (secrets.token_urlsafe(32))", UserWarning, stacklevel=3)
    return secret


@functools.lru_cache(maxsize=8)
def _key(secret: bytes, run: str) -> bytes:
    """The MAC key of a run: scrypt, so each guess at a secret costs tens of ms."""
    return hashlib.scrypt(secret, salt=f"somatize federated {run}".encode(), n=2**14, r=8,
                          p=1, dklen=32)


def _mac(key: bytes, name: str, digest: str, meta: Mapping[str, Any]) -> str:
    signed = {k: v for k, v in meta.items() if k != "mac"}
    text = json.dumps([name, digest, signed], sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _signed(key: bytes | None, name: str, digest: str, meta: dict[str, Any]) -> dict[str, Any]:
    if key is not None:
        meta["mac"] = _mac(key, name, digest, meta)
    return meta


def _checked_mac(store: Store, bound: Bound, key: bytes | None) -> Bound:
    """``bound`` itself, once its MAC is the one ``key`` makes; refused, naming it, if not."""
    if key is None:
        return bound
    said = bound.meta.get("mac")
    if type(said) is str and hmac.compare_digest(said, _mac(key, bound.name, bound.digest,
                                                            bound.meta)):
        return bound
    how = "carries no MAC" if said is None else "carries a MAC this secret does not make"
    raise StoreError(
        f"{bound.name} in {store.where} {how}: whoever wrote it (it says {bound.meta.get('by')!r}) "
        "does not hold this round's secret=, so it is refused. If every client was given "
        "the same secret, somebody who may write the store planted it: find out who, "
        "remove the name, and run the round again")


def _agreed(seen: dict[int, Bound], clients: int, run: str, round: int) -> list[float] | None:
    """The sizes to weigh by, once every client's part is in: all given, or none."""
    for k, bound in sorted(seen.items()):
        if bound.meta.get("clients") != clients:
            raise ValueError(
                f"round {round} of run {run!r}: client {k} kept its part saying there are "
                f"{bound.meta.get('clients')} clients and this one says {clients}; every "
                "client of a run has to be started with the same clients=")
    sizes = {k: bound.meta.get("size") for k, bound in seen.items()}
    unsized = sorted(k for k, size in sizes.items() if size is None)
    if not unsized:
        return [sizes[k] for k in range(clients)]
    if len(unsized) == clients:
        return None
    raise ValueError(
        f"round {round} of run {run!r}: clients {unsized} gave no size= and the others "
        "did; give every client its size, or none of them, so the round can be weighed")


def _average(store: Store, names: _Round, seen: dict[int, Bound], sizes: list[float] | None,
             who: str, turn: int, key: bytes | None, nonfinite: str) -> Export:
    """Averages the round, one part in memory at a time, and writes it unless somebody
    already has; answers what was written first."""

    def parts() -> Iterator[Any]:
        for k in range(len(seen)):
            part = _value(store, seen[k])
            _finite(part, k, names.run, names.round, nonfinite)
            yield part

    average = fedavg(parts(), sizes)
    digest = store.put(dumps(average))
    meta = {"clients": len(seen), "sizes": sizes, "by": who, "turn": turn}
    if store.claim(names.average, digest, _signed(key, names.average, digest, meta)):
        return average
    return _answer(store, names, key)  # a predecessor woke up and finished first


def _finite(export: Mapping[str, Mapping[str, Any]], client: int, run: str, round: int,
            nonfinite: str) -> None:
    """Refuses (or, with ``nonfinite="warn"``, warns about) a part holding NaN or inf,
    naming the client and where in its export the first one is."""
    for node, weights in export.items():
        for key, value in weights.items():
            if _averaged(value) and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                said = (f"round {round} of run {run!r}: client {client}'s part holds {bad} NaN "
                        f"or inf value{'s' if bad != 1 else ''} in node {node!r}, key {key!r}")
                if nonfinite == "warn":
                    warnings.warn(f"{said}; it is averaged in as asked (nonfinite='warn'), so "
                                  "the average is NaN there", UserWarning, stacklevel=4)
                    return
                raise ValueError(
                    f"{said}, which would make that weight NaN in every client's average: it "
                    "is refused. Mend that client's training (a lower learning rate, gradient "
                    "clipping) and run the round again, or pass nonfinite='warn' to average "
                    "it anyway")


def _late(store: Store, names: _Round, run: str, round: int, clients: int,
          seen: dict[int, Bound], turns: _Turns, within: float) -> str:
    where = f"round {round} of run {run!r} in {store.where}"
    missing = [k for k in range(clients) if k not in seen]
    if missing:
        said = "client" if len(missing) == 1 else "clients"
        return (f"{where}: {said} {', '.join(map(str, missing))} never kept a part within "
                f"{within:g} s ({len(seen)} of {clients} did); check that every client runs, "
                "with the same store, run= and round=, or give them longer with within=")
    holders = turns.holders(store, names)
    return (f"{where}: every client kept its part, but the average was never written within "
            f"{within:g} s; the averaging was claimed by {', '.join(holders) or 'nobody'} "
            "and is not finished — look at what happened to them, or give it longer with "
            "within=")


def _checked(store: Any, what: Any, run: Any, round: Any, clients: Any, mine: Any,
             size: Any, within: Any, asking: Any, lease: Any) -> float:
    """Refuses what cannot make a round, before anything is written; answers the lease."""
    if not isinstance(store, Store):
        raise TypeError(f"gather() keeps the round in a Store, not a {type(store).__qualname__}; "
                        "open one with Store(directory) or Store.on_bucket(...)")
    _check_export(what, "what=")
    if type(run) is not str or "/" in run:
        raise BadName(f"run={run!r} is refused: a run is one name part, such as "
                      "'tuesday', with no '/'")
    check_name(run, "run")
    for name, value, least in (("round", round, 0), ("clients", clients, 1)):
        if type(value) is not int:
            raise TypeError(f"{name}= is an int, not a {type(value).__qualname__}")
        if value < least:
            raise ValueError(f"{name}={value} is refused: it is at least {least}")
    if type(mine) is not int or not 0 <= mine < clients:
        raise ValueError(f"mine={mine!r} is not one of the {clients} clients; clients are "
                         f"counted from 0, so mine is 0 to {clients - 1}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, Real)
                             or not (math.isfinite(size) and size > 0)):
        raise ValueError(f"size={size!r} is refused: it is how many samples this client saw, "
                         "a positive number — or None, for every client to weigh the same")
    for name, value in (("within", within), ("asking", asking), ("lease", lease)):
        if value is None and name == "lease":
            continue
        if isinstance(value, bool) or not isinstance(value, Real) or not value > 0 \
                or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} is refused: it is a positive number of seconds")
    return float(lease) if lease is not None else max(5.0 * asking, 10.0)
