"""A graph trained in one piece: the Trainer's driver where nothing trains where it runs.

A Trainer drives its graph through one of two drivers, chosen once when it is built,
which answer the same few calls:

    forward(x, one)         the graph's output for one piece of the batch
    backward(one)           after the objective's backward: what is owed across a cut
    update(one)             the group ends: what trains across a cut applies its group
    predict(x, one)         the output with what was trained, changing nothing
    data(), asking()        what runs here, and how a verb is asked of its hosts
    control(host, verb, a)  one verb of this Trainer's session on a host
    told(watching)          the watchers as the record should see this graph
    trains, health          the nodes trained where they run, what their hosts measured
    pipelines(n), changed(), audited(), release(), privacy

Here (``InOnePiece``) the graph runs through the ordinary walk and the objective's
backward reaches every parameter, so most of them have nothing to do; where some node
is trained where it runs, ``_staged.StagedDriver`` answers them stage by stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._engine import Pass
from .._errors import DeclarationError
from .._graph import Graph
from .._slices import runner_of

__all__ = ["InOnePiece"]


class InOnePiece:
    """Drives a graph that trains nothing where it runs: one walk forward, and the
    objective's own backward is the whole backward."""

    trains: dict[str, Any] = {}  # nothing is trained where it runs (read, never written)
    privacy: Any = None  # nothing crosses a trained cut, so nothing is protected

    def __init__(self, graph: Graph, *, broker: Any, store: Any):
        self._graph, self._broker, self._store = graph, broker, store
        self.health: list[dict[str, Any]] = []  # stays empty: no trainer measures elsewhere

    def told(self, watching: Any) -> Any:
        return watching  # the graph's own nodes are what the record names

    def forward(self, x: Any, one: Pass) -> Any:
        return one.run(self._graph, x, store=self._store, broker=self._broker)

    def backward(self, one: Pass) -> None:
        """Nothing: the objective's backward reached every parameter."""

    def update(self, one: Pass) -> None:
        """Nothing: the Trainer's optimizer is all that steps."""

    def predict(self, x: Any, one: Pass) -> Any:
        with one:
            return one.run(self._graph, x, store=self._store, broker=self._broker)

    def pipelines(self, pieces: int) -> bool:
        return False  # nothing runs on a worker while something here waits for it

    def changed(self) -> None:
        """Nothing: the graph itself sees its hooks."""

    def audited(self, audit: Any, pieces: int) -> None:
        """Nothing: the Audit hooks every node, all of them here or run as they are."""

    def release(self) -> None:
        """Nothing: the session the graph runs in is the broker's, kept per graph."""

    def data(self) -> Any:
        """The data form that runs: the graph's own."""
        return self._graph.data()

    def asking(self) -> Callable[[str, str, Any], Any] | None:
        """How a verb is asked of this graph's session on its hosts; None where it has
        none. Refused at once where its broker says no verb, so that nothing was put in
        eval mode before that is found."""
        if not self._graph.data().hosts:
            return None
        self._session("put in eval mode")
        return self.control

    def control(self, host: str, verb: str, args: Any) -> Any:
        """Asks the session this graph runs in on ``host`` a verb, its catalog staged
        first (the broker keeps one such session per graph)."""
        session = self._session(f"asked {verb!r}")
        session.prepare(self._graph.data())
        return session.control(host, verb, args)

    def _session(self, done: str) -> Any:
        data = self._graph.data()
        runner = runner_of(self._broker)
        opens = getattr(runner, "session_of", None)
        session = opens(data) if callable(opens) else runner
        if not callable(getattr(session, "control", None)):
            raise DeclarationError(
                f"{type(runner).__qualname__} reaches host {next(iter(data.hosts.values()))!r} "
                f"and says no verb to it, so its nodes cannot be {done} there; run through "
                "a Broker or workers=")
        return session
