"""The Trainer: a graph trained from outside, and the Result a run leaves.

One step is a handful of movements, each a method; the two that change where a graph
is cut into stages (a node trained where it runs, on another machine) — the forward
and the backward — are its driver's, chosen once when the Trainer is built: the graph
in one piece (``_one_piece``) or stage by stage (``_staged``)::

    _open      a group begins: the optimizer's gradients are cleared
    _forward   the graph runs on one piece of the batch
    _loss      the objective, checked for something a backward pass can start from
    _backward  that loss, scaled by the piece's share and the group's size
    _close     the group ends: the optimizer steps

The graph is never changed by training, except for what ``freeze`` makes true and
the weights, which live in the nodes and always did.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._engine import Pass
from .._errors import DeclarationError, NoGradient, whole_number
from .._graph import Graph, describe
from .._node import Opaque
from .._remember import open_store
from ..store._store import check_name
from .._slices import runner_of
from ._architecture import architecture
from ._audit import audit_for
from ._checks import (
    check_caches,
    check_devices,
    check_given_optimizer,
    check_gradients,
    check_trains,
    no_loss,
    warn_unheld,
    watchers_of,
)
from ._checkpoint import Run, keep, kept_by, seed_all, take_up
from ._predicting import averaged, better, checked_metrics, evaluated, number, rows_of
from ._one_piece import InOnePiece
from ._pipeline import worthwhile
from ._privacy import privacy_for
from ._staged import StagedDriver
from ._tensors import detached, tensors_in
from ._weights import (
    Weights,
    checked_weights,
    copy_weights,
    freeze,
    snapshot,
)

__all__ = ["Result", "Trainer"]


@dataclass
class Result:
    """What a training run leaves behind: its losses, one per step, in order, and with
    ``fit(validate=...)`` what each epoch's evaluation answered (``Trainer.evaluate``),
    and the epoch (from 0) that did best by the chosen measure."""

    history: list[float] = field(default_factory=list)
    validation: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int | None = None  # an index into validation

    @property
    def loss(self) -> float | None:
        """The last loss, or None when not a single step was taken."""
        return self.history[-1] if self.history else None


class Trainer:
    """Trains a graph without the graph finding out.

    ``objective(output, target)`` answers a loss; ``optimizer`` is the caller's, built
    over ``parameters(g)`` (or a part of them). ``every`` steps make one update and
    ``micro`` pieces make one step; they multiply. ``store`` makes a frozen
    ``.cached()`` prefix run once per distinct batch. ``broker`` says where the hosts
    are; ``workers={host: Worker}`` says the same in the reference pages' spelling.
    ``watching`` is handed to every forward and also told ``loss`` and ``updated``,
    and once, before the first forward, ``graph``: the graph described, the optimizer's
    class and, as ``inside``, what each node holds (``architecture(graph)``, without an
    example), so that a report drawn from the record alone opens the nodes' boxes.
    ``auditing=True`` (or an ``Audit``) hooks the graph and tells ``watching`` one
    ``health`` fact per node after each measured step (``Audit(leaks=True)`` adds, per
    trained cut, what a worker could learn from what it is sent); ``protecting={node:
    Protection(...)}`` guards what crosses a trained node's cut before it is sent
    (``_privacy``); ``close()`` takes the hooks off (so does collecting the Trainer).
    With ``micro`` pieces and a trained stage on a worker, the pieces overlap, with the
    same losses and weights bit for bit; they run one after another with
    ``pipeline=False``, and while watched, audited or protected.

    What is certainly wrong is refused here, before the first step: the same weights
    in two optimizers, a node both frozen and trained, a cache over something still
    training, nothing to train at all. What PyTorch allows on purpose is not: a frozen
    node's parameters in the optimizer are harmless (they never get a gradient, so no
    optimizer moves them), and parameters the optimizer leaves out are trained by
    nobody, which is said once, as a ``UserWarning``, at the first update that gave
    them a gradient. The graph's ``.frozen()`` declarations are then made true
    (``freeze``), last, so that a refused Trainer has changed nothing.
    """

    def __init__(self, graph: Graph, *, objective: Callable[[Any, Any], Any],
                 optimizer: Any = None, trains: Mapping[str, Any] | None = None,
                 every: int = 1, micro: int = 1, store: Any = None, broker: Any = None,
                 workers: Mapping[str, Any] | None = None, watching: Any = None,
                 auditing: Any = None, pipeline: bool = True, protecting: Any = None):
        if not isinstance(graph, Graph):
            raise TypeError(f"Trainer takes a somatize Graph, not a {type(graph).__qualname__}; "
                            "build one with Graph.somatize(...)")
        broker = _broker(broker, workers, graph.hosts())
        if not callable(objective):
            raise DeclarationError(
                f"objective= is a {type(objective).__qualname__}, which cannot be called; "
                "give a function of (output, target) answering the loss, such as "
                "torch.nn.functional.mse_loss"
            )
        self._every = whole_number(every, "every", of="Trainer")  # steps in one update
        self._micro = whole_number(micro, "micro", of="Trainer")  # pieces of one step
        self._pipeline = bool(pipeline)
        self._watchers = watchers_of(watching)
        self._watching = self._watchers or None  # as the walk wants it: None is cheapest
        frozen = set(graph.frozen())
        check_caches(graph, frozen)
        check_devices(graph)
        trains = check_trains(graph, trains, optimizer, frozen)
        self._unheld = check_given_optimizer(graph, optimizer, frozen,
                                        elsewhere=set(trains) | set(graph.hosts()))
        if store is not None:
            store = open_store(store)
        audit = audit_for(graph, auditing, self._watchers)  # checked here, hooked last
        privacy = privacy_for(protecting, audit, trains)
        freeze(graph)
        self._broker = broker
        # The one place that asks how the graph is driven: in stages only when something
        # is trained where it runs.
        self._driver = (StagedDriver(graph, trains, broker=broker, store=store,
                                     steps_per_update=self._every * self._micro, micro=self._micro)
                        if trains else InOnePiece(graph, broker=broker, store=store))
        self._told = self._driver.told(self._watching)
        _placed(broker, graph.hosts())  # after the stages' own refusals, which say more
        for node, host in graph.hosts().items():
            if node in trains:  # its object here keeps its first weights from now on
                graph.trained_away(node, _stale(node, host))
        self._pass = Pass()  # the forward of the step under way, unwatched until one is
        self._graph = graph
        self._objective = objective
        self._optimizer = optimizer
        self._store = store
        self._taken = 0  # steps in the group that is open; 0 means none is
        self._described = False  # whether the watchers were told what the graph is
        self._steps = 0  # steps taken, over the Trainer's life
        self._skip = 0  # steps a resumed run took already, which fit() walks past
        self._best: list[Any] | None = None  # [measure, higher, value]: fit's best so far
        self._checked = False
        self._audit = audit
        self._privacy = privacy
        if privacy is not None:
            self._driver.privacy = privacy
        if audit is not None:  # off again by close(), or when this Trainer is collected
            self._driver.audited(audit, self._micro)
            audit.take(graph)
            self._unhook = weakref.finalize(self, audit.release)

    def __repr__(self) -> str:
        return (f"Trainer({self._graph!r}, every={self._every}, micro={self._micro}, "
                f"optimizer={type(self._optimizer).__qualname__})")

    # -- the loop ---------------------------------------------------------------------
    def step(self, batch: Any) -> float:
        """One step over ``batch = (input, target)``: forward, loss, backward, and an
        update when the group closes. Answers the whole batch's loss, undivided, so a
        history reads the same whatever ``every`` and ``micro`` are."""
        pieces = _pieces(batch, self._micro)
        if not self._described and self._watchers:
            self._described = True  # said once, before the first forward: it lands in it
            # Which optimizer, so that advice read from the record fits the one used.
            said = {"fact": "graph", "graph": describe(self._graph.data()),
                    "optimizer": type(self._optimizer).__qualname__
                    if self._optimizer is not None else None}
            # What each node holds, read from its module tree without a forward (a node
            # trained on a worker is an object here too): a report drawn from the record
            # alone opens the boxes as architecture() would.
            inside = architecture(self._graph)
            if inside:
                said["inside"] = {node: [[path, what] for path, what in parts]
                                  for node, parts in inside.items()}
            # A narrower type on a cut changes the arithmetic: the record says where.
            compressed = {n: str(learning.seat.compress).removeprefix("torch.")
                          for n, learning in self._driver.trains.items()
                          if learning.seat.compress is not None}
            if compressed:
                said["compressed"] = compressed
            protected = {n: p.said() for n, p in (self._privacy.protecting.items()
                                                   if self._privacy else ()) if p.said()}
            if protected:  # a defence changes what was sent, and what was learnt
                said["protected"] = protected
            self._emit(said)
        if self._audit is not None and self._audit.begin(self._graph):
            self._driver.changed()  # hooks back on after close(): look again
        if self._taken == 0:
            self._open()
        losses = []
        if self._pipelines(len(pieces)):
            losses = self._driver.pipelined(pieces, self._loss, self._seed)
        else:
            for x, y, share in pieces:
                if self._privacy is not None:  # what the gradient defence aims with
                    self._privacy.labelled(y)
                loss = self._loss(self._forward(x), y)
                self._backward(loss, share)
                losses.append(loss)
        self._taken += 1
        self._steps += 1
        if self._taken == self._every:
            self._close()
        # Read after the update: .item() waits for the device, and the step need not.
        if len(losses) == 1:
            value = losses[0].item()
        else:
            value = sum(loss.detach() * share for loss, (_, _, share) in zip(losses, pieces)).item()
        if self._watchers:
            self._emit({"fact": "loss", "value": value})
        if self._audit is not None:  # after loss and updated, so they land in one record
            measured = self._audit.measuring
            for fact in self._audit.observed(self._graph, updated=self._taken == 0):
                self._emit(fact)
            for fact in self._driver.health:  # what trainers on workers measured, with the host
                self._emit(fact)
            self._driver.health.clear()
            if self._privacy is not None:  # what each trained cut was sent could tell
                for fact in self._privacy.observed(self._steps, measured):
                    self._emit(fact)
        return value

    def update(self) -> bool:
        """Applies what the open group has accumulated, as it is, and starts a new one.

        For the group a run ends in the middle of. False, and nothing done, when no
        group is open. The gradients are not rescaled: a group closed after ``k`` of
        ``every`` steps pulls ``k/every`` as hard as a whole one.
        """
        if self._taken == 0:
            return False
        self._driver.update(Pass(self._told, framed=False))
        self._close()
        return True

    def fit(self, data: Iterable[Any], epochs: int = 1, *, checkpoint: Any = None,
            checkpoint_every: int | None = None, validate: Iterable[Any] | None = None,
            metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
            best: str = "loss", higher: bool = False, patience: int | None = None) -> Result:
        """One step per batch of ``data``, for ``epochs`` passes, then ``update()``.

        ``data`` is walked once per epoch, so with more than one it has to be walkable
        again: an iterator (a generator) is refused before the first step, because its
        second epoch would silently be empty. Shows a progress bar with the loss on a
        terminal or in a notebook, and nothing otherwise.

        ``checkpoint=(store, name)`` keeps a checkpoint under ``name`` every
        ``checkpoint_every`` steps and at the end, each written on a thread while the
        next steps go on (its snapshot is taken between two steps). After ``resume``,
        the steps already taken are skipped by position — their batches drawn and
        dropped, a list's whole epochs not even walked — so the same call goes on where
        the run stopped; ``data`` must give the same batches in the same order again (a
        shuffling DataLoader needs a generator of its own). The Result holds the steps
        this call took.

        ``validate=batches`` evaluates them after each epoch's steps (``evaluate``, with
        ``metrics``), into ``Result.validation``. The best epoch by ``best`` (the loss,
        or a metric's name; lower is better unless ``higher``) is ``Result.best_epoch``,
        and with a checkpoint it is kept under ``name + "/best"`` as it ends; the best is
        the run's, across fits and a resume (kept in the checkpoint), so a later epoch
        replaces it only by doing better.
        ``patience=k`` stops after ``k`` epochs in a row that did no better. An epoch a
        resumed run had finished is not evaluated again.
        """
        epochs = whole_number(epochs, "epochs", of="fit()")
        keeper = kept_by(checkpoint, checkpoint_every)
        judge = _Judge(validate, metrics, best, higher, patience, epochs, self._best)
        try:
            walked = iter(data)
        except TypeError:
            raise TypeError(f"fit() takes batches to walk over, not a "
                            f"{type(data).__qualname__}") from None
        if epochs > 1 and walked is data:
            raise TypeError(
                f"fit(epochs={epochs}) was handed a {type(data).__qualname__}, which is used "
                "up by the first epoch, so the others would take no step; pass something "
                "that can be walked again (a list, a DataLoader), or call fit() once per "
                "epoch with a fresh one"
            )
        history: list[float] = []
        validation: list[dict[str, float]] = []
        # Only a sequence can have an epoch skipped without walking it: anything else
        # (a DataLoader) may draw its order as it is walked, so its batches are drawn.
        length = _length(data, 1) if isinstance(data, Sequence) else None
        resumed = self._skip > 0
        bar = _progress(_length(data, epochs))
        try:
            for epoch in range(epochs):
                taken = len(history)
                for batch in self._untaken(walked if epoch == 0 else data, length, bar):
                    history.append(self.step(batch))
                    if keeper is not None:
                        keeper.stepped(self._steps, self._run)
                    if bar is not None:
                        bar.set_postfix(loss=f"{history[-1]:.4g}", refresh=False)
                        bar.update()
                if judge.data is not None and len(history) > taken:  # not an epoch resumed past
                    validation.append(self.evaluate(judge.data, judge.metrics))
                    if judge.improved(validation[-1], len(validation) - 1):
                        self._best = [judge.best, judge.higher, judge.best_value]
                        if checkpoint is not None:
                            self.checkpoint(checkpoint[0], f"{checkpoint[1]}/best")
                    if judge.exhausted():
                        break
            if history or not resumed:  # a run whose steps were all taken ended before
                updated = self.update()
                if keeper is not None:
                    keeper.ended(updated, self._steps, self._run)
        finally:
            if keeper is not None:
                keeper.join()  # whatever happened, no write goes on past fit()
            if bar is not None:
                bar.close()
        return Result(history, validation, judge.best_epoch)

    def _untaken(self, batches: Iterable[Any], length: int | None, bar: Any) -> Iterable[Any]:
        """The batches of one epoch that a resumed run has not taken yet; those it took
        are drawn and dropped, except that a whole epoch of a sequence is not walked."""
        if length is not None and self._skip >= length > 0:
            self._skip -= length
            if bar is not None:
                bar.update(length)
            return
        for batch in batches:
            if not self._skip:
                yield batch
                continue
            self._skip -= 1
            if bar is not None:
                bar.update()

    # -- what was trained, used ------------------------------------------------------------
    def predict(self, x: Any) -> Any:
        """The graph's output for ``x`` with the weights as trained, wherever they live,
        as a PyTorch user reads a trained model: every node in eval mode (here, and in
        this Trainer's session on each worker, whose trainers keep no activation) and
        no autograd graph kept. Each module's mode is put back as it was afterwards,
        after an error too; nothing a step needs moves (a batch norm's running
        statistics included), so predicting changes nothing that follows."""
        with self._evaluated():
            return self._predicted(x)

    def evaluate(self, data: Iterable[Any],
                 metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None) -> dict[str, float]:
        """``{"loss": ..., name: ...}``: the objective and each metric ``(output,
        target) -> number`` over the batches ``(input, target)`` of ``data``, in eval
        mode as ``predict`` runs, each batch weighing by its rows, so unequal batches
        average to the mean over all rows (for a mean objective). Told to the watchers
        as one ``evaluated`` fact, with the steps taken so far; changes nothing that
        follows."""
        measures = checked_metrics(metrics)
        sums = dict.fromkeys(["loss", *measures], 0.0)
        rows = 0
        with self._evaluated():
            for batch in data:
                x, y, _ = _pieces(batch, 1)[0]
                output = self._predicted(x)
                if (isinstance(output, torch.Tensor) and isinstance(y, torch.Tensor)
                        and y.device != output.device):
                    y = y.to(output.device)
                n = rows_of(y, output)
                sums["loss"] += number(self._objective(output, y), "the objective") * n
                for name, measure in measures.items():
                    sums[name] += number(measure(output, y), f"metric {name!r}") * n
                rows += n
        said = averaged(sums, rows)
        if self._watchers:
            self._emit({"fact": "evaluated", "step": self._steps, "rows": rows, **said})
        return said

    def _evaluated(self) -> Any:
        """Eval mode over this Trainer's nodes, here and in its session on each worker:
        the driver's, or else the one its graph runs in on its broker. A node sent away
        is left alone here: its copy here is what a worker is provisioned from."""
        data, ask = self._driver.data(), self._driver.asking()
        here = {n: impl for n, impl in data.impls.items() if n not in data.hosts}
        return evaluated(here, list(dict.fromkeys(data.hosts.values())), ask)

    def _predicted(self, x: Any) -> Any:
        x = x if type(x) is Opaque else Opaque(x)
        # not a step: nobody is told, and no step's state is touched
        return detached(self._driver.predict(x, Pass()))

    # -- a run kept, and taken up again -------------------------------------------------
    def checkpoint(self, store: Any, name: str) -> str:
        """Keeps everything this run needs to go on as if nothing happened under
        ``name`` in ``store``, and answers its digest: every node's weights (those
        trained on a worker asked there), the optimizers' state (this one's and each
        trainer's, wherever it runs), the steps taken and where the open group stands,
        and the random state of every machine. Whole or absent: the name is bound last.
        """
        return keep(open_store(store), check_name(name), self._run())

    def resume(self, store: Any, name: str) -> int:
        """Takes up the checkpoint kept under ``name``, here and on every worker, and
        answers the steps it had taken; the next ``fit`` skips that many batches (a
        loop of one's own skips by the number answered).

        All or nothing: every part is read and checked, here and by each trainer where
        it runs, before anything is copied. A checkpoint of another graph, another
        optimizer layout or another set of trained nodes is refused, naming the
        difference, and leaves this run as it was."""
        counters = take_up(open_store(store), check_name(name), self._run())
        self._steps, self._taken = counters["steps"], counters["taken"]
        if counters["checked"]:  # the first update's checks were made in the kept run
            self._checked, self._unheld = True, {}
        self._skip = self._steps
        best = counters.get("best")
        self._best = list(best) if isinstance(best, (list, tuple)) and len(best) == 3 else None
        return self._steps

    def seed(self, seed: int) -> None:
        """Seeds torch, Python's ``random`` and numpy here and on every host of the
        graph (each its own seed, drawn from ``seed``): a worker's process starts from
        a random state of its own, so a run with dropout there repeats only once it is
        seeded."""
        seed_all(self._run(), whole_number(seed, "seed", of="Trainer.seed()", least=0))
        if self._privacy is not None:  # the defences' noise, off the model's own stream
            self._privacy.seed(seed)

    def _run(self) -> Run:
        return Run(self._graph, self._optimizer, self._driver,
                   {"steps": self._steps, "taken": self._taken, "every": self._every,
                    "micro": self._micro, "checked": self._checked, "best": self._best},
                   self._broker)

    # -- the four movements -------------------------------------------------------------
    def _open(self) -> None:
        if self._optimizer is not None:
            self._optimizer.zero_grad()

    def _forward(self, x: Any) -> Any:
        x = x if type(x) is Opaque else Opaque(x)
        # The began fact says which step this forward belongs to, so a Recorder can
        # write the record once, when the step's loss is in, rather than twice; one
        # forward in the record, however many stages it takes.
        one = self._pass = Pass(self._told, opening={"step": self._steps + 1})
        with one:
            return self._driver.forward(x, one)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        if (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
                and target.device != output.device):
            target = target.to(output.device)
        loss = self._objective(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise NoGradient(no_loss(loss))
        penalty = self._privacy.penalty() if self._privacy is not None else None
        return loss if penalty is None else loss + penalty

    def _pipelines(self, pieces: int) -> bool:
        """Whether this step's pieces overlap (``_pipeline``): only where nobody watches
        or audits, whose facts and measures come piece by piece."""
        return (self._pipeline and not self._watchers
                and self._audit is None and self._privacy is None
                and worthwhile(self._driver, pieces))

    def _seed(self, loss: torch.Tensor, share: float) -> None:
        # Written as the brief arithmetic says it, so micro=1, every=1 is exactly
        # loss.backward() and every=N is exactly loss / N.
        if share != 1.0:
            loss = loss * share
        if self._every != 1:
            loss = loss / self._every
        loss.backward()

    def _backward(self, loss: torch.Tensor, share: float) -> None:
        self._seed(loss, share)
        self._driver.backward(self._pass)

    def _close(self) -> None:
        if not self._checked:
            self._checked = True
            warn_unheld(self._unheld)
            self._unheld = {}
            if self._optimizer is not None:
                check_gradients(self._graph, self._optimizer)
        if self._optimizer is not None:
            self._optimizer.step()
        self._taken = 0
        if self._watchers:
            self._emit({"fact": "updated"})

    def _emit(self, fact: dict[str, Any]) -> None:
        for watcher in self._watchers:  # one dict for all of them, as the walk does
            watcher(fact)

    def close(self) -> None:
        """Ends this Trainer: takes the audit's hooks off the graph now, rather than when
        it is collected, and has every worker let go of what its session holds there (the
        trainers it trained, their optimizers), rather than at the worker's lease. Not
        done by ``fit``, since ``step`` may go on after it. Export first what you want
        to keep: a step after ``close`` that needs a worker's trainers is a
        ``StateLost``."""
        if self._audit is not None:
            self._audit.release()
        self._driver.release()

    # -- what a run leaves --------------------------------------------------------------
    def export(self) -> Weights:
        """The weights, ``{node: {key: tensor}}``: a detached copy, so the next step does
        not move it under whoever holds it. The optimizer's state is not in it.

        A node trained on a worker is asked there (its copy here never learnt anything),
        through its trainer, so what comes back is what was trained."""
        weights = snapshot(self._graph)
        for node in self._trained_far():
            weights[node] = self._driver.weights(node)
        return weights

    def load(self, weights: Mapping[str, Mapping[str, Any]]) -> None:
        """Copies ``weights`` (as ``export`` gives them) into the nodes they name,
        wherever they are trained: the weights of a node trained on a worker are sent to
        its trainer there, the mirror of how ``export`` asks for them.

        All or nothing, across machines: every node, key, shape and dtype is checked,
        here and by each trainer on a worker, before a single tensor is copied anywhere,
        and a refusal names the node, the key and both sides. A frozen node that is
        loaded is frozen again at the digest of its new weights, or its kept outputs
        would be recalled for weights that no longer produce them.
        """
        if not isinstance(weights, Mapping):
            raise TypeError(f"load() takes {{node: {{key: tensor}}}}, as export() gives it, "
                            f"not a {type(weights).__qualname__}")
        far = self._trained_far()
        here = {n: w for n, w in weights.items() if n not in far}
        there = {n: w for n, w in weights.items() if n in far}
        plan = checked_weights(self._graph, here)
        for node in there:  # asked to check only: nothing moves until everybody agreed
            self._driver.load(node, there[node], check_only=True)
        copy_weights(plan)
        for node in there:
            self._driver.load(node, there[node], check_only=False)
        frozen = [n for n in here if n in self._graph.frozen()]
        if frozen:
            freeze(self._graph, *frozen)

    def shared_order(self, node: str) -> dict[str, Any]:
        """What the shared trainer of ``node`` (``Split(..., shared=key)``) did, in the
        order its host did it: ``{"order": [[client, event], ...], "you": client, "key":
        key, "logged": n}``, each client named by its session, ``you`` being this
        Trainer's, and each event a ``forward``, a ``gradient``, an ``update`` or, for a
        client that stalled mid-step past the others' patience, ``dropped``. Replaying
        it in one process gives the very numbers the host computed."""
        far = self._trained_far()
        if node not in far:
            raise DeclarationError(
                f"node {node!r} is not trained on a worker by this Trainer (trained there: "
                f"{sorted(far) or 'none'}); only a trainer on a worker can be shared")
        return self._driver.ask(node, "shared_order", {"node": node})

    def _trained_far(self) -> dict[str, str]:
        """The nodes trained on a worker, and their hosts: their weights live there."""
        hosts = self._graph.hosts()
        return {n: hosts[n] for n in self._driver.trains if n in hosts}


class _Judge:
    """What ``fit`` validates with, checked before the first step, and which epoch did
    best by ``best``; ``patience`` epochs in a row without doing better end the fit."""

    def __init__(self, data: Any, metrics: Any, best: str, higher: bool, patience: Any,
                 epochs: int, before: list[Any] | None = None):
        self.data = data
        self.metrics = checked_metrics(metrics)
        if data is not None and epochs > 1 and iter(data) is data:
            raise TypeError(f"fit(validate=) was handed a {type(data).__qualname__}, which "
                            "the first epoch's evaluation would use up; pass something that "
                            "can be walked again (a list, a DataLoader)")
        if data is None and (metrics is not None or patience is not None):
            raise DeclarationError("fit() was given metrics= or patience=, which judge each "
                                   "epoch's validation, and no validate=; give validate=batches")
        if best != "loss" and best not in self.metrics:
            raise DeclarationError(f"fit(best={best!r}) names no measure; it is 'loss' or one "
                                   f"of metrics= ({sorted(self.metrics) or 'none given'})")
        self.best, self.higher = best, bool(higher)
        self.patience = None if patience is None else whole_number(patience, "patience",
                                                                  of="fit()")
        # The best of this run's earlier fits (a resumed one's included), where it was
        # judged by the same measure the same way: a later epoch must beat it.
        self.best_value: float | None = (before[2] if before and before[:2] == [best, self.higher]
                                         else None)
        self.best_epoch: int | None = None
        self.since = 0  # epochs since the best one

    def improved(self, said: Mapping[str, float], epoch: int) -> bool:
        if better(said[self.best], self.best_value, not self.higher):
            self.best_value, self.best_epoch, self.since = said[self.best], epoch, 0
            return True
        self.since += 1
        return False

    def exhausted(self) -> bool:
        return self.patience is not None and self.since >= self.patience


def _stale(node: str, host: str) -> str:
    """Why the graph itself refuses to run once ``node`` learns on ``host``."""
    return (f"node {node!r} is trained on host {host!r} by a Trainer, and its copy here "
            "still holds the weights it started with, so Graph.forward through a broker "
            "would answer with weights that never learnt anything; use Trainer.predict(x), "
            "which runs it with what was trained, or build the graph again and load "
            "Trainer.export() into its nodes")


# -- refusals when the Trainer is built --------------------------------------------------
def _broker(broker: Any, workers: Any, hosts: Mapping[str, str]) -> Any:
    """The broker, from ``broker=`` or from the pages' ``workers={host: Worker}``; a
    ``workers=`` that lacks a host of the graph is refused, naming it."""
    if workers is None:
        return broker
    if broker is not None:
        raise DeclarationError(
            "Trainer was given both broker= and workers=, which say the same thing twice; "
            "give one: workers={'gpu': Worker.at('node3:7000')} or "
            "broker=Broker.embedded({'gpu': Worker.at('node3:7000')})")
    if not isinstance(workers, Mapping):
        raise TypeError(f"workers= maps host names to Workers, {{'gpu': Worker.at('node3:7000')}}, "
                        f"not a {type(workers).__qualname__}")
    missing = [host for host in dict.fromkeys(hosts.values()) if host not in workers]
    if missing:
        lead = "workers= is empty" if not workers else \
            f"workers= says nothing about host {', '.join(map(repr, missing))}"
        placed = ", ".join(f"node {node!r} on {host!r}" for node, host in hosts.items()
                           if host in missing)
        said = ", ".join(f"{host!r}: Worker.at('HOST:PORT')" for host in missing)
        raise DeclarationError(f"{lead}, and this graph runs {placed}; map each host to its "
                               f"worker: workers={{{said}}}")
    return runner_of(dict(workers))


def _placed(broker: Any, hosts: Mapping[str, str]) -> None:
    """A graph with a host that neither ``broker=`` nor ``workers=`` speaks of is refused,
    naming the host and ``workers=``, since its first step could only fail."""
    if broker is None and hosts:
        node, host = next(iter(hosts.items()))
        raise DeclarationError(
            f"node {node!r} runs on host {host!r} (.at({host!r})), and this Trainer was "
            f"told nothing about {host!r}; say where it is: Trainer(..., "
            f"workers={{{host!r}: Worker.at('HOST:PORT')}}) (or Worker.generic() for "
            "one on this machine)")


# -- batches ------------------------------------------------------------------------------
def _pieces(batch: Any, micro: int) -> list[tuple[Any, Any, float]]:
    """``(input, target, share)`` for each piece of the batch: torch.chunk along the
    first dimension, each share being its rows over the batch's."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"a batch is a pair (input, target), not a {type(batch).__qualname__}"
                        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    x, y = batch
    if micro == 1:
        return [(x, y, 1.0)]
    rows, targets = _rows(x, "the input"), _rows(y, "the target")
    if targets != rows:
        raise ValueError(f"micro={micro}: the input has {rows} rows and the target "
                         f"{targets}; they are cut together, so they must agree")
    xs, ys = _chunk(x, micro), _chunk(y, micro)
    return [(a, b, _first(b, "target").shape[0] / rows) for a, b in zip(xs, ys)]


def _rows(value: Any, what: str) -> int:
    sizes = {t.shape[0] if t.dim() else None for t in tensors_in(value, refusing=what)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"micro cuts {what} along its first dimension, and its tensors "
                         f"have first dimensions {sorted(map(str, sizes))}; they must share one")
    return sizes.pop()


def _chunk(value: Any, micro: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.chunk(value, micro))
    if isinstance(value, dict):
        parts = {k: _chunk(v, micro) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(len(next(iter(parts.values()))))]
    parts = [_chunk(v, micro) for v in value]
    return [type(value)(p[i] for p in parts) for i in range(len(parts[0]))]


def _first(value: Any, what: str) -> torch.Tensor:
    return tensors_in(value, refusing=what)[0]


# -- the progress bar ---------------------------------------------------------------------
def _progress(total: int | None) -> Any:
    """A tqdm bar where somebody is watching (a terminal, a notebook); else None."""
    notebook = _in_notebook()
    stream = sys.stderr
    if not notebook and not (stream is not None and hasattr(stream, "isatty") and stream.isatty()):
        return None
    try:
        if notebook and _has("ipywidgets"):
            from tqdm.notebook import tqdm
        else:
            from tqdm.std import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def _length(data: Any, epochs: int) -> int | None:
    try:
        return epochs * len(data)
    except TypeError:  # no len, or one that refuses (a DataLoader over an iterable dataset)
        return None


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")  # never imported here: only if somebody did
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _has(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None
