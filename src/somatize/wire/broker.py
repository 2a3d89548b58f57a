"""Broker: which worker each host is, and the engine's way of reaching them.

The broker groups hosts by wire (two hosts declared with one Worker, or with two
Workers at one address, are one place), provisions one catalog per wire — the
whole graph's share of it, the union of its hosts — and runs slices on the wire's
one connection. A host nobody listed is not an error until a slice needs it.

What a worker holds belongs to a session (``Session``): a Trainer opens one of its
own, and a graph runs in a session of its data form (the same in this process whichever
broker reaches that worker). So two Trainers, two graphs, or two clients on one worker
never see or replace each other's nodes.
"""

from __future__ import annotations

import secrets
import weakref
from typing import Any

from .._dsl import is_host_name
from .._errors import DeclarationError, Lost, UnwritableError, WireError
from .._graph import made_from, user_ids
from .._slices import Outcome, Runner, Shape, Slice, stands_for
from .._walk import LostValue
from .catalog import catalog_id, pack_values, runtime_of
from .transport import Place, Request, SessionThere, SliceForm, Staged, state_lost

__all__ = ["Broker", "Session"]

# Per data form of a graph (thrown away when the graph changes): each wire's catalog,
# packed once. Re-pickling on every forward would cost a model's weights each time.
_packed: weakref.WeakKeyDictionary[Any, dict[Any, Staged]] = weakref.WeakKeyDictionary()
_last: tuple[tuple, Broker] | None = None
# Per data form of a graph: the id of the session it runs in, and what each wire holds
# for it, whichever broker reaches that wire (a Worker declared again at the same
# address is the same wire, and finds the graph's session there).
_graphs: weakref.WeakKeyDictionary[Any, tuple[bytes, dict]] = weakref.WeakKeyDictionary()
# Where a shape keeps, per session, the wire its slices take and the form they say.
_FORMS = "broker.forms"


class Broker(Runner):
    """Where the hosts of a graph are: ``{host: Worker}``, resolved in this process.
    The walk's way to them: a ``Runner`` whose slices go over each host's wire, in
    the order they were sent (a worker answers a connection's requests in turn), each
    in the session of the graph it is part of (``session`` opens one of its own)."""

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        """Whether every host runs its slices in the order they were sent: yes over a
        socket (a connection is answered in turn) and over Ray (an actor runs one
        caller's calls in the order they were made)."""
        return all(worker.link.ordered for worker in self._wires.values())

    def __init__(self, listing: dict[str, Place]):
        if not isinstance(listing, dict):
            raise DeclarationError(f"a broker takes {{host: Worker}}, not a {type(listing).__qualname__}")
        for host, worker in listing.items():
            if not is_host_name(host):
                raise DeclarationError(f"{host!r} is not a host name (letters, digits, '.', '_', '-')")
            if not isinstance(worker, Place):
                raise DeclarationError(
                    f"host {host!r} is listed as a {type(worker).__qualname__}; list a Worker, "
                    f"e.g. Worker.at('node3:7000')")
        self._listing = dict(listing)
        self._stagings: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        self._graphs: weakref.WeakKeyDictionary[Any, Session] = weakref.WeakKeyDictionary()
        self._last: tuple[Any, Session] | None = None
        # Every host of one wire goes through the first worker listed for it.
        first: dict[bytes, Place] = {}
        self._wires = {host: first.setdefault(worker.wire, worker) for host, worker in listing.items()}

    @classmethod
    def embedded(cls, workers: dict[str, Place]) -> Broker:
        """A broker inside this process, knowing where these hosts are."""
        if type(workers) is not dict:
            return cls(workers)
        # forward(broker={...}) asks for one per forward, twice: the same listing as
        # last time answers with the same (immutable) broker. Only the last, so no
        # more than one listing's workers are kept alive by it.
        global _last
        key = tuple(workers.items())
        if _last is not None and _last[0] == key:
            return _last[1]
        broker = cls(workers)
        _last = (key, broker)
        return broker

    def worker_for(self, host: str) -> Place:
        """The worker declared for this host; an unknown host is a WireError saying how
        to list it."""
        worker = self._listing.get(host)
        if worker is None:
            known = ", ".join(map(repr, self._listing)) or "none"
            raise WireError(
                f"host {host!r} is not known to this broker (it knows {known}); say where it "
                f"is: Broker.embedded({{{host!r}: Worker.at('HOST:PORT'), ...}})", host=host)
        return worker

    def token_for(self, host: str) -> bytes | None:
        """What this host shares a wire with, or None for a host nobody listed."""
        worker = self._listing.get(host)
        return None if worker is None else worker.wire

    def hosts(self) -> list[str]:
        """The hosts this broker knows, in the order they were listed."""
        return list(self._listing)

    def wire_of(self, host: str) -> Place:
        """The one worker whose connection every host of this wire uses."""
        worker = self._wires.get(host)
        return worker if worker is not None else self.worker_for(host)

    def session(self, keeps: bool = False, shares: bool = False) -> Session:
        """A session of its own on every worker of this broker. ``keeps`` says that
        what runs in it learns there (a Trainer's trainers): such a session, once it
        has run, is never given its first catalog again, and a worker that lost it
        says so (``StateLost``). ``shares`` says that its slices may wait there for
        other clients' (a trainer several clients share): a transport that answers
        one request at a time carries it apart from the other sessions."""
        return Session(self, keeps, shares=shares)

    def stagings(self, data: Any) -> list[tuple[Place, Staged]]:
        """The catalog each wire a graph uses is provisioned with: the nodes of all
        its hosts, packed once per data form of the graph. Hosts nobody listed are
        left to fail when a slice needs them."""
        found = self._stagings.get(data)
        if found is None:
            found = self._stagings[data] = self._stage_all(data)
        return found

    def _stage_all(self, data: Any) -> list[tuple[Place, Staged]]:
        wires: dict[bytes, list[str]] = {}
        for host in dict.fromkeys(data.hosts.values()):
            token = self.token_for(host)
            if token is not None:
                wires.setdefault(token, []).append(host)
        cache = _packed.setdefault(data, {})
        stagings = []
        for token, hosts in wires.items():
            worker = self.wire_of(hosts[0])
            key = (token, worker.mode, worker.send, frozenset(hosts))
            staged = cache.get(key)
            if staged is None:
                staged = cache[key] = _pack(data, worker, set(hosts))
            stagings.append((worker, staged))
        return stagings

    # -- the walk's side: each graph in a session of its own ---------------------------
    def _of(self, data: Any) -> Session:
        last = self._last
        if last is not None and last[0]() is data:  # a forward asks twice, forward after forward
            return last[1]
        found = self._graphs.get(data)
        if found is None:
            owned = _graphs.get(data)
            if owned is None:
                owned = _graphs[data] = (secrets.token_bytes(16), {})
            found = self._graphs[data] = Session(self, keeps=False, owned=owned)
        self._last = (weakref.ref(data), found)  # weakly, like every graph it keeps a session of
        return found

    def session_of(self, data: Any) -> Session:
        """The session a graph of this data form runs in when no owner opened one (a
        Trainer that trains nothing where it runs): the one its verbs go to."""
        return self._of(data)

    def prepare(self, data: Any) -> None:
        """Stages the whole graph's catalog on every wire it uses, in the graph's own
        session: nothing is sent until a slice goes there, and then only if the
        worker says it lacks it."""
        self._of(data).prepare(data)

    def run(self, piece: Slice) -> Outcome:
        """Runs one slice on its host in one round trip."""
        return self._of(piece.shape.data).run(piece)

    def submit(self, piece: Slice) -> Any:
        """Sends one slice now and answers a pending Outcome (``result()``), read when
        asked: a wave over many hosts costs one wait, not one round trip per host, and
        a pipeline runs its next piece here while this one is out."""
        return self._of(piece.shape.data).submit(piece)

    def __repr__(self) -> str:
        return f"Broker({self._listing!r})"


def _NOTHING() -> None:  # a dead weak reference: nothing staged yet
    return None


def _pack(data: Any, worker: Place, hosts: set[str]) -> Staged:
    here = {n for n, h in data.hosts.items() if h in hosts}
    kind, blob_id, blob = worker.packed({n: data.impls[n] for n in data.ids if n in here})
    runtime = runtime_of(data, here)
    nodes = tuple(dict.fromkeys(made_from(n) for n in data.ids if n in here))
    return Staged(catalog_id(kind, blob_id, runtime), kind, blob_id, blob, runtime, nodes)


class Session(Runner):
    """One owner's state on the workers of a broker, kept apart from everybody
    else's: a random id, a catalog per wire, and what each worker is known to hold
    (a ``transport.SessionThere`` per wire, which its host holds as a
    ``host.SessionHere`` among its ``SessionsHere``).
    A runner of its own, so whoever drives a graph in pieces hands it to the walk."""

    def __init__(self, broker: Broker, keeps: bool = False,
                 owned: tuple[bytes, dict[bytes, SessionThere]] | None = None,
                 shares: bool = False):
        self.broker, self.keeps, self.shares = broker, keeps, shares
        self.id, self._by_wire = owned if owned is not None else (secrets.token_bytes(16), {})
        # The data form staged last (a forward stages each time), held weakly: a broker
        # keeps a session per graph for as long as the graph lives, and no longer.
        self._prepared: Any = _NOTHING
        self._hosts: dict[str, tuple[Place, SessionThere]] = {}  # each host's wire, found once
        self._closed = False  # closed by its owner: what it learnt is nobody's now

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        return self.broker.ordered

    def session(self, keeps: bool = False, shares: bool = False) -> Session:
        """Another session on the same workers (sessions do not nest)."""
        return self.broker.session(keeps, shares)

    def _there(self, worker: Place) -> SessionThere:
        found = self._by_wire.get(worker.wire)
        if found is None:
            found = self._by_wire[worker.wire] = SessionThere(self.id, self.keeps,
                                                           shares=self.shares)
        return found

    def prepare(self, data: Any) -> None:
        """Stages the graph's catalog for this session on every wire it uses."""
        if self._prepared() is data:
            return
        self._prepared = weakref.ref(data)
        for worker, staged in self.broker.stagings(data):
            there = self._there(worker)
            if there.staged is not staged:
                there.staged = staged

    def run(self, piece: Slice) -> Outcome:
        worker, request = self._request(piece)
        return worker.link_for(request.form.there).run(request)

    def submit(self, piece: Slice) -> Any:
        worker, form = self._form(piece.shape)
        link = worker.link_for(form.there)
        if not link.ordered:  # a host that may reorder what is sent ahead: a thread
            return super().submit(piece)
        worker, request = self._request(piece)
        return link.submit(request)

    def control(self, host: str, verb: str, args: Any = None) -> Any:
        """Asks the worker of ``host`` a verb for this session (``Link.control``): what
        a trainer there holds, the session's random state there. Its catalog is staged
        first where the graph is known (``prepare``), so a verb that comes before any
        slice provisions this session itself, and never opens another."""
        worker, there = self._place(host)
        if self._closed and there.learnt:
            raise state_lost(host, worker.where(host), there,
                             "its owner closed it (Trainer.close())")
        return worker.control(there, verb, args, host=host)

    def close(self) -> None:
        """Tells every worker this session ran on to let go of it now. What it learnt
        is gone from then on, whether a worker heard or not: a slice of it after this
        is a ``StateLost``, never a session that quietly trains on."""
        self._closed = True
        for worker in dict.fromkeys(self.broker.wire_of(h) for h in self.broker.hosts()):
            there = self._by_wire.get(worker.wire)
            if there is not None:
                worker.end(there)

    def _place(self, host: str) -> tuple[Place, SessionThere]:
        """The worker whose wire a host is on, and this session there; found once."""
        found = self._hosts.get(host)
        if found is None:
            worker = self.broker.wire_of(host)
            found = self._hosts[host] = (worker, self._there(worker))
        return found

    def _form(self, shape: Shape) -> tuple[Place, SliceForm]:
        """The wire a shape of slice goes over and what its requests always say; made
        once per shape, since a walk sends the same shapes again and again, and kept
        with the shape (so with its graph), not here."""
        forms = shape.memo.get(_FORMS)
        if forms is None:  # weakly: a session lives as long as its owner, not its graph
            forms = shape.memo[_FORMS] = weakref.WeakKeyDictionary()
        found = forms.get(self)
        if found is None:
            worker, there = self._place(shape.host)
            found = forms[self] = (worker, SliceForm(there, shape.host, list(shape.nodes),
                                                list(shape.wanted), shape.transposed))
        return found

    def _request(self, piece: Slice) -> tuple[Place, Request]:
        """The wire a slice goes over, and the request its link sends."""
        shape = piece.shape
        worker, form = self._form(shape)
        if self._closed and form.there.learnt:
            raise state_lost(shape.host, worker.where(shape.host), form.there,
                             "its owner closed it (Trainer.close())")
        data = shape.data
        if self._prepared() is not data:
            self.prepare(data)
        values = piece.given
        refs: list[str] = []
        for pred, value in values.items():
            if type(value) is LostValue:
                if self.broker.token_for(value.host) != worker.wire:
                    raise _stranded(data, pred, value, shape.nodes, shape.host)
                refs.append(pred)
        if refs:
            values = {pred: value for pred, value in values.items() if pred not in refs}
        buffers: list[Any] = []
        trees, refused = pack_values(values, buffers)
        if refused:
            pred, why = next(iter(refused.items()))
            readers = user_ids(n for n in shape.nodes if pred in data.preds[n])
            raise UnwritableError(
                f"the output of node {pred!r} cannot travel to host {shape.host!r}, where "
                f"{', '.join(map(repr, readers))} read{'s' if len(readers) == 1 else ''} it: {why}")
        tree: dict[str, Any] = {"g": trees}
        if shape.needs_input:
            packed, refused = pack_values({"i": piece.input}, buffers)
            if refused:
                raise UnwritableError(f"the input cannot travel to host {shape.host!r}: "
                                      f"{refused['i']}")
            tree.update(packed)
        return worker, Request(form, tree, buffers, refs, piece.watching, piece.forward)

    def __repr__(self) -> str:
        return f"Session({self.id.hex()[:12]} on {self.broker!r}{', keeps state' if self.keeps else ''})"


def _stranded(data: Any, pred: str, value: LostValue, nodes: Any, host: str) -> Lost:
    readers = [n for n in nodes if pred in data.preds[n]]
    return Lost(
        f"node {made_from(readers[0] if readers else nodes[0])!r} on host {host!r} reads the output "
        f"of {pred!r}, which stayed on host {value.host!r}: {value.why}. Place them on "
        f"one worker, or make {pred!r} answer with something that can travel",
        node=pred, host=value.host)


stands_for(Place, Broker.embedded)  # forward(broker={"gpu": Worker.at(...)}) means this
