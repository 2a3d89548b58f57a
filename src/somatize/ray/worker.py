"""RayWorker: a Worker whose host is a Ray actor, and the link that carries its slices.

The link speaks the socket wire's messages (the same request header, the same reply
kinds and headers, read back by the same code) over actor calls instead of frames:
a slice is one call, its buffers ride in Ray's object store, and a catalog is put
there once and handed to the actor by reference, again after Ray restarted it.
What the socket says about silence Ray says about death: an actor that is gone
fails the call, and the failure is a ``WireError`` naming the host.
"""

from __future__ import annotations

import secrets
import threading
import time
import warnings
from typing import Any

import ray
import ray.exceptions

from .._errors import DeclarationError, WireError
from .._slices import Outcome
from .._verbs import END
from ..wire.buffers import joined, outgoing, size
from ..wire.declare import Worker
from ..wire.transport import (Link, Pending, Request, SessionThere, catalog_refused,
                              outcome_of, state_lost, verb_answered, verb_request)
from .actor import Host

__all__ = ["NAMESPACE", "RayWorker"]

NAMESPACE = "somatize"  # where a named actor is, so every client's driver finds it
_CONCURRENT = 64  # calls a named actor runs at once: one client may wait for another's
_PUT = 1 << 16  # buffers this large are put in the store before the call, not inside it
_STARTUP = 60.0  # how long the cluster may take to place an actor (a node may be starting)
_GONE = (ray.exceptions.RayActorError, ray.exceptions.TaskCancelledError,
         ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
_remote: Any = None


def _actor_class() -> Any:
    global _remote
    if _remote is None:
        _remote = ray.remote(Host)
    return _remote


class _Restarting(Exception):
    """A call that met the actor while Ray restarted it (``error`` says so)."""

    def __init__(self, error: WireError):
        super().__init__(str(error))
        self.error = error


class RayWorker(Worker):
    """A worker whose host is a Ray actor, placed by resources; see ``Worker.on_ray``."""

    def __init__(self, mode: str = "project", send: Any = (), *, num_cpus: float | None = None,
                 num_gpus: float | None = None, resources: dict[str, float] | None = None,
                 runtime_env: dict[str, Any] | None = None, max_restarts: int = 3,
                 timeout: float | None = None, deadline: float | None = None,
                 name: str | None = None):
        super().__init__(mode, send, timeout=timeout, deadline=deadline)
        # Placing an actor may wait for a node to start; a timeout said outright bounds it.
        self.placing = _STARTUP if timeout is None else self.timeout
        self.options = _options(num_cpus, num_gpus, resources, runtime_env, max_restarts)
        self.name = _named(name, self.options)
        self._actor: Any = None
        self._where_said = "a Ray actor not started yet"
        self.closed = False
        self._start_lock = threading.Lock()
        self._link = RayLink(self)
        # A named actor runs several clients' calls at once, so one caller's calls may
        # run out of the order they were made in: nothing is sent ahead to it.
        self._link.ordered = name is None
        self._wire = (b"ray " + secrets.token_hex(16).encode() if name is None
                      else b"ray named " + name.encode())

    def actor(self, host: str) -> Any:
        """The actor, started at first need and waited for until the cluster placed it."""
        with self._start_lock:
            if self.closed:
                raise WireError(f"host {host!r}: its Ray worker was closed", host=host)
            if self._actor is None:
                actor = _actor_class().options(**self.options).remote()
                wait = self.placing
                try:
                    said = ray.get(actor.ready.remote(), timeout=wait)
                except ray.exceptions.GetTimeoutError:
                    ray.kill(actor)
                    raise WireError(
                        f"host {host!r}: the Ray cluster placed no actor asking for "
                        f"{_asked(self.options)} within {wait:g} s; it has "
                        f"{_offered()} in all. Ask for less, or add a node that has it",
                        host=host) from None
                except _GONE as exc:
                    raise WireError(f"host {host!r}: its Ray actor died as it started: "
                                    f"{_first_line(exc)}", host=host) from None
                self._actor = actor
                self._link.instance = said["instance"]
                self._where_said = f"Ray actor on {said['node']}, pid {said['pid']}"
            return self._actor

    def where(self, host: str) -> str:
        return self._where_said

    def started(self) -> Any:
        """The actor, if it was started (and not closed); None otherwise."""
        return self._actor

    def close(self) -> None:
        """Cancels what is in flight and ends the actor — unless it is named: that one
        is every client's, and outlives each (``ray.kill(ray.get_actor(name,
        namespace="somatize"))`` ends it)."""
        with self._start_lock:
            self.closed = True
            actor, self._actor = self._actor, None
        self._link.cancel()
        if actor is not None and self.name is None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (the cluster itself may be gone by now)
                pass

    def __repr__(self) -> str:
        named = f", name={self.name!r}" if self.name is not None else ""
        return f"Worker.on_ray({_asked(self.options)}{named}, mode={self.mode!r})"


def _named(name: Any, options: dict[str, Any]) -> str | None:
    """Checks a name and has the options reach (or make) the one actor of that name,
    which outlives the driver that made it and runs several clients' calls at once."""
    if name is None:
        return None
    if type(name) is not str or not name:
        raise DeclarationError(f"name= is the Ray actor's name every client reaches it by, a "
                               f"non-empty str, not {name!r}")
    options.update(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                   max_concurrency=_CONCURRENT)
    return name


def _options(num_cpus: Any, num_gpus: Any, resources: Any, runtime_env: Any,
             max_restarts: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise DeclarationError(f"{name} is a number at least 0, not {value!r}")
        options[name] = value
    if resources is not None:
        if type(resources) is not dict or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= 0 for k, v in resources.items()):
            raise DeclarationError(f"resources is {{name: amount}}, e.g. {{'tpu': 1}}, "
                                   f"not {resources!r}")
        options["resources"] = dict(resources)
    if runtime_env is not None:
        if not isinstance(runtime_env, dict):
            raise DeclarationError(f"runtime_env is a dict, as Ray takes it, not {runtime_env!r}")
        options["runtime_env"] = runtime_env
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise DeclarationError(f"max_restarts is a whole number (-1: without end), "
                               f"not {max_restarts!r}")
    options["max_restarts"] = max_restarts
    # Ray's default, said outright: a retried call may run out of the order it was made
    # in, and a pipelined step counts on that order (a lost call is a WireError instead).
    options["max_task_retries"] = 0
    return options


def _asked(options: dict[str, Any]) -> str:
    said = [f"{k}={options[k]!r}" for k in ("num_cpus", "num_gpus", "resources") if k in options]
    return ", ".join(said) or "Ray's defaults"


def _offered() -> str:
    try:
        return ", ".join(f"{k}={v:g}" for k, v in sorted(ray.cluster_resources().items())
                         if not k.startswith("node:") and "memory" not in k) or "nothing"
    except Exception:  # noqa: BLE001
        return "what it could not say"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


class _Sent(Pending):
    """A slice handed to the actor and not read back yet: ``result()`` reads it (Ray
    runs one caller's calls to an actor in the order they were made, so a pipeline may
    send its next piece before this one's answer is read)."""

    __slots__ = ("began", "bytes", "header", "pieces", "ref")

    def __init__(self, link: RayLink, request: Request):
        super().__init__(link, request)
        self.header, self.bytes = request.header(), size(request.buffers)
        self.began = time.perf_counter_ns()
        # what the call carries: a large buffer put in the store first, the rest inline
        self.pieces = [ray.put(b) if size([b]) >= _PUT else b for b in outgoing(request.buffers)]
        self.took_sent = (time.perf_counter_ns() - self.began) // 1000
        self.ref: Any = None


class RayLink(Link):
    """The wire's requests and replies over Ray actor calls instead of frames: an
    actor runs one caller's calls in the order they were made, so a slice may be sent
    before the last one's answer is read."""

    def __init__(self, worker: RayWorker):
        self.worker = worker
        self.lock = threading.Lock()  # calls leave in the order their slices were handed over
        self.instance: str | None = None  # the actor process, as its ready() says
        self._blobs: dict[str, Any] = {}  # each staged catalog, put in the store once
        self._flying: set[Any] = set()
        self._flying_lock = threading.Lock()

    def run(self, request: Request) -> Outcome:
        """Runs one slice on the actor and answers with what came back."""
        return self.submit(request).result()

    def submit(self, request: Request) -> _Sent:
        """Hands one slice to the actor now; its ``result()`` reads the answer."""
        sent = _Sent(self, request)
        try:
            self._send(sent)
        except _Restarting as exc:  # met the actor while Ray restarted it: read it again
            sent.ref = exc
        except BaseException as exc:
            sent.error, sent.answered = exc, True
        return sent

    def _send(self, sent: _Sent) -> None:
        """The call itself, after the catalog where the actor lacks it (under the lock,
        so that calls leave in the order their slices were handed over)."""
        with self.lock:
            actor = self.worker.actor(sent.host)
            self._provide(sent.host, actor, sent.there)
            sent.ref = actor.slice.remote(sent.header, *sent.pieces)
            with self._flying_lock:
                self._flying.add(sent.ref)

    def read_reply(self, sent: _Sent) -> None:
        """Reads a sent slice's answer. A fresh actor (Ray restarted it) answers "need"
        before running anything: a session that keeps nothing is sent once more, one
        whose state was there is said to be lost."""
        host, nodes, there = sent.host, sent.nodes, sent.there
        doing = f"while running slice {nodes}"
        try:
            for attempt in (0, 1):
                try:
                    if isinstance(sent.ref, _Restarting):
                        raise sent.ref
                    kind, head, back = self._call(host, sent.ref, doing)
                except _Restarting as exc:
                    if attempt == 1:
                        raise exc.error from None
                    self._back(host, self.worker.actor(host), exc.error)
                    self._send(sent)
                    continue
                if kind == "need":
                    self._lost_catalog(host, there, head, attempt)
                    self._send(sent)
                    continue
                there.live = True
                took = (time.perf_counter_ns() - sent.began) // 1000
                sent.outcome = outcome_of(host, nodes, kind, head, joined(back),
                                          sent=sent.bytes, took_sent=sent.took_sent,
                                          size=size(back), took_us=took, watching=sent.watching)
                return
        except BaseException as exc:
            sent.error = exc
        finally:
            sent.answered, sent.pieces = True, []

    def control(self, there: SessionThere, verb: str, args: Any = None, *, host: str = "") -> Any:
        """Asks the actor a verb for the session (``Link.control``): one actor call,
        after the catalog where the actor lacks it, in the order of the calls before it."""
        if verb == END:
            return self.end(there)
        head, buffers = verb_request(there, verb, args)
        doing = f"while answering verb {verb!r}"
        for attempt in (0, 1):
            with self.lock:
                actor = self.worker.actor(host)
                self._provide(host, actor, there)
                ref = actor.control.remote(head, *outgoing(buffers))
            kind, said, back = self._call(host, ref, doing)
            if kind == "need":
                self._lost_catalog(host, there, said, attempt)
                continue
            return verb_answered(host, verb, kind, said, joined(back))
        raise AssertionError("unreachable")

    def _lost_catalog(self, host: str, there: SessionThere, said: dict[str, Any],
                      attempt: int) -> None:
        """An actor answered "need": Ray restarted it, and a fresh actor holds no
        session. Where the session's state was there it is lost; one that keeps nothing
        may be sent once more (the caller does so), and a second "need" is an error."""
        there.declared = None
        if there.learnt:
            raise state_lost(host, self.worker.where(host), there,
                             said.get("gone") or "Ray started its actor afresh")
        if attempt:
            raise WireError(f"host {host!r}: its Ray actor keeps losing its catalog", host=host)

    def _provide(self, host: str, actor: Any, there: SessionThere) -> None:
        """Hands the actor the session's staged catalog, unless it holds it already."""
        if there.declared_in(self.instance):
            return
        staged = there.staged
        where = self.worker.where(host)
        if there.lost_in(self.instance):
            raise state_lost(host, where, there, "Ray started its actor afresh")
        blob = self._blobs.get(staged.ident)
        if blob is None:
            blob = self._blobs[staged.ident] = ray.put(staged.blob)
        kind, head = self._call(host, actor.provision.remote(
            there.session, staged.ident, staged.kind, staged.runtime, blob, there.keeps,
            there.learnt), "while receiving its catalog")
        if kind == "need":
            raise state_lost(host, where, there, head.get("gone") or "Ray started its actor afresh")
        if kind == "error":
            raise catalog_refused(host, where, head)
        there.declared, there.instance = staged.ident, self.instance

    def end(self, there: SessionThere) -> None:
        """Tells the actor to let go of a session (nothing, if it is gone)."""
        actor = self.worker.started()
        if actor is None or there.declared is None or there.instance != self.instance:
            return
        there.declared = None
        try:
            ray.get(actor.end.remote(there.session), timeout=self.worker.timeout)
        except Exception as exc:  # noqa: BLE001  (the actor or the cluster may be gone)
            warnings.warn(f"the Ray actor could not be told to end session "
                          f"{there.session.hex()[:12]} ({type(exc).__name__}: {exc}); it "
                          "holds what the session trained until it is let go",
                          RuntimeWarning, stacklevel=4)

    def _call(self, host: str, ref: Any, doing: str) -> Any:
        """The answer to one actor call; the actor's death is a WireError naming the host."""
        with self._flying_lock:
            self._flying.add(ref)
        try:
            return ray.get(ref, timeout=self.worker.deadline)
        except ray.exceptions.GetTimeoutError:
            try:
                ray.cancel(ref)  # asked, not forced: the actor serves on
            except Exception:  # noqa: BLE001  (a running actor call may not be cancelled)
                pass
            raise WireError(f"host {host!r} ({self.worker.where(host)}): no answer {doing} "
                            f"within its deadline of {self.worker.deadline:g} s "
                            "(Worker.on_ray(..., deadline=)); the actor may still be computing "
                            "it, and the calls after it wait for it", host=host) from None
        except _GONE as exc:
            if isinstance(exc, ray.exceptions.ActorUnavailableError) and not self.worker.closed:
                raise _Restarting(WireError(
                    f"host {host!r} ({self.worker.where(host)}) is unavailable {doing}: "
                    f"{_first_line(exc)}", host=host)) from None
            if self.worker.closed:
                raise WireError(f"host {host!r}: its Ray worker was closed {doing}",
                                host=host) from None
            raise WireError(
                f"host {host!r} ({self.worker.where(host)}) died {doing}: "
                f"{_first_line(exc)}. Ray restarts an actor up to max_restarts times; what it "
                "held for this step is gone either way", host=host) from None
        except ray.exceptions.RayError as exc:  # the actor's own code failed, outside a slice
            raise WireError(f"host {host!r} ({self.worker.where(host)}) failed {doing}: "
                            f"{_first_line(exc)}", host=host) from exc
        finally:
            with self._flying_lock:
                self._flying.discard(ref)

    def _back(self, host: str, actor: Any, error: WireError) -> None:
        """Waits for Ray to have restarted the actor; ``error`` if it does not."""
        deadline = time.monotonic() + self.worker.placing
        while time.monotonic() < deadline and not self.worker.closed:
            try:
                said = ray.get(actor.ready.remote(), timeout=max(0.0, deadline - time.monotonic()))
                self.instance = said["instance"]
                return
            except ray.exceptions.ActorUnavailableError:  # not back yet
                time.sleep(0.1)
            except (ray.exceptions.GetTimeoutError, *_GONE):
                break
        raise error

    def cancel(self) -> None:
        """Cancels every call in flight (their callers get a WireError)."""
        with self._flying_lock:
            flying = list(self._flying)
        for ref in flying:
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001  (it may have finished meanwhile)
                pass

    def close(self) -> None:
        self.cancel()
