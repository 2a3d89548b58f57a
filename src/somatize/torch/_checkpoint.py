"""Checkpoints: a training run kept in the store whole, and taken up again exactly.

A checkpoint is a handful of objects put in the store by their content — each node's
weights, the gradients of a group still open, the caller's optimizer state, each
trainer's own state, the random state of every process and of the defences' noise
(``_privacy``) — and one small manifest that names them all by digest. The name is
bound to the manifest last, so a checkpoint is whole or absent: a process killed while
writing one leaves objects nobody names, and the name still points at the previous
checkpoint. Every object is verified against its digest when read.

Taking one up is all or nothing: every part is read, and checked here and by each
trainer on a worker, before anything is copied anywhere. What a checkpoint does not
hold is the data loader's own state (where a shuffle stands, its workers): ``fit``
skips the steps already taken by position, so a loader has to give the same batches
in the same order when walked again (a seeded generator of its own).

A trainer on another machine is reached by verbs of its session there (``state``,
``restore``: ``VERBS``, registered by ``somatize.torch``), answered by the functions
here, so that a technique holds no checkpoint code; a host's random state is the
session's own there, read and set by verbs too (``somatize.torch._random``). No verb
opens a session, so a checkpoint on a full worker keeps the trainers it is of.

A trainer several clients share (``Split(..., shared=key)``) belongs to the share, not
to any one client's checkpoint: a resume restores it only where it is gone (the worker
restarted, or let it go), and leaves it as it is, saying so and naming them, while
other clients' sessions train it.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._codec import dumps, loads
from .._errors import DeclarationError, StateLost, StoreError, whole_number
from .._graph import Graph
from .._remember import open_store
from ..store._store import check_name
from ._random import HERE, check_random, random_state, seeded, set_random
from ._weights import checked_node, checked_weights, copy_weights, trainer_at, weights_of

__all__ = ["Keeper", "Run", "VERBS", "check_learning", "check_optimizer", "copied",
           "grads_of", "keep", "layout", "learning_state", "load_optimizer", "optimizer_state",
           "restore_learning", "restore_verb", "seed_all", "set_grads", "state_verb", "take_up",
           "weight_names"]

FORMAT = "somatize.checkpoint/1"


@dataclass
class Run:
    """What a Trainer hands over to be kept, or taken up: its graph, its optimizer, its
    driver (``_one_piece``; it knows the trained nodes), its counters, and its broker."""

    graph: Graph
    optimizer: Any
    driver: Any
    counters: dict[str, Any]
    broker: Any = None


# -- optimizers ---------------------------------------------------------------------------
def optimizer_state(optimizer: Any) -> dict[str, Any] | None:
    """An optimizer's state as data the store can keep: detached copies, str keys."""
    if optimizer is None:
        return None
    said = optimizer.state_dict()
    state = {str(k): {key: copied(v) for key, v in entry.items()}
             for k, entry in said["state"].items()}
    return {"type": type(optimizer).__qualname__, "state": state,
            "param_groups": [dict(group) for group in said["param_groups"]]}


def copied(value: Any) -> Any:
    """A tensor detached and cloned, so training on cannot change what is kept."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def layout(optimizer: Any, name_of: Mapping[int, str]) -> list[list[str]]:
    """Which weights each group of ``optimizer`` holds, by name (``node/key``)."""
    if optimizer is None:
        return []
    return [[name_of.get(id(p), f"a parameter of no node, {tuple(p.shape)}")
             for p in group["params"]] for group in optimizer.param_groups]


def check_optimizer(optimizer: Any, saved: Any, kept: list, here: list, whose: str) -> None:
    """Refuses an optimizer state that another layout of optimizer left."""
    if saved is None:
        return
    if optimizer is None:
        raise DeclarationError(f"the checkpoint holds {whose} optimizer's state ({saved['type']}) "
                               "and this run has no optimizer; build the run as it was")
    if saved["type"] != type(optimizer).__qualname__:
        raise DeclarationError(
            f"the checkpoint holds the state of {whose} optimizer as a {saved['type']}, and "
            f"this run's is a {type(optimizer).__qualname__}; build the same optimizer")
    if len(kept) != len(here):
        raise DeclarationError(
            f"{whose} optimizer had {len(kept)} parameter group(s) when the checkpoint was "
            f"kept and has {len(here)} now; build its groups as they were")
    for at, (then, now) in enumerate(zip(kept, here)):
        if then != now:
            gone = [n for n in then if n not in now][:3]
            new = [n for n in now if n not in then][:3]
            said = (f"holds {', '.join(gone)} no more" if gone else "") + \
                (" and " if gone and new else "") + (f"now holds {', '.join(new)}" if new else "")
            raise DeclarationError(
                f"{whose} optimizer's group {at} {said or 'holds its weights in another order'} "
                "compared with the checkpoint; build the optimizer over the same parameters")


def load_optimizer(optimizer: Any, saved: Any) -> None:
    """Takes a state ``optimizer_state`` answered, already checked."""
    if optimizer is None or saved is None:
        return
    optimizer.load_state_dict({"state": {int(k): v for k, v in saved["state"].items()},
                               "param_groups": saved["param_groups"]})


def weight_names(node: Any, prefix: str = "") -> dict[int, str]:
    """Each tensor weight of ``node`` by its id, named ``prefix + key``."""
    return {id(v): prefix + k for k, v in weights_of(node).items() if isinstance(v, torch.Tensor)}


def grads_of(node: Any) -> dict[str, torch.Tensor]:
    """The gradients a group still open has accumulated in a node, by weight name."""
    return {k: v.grad.detach().clone() for k, v in weights_of(node).items()
            if isinstance(v, torch.Tensor) and v.grad is not None}


def set_grads(node: Any, grads: Mapping[str, Any]) -> None:
    """Puts back the gradients of an open group; every other weight's is cleared."""
    live = weights_of(node)
    for key, value in live.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.grad = None
    for key, grad in grads.items():
        live[key].grad = grad.to(live[key].device, live[key].dtype).clone()


# -- a trainer's part, where it runs -----------------------------------------------------
def learning_state(learning: Any) -> dict[str, Any]:
    """A trainer's own state, to be kept: its optimizer's (None until built), and where
    its group stands. Not its node's weights, which are the node's. Both are its seat's
    (``_seat.Seat``); the technique names the state."""
    seat = learning.seat
    built = seat.built
    taken, piece = seat.standing
    return {"type": type(learning).__qualname__, "every": seat.steps_per_update(),
            "taken": taken, "piece": piece, "optimizer": optimizer_state(built),
            "layout": layout(built, weight_names(seat.node)) if built is not None else []}


def check_learning(learning: Any, state: Any) -> None:
    """Refuses a state ``learning_state`` answered for another technique, another
    layout of optimizer, or a group further along than this trainer ever gets; builds
    nothing to check it."""
    name, seat = type(learning).__qualname__, learning.seat
    if not isinstance(state, Mapping) or "taken" not in state:
        raise TypeError(f"a {name} restores what learning_state() answered, "
                        f"not a {type(state).__qualname__}")
    if state["type"] != name:
        raise DeclarationError(f"the state given was a {state['type']}'s and this is a "
                               f"{name}; train the node the same way")
    every = seat.steps_per_update()
    if state["taken"] >= every:
        raise DeclarationError(
            f"the state given is {state['taken']} steps into a group and this {name} makes "
            f"one update every {every}; restore it with the every= it was kept with")
    if state["optimizer"] is not None:
        built = seat.built or seat.fresh_optimizer()
        check_optimizer(built, state["optimizer"], state["layout"],
                        layout(built, weight_names(seat.node)), f"the {name}'s")


def restore_learning(learning: Any, state: Any, standing_only: bool = False) -> None:
    """Gives ``learning`` back what ``learning_state`` answered, checked first: nothing
    changes if it is refused. ``standing_only`` leaves its optimizer as it is (a shared
    one other clients train), taking only where its group stands."""
    check_learning(learning, state)
    seat = learning.seat
    if standing_only:
        seat.stand(state["taken"], state["piece"])
    elif state["optimizer"] is None:  # built afresh at first use, as it was then
        seat.stand(state["taken"], state["piece"], rebuilt=True)
    else:
        load_optimizer(seat.optimizer, state["optimizer"])
        seat.stand(state["taken"], state["piece"])


def state_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """``state``: a trained node's weights, the gradients of a group still open, and
    its trainer's own state; a shared trainer's open group is this session's own."""
    learning = trainer_at(nodes, asked["node"])
    seat = learning.seat
    with seat.answering():
        node = seat.node
        taken, _ = seat.standing
        return {"weights": {k: copied(v) for k, v in weights_of(node).items()},
                "grads": grads_of(node) if taken else {}, "learning": learning_state(learning),
                "sharing": seat.group.members_but(seat.label) if seat.group is not None else []}


def restore_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """``restore``: a trainer's part of a checkpoint checked, and taken unless ``check``
    says this is only the check every machine passes before any of them copies.

    A shared trainer that other sessions on its host train (``sharing``, in the answer)
    belongs to them too: its node and optimizer are left as they are, and only what is
    this session's own (its open group, where it stands) is taken."""
    learning = trainer_at(nodes, asked["node"])
    seat = learning.seat
    with seat.answering():
        node = seat.node
        others = seat.group.members_but(seat.label) if seat.group is not None else []
        plan = checked_node(node, asked["node"], asked["weights"])
        check_learning(learning, asked["learning"])
        if not asked["check"]:
            if not others:
                copy_weights([plan])
            set_grads(node, asked["grads"])
            restore_learning(learning, asked["learning"], standing_only=bool(others))
    return {"sharing": others}


VERBS = {"state": state_verb, "restore": restore_verb}


def seed_all(run: Run, seed: int) -> None:
    """Seeds this process and every host the graph runs on, each with its own seed
    (drawn from ``seed`` and the host's name), so that a fresh worker's random state
    is not whatever its process started with."""
    for host in sorted(set(run.graph.hosts().values())):
        _asked(run, host, "seed", {"seed": (seed + zlib.crc32(host.encode())) % 2**63})
    seeded(seed)


def _asked(run: Run, host: str, verb: str, args: Any) -> Any:
    """What the verb answers in ``run``'s session on ``host``: its driver's, or the
    session its graph runs in where nothing is trained there."""
    return run.driver.control(host, verb, args)


# -- what a run is, to be compared ------------------------------------------------------
def identity(run: Run) -> dict[str, Any]:
    """What a checkpoint must agree with to be taken up: the graph's nodes, edges and
    implementations, what is frozen and at which state, and what trains where.

    An implementation is its class's name without its module: the same script is
    ``__main__`` when run, ``__mp_main__`` in a spawned process and its file's name
    when imported, and the weights' keys and shapes are checked anyway."""
    g = run.graph
    trains = run.driver.trains
    return {"nodes": list(g.nodes()), "edges": [list(e) for e in g.edges()],
            "identities": {n: type(g.implementation(n)).__qualname__ for n in g.nodes()},
            "frozen": dict(g.frozen()),
            "trained": {n: type(t).__qualname__ for n, t in trains.items()}}


def _compare(kept: Mapping[str, Any], here: Mapping[str, Any]) -> None:
    """Refuses a checkpoint of another graph or another set of trained nodes, naming
    the first difference found."""
    for what, words in (("nodes", "nodes"), ("trained", "trained nodes")):
        gone = [n for n in kept[what] if n not in here[what]]
        new = [n for n in here[what] if n not in kept[what]]
        if gone or new:
            said = "; ".join(([f"it has {_listed(gone)}, which this run has not"] if gone else [])
                             + ([f"this run has {_listed(new)}, which it has not"] if new else []))
            raise DeclarationError(f"this checkpoint is of another set of {words}: {said}; "
                                   "resume it into the run it was kept from")
    for n, kind in kept["trained"].items():
        if here["trained"][n] != kind:
            raise DeclarationError(f"node {n!r} was trained by a {kind} when the checkpoint was "
                                   f"kept and by a {here['trained'][n]} now")
    edges = {tuple(e) for e in here["edges"]}
    for a, b in map(tuple, kept["edges"]):
        if (a, b) not in edges:
            raise DeclarationError(f"this checkpoint is of another graph: it has the edge "
                                   f"{a!r} -> {b!r}, which this graph has not")
    if len(edges) != len(kept["edges"]):
        extra = sorted(edges - {tuple(e) for e in kept["edges"]})[0]
        raise DeclarationError(f"this checkpoint is of another graph: this one has the edge "
                               f"{extra[0]!r} -> {extra[1]!r}, which it has not")
    for n, impl in kept["identities"].items():
        if here["identities"][n] != impl:
            raise DeclarationError(f"this checkpoint is of another graph: node {n!r} was a "
                                   f"{impl} and is a {here['identities'][n]} here")
    if kept["frozen"] != here["frozen"]:
        n = next(n for n in {*kept["frozen"], *here["frozen"]}
                 if kept["frozen"].get(n, "-") != here["frozen"].get(n, "-"))
        raise DeclarationError(f"node {n!r} is frozen differently than when the checkpoint was "
                               "kept (another state, or frozen in only one of the two)")


def _listed(ids: list[str]) -> str:
    return ", ".join(map(repr, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


# -- keeping one ---------------------------------------------------------------------------
def _far(run: Run) -> dict[str, str | None]:
    """Every trained node and its host (None: here)."""
    hosts = run.graph.hosts()
    return {n: hosts.get(n) for n in run.driver.trains}


def _trainer(run: Run, node: str, verb: str, args: Any) -> Any:
    """What the trainer of ``node`` answers to ``verb`` where it runs; its refusal names
    it, its host, and that nothing was taken."""
    try:
        return run.driver.ask(node, verb, args)
    except (DeclarationError, TypeError) as exc:
        host = run.graph.hosts().get(node)
        raise DeclarationError(f"{exc} (checked by the trainer of {node!r} on host "
                               f"{host!r}); nothing was resumed, here or there") from exc


def _names_of(graph: Graph) -> dict[int, str]:
    return {k: v for n in graph.nodes()
            for k, v in weight_names(graph.implementation(n), n + "/").items()}


def gather(run: Run) -> dict[str, Any]:
    """Everything a checkpoint holds, as values (no store yet); see the module's docstring."""
    far = _far(run)
    trainers = {n: _trainer(run, n, "state", {"node": n}) for n in far}
    for kept in trainers.values():
        kept.pop("sharing", None)
    hosts = sorted(set(run.graph.hosts().values()))
    randoms = {h: _asked(run, h, "random", None) for h in hosts}
    g, frozen = run.graph, run.graph.frozen()
    weights, grads = {}, {}
    for n in g.nodes():
        if n in frozen or (n in far and far[n] is not None):
            continue  # frozen: never changes; trained on a worker: its copy here is stale
        node = g.implementation(n)
        live = weights_of(node, n)
        if live:
            weights[n] = {k: copied(v) for k, v in live.items()}
            if run.counters["taken"]:
                grads[n] = grads_of(node)
    randoms[HERE] = random_state()
    privacy = run.driver.privacy  # the defences (``_privacy``): a noise generator of their own
    return {"identity": identity(run), "counters": dict(run.counters), "weights": weights,
            "grads": grads, "optimizer": optimizer_state(run.optimizer),
            "layout": layout(run.optimizer, _names_of(g)), "trainers": trainers,
            "random": randoms,
            "defences": None if privacy is None else privacy.random_state()}


def written(store: Any, name: str, parts: dict[str, Any]) -> str:
    """Writes what ``gather`` answered: the parts of this process in one object, each
    trainer's in one of its own, then the manifest naming them (with the counters and
    the random states, which are small), and binds ``name`` to it last."""
    put = lambda value: store.put(dumps(value))  # noqa: E731
    here = {k: parts[k] for k in ("weights", "grads", "optimizer")}
    manifest = {k: parts[k] for k in ("identity", "counters", "layout", "random")}
    if parts.get("defences") is not None:
        manifest["defences"] = parts["defences"]
    manifest.update(format=FORMAT, here=put(here),
                    trainers={n: put(t) for n, t in parts["trainers"].items()})
    digest = put(manifest)
    store.bind(name, digest, {"checkpoint": FORMAT, "steps": parts["counters"]["steps"]})
    return digest


def keep(store: Any, name: str, run: Run) -> str:
    """Keeps a checkpoint of ``run`` under ``name``; answers the manifest's digest."""
    return written(store, name, gather(run))


class Keeper:
    """Keeps ``fit``'s checkpoints under ``name``: every ``every`` steps (None: only at
    the end), one at a time, the writing on a thread of its own.

    The snapshot (``gather``: copies of every tensor, asked of every worker) is taken on
    the caller's thread, between two steps, so it is exactly that step's; only the
    encoding, hashing and writing overlap the next steps. A checkpoint due while the
    last one is still being written waits for it, so they are bound in order; what
    went wrong writing one is raised at the next, or at the end."""

    def __init__(self, store: Any, name: str, every: int | None):
        self.store, self.name, self.every = store, name, every
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._kept_at: int | None = None
        self.digest: str | None = None

    def stepped(self, steps: int, run: Callable[[], Run]) -> None:
        """After a step: keeps one if it is due."""
        if self.every and steps % self.every == 0:
            self.keep(run())
            self._kept_at = steps

    def ended(self, updated: bool, steps: int, run: Callable[[], Run]) -> str | None:
        """At the end of ``fit``: keeps the last one (unless the last step's is it) and
        waits for it to be written."""
        if updated or self._kept_at != steps:
            self.keep(run())
        return self.wait()

    def keep(self, run: Run) -> None:
        self.wait()
        parts = gather(run)
        self._thread = threading.Thread(target=self._write, args=(parts,),
                                        name="somatize-checkpoint", daemon=True)
        self._thread.start()

    def _write(self, parts: dict[str, Any]) -> None:
        try:
            self.digest = written(self.store, self.name, parts)
        except BaseException as exc:  # raised on the caller's thread, at the next call
            self._error = exc

    def wait(self) -> str | None:
        """Waits for the checkpoint being written; answers its digest or raises why not."""
        self.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.digest

    def join(self) -> None:
        """Waits for the writing thread, raising nothing (for a ``finally``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


# -- taking one up ------------------------------------------------------------------------
def _read(store: Any, digest: str, what: str) -> Any:
    blob = store.get(digest)
    if blob is None:
        raise StoreError(f"the checkpoint's {what} ({digest}) is not in {store.where}; the "
                         "checkpoint cannot be taken up, keep a new one")
    return loads(blob, f"the checkpoint's {what}")


def read(store: Any, name: str) -> dict[str, Any]:
    """Every part of the checkpoint under ``name``, read and verified."""
    bound = store.resolve(name)
    if bound is None:
        raise StoreError(f"no checkpoint is kept under {name!r} in {store.where}; keep one "
                         "with Trainer.checkpoint(store, name) or fit(checkpoint=(store, name))")
    manifest = _read(store, bound.digest, "manifest")
    if type(manifest) is not dict or manifest.get("format") != FORMAT:
        raise StoreError(f"{name!r} in {store.where} is bound to something that is not a "
                         "checkpoint; give the name a checkpoint was kept under")
    whose = f"the checkpoint {name!r} in {store.where}"
    _shaped(manifest, _MANIFEST, f"{whose}: its manifest")
    _shaped(manifest["identity"], _IDENTITY, f"{whose}: its manifest's identity")
    _shaped(manifest["counters"], _COUNTERS, f"{whose}: its manifest's counters")
    if HERE not in manifest["random"]:
        raise StoreError(f"{whose}: its manifest's random states lack this process's; it was "
                         "changed after it was kept: keep a new one")
    parts = dict(manifest)
    here = _read(store, manifest["here"], "weights and optimizer state")
    _shaped(here, _HERE, f"{whose}: its weights and optimizer state")
    parts.update(here)
    parts["trainers"] = {}
    for n, d in manifest["trainers"].items():
        trainer = _read(store, d, f"state of the trainer of {n!r}")
        _shaped(trainer, _TRAINER, f"{whose}: the state of the trainer of {n!r}")
        parts["trainers"][n] = trainer
    return parts


# What each part of a checkpoint holds, to name what a hand-edited one lacks.
_MANIFEST = {"identity": dict, "counters": dict, "layout": list, "random": dict, "here": str,
             "trainers": dict}
_IDENTITY = {"nodes": list, "edges": list, "identities": dict, "frozen": dict, "trained": dict}
_COUNTERS = {"steps": int, "taken": int, "every": int, "micro": int, "checked": bool}
_HERE = {"weights": dict, "grads": dict, "optimizer": (dict, type(None))}
_TRAINER = {"weights": dict, "grads": dict, "learning": dict}


def _shaped(value: Any, fields: Mapping[str, Any], what: str) -> None:
    """Refuses a part of a checkpoint that lacks a field, or holds one of another kind."""
    if type(value) is not dict:
        raise StoreError(f"{what} is a {type(value).__name__}, not a map; the checkpoint was "
                         "changed after it was kept: keep a new one")
    for field, kind in fields.items():
        if field not in value:
            raise StoreError(f"{field!r} is missing from {what}; the checkpoint was changed "
                             "after it was kept (or by another program): keep a new one")
        if not isinstance(value[field], kind) or (kind is int and type(value[field]) is bool):
            raise StoreError(f"{what} holds {field!r} as {type(value[field]).__name__}; the "
                             "checkpoint was changed after it was kept: keep a new one")


def take_up(store: Any, name: str, run: Run) -> dict[str, Any]:
    """Takes the checkpoint under ``name`` into ``run``, all or nothing; answers the
    counters the Trainer sets (the one thing left to it, and nothing that can fail)."""
    parts = read(store, name)
    _compare(parts["identity"], identity(run))
    counters, every = parts["counters"], run.counters["every"]
    if counters["taken"] >= every:
        raise DeclarationError(
            f"the checkpoint is {counters['taken']} steps into a group and this Trainer "
            f"updates every={every}; resume with the every= it was kept with "
            f"({counters['every']})")
    g = run.graph
    check_optimizer(run.optimizer, parts["optimizer"], parts["layout"],
                     layout(run.optimizer, _names_of(g)), "the Trainer's")
    plan = checked_weights(g, parts["weights"])
    far = _far(run)
    hosts = set(g.hosts().values())
    for h in sorted(set(parts["random"]) - hosts - {HERE}):
        warnings.warn(f"the checkpoint holds the random state of host {h!r}, which this graph "
                      "does not use; it is left out, so what is random there may differ from "
                      "the run that was kept", UserWarning, stacklevel=4)
    randoms = {h: s for h, s in parts["random"].items() if h in hosts}
    check_random(parts["random"][HERE], HERE)
    privacy, defences = run.driver.privacy, parts.get("defences")
    if privacy is not None and defences is not None:
        privacy.check_random(defences, f"the checkpoint {name!r} in {store.where}")
    elif privacy is not None and privacy.protecting:
        warnings.warn("the checkpoint holds no state of the defences' noise (it was kept by a "
                      "run without protecting=): their noise goes on from where this run's "
                      "seed put it, so it differs from the kept run's", UserWarning, stacklevel=4)
    if far:  # every machine agrees before any of them copies
        try:
            _restored(run, parts, far, check=True)
        except StateLost:  # what it had learnt there is gone: start afresh, then restore
            run.driver.renew()
            _restored(run, parts, far, check=True)
    for h, state in randoms.items():
        _random_verb(run, h, {"state": state, "host": h, "check": True})
    _restored(run, parts, far, check=False)
    for h, state in randoms.items():
        _random_verb(run, h, {"state": state, "host": h, "check": False})
    copy_weights(plan)
    for n in g.nodes():
        if n in parts["weights"]:
            set_grads(g.implementation(n), parts["grads"].get(n, {}))
    load_optimizer(run.optimizer, parts["optimizer"])
    set_random(parts["random"][HERE])
    if privacy is not None and defences is not None:
        privacy.set_random_state(defences)
    return counters


def _random_verb(run: Run, host: str, args: dict[str, Any]) -> None:
    """A kept random state checked, or taken, in ``run``'s session on ``host``."""
    try:
        _asked(run, host, "set_random", args)
    except DeclarationError as exc:
        raise DeclarationError(f"{exc}; nothing was resumed") from exc


def _restored(run: Run, parts: dict[str, Any], far: Mapping[str, Any], check: bool) -> None:
    """Hands each trainer its part of the checkpoint where it runs: to check only, or
    to take. A shared trainer other clients train is left as it is (``restore_verb``),
    which is said, naming them, once it is taken."""
    for n in far:
        t = parts["trainers"][n]
        said = _trainer(run, n, "restore", {"node": n, "weights": t["weights"],
                                            "grads": t["grads"], "learning": t["learning"],
                                            "check": check})
        others = said.get("sharing") if type(said) is dict else None
        if others and not check:
            warnings.warn(
                f"the trainer of {n!r} on host {run.graph.hosts().get(n)!r} is shared "
                f"(shared={run.driver.trains[n].seat.shared!r}) and other clients' sessions train "
                f"it there now ({', '.join(others)}); its weights and optimizer belong to them "
                "too, so the resume left them as they are and took only this client's own "
                "part (its open group, where it stands). A shared trainer is restored from a "
                "checkpoint only where it is gone (the worker restarted, or let it go)",
                UserWarning, stacklevel=4)


def kept_by(checkpoint: Any, every: Any) -> Keeper | None:
    """The Keeper of ``fit``'s ``checkpoint=(store, name)`` and ``checkpoint_every=``,
    checked before the first step; None when no checkpoint is asked for."""
    if checkpoint is None:
        if every is not None:
            raise DeclarationError("fit(checkpoint_every=...) says how often to keep a "
                                   "checkpoint, and checkpoint= says nowhere; give "
                                   "checkpoint=(store, 'run/ckpt') too")
        return None
    if not isinstance(checkpoint, (tuple, list)) or len(checkpoint) != 2:
        raise TypeError(f"fit(checkpoint=) takes (store, name), not a "
                        f"{type(checkpoint).__qualname__}")
    if every is not None:
        whole_number(every, "checkpoint_every", of="fit()")
    return Keeper(open_store(checkpoint[0]), check_name(checkpoint[1]), every)
