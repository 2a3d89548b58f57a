"""Broker: which worker each host is, and the engine's way of reaching them.

The broker groups hosts by wire (two hosts declared with one Worker, or with two
Workers at one address, are one place), provisions one catalog per wire — the
whole graph's share of it, the union of its hosts — and runs slices on the wire's
one connection. A host nobody listed is not an error until a slice needs it.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._dsl import is_host_name
from .._errors import DeclarationError, Lost, UnwritableError, WireError
from .._slices import Backend, Outcome, Slice, listing
from .._walk import LostValue
from .catalog import catalog_id, pack_values, runtime_of
from .client import Staged
from .declare import Worker

__all__ = ["Broker"]

# Per data form of a graph (thrown away when the graph changes): each wire's catalog,
# packed once. Re-pickling on every forward would cost a model's weights each time,
# and bytes that differed by accident would replace a worker's live state.
_packed: weakref.WeakKeyDictionary[Any, dict[Any, Staged]] = weakref.WeakKeyDictionary()
_last: tuple[tuple, Broker] | None = None


class Broker(Backend):
    """Where the hosts of a graph are: ``{host: Worker}``, resolved in this process.
    The walk's way to them: a ``Backend`` whose slices go over each host's wire, in
    the order they were sent (a worker answers a connection's requests in turn)."""

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        """Whether every host runs its slices in the order they were sent: yes over a
        socket (a connection is answered in turn) and over Ray (an actor runs one
        caller's calls in the order they were made)."""
        return all(worker._link.sends_ahead() for worker in self._wires.values())

    def __init__(self, listing: dict[str, Worker]):
        if not isinstance(listing, dict):
            raise DeclarationError(f"a broker takes {{host: Worker}}, not a {type(listing).__qualname__}")
        for host, worker in listing.items():
            if not is_host_name(host):
                raise DeclarationError(f"{host!r} is not a host name (letters, digits, '.', '_', '-')")
            if not isinstance(worker, Worker):
                raise DeclarationError(
                    f"host {host!r} is listed as a {type(worker).__qualname__}; list a Worker, "
                    f"e.g. Worker.at('node3:7000')")
        self._listing = dict(listing)
        self._provisioned: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        # Every host of one wire goes through the first worker listed for it.
        first: dict[bytes, Worker] = {}
        self._wires = {host: first.setdefault(worker._wire, worker) for host, worker in listing.items()}

    @classmethod
    def embedded(cls, workers: dict[str, Worker]) -> Broker:
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

    def worker_for(self, host: str) -> Worker:
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
        return None if worker is None else worker._wire

    def provision(self, host: str, kind: str, id: str, blob: bytes, runtime: dict[str, Any]) -> None:
        """Stages what the host's wire provisions the far side with. Nothing is sent
        until a slice goes there, and then only if the worker says it lacks it."""
        if not isinstance(blob, (bytes, bytearray)) or not isinstance(kind, str) or not isinstance(id, str):
            raise TypeError("provision takes (host, kind: str, id: str, blob: bytes, runtime: dict)")
        self._stage(host, Staged(catalog_id(kind, id, runtime), kind, id, bytes(blob), runtime))

    def _stage(self, host: str, staged: Staged) -> None:
        link = self._wire_of(host)._link
        if link.staged is None or link.staged.ident != staged.ident:
            link.stage(staged)

    def _wire_of(self, host: str) -> Worker:
        """The one worker whose connection every host of this wire uses."""
        worker = self._wires.get(host)
        return worker if worker is not None else self.worker_for(host)

    # -- the walk's side --------------------------------------------------------------
    def prepare(self, data: Any) -> None:
        """Stages the whole graph's catalog on every wire it uses: one per wire, with
        the nodes of all its hosts. Hosts nobody listed are left to fail when needed."""
        stagings = self._provisioned.get(data)
        if stagings is None:  # once per data form of the graph, for this broker
            stagings = self._provisioned[data] = self._stagings(data)
        for worker, staged in stagings:
            if worker._link.staged is not staged:
                worker._link.stage(staged)

    def _stagings(self, data: Any) -> list[tuple[Worker, Staged]]:
        wires: dict[bytes, list[str]] = {}
        for host in dict.fromkeys(data.hosts.values()):
            token = self.token_for(host)
            if token is not None:
                wires.setdefault(token, []).append(host)
        cache = _packed.setdefault(data, {})
        stagings = []
        for token, hosts in wires.items():
            worker = self._wire_of(hosts[0])
            key = (token, worker.mode, worker.send, frozenset(hosts))
            staged = cache.get(key)
            if staged is None:
                staged = cache[key] = self._pack(data, worker, set(hosts))
            stagings.append((worker, staged))
        return stagings

    @staticmethod
    def _pack(data: Any, worker: Worker, hosts: set[str]) -> Staged:
        here = {n for n, h in data.hosts.items() if h in hosts}
        kind, blob_id, blob = worker.packed({n: data.impls[n] for n in data.ids if n in here})
        runtime = runtime_of(data, here)
        return Staged(catalog_id(kind, blob_id, runtime), kind, blob_id, blob, runtime)

    def run(self, piece: Slice) -> Outcome:
        """Runs one slice on its host in one round trip."""
        worker, args = self._request(piece)
        return worker._link.run(*args)

    def submit(self, piece: Slice) -> Any:
        """Sends one slice now and answers a pending Outcome (``result()``), read when
        asked: a wave over many hosts costs one wait, not one round trip per host, and
        a pipeline runs its next piece here while this one is out."""
        worker = self._wire_of(piece.host)
        if not worker._link.sends_ahead():
            return super().submit(piece)
        worker, args = self._request(piece)
        return worker._link.submit(*args)

    def _request(self, piece: Slice) -> tuple[Worker, tuple]:
        """The wire a slice goes over, and what its link is handed to send it."""
        host, data = piece.host, piece.data
        worker = self._wire_of(host)
        if worker._link.staged is None:
            self.prepare(data)
        values: dict[str, Any] = {}
        refs: list[str] = []
        for pred, value in piece.given.items():
            if type(value) is LostValue:
                if self.token_for(value.host) != worker._wire:
                    raise self._stranded(data, pred, value, piece.nodes, host)
                refs.append(pred)
            else:
                values[pred] = value
        buffers: list[Any] = []
        trees, refused = pack_values(values, buffers)
        if refused:
            pred, why = next(iter(refused.items()))
            readers = [n for n in piece.nodes if pred in data.preds[n]]
            raise UnwritableError(
                f"the output of node {pred!r} cannot travel to host {host!r}, where "
                f"{', '.join(map(repr, readers))} read{'s' if len(readers) == 1 else ''} it: {why}")
        tree: dict[str, Any] = {"g": trees}
        if piece.needs_input:
            packed, refused = pack_values({"i": piece.input}, buffers)
            if refused:
                raise UnwritableError(f"the input cannot travel to host {host!r}: {refused['i']}")
            tree.update(packed)
        return worker, (host, list(piece.nodes), tree, buffers, refs, list(piece.wanted),
                        piece.watching, piece.forward, piece.transposed)

    @staticmethod
    def _stranded(data: Any, pred: str, value: LostValue, nodes: Any, host: str) -> Lost:
        readers = [n for n in nodes if pred in data.preds[n]]
        return Lost(
            f"node {readers[0] if readers else nodes[0]!r} on host {host!r} reads the output "
            f"of {pred!r}, which stayed on host {value.host!r}: {value.why}. Place them on "
            f"one worker, or make {pred!r} answer with something that can travel",
            node=pred, host=value.host)

    def __repr__(self) -> str:
        return f"Broker({self._listing!r})"


listing(Worker, Broker.embedded)  # forward(broker={"gpu": Worker.at(...)}) means this
