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

import functools
import hashlib
import hmac
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from numbers import Real
from typing import Any

import torch

from .._codec import dumps, loads
from .._errors import BadName, StoreError
from ..store import Bound, Store
from ..store._store import check_name
from ._aggregate import Export, _averaged, _check_export, fedavg
from ._watch import reader

__all__ = ["gather"]


# -- the round ---------------------------------------------------------------------------
class _Round:
    """The names one round is kept under."""

    def __init__(self, run: str, round: int, stage: str | None = None):
        self.run, self.round = run, round
        self.base = f"fed/{run}/{round}" if stage is None else f"fed/{run}/{stage}/{round}"
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
           secret: str | bytes | None = None, nonfinite: str = "refuse",
           aggregate: Callable[..., Export] | None = None, server: Any = None,
           quorum: int | None = None, start: Mapping[str, Mapping[str, Any]] | None = None,
           privacy: Any = None) -> Export:
    """Keeps this client's export for the round, waits for the other clients', and
    answers the round's average, which every client gets bit for bit the same.

    ``run`` names the training run (one name part), ``round`` counts from 0,
    ``clients`` is how many take part and ``mine`` which one this is, from 0. ``size``
    weighs this export (how many samples it saw): all clients give one or none does.
    The store is read by one thread per process for every client waiting there, soon
    after something changed and ever more rarely while nothing does, never less often
    than every ``asking`` seconds; after ``within`` seconds a ``TimeoutError`` names the
    clients that never turned up, or who claimed the averaging and never finished it.

    Asked again for a round it already took part in — a restarted client — it answers
    the same average; the export it kept the first time is the one that counts. An
    averager that is quiet for ``lease`` seconds (default ``max(5 * asking, 10)``) is
    taken over by the next client to notice, so a crash between claiming the
    averaging and writing it costs a lease, not the round.

    How the parts are combined: ``aggregate`` (default ``fedavg``; or ``fedmedian``,
    ``fedtrimmedavg``, ``krum``, ``bulyan``, or any function of ``(exports, sizes)``);
    ``privacy`` (a ``ClientPrivacy``) clips each client's update and noises their
    mean instead; then ``server`` (``FedAvgM``, ``FedAdam``, ``FedYogi``,
    ``FedAdagrad``) takes the result as a step from the round's start, with its state
    carried from round to round in the store. Both need the weights the round started
    from: the previous round's average, or in the first round ``start=``.

    ``quorum=k`` lets a round close without everybody: once ``within`` has passed
    with at least k parts kept, the first client to notice averages those, and a
    ``UserWarning`` names the clients that were missing. A part kept after that is in
    no average (its client is warned and gets the closed round's average, as a client
    that turns up late does); the client then joins the next round. It waits for the
    averager up to ``within + lease``.

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
    return through(store, what, run=run, round=round, stage=None, clients=clients,
                   mine=mine, size=size, within=within, asking=asking, lease=lease,
                   secret=secret, nonfinite=nonfinite, aggregate=aggregate, server=server,
                   quorum=quorum, start=start, privacy=privacy)


def through(store: Store, what: Mapping[str, Mapping[str, Any]], *, run: str, round: int,
            stage: str | None, clients: int, mine: int, size: float | None, within: float,
            asking: float, lease: float | None, secret: str | bytes | None, nonfinite: str,
            aggregate: Any, server: Any, quorum: int | None, start: Any,
            privacy: Any) -> Export:
    """gather's round, under ``fed/{run}/{round}`` or, with a ``stage`` (such as
    ``"evaluate"``), under ``fed/{run}/{stage}/{round}``; everything checked before
    anything is kept. What ``evaluate`` shares with ``gather``."""
    lease = _checked(store, what, run, round, clients, mine, size, within, asking, lease)
    how = _How(aggregate, server, quorum, privacy, clients, nonfinite)
    key = None if secret is None else _key(_secret(secret), run)
    return _through(store, what, _Round(run, round, stage), clients, mine, size, within,
                    asking, lease, key, how, start)


def _through(store: Store, what: Mapping[str, Mapping[str, Any]], names: _Round,
             clients: int, mine: int, size: float | None, within: float, asking: float,
             lease: float, key: bytes | None, how: _How, start: Any) -> Export:
    """One round under ``names``, checked already: keep this part, wait, average."""
    run, round = names.run, names.round
    deadline = time.monotonic() + within
    bound = _answer_bound(store, names, key)
    if bound is not None:
        return _taken(store, bound, mine, run, round)
    if how.needs_start:
        start = _start(store, names, start, key)
    _finite(what, mine, run, round, how.nonfinite)  # before it is kept, where it would count
    written = dumps(what)  # first: what has no codec is refused before anything is put
    who = f"{socket.gethostname()}/{os.getpid()}"
    me = (store.put(who.encode()), {"client": mine, "by": who})
    watch = reader(store, names.base)
    part = store.put(written)
    store.claim(names.client(mine), part, _signed(key, names.client(mine), part, {
        "client": mine, "clients": clients, "size": size, "by": who}))
    watch.add(store.resolve(names.client(mine)))
    seen: dict[int, Bound] = {}
    turns = _Turns()
    wanted = [names.average] + [names.client(k) for k in range(clients)]
    with watch.waiting(asking, wanted):
        while True:
            listed, version = watch.names()
            bound = listed.get(names.average)
            if bound is not None:
                return _taken(store, _checked_mac(store, bound, key), mine, run, round)
            _look(store, names, clients, listed, seen, key)
            now = time.monotonic()
            if how.quorum is not None and now >= deadline and len(seen) < clients:
                # the reader stops at the first missing part; closing needs them all
                _look(store, names, clients, _resolved(store, names, clients, seen), seen,
                      key)
            closing = how.quorum is not None and now >= deadline and len(seen) >= how.quorum
            if len(seen) == clients or closing:
                sizes = _agreed(seen, clients, run, round)
                if turns.take(store, names, lease, me):
                    average = _average(store, names, seen, sizes, who, turns.turn, key, how,
                                       start)
                    watch.add(store.resolve(names.average))
                    return average
            give_up = deadline if how.quorum is None or len(seen) < how.quorum \
                else deadline + lease
            if now >= give_up:
                _look(store, names, clients, _resolved(store, names, clients, seen), seen,
                      key)  # name only the clients that are truly missing
                raise TimeoutError(_late(store, names, run, round, clients, seen, turns,
                                         within))
            wake = deadline if how.quorum is not None and now < deadline else give_up
            watch.wait(version, max(0.0, min(asking, wake - now)))


class _How:
    """How a round combines its parts, checked before anything is kept."""

    def __init__(self, aggregate: Any, server: Any, quorum: Any, privacy: Any,
                 clients: int, nonfinite: str):
        if nonfinite not in ("refuse", "warn"):
            raise ValueError(f"nonfinite={nonfinite!r} is refused: it is 'refuse' (a part "
                             "holding NaN or inf is refused) or 'warn' (it is averaged, with "
                             "a warning)")
        if aggregate is not None and not callable(aggregate):
            raise TypeError(f"aggregate= is a {type(aggregate).__qualname__}; give a function "
                            "of (exports, sizes), such as fedmedian")
        if server is not None and not callable(getattr(server, "step", None)):
            raise TypeError(f"server= is a {type(server).__qualname__}, which has no step(); "
                            "give FedAvgM, FedAdam, FedYogi or FedAdagrad")
        if privacy is not None and not callable(getattr(privacy, "average", None)):
            raise TypeError(f"privacy= is a {type(privacy).__qualname__}; give a "
                            "ClientPrivacy(clip=..., noise=...)")
        if privacy is not None and aggregate is not None:
            raise ValueError("privacy= averages the clipped updates itself, with equal "
                             "weight, which is what its noise is scaled to; leave out "
                             "aggregate= (a robust rule would change what one client can move)")
        if quorum is not None and (type(quorum) is not int or not 1 <= quorum <= clients):
            raise ValueError(f"quorum={quorum!r} is refused: it is how many of the {clients} "
                             f"clients' parts close a round after within=, 1 to {clients}")
        self.aggregate, self.server, self.privacy = aggregate, server, privacy
        self.quorum, self.nonfinite = quorum, nonfinite
        self.needs_start = server is not None or privacy is not None


def _before(store: Store, names: _Round, key: bytes | None) -> Bound | None:
    """The average of the round before, checked as this round's would be."""
    if names.round == 0:
        return None
    bound = store.resolve(_Round(names.run, names.round - 1).average)
    return None if bound is None else _checked_mac(store, bound, key)


def _start(store: Store, names: _Round, start: Any, key: bytes | None) -> Any:
    """The weights the round began from: the last round's average, or ``start=``."""
    before = _before(store, names, key)
    if before is not None:
        return _value(store, before)
    if start is None:
        raise ValueError(
            f"round {names.round} of run {names.run!r} has no round before it in the store, "
            "and server= and privacy= step from the weights the round started from: give "
            "them as start= (the same weights every client began with)")
    _check_export(start, "start=")
    return start


def _taken(store: Store, bound: Bound, mine: int, run: str, round: int) -> Export:
    """The round's average; a client whose part is not in it is told so."""
    parts = bound.meta.get("parts")
    if parts is not None and mine not in parts:
        warnings.warn(
            f"round {round} of run {run!r} closed without client {mine}'s part (it averaged "
            f"clients {_listed(parts)}); client {mine} takes that average and joins the "
            "next round", UserWarning, stacklevel=3)
    return _value(store, bound)


def _listed(clients: Iterable[int]) -> str:
    return ", ".join(map(str, clients))


def _look(store: Store, names: _Round, clients: int, listed: Mapping[str, Bound],
          seen: dict[int, Bound], key: bytes | None) -> None:
    """Adds the clients whose part is now kept; once kept (and checked), a part is
    read by that digest, whatever the name is bound to later."""
    for k in range(clients):
        if k not in seen:
            bound = listed.get(names.client(k))
            if bound is not None:
                seen[k] = _checked_mac(store, bound, key)


def _resolved(store: Store, names: _Round, clients: int,
              seen: dict[int, Bound]) -> dict[str, Bound]:
    """Every client's part not yet seen that is kept, read from the store now."""
    found = {}
    for k in range(clients):
        if k not in seen:
            bound = store.resolve(names.client(k))
            if bound is not None:
                found[bound.name] = bound
    return found


def _answer_bound(store: Store, names: _Round, key: bytes | None) -> Bound | None:
    bound = store.resolve(names.average)
    return None if bound is None else _checked_mac(store, bound, key)


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
    """The sizes to weigh by, once the parts that close the round are in: all given, or
    none."""
    for k, bound in sorted(seen.items()):
        if bound.meta.get("clients") != clients:
            raise ValueError(
                f"round {round} of run {run!r}: client {k} kept its part saying there are "
                f"{bound.meta.get('clients')} clients and this one says {clients}; every "
                "client of a run has to be started with the same clients=")
    sizes = {k: bound.meta.get("size") for k, bound in seen.items()}
    unsized = sorted(k for k, size in sizes.items() if size is None)
    if not unsized:
        return [sizes[k] for k in sorted(seen)]
    if len(unsized) == len(seen):
        return None
    raise ValueError(
        f"round {round} of run {run!r}: clients {unsized} gave no size= and the others "
        "did; give every client its size, or none of them, so the round can be weighed")


def _average(store: Store, names: _Round, seen: dict[int, Bound], sizes: list[float] | None,
             who: str, turn: int, key: bytes | None, how: _How, start: Any) -> Export:
    """Averages the parts in ``seen`` (one in memory at a time, for a plain fedavg),
    and writes the answer unless somebody already has; answers what was written first."""
    taken = sorted(seen)
    clients = seen[taken[0]].meta["clients"]

    def parts() -> Iterator[Any]:
        for k in taken:
            part = _value(store, seen[k])
            _finite(part, k, names.run, names.round, how.nonfinite)
            yield part

    meta: dict[str, Any] = {"clients": len(seen), "sizes": sizes, "by": who, "turn": turn,
                            "parts": taken}
    before = _before(store, names, key)
    if how.privacy is not None:
        average = how.privacy.average(start, list(parts()), names.run, names.round)
        meta["privacy"] = how.privacy.spent(
            [] if before is None else before.meta.get("privacy", {}).get("rounds", []),
            len(taken), clients)
    elif how.aggregate is None:
        average = fedavg(parts(), sizes)  # looked up here, so a test may stand in for it
    else:
        average = how.aggregate(list(parts()), sizes)
    if how.server is not None:
        state = None
        if before is not None and "server" in before.meta:
            state = loads(_blob(store, before.meta["server"], before.name),
                          f"the server state of {before.name!r}")
        average, state = how.server.step(start, average, state)
        meta["server"] = store.put(dumps(state))
        meta["optimizer"] = type(how.server).__name__
    digest = store.put(dumps(average))
    if store.claim(names.average, digest, _signed(key, names.average, digest, meta)):
        missing = [k for k in range(clients) if k not in seen]
        if missing:
            warnings.warn(
                f"round {names.round} of run {names.run!r} closed at its quorum without "
                f"client{'s' if len(missing) > 1 else ''} {_listed(missing)}: the average is "
                f"of clients {_listed(taken)} ({len(taken)} of {clients})", UserWarning,
                stacklevel=3)
        return average
    return _answer(store, names, key)  # a predecessor woke up and finished first


def _blob(store: Store, digest: str, name: str) -> bytes:
    blob = store.get(digest)
    if blob is None:
        raise StoreError(f"{name} names {digest} as its server state, which {store.where} does "
                         "not have; the server step cannot continue — remove the name and run "
                         "the round again")
    return blob


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
