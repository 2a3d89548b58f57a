"""A graph driven in stages, for a Trainer that trains some nodes where they run.

The Trainer's graph is never touched. A private copy of its data form is rewired so
that each trained node ``n`` sits between its trainer's two positions — ``p → (n, in)
→ (n, computes) → n``, the two made ids ``generated`` so that no id of the user's can
be one of them, the trainer keeping the id ``n`` so nobody below it changes — and cut
into stages by the core's ``stages`` (on host and trained). Then one step is:

- **forward**, stage by stage, through the ordinary walk (here, or on workers). A
  value handed from one stage to a later one becomes a fresh leaf, so each stage's
  autograd graph here ends at its own inputs and can be walked back exactly once.
- **backward**, stage by stage from the last: the trained part of a stage is walked
  back through the core (``transposed``), envelopes in and envelopes out, so a
  trainer on a worker is reached by the same channel as its forward; the untrained
  part here is one ``torch.autograd.backward`` over the outputs later stages sent
  gradients for; what a stage's inputs received is owed to the stage that made them.
- ``update`` across a cut is a closing empty envelope, walked back the same way.

It answers the calls of the Trainer's driver (``_one_piece`` lists them); a trainer's
``OutOfStep`` that crossed a worker as a node's failure is raised as itself again.

A stage sent to a worker and trained by nobody gets nothing back: its parameters are
there, not here, and nobody asked for them to learn.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._engine import Pass, Walk, compiled
from .._errors import CacheError, DeclarationError, NodeError, OutOfStep
from .._graph import DECLARATIONS, Graph, GraphData, assembled, generated
from .._node import Opaque
from .._plan import stages
from .._slices import runner_of, finish
from .._transpose import Back, backward
from .._verbs import VERBS
from ._audit import Audit
from ._checks import outside_somatize
from ._envelope import HEALTH, envelope, gradient, narrowed, overflowed, widened
from ._learning import Learning
from ._pipeline import pipelined
from ._tensors import device_of, gradients_of, leafed, paired, summed

__all__ = ["StagedDriver", "out_of_step", "rewired"]

IN, COMPUTES = "in", "computes"


class Positions:
    """The three ids of one trained node ``n`` in the rewired graph: its trainer's
    entering position, the node itself, and the trainer under ``n``'s own id."""

    def __init__(self, node: str):
        self.node = node
        self.enters = generated(node, IN)
        self.computes = generated(node, COMPUTES)
        self.all = (self.enters, self.computes, node)


def rewired(data: GraphData,
            trains: Mapping[str, Learning]) -> tuple[GraphData, dict[str, tuple[str, str]]]:
    """``data`` with each trained node between its trainer's two positions, and where
    each made id comes from: ``{made id: (user's node, role)}``.

    Pure: the user's graph is read, never touched. The made ids are ``generated``, so
    they cannot be any id of the user's. Every declaration of ``GraphData`` is carried,
    one added later included; ``_carried_to`` says which positions of a trained node
    each one lands on.
    """
    ids: list[str] = []
    impls: dict[str, Any] = {}
    origin: dict[str, tuple[str, str]] = {}
    tables: dict[str, dict[str, Any]] = {name: {} for name in DECLARATIONS}
    edges: list[tuple[str, str]] = []
    for n in data.ids:
        impl = data.impls[n]
        at = Positions(n) if n in trains else None
        if at is not None:
            enters, learning = trains[n].of(impl).beside()
            ids += at.all
            impls.update({at.enters: enters, at.computes: impl, n: learning})
            origin[at.enters], origin[at.computes] = (n, IN), (n, COMPUTES)
            edges += [(at.enters, at.computes), (at.computes, n)]
        else:
            ids.append(n)
            impls[n] = impl
        for name in DECLARATIONS:
            table = getattr(data, name)
            if n in table:  # a set's members are carried as keys, which ``assembled`` reads
                value = table[n] if isinstance(table, Mapping) else None
                for target in (n,) if at is None else _carried_to(name, at):
                    tables[name][target] = value
    for a, b in data.edges:
        edges.append((a, Positions(b).enters if b in trains else b))
    return assembled(ids, impls, edges, **tables), origin


def _carried_to(declaration: str, at: Positions) -> tuple[str, ...]:
    """The positions of a trained node that one of its declarations holds for. Where it
    runs holds for all three; its own declaration (``declared_as``) stays with its id;
    anything else it is said to be (cached, frozen, mapped, unwritable, and whatever is
    declared later) stands where the user's object and its trainer stand, not where the
    trainer's entering position does."""
    if declaration in ("devices", "hosts", "fingerprints"):
        return at.all
    if declaration == "declarations":
        return (at.node,)
    return (at.computes, at.node)


class Stage:
    """One stage, as the driver needs it."""

    def __init__(self, private: GraphData, nodes: list[str], trains: Mapping, leaves: set[str]):
        inside = set(nodes)
        preds, succs = private.preds, private.succs
        self.nodes = nodes
        self.outside = sorted({p for n in nodes for p in preds[n] if p not in inside})
        self.wanted = [n for n in nodes if n in leaves or any(s not in inside for s in succs[n])]
        self.trainers = [n for n in nodes if n in trains]
        self.trained = [m for n in self.trainers for m in Positions(n).all]
        enters = {n: Positions(n).enters for n in self.trainers}
        # Where what a trainer's input received goes back to: its one producer, or,
        # for a node fed by several, each producer its own part (the input is then a
        # map by producer, and so is its gradient). A producer in this stage is
        # trained by nobody and owed nothing.
        self.entries = [(enters[n], tuple(preds[enters[n]])) for n in self.trainers
                        if any(p not in inside for p in preds[enters[n]])]
        self.back_given = [n for n in self.trainers if n in self.wanted]
        self.reporting = [enters[n] for n in self.trainers]  # every trainer's answer
        # What crosses into this stage narrowed: a value handed in whose every taker
        # here is a trainer that compresses, all to one type (anyone else takes it whole).
        self.narrowing: dict[str, Any] = {}
        self.takers: dict[str, str] = {}  # the first trainer here that takes it, to name
        for p in self.outside:
            takers = [s for s in succs[p] if s in inside]
            kinds = {trains[n].seat.compress for n in self.trainers if enters[n] in takers}
            if len(kinds) == 1 and len(takers) == sum(enters[n] in takers for n in self.trainers):
                self.narrowing[p] = kinds.pop()
                self.takers[p] = next(n for n in self.trainers if enters[n] in takers)
        self.narrows = [self.narrowing.get(p) for p in self.outside]  # in the given order
        self.compress = [trains[n].seat.compress for n in self.back_given]
        # whether what this stage answers may come narrowed (a trainer here compresses)
        self.widens = any(trains[n].seat.compress is not None for n in self.trainers)
        for n in self.trainers:  # what a trainer makes crosses when nobody here takes it
            trains[n].seat.crossing(out=not any(s in inside for s in succs[n]))
        trained = set(self.trained)
        self.untrained_here = [n for n in self.wanted
                               if n not in trained and n not in private.hosts]


class StagedDriver:
    """Drives one Trainer's graph stage by stage; see the module's docstring."""

    privacy: Any = None  # what protects and measures what crosses (``_privacy``)

    def __init__(self, graph: Graph, trains: Mapping[str, Learning], *, broker: Any,
                 store: Any, steps_per_update: int, micro: int = 1):
        self.trains = dict(trains)
        for learning in self.trains.values():
            learning.accumulating(steps_per_update, micro)
        data, self.origin = rewired(graph.data(), self.trains)
        self.private = Graph.from_data(data)
        positions = {m for n in self.trains for m in Positions(n).all}
        grouped = stages(data, positions)
        leaves = {n for n in data.ids if not data.succs[n]}
        self.leaves = graph.leaves()
        self.stages = [Stage(data, nodes, self.trains, leaves) for nodes in grouped]
        for k, stage in enumerate(self.stages[1:], start=1):
            for n in stage.nodes:
                if n in data.cached:
                    raise CacheError(
                        f"node {self._user(n)!r} is .cached() after a cut (stage {k}): the "
                        "roots of a later stage are handed values, not the graph's input, so "
                        "two different batches would be kept under one name; cache only in "
                        "front of the first trained or remote node"
                    )
        # An output made here keeps its graph, so the objective's backward runs straight
        # through its stage — unless a later stage sends that stage gradients too: its
        # graph is then walked back once, by the driver, with everything it is owed.
        fed = {p for stage in self.stages for p in stage.outside}
        self.through = {n for stage in self.stages if not fed & set(stage.nodes)
                        for n in stage.untrained_here if n in self.leaves}
        self._backend = runner_of(broker)
        self.broker = self._session()
        self.store = store
        self._passed: Any = None
        self._compiled: tuple[Any, list[tuple[Walk, Back | None]]] = (None, [])
        self.health: list[dict[str, Any]] = []  # what trainers on workers measured

    def _session(self) -> Any:
        """A session of this driver's own on the workers, which keeps state: its
        trainers learn there, so nobody else's catalog may replace them, and losing
        them is said (``StateLost``) rather than made good from the first copy."""
        backend = self._backend
        opens = getattr(backend, "session", None)
        shares = any(learning.seat.shared is not None for learning in self.trains.values())
        return opens(keeps=True, shares=shares) if callable(opens) else backend

    def renew(self) -> None:
        """Starts this driver's session afresh (a resume after its state was lost):
        the next slice provisions the trainers as this process holds them, and what
        the checkpoint holds is copied into them then."""
        self.release()
        self.broker = self._session()
        self._passed = None

    def release(self) -> None:
        """Lets go of what this driver's session holds on its workers."""
        ends = getattr(self.broker, "close", None)
        if callable(ends) and self.broker is not self._backend:
            ends()

    def _user(self, node: str) -> str:
        """The user's id for an id of the rewired graph."""
        return self.origin.get(node, (node, ""))[0]

    def changed(self) -> None:
        """The nodes' forwards were hooked or unhooked (an Audit): look at them again."""
        self.private.changed()

    def told(self, watching: Any) -> Any:
        """``watching`` as the record should see this graph: the node a trainer stands
        beside is the user's ``n``, not its made ids, and the positions' own forward
        passes (a leaf made, an activation let go of) are not nodes of the user's."""
        if watching is None:
            return None
        watchers = list(watching) if isinstance(watching, (list, tuple)) else [watching]
        trains, origin = self.trains, self.origin

        def tell(fact: dict) -> None:
            node = fact.get("node")
            if node is not None:
                if node in trains and fact.get("fact") == "ran" and not fact.get("backward"):
                    return
                made = origin.get(node)
                if made is not None:
                    if made[1] == IN and fact.get("fact") == "ran":
                        return
                    fact["node"] = made[0]
            for watcher in watchers:
                watcher(fact)
        return tell

    def _walks(self) -> list[tuple[Walk, Back | None]]:
        """Each stage's walk forward and, where it trains, its walk back, decided once
        per data form of the rewired graph (an Audit's hooks make a new one)."""
        data = self.private.data()
        made_for, walks = self._compiled
        if data is not made_for:
            walks = [(compiled(data, stage.nodes, tuple(stage.outside), stage.wanted, False),
                      backward(data, stage.trained, tuple(stage.back_given),
                               tuple(stage.reporting), False) if stage.trainers else None)
                     for stage in self.stages]
            self._compiled = (data, walks)
        return walks

    def forward(self, x: Any, one: Pass) -> Any:
        """Runs every stage in order, as pieces of the forward ``one``; answers the
        graph's output, made of fresh leaves so the objective's backward stops at the
        seam."""
        with out_of_step():
            self._passed, output = finish(self.forwarding(x, one))
        return output

    def predict(self, x: Any, one: Pass) -> Any:
        """The graph's output for ``x``, as ``forward`` runs it, leaving no pass to walk
        back. The defences guard what training sends; a prediction is the model's own
        answer, and drawing their noise here would move the steps that follow."""
        privacy, self.privacy = self.privacy, None
        try:
            with one, out_of_step():
                return finish(self.forwarding(x, one))[1]
        finally:
            self.privacy = privacy

    def pipelined(self, pieces: list[tuple[Any, Any, float]], loss_of: Any, seed: Any) -> list[Any]:
        """One step's pieces overlapped (``_pipeline``); answers their losses in order."""
        with out_of_step():
            return pipelined(self, pieces, loss_of, seed)

    def forwarding(self, x: Any, one: Pass, pipe: Any = None):
        """``forward`` as a generator: with a ``pipe`` (``_pipeline.Counts``) it yields
        while a stage is out on a worker, and it returns ``(what passed, the output)``."""
        produced: dict[str, Any] = {}
        handed: list[dict[str, Any]] = []
        numbers: list[int] = []  # which forward of its stage this one is, in the pipe
        later, broker = pipe is not None, self.broker
        store = self.store
        for k, (stage, (walk, _)) in enumerate(zip(self.stages, self._walks())):
            if not stage.outside:  # the first stage: handed the input alone
                leaves, values = _NOTHING, ()
            else:
                leaves = {p: _fresh(produced[p]) for p in stage.outside}
                sent = leaves if self.privacy is None else self._protected(stage, x, leaves)
                values = ([Opaque(self._narrowed(leaf, dtype, stage.takers.get(p), "given"))
                           for (p, leaf), dtype in zip(sent.items(), stage.narrows)]
                          if stage.narrowing else [Opaque(leaf) for leaf in sent.values()])
            answer = walk.run(one, x, values, broker, store if k == 0 else None, later)
            if later:
                numbers.append(pipe.forwarded(k))
                if answer.waiting:
                    yield
                answer = answer.result()
            if stage.widens:
                for n, v in answer.items():
                    self._said_overflow(v, n, "made")
                    produced[n] = widened(v)
            else:
                produced.update(answer)
            handed.append(leaves)
        # An output made here by an untrained node keeps its graph, so the objective's
        # backward runs straight through its stage; only a trainer's (detached) or a
        # worker's output needs a leaf of its own to catch its gradient.
        outputs = {n: produced[n] if n in self.through else _fresh(produced[n])
                   for n in self.leaves}
        output = next(iter(outputs.values())) if len(outputs) == 1 else outputs
        return (produced, handed, outputs, numbers), output

    def _protected(self, stage: Stage, x: Any, leaves: dict[str, Any]) -> dict[str, Any]:
        """What a stage is sent in place of the leaves handed to it: each trainer's
        input as its protection has it (``_privacy``); the leaves stay as they are."""
        sent = dict(leaves)
        for enters, producers in stage.entries:
            for producer in producers:
                if producer in leaves:
                    sent[producer] = self.privacy.sending(self._user(enters), x,
                                                          leaves[producer])
        return sent

    def backward(self, one: Pass) -> None:
        """After the objective's backward: hands every stage what it is owed, last
        first, as pieces of the forward ``one``."""
        if self._passed is None:
            raise DeclarationError("a backward without a forward: step() runs them in pairs")
        passed, self._passed = self._passed, None
        with out_of_step():
            finish(self.backwarding(passed, one))

    def backwarding(self, passed: Any, one: Pass, pipe: Any = None):
        """``backward`` of one forward's pass as a generator, which yields (with a
        ``pipe``) while a stage's walk back is out on a worker."""
        produced, handed, outputs, numbers = passed
        owed: dict[str, torch.Tensor] = {}
        for n, leaf in outputs.items():
            if n not in self.through:  # those already passed their gradient on
                _add(owed, n, gradients_of(leaf))
        last = len(self.stages) - 1
        later, broker = pipe is not None, self.broker
        walks = self._walks()
        for k in range(last, -1, -1):
            stage, leaves = self.stages[k], handed[k]
            back = walks[k][1]
            if back is not None:
                behind = 0 if pipe is None else pipe.behind(k, numbers[k])
                sent = {n: owed.get(n) if self.privacy is None else
                        self.privacy.gradient_sent(n, owed.get(n)) for n in stage.back_given}
                answers = back.run(one, {n: envelope(sent[n] if dtype is None else
                                                     self._narrowed(sent[n], dtype, n, "handed"),
                                                     behind=behind)
                                         for n, dtype in zip(stage.back_given, stage.compress)},
                                   broker, later)
                if later:
                    if answers.waiting:
                        yield
                    answers = answers.result()
                for entry, producers in stage.entries:
                    self._said_overflow(answers[entry], entry, "answered")
                    handed_in = [p for p in producers if p in leaves]
                    got = gradient(answers[entry], device_of(leaves[handed_in[0]]))
                    if len(producers) == 1:
                        _add(owed, producers[0], got)
                    elif type(got) is dict:  # a map by producer, as its input was
                        for producer in handed_in:
                            _add(owed, producer, got.get(producer))
                self._heard(answers)
            tensors, grads = [], []
            for n in stage.untrained_here:
                these, their = paired(produced[n], owed.get(n))
                tensors += these
                grads += their
            if tensors:
                torch.autograd.backward(tensors, grads)
            for producer, leaf in leaves.items():
                _add(owed, producer, gradients_of(leaf))

    def update(self, one: Pass) -> None:
        """Ends every trainer's open group: a closing, empty envelope walked back."""
        with out_of_step():
            for stage, (_, back) in zip(reversed(self.stages), reversed(self._walks())):
                if back is not None:
                    back.run(one, {n: envelope(None, closing=True) for n in stage.back_given},
                             self.broker)

    def data(self) -> Any:
        """The data form that runs: the rewired graph's."""
        return self.private.data()

    def asking(self) -> Any:
        """How a verb is asked of this driver's session on a host (``control``)."""
        return self.control

    def weights(self, node: str) -> dict[str, Any]:
        """The weights of a trained node as they are where it runs, asked of its trainer."""
        return self.ask(node, "weights", {"node": node})

    def ask(self, node: str, verb: str, args: Any) -> Any:
        """What the trainer of ``node`` answers to ``verb`` where it runs: a verb of this
        driver's session on its host (``_verbs``), or the same handler here."""
        host = self.private.hosts().get(node)
        if host is None:
            return VERBS[verb](self.private.data().impls, args)
        return self.control(host, verb, args)

    def control(self, host: str, verb: str, args: Any) -> Any:
        """Asks this driver's session on ``host`` a verb, its catalog staged first, so a
        verb before the first step provisions this session and no other."""
        session = self.broker
        if not callable(getattr(session, "control", None)):
            raise DeclarationError(f"{type(session).__qualname__} reaches host {host!r} and "
                                   "says no verb to it; train through a Broker or workers=")
        session.prepare(self.private.data())
        return session.control(host, verb, args)

    def load(self, node: str, weights: Any, *, check_only: bool) -> None:
        """Hands a trained node's weights to its trainer where it runs, the way
        ``weights`` asks for them. ``check_only`` has the trainer check every key, shape
        and dtype and copy nothing, so that a load across machines can be all or nothing."""
        asked = {"node": node, "weights": dict(weights), "check": check_only}
        try:
            self.ask(node, "load", asked)
        except (DeclarationError, TypeError) as exc:
            host = self.private.hosts().get(node)
            if host is None:
                raise
            raise DeclarationError(
                f"{exc} (checked by the trainer of {node!r} on host {host!r}); nothing "
                "was loaded, here or there") from exc

    def pipelines(self, pieces: int) -> bool:
        """Whether a step of ``pieces`` would overlap: some stage runs on a worker, over
        a backend that runs each host's slices in the order they were sent, and no
        trainer updates inside a step (a piece's forward would see other weights).
        Nor where an output made before the last worker's stage keeps its graph: the
        loss's own backward would reach that stage before the worker's gradients did,
        for every piece first, and its gradients would be added in another order."""
        if any(learning.seat.steps_per_update() % pieces for learning in self.trains.values()):
            return False
        hosts = self.private.hosts()
        away = [k for k, stage in enumerate(self.stages) if any(n in hosts for n in stage.nodes)]
        if not away:
            return False
        if any(n in self.through for stage in self.stages[:away[-1]] for n in stage.nodes):
            return False
        backend = runner_of(self.broker)
        return bool(getattr(backend, "ordered", False))

    def _narrowed(self, value: Any, dtype: Any, node: str | None, crossing: str) -> Any:
        """``narrowed``, here, on its way to the trainer of ``node``; said if it overflowed."""
        sent = narrowed(value, dtype)
        if node is not None:
            self._said_overflow(sent, node, crossing)
        return sent

    def _said_overflow(self, value: Any, node: str, crossing: str) -> None:
        """Warns the user where ``value`` crossed the cut of ``node`` with finite values
        made inf by float16, whichever side narrowed it: a worker that did would say so
        only in its own log, and the user here would see a nan loss and nothing else."""
        lost = overflowed(value)
        if not lost:
            return
        user = self._user(node)
        host = self.private.hosts().get(node)
        warnings.warn(
            f"compress='fp16': {lost} values of {_CROSSINGS[crossing]} node {user!r}"
            f"{f' (on host {host!r})' if host else ''} lie beyond float16's range (65504) and "
            "crossed the cut as inf; compress='bf16' sends the same bytes with float32's "
            "range, or leave compress out to send them whole",
            RuntimeWarning, stacklevel=outside_somatize())

    def _heard(self, answers: dict[str, Any]) -> None:
        """Keeps the health facts that came back beside the gradients, with the host
        of the trainer that measured them."""
        for entry, answer in answers.items():
            if type(answer) is dict and HEALTH in answer:
                host = self.private.hosts().get(entry)
                for fact in answer[HEALTH]:
                    self.health.append({**fact, "host": host} if host else fact)

    def audited(self, audit: Any, pieces: int) -> None:
        """Has each trainer on a worker measure its node like ``audit`` would here
        (the Audit there cannot hook what it cannot reach; the trainer sees it all)."""
        hosts = self.private.hosts()
        for node, learning in self.trains.items():
            if node in hosts:
                learning.seat.audited(Audit(every=audit.every, snapshot=audit.snapshot,
                                       channels=audit.channels, window=audit.window),
                                 node, pieces)


# What crosses a trained node's cut, by the way it goes: what an overflow warning names.
_CROSSINGS = {"given": "the activation given to", "made": "the output of",
              "handed": "the gradient handed to", "answered": "the gradient answered by"}
_NOTHING: dict[str, Any] = {}  # what a stage handed nothing was handed (read, never written)


class out_of_step:
    """Turns a trainer's OutOfStep that crossed as a node's failure back into itself."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        if isinstance(error, NodeError) and (error.kind == "OutOfStep"
                                             or isinstance(error.__cause__, OutOfStep)):
            where = f" on host {error.host!r}" if error.host else ""
            raise OutOfStep(f"{error}{where}") from error
        return False


def _fresh(value: Any) -> Any:
    """A value handed across a stage boundary: each tensor in it becomes a new leaf."""
    return leafed(value)


def _add(owed: dict[str, Any], node: str, grad: Any) -> None:
    if grad is not None:
        owed[node] = summed(owed.get(node), grad)
