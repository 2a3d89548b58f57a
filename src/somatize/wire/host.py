"""A host's side of a slice, whatever carried it there: a socket, or a Ray actor call.

Names ending in ``Here`` are the host's side of what a client names on its side of
the wire: ``SessionHere`` is one session as this host holds it (the client knows it
as a ``transport.SessionThere``), ``SessionsHere`` all the sessions this host holds,
and ``SliceFormHere`` a slice's form as this host read it (the client's
``transport.SliceForm``).

Everything here is the transport's business only through plain data: a slice arrives
as the request header the client wrote (``n`` nodes, ``w`` wanted, ``f`` forward,
``v`` values, ``r`` references to what stayed here, ``x`` watching, ``t`` walked
back) and its buffers, and leaves as an :class:`Answer`, a reply's kind, header and
buffers, which the transport sends as they are. The socket worker
(``connection.py``) and the Ray actor (``somatize.ray``) both call :func:`answer`,
so a slice runs one way whichever way it came; and :func:`control` for a verb of a
session (``somatize._verbs``), what its owner asks besides a slice.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib
import sys
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

from .._engine import run_slice
from .._errors import NodeError, ProtocolError, SomaError
from .._verbs import END, SEEDING, VERBS
from .._graph import made_from, user_ids
from .._node import Opaque, afterwards_held_here
from .._slices import Shape, Slice
from .catalog import build, catalog_id, pack_values, unpack_values
from .log import say
from .resident import Resident, Turns

__all__ = ["Answer", "Holding", "Refused", "SessionHere", "SessionsHere", "Sharing",
           "SliceFormHere", "answer", "control", "provisioned", "refused_catalog", "short",
           "slice_form_here"]

# The engine's own bracket of a walk; the client brackets the forward itself.
_BRACKET = frozenset(("began", "finished"))
_TRACEBACK = 64 << 10  # the most of a traceback's text that travels back
_GONE = 4096  # sessions let go that are remembered, to tell their owners why


def short(ident: str) -> str:
    """A catalog's id as the log shows it."""
    return ident.split(":", 1)[-1][:12]


class Answer(NamedTuple):
    """A reply to send: ``kind`` (``"done"`` or ``"error"``), its header and buffers;
    ``said`` is the log's line for a failure (its traceback follows it, ``text``).
    ``afterwards``, when there is one, runs the work the slice's nodes left for after their
    answer (``Ctx.afterwards``): the transport calls it once the reply has gone."""

    kind: str
    header: dict[str, Any]
    buffers: list[Any]
    said: str | None = None
    text: str | None = None
    afterwards: Callable[[], None] | None = None


class Holding:
    """What one client's forward left on a host: the outputs that could not travel,
    kept for the slices of the same forward that read them."""

    def __init__(self) -> None:
        self.forward: bytes | None = None
        self.held: dict[str, Any] = {}

    def clear(self) -> None:
        self.held.clear()


class SessionHere:
    """One client session as this host holds it (its client's ``SessionThere``): its
    catalog, the graph built from it, whether its owner said it keeps state here,
    whether a slice has run in it since, and the nodes of it that share something with
    other sessions (``Sharing``)."""

    __slots__ = ("catalog", "failed", "graph", "keeps", "left", "live", "lock", "owns",
                 "random", "shapes", "shares", "turn", "used")

    def __init__(self, catalog: str, graph: Any, keeps: bool, shares: tuple = (),
                 sharing: Sharing | None = None):
        self.catalog, self.graph, self.keeps, self.shares = catalog, graph, keeps, shares
        self.live = False
        self.lock = threading.Lock()  # a session's slices run one at a time
        # What it holds to touch its nodes: its own lock, and the lock of what it shares
        # with other sessions when it shares something (one slice at a time across them).
        self.turn = _Both(self.lock, sharing.lock) if shares and sharing else self.lock
        self.used = time.monotonic()
        # The work its last slice's nodes left for after the answer (Ctx.afterwards),
        # until it runs; and how that work failed, until a slice is answered with it.
        self.left: list[tuple[str | None, Callable[[], Any]]] = []
        self.failed: Answer | None = None
        # The slices its forms make in its catalog (SliceFormHere.shape): kept with the
        # session, so that what it held goes when it goes, whoever's connection asked.
        self.shapes: dict[tuple, Shape] = {}
        # Whether its owner gave it a random state of its own (``Resident``), and that
        # state while another is in the process's generators.
        self.owns = False
        self.random: Any = None


class Sharing:
    """What the sessions of one host share on purpose, and the lock they share it under.

    Sessions never see each other's nodes unless a node asks to: a node with a
    ``share_on(sharing, nodes, session)`` method is called when its session's catalog is
    installed, puts what it shares in ``table`` under a key of its own (a shared trainer
    of ``somatize.torch``, most often), and answers which nodes of the catalog to put the
    shared ones in place of, or None when it shares nothing this time (a trainer nobody
    asked to share); ``unshare()`` is called when the session is let go. Every slice of
    a session that shares runs holding ``lock``, so what is shared is touched by one
    slice at a time; a node that must wait for the others' slices waits on it (a
    condition), which lets them run meanwhile. A session none of whose nodes share never
    takes it: the slices of unrelated sessions run side by side.
    """

    def __init__(self, patience: float = 30.0, resident: Resident | None = None) -> None:
        self.table: dict[str, Any] = {}
        self.lock = Turns(resident or Resident())
        self.patience = patience  # how long a slice waits for other sessions' (seconds)

    def joined(self, graph: Any, session: bytes) -> tuple[Any, tuple]:
        """``graph`` with what its nodes share put in, and the nodes that share."""
        sharers = [impl for impl in graph.impls.values()
                   if callable(getattr(type(impl), "share_on", None))]
        if not sharers:
            return graph, ()
        swapped: dict[str, Any] = {}
        shares: list[Any] = []
        with self.lock:
            for impl in sharers:
                try:
                    put = impl.share_on(self, graph.impls, session.hex())
                except BaseException:  # all of a catalog shares, or none of it
                    for joined in shares:
                        joined.unshare()
                    raise
                if put is not None:
                    shares.append(impl)
                    swapped.update(put)
        if swapped:
            graph = dataclasses.replace(graph, impls={**graph.impls, **swapped}, memo={})
        return graph, tuple(shares)

    def left(self, shares: tuple) -> None:
        """The nodes of a session let go stop sharing."""
        if shares:
            with self.lock:
                for impl in shares:
                    impl.unshare()

    def sweep(self, now: float, lease: float) -> None:
        """Lets go of what nobody has shared for longer than ``lease`` seconds."""
        with self.lock:
            for key, shared in list(self.table.items()):
                idle = shared.idle_for(now)
                if idle is not None and idle > lease:
                    del self.table[key]
                    say("shared %r let go: nobody trained it for %.0f s (--session-lease %g)",
                        key, idle, lease)

    def trim(self, room: int, most: int) -> None:
        """Keeps at most ``room`` of what no session shares any more, letting the
        longest idle go first: each holds a node and its optimizer's state as a
        session does, so each counts against the host's ``most`` sessions, and goes
        before any session does."""
        with self.lock:
            now = time.monotonic()
            idle = sorted(((shared.idle_for(now), key) for key, shared in self.table.items()
                           if shared.idle_for(now) is not None), reverse=True)
            for seconds, key in idle[:max(0, len(idle) - room)]:
                del self.table[key]
                say("shared %r let go after nobody trained it for %.0f s, to keep within "
                    "%d sessions (--max-sessions)", key, seconds, most)


class Refused(Exception):
    """A request this host turns down, and why, in words for the client."""


class SessionsHere:
    """Every client session this host holds (a ``SessionHere`` each): a catalog
    apiece, side by side.

    A session is named by its owner (a Trainer, a graph run through a broker) with a
    random id, so two clients never see or replace each other's nodes, whatever bytes
    their catalogs pickle to. Within a session that holds state and has run, another
    catalog is refused: swallowing it would take every trainer's weights and optimizer
    with it. At most ``most`` sessions are held, and one idle past ``lease`` seconds
    is let go; a session let go is remembered as gone, with the reason, so its owner
    is told rather than handed a fresh copy of what it had."""

    def __init__(self, most: int = 64, lease: float = 86400.0, routine: Any = None,
                 patience: float = 30.0):
        self.most, self.lease = most, lease
        self._routine = say.routine if routine is None else routine  # the everyday lines
        self._held: collections.OrderedDict[bytes, SessionHere] = collections.OrderedDict()
        self._gone: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.resident = Resident()  # whose random state the process's generators hold
        self.sharing = Sharing(patience, self.resident)
        self._leaving: list[tuple] = []  # what sessions forgotten under the lock shared
        # Every slice looks its session up, and a look at every session held for one
        # idle past the lease is a walk over all of them: it is taken at most every
        # tenth of a lease (a second at most), which lets a session go that late at most.
        self._expiry_every = min(1.0, lease / 10)
        self._expires_next = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, session: object) -> bool:
        with self._lock:
            return session in self._held

    def lookup(self, session: bytes) -> tuple[SessionHere | None, str | None]:
        """The session as held here, marked as just used; else None and why it is gone
        (None: never held here)."""
        with self._lock:
            now = time.monotonic()
            if now >= self._expires_next:
                self._expire(now)
                self._expires_next = now + self._expiry_every
            held = self._held.get(session)
            if held is not None:
                held.used = now
                self._held.move_to_end(session)
            gone = None if held is not None else self._gone.get(session)
        if self._leaving:
            self._let_go()
        return held, gone

    def admits(self, session: bytes, ident: str) -> None:
        """Refuses a catalog this session may not take (see the class); checked before
        the catalog is unpickled, and again when it is installed."""
        with self._lock:
            held = self._held.get(session)
            if held is not None and held.catalog != ident and held.keeps and held.live:
                raise Refused(
                    f"session {session.hex()[:12]} holds catalog {short(held.catalog)} "
                    f"({_held_nodes(held.graph)}), whose trainers have learnt here, and was "
                    f"sent catalog {short(ident)}; a session keeps one catalog once it has "
                    "state: start a new one (a new Trainer), or resume from a checkpoint")

    def install(self, session: bytes, ident: str, graph: Any, keeps: bool) -> None:
        """Holds this catalog for the session from now on; the same one again changes
        nothing, so its nodes' live state survives being provisioned twice."""
        self.admits(session, ident)
        with self._lock:
            held = self._held.get(session)
            if held is not None and held.catalog == ident:
                held.keeps = held.keeps or keeps
                return
        self.sharing.sweep(time.monotonic(), self.lease)
        try:  # before it is held: a node refused there leaves everything as it was
            graph, shares = self.sharing.joined(graph, session)
        except SomaError as exc:
            raise Refused(f"{exc} (session {session.hex()[:12]})") from exc
        try:
            with self._lock:
                now = time.monotonic()
                self._expire(now)
                held = self._held.get(session)
                if held is None and len(self._held) >= self.most:
                    try:
                        self._make_room(now)
                    except Refused:
                        self._leaving.append(shares)
                        raise
                fresh = self._held[session] = SessionHere(ident, graph, keeps, shares, self.sharing)
                if held is not None and held.owns and held.random is not None:
                    fresh.owns, fresh.random = True, held.random  # the session's, not the catalog's
                self._held.move_to_end(session)
                self._gone.pop(session, None)
                count = len(self._held)
                if held is not None:
                    self._leaving.append(held.shares)
        finally:
            self._let_go()
        verb = "replaces its catalog with" if held is not None else "holds"
        self._routine("session %s %s catalog %s: %s (%d session%s held)", session.hex()[:12], verb,
                    short(ident), _held_nodes(graph), count, "" if count == 1 else "s")

    def end(self, session: bytes) -> bool:
        """Lets go of a session its owner closed; whether it was held."""
        with self._lock:
            held = self._held.pop(session, None)
            if held is not None:
                self._forget(session, "its owner closed it", held)
        self._let_go()
        if held is not None:
            self._routine("session %s closed by its owner", session.hex()[:12])
        return held is not None

    def _expire(self, now: float) -> None:
        """Lets go of the sessions idle past the lease (under the lock)."""
        for session, held in list(self._held.items()):
            idle = now - held.used
            if idle > self.lease and not held.lock.locked():
                del self._held[session]
                self._forget(session, f"it was idle for {idle:.0f} s, past this worker's "
                                      f"lease of {self.lease:g} s (--session-lease)", held)
                say("session %s let go: idle for %.0f s (--session-lease %g)", session.hex()[:12],
                    idle, self.lease)

    def _make_room(self, now: float) -> None:
        """Lets go of one session for a new one: the least recently used of those not
        running, one that keeps no state first (under the lock)."""
        idle = [(s, t) for s, t in self._held.items() if not t.lock.locked()]
        if not idle:
            raise Refused(f"this worker holds its most sessions ({self.most}), all of them "
                          "running; try again later, or start it with a larger --max-sessions")
        session, held = next(((s, t) for s, t in idle if not t.keeps), idle[0])
        del self._held[session]
        self._forget(session, f"this worker holds at most {self.most} sessions "
                              "(--max-sessions) and needed room for a newer one after it "
                              f"was idle {now - held.used:.0f} s", held)
        say("session %s let go to make room (at most %d: --max-sessions)", session.hex()[:12],
            self.most)

    def _forget(self, session: bytes, why: str, held: SessionHere) -> None:
        """Remembers why a session went (under the lock), and what it shared, for
        ``_let_go``."""
        self._gone[session] = why
        while len(self._gone) > _GONE:
            self._gone.popitem(last=False)
        if held.shares:
            self._leaving.append(held.shares)

    def _let_go(self) -> None:
        """What the sessions just forgotten shared stops being shared, and what nobody
        shares any more is kept within the room the sessions leave; called with the
        sessions' lock released, as the sharing lock is taken after it, never before.
        The list is taken whole under the lock, since several connections' threads
        may let go at once."""
        with self._lock:
            leaving, self._leaving = self._leaving, []
            room = self.most - len(self._held)
        for shares in leaving:
            self.sharing.left(shares)
        if self.sharing.table:
            self.sharing.trim(room, self.most)


def _held_nodes(graph: Any) -> str:
    """The user's ids of the nodes a catalog holds (a trainer's made ids as its node's)."""
    held = dict.fromkeys(made_from(n) for n, impl in graph.impls.items()
                         if type(impl).__name__ != "Elsewhere")
    return ", ".join(held) or "no nodes"


def provisioned(ident: Any, kind: Any, runtime: Any, blobs: list[Any]) -> Any:
    """The graph a catalog's bytes make, checked against the id it was sent under.

    A request that is not a catalog of ours is a ProtocolError; whatever building it
    raises (an import that fails, most often) is raised as it is, for
    :func:`refused_catalog` to answer."""
    if len(blobs) != 1 or type(ident) is not str or type(kind) is not str:
        raise ProtocolError("a provision frame without exactly one blob, an id and a kind")
    blob = blobs[0]
    blob_id = "sha256:" + hashlib.sha256(blob).hexdigest()
    if catalog_id(kind, blob_id, runtime) != ident:
        raise ProtocolError("a catalog whose bytes do not match its id")
    return build(kind, blob, runtime)


def refused_catalog(exc: Exception) -> tuple[dict[str, Any], str]:
    """The error header for a catalog that cannot be loaded here, and its traceback."""
    module = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    text = traceback_text(exc)
    return {"e": "catalog", "m": f"{type(exc).__name__}: {exc}", "module": module, "tb": text}, text


_STR = frozenset((str,))  # what every name in a slice's header is


class SliceFormHere:
    """What a slice request says that is the same every time it is sent (the client's
    ``transport.SliceForm``), read and checked: its session, nodes, the outputs wanted,
    and whether it walks its nodes back. A connection keeps the forms it was told, so a
    request that names one is not read and checked again, and the slice it makes in a
    session's catalog is made once (``shape``)."""

    __slots__ = ("key", "nodes", "session", "transposed", "wanted")

    def __init__(self, session: bytes, nodes: list[str], wanted: list[str], transposed: bool):
        self.session, self.nodes, self.wanted = session, nodes, wanted
        self.transposed = transposed
        self.key = (tuple(nodes), tuple(wanted), transposed)

    def shape(self, held: SessionHere, given: tuple[str, ...]) -> Shape:
        """The slice this form is in ``held``'s catalog handed values for ``given``:
        made once, and kept with that session (a session holds a few forms; one that sends
        ever new ones has the oldest forgotten)."""
        key = (self.key, given)
        found = held.shapes.get(key)
        if found is None:
            if len(held.shapes) >= 64:
                held.shapes.clear()
            nodes, wanted, transposed = self.key
            found = held.shapes[key] = Shape("", held.graph, nodes, given, wanted=wanted,
                                               transposed=transposed)
        return found


def slice_form_here(head: Any) -> SliceFormHere:
    """The form a request header says in full; anything malformed is a ProtocolError."""
    nodes, wanted, session = head.get("n"), head.get("w"), head.get("s")
    if (type(nodes) is not list or type(wanted) is not list or type(session) is not bytes
            or not _STR.issuperset(map(type, nodes + wanted))):
        raise ProtocolError("a slice frame without its session, nodes or outputs")
    return SliceFormHere(session, nodes, wanted, bool(head.get("t")))


def answer(sessions: SessionsHere, head: Any, buffers: list[Any], holding: Holding,
           form: SliceFormHere | None = None, defers: bool = False, stays: bool = True) -> Answer:
    """Runs the slice a request header describes, here, against the catalog of the
    session it names (``s``): ``"need"`` when this host holds no such session, with
    why it is gone (``gone``) where it once held it. ``form`` is what the header would
    say in full, where the transport read it from an earlier request.

    A transport that ``defers`` promises to call the answer's ``afterwards`` once its reply
    has gone: the work the slice's nodes left for afterwards (``Ctx.afterwards``) waits
    until then. Otherwise that work runs inside the slice, as the nodes ask for it.
    The slice draws from its session's random state (``Resident``); ``stays=False``
    puts the process's own back after it (a host in the client's own process).

    A request that is not a slice of ours raises ProtocolError (the transport drops
    whoever sent it); anything the slice itself raises is answered as an error."""
    if form is None:
        form = slice_form_here(head)
    transposed = form.transposed
    forward = head.get("f")
    if type(forward) is not bytes:
        raise ProtocolError("a slice frame without its forward")
    held, gone = sessions.lookup(form.session)
    if held is None:
        return Answer("need", {"gone": gone} if gone else {}, [])
    if forward != holding.forward:  # what stayed for an earlier forward is nobody's now
        holding.forward = forward
        if holding.held:
            holding.held = {}
    try:
        values = unpack_values(head.get("v", {}), buffers)
    except SomaError as exc:
        return failed(exc, [])
    given = values.get("g", {}) if type(values) is dict else None
    refs = head.get("r")
    if type(given) is not dict or refs is not None and (
            type(refs) is not list or not _STR.issuperset(map(type, refs))):
        raise ProtocolError("a slice whose values or references are malformed")
    # Values arrive unwrapped, as the walk holds them; Opaque lets them in as they
    # are. A walk back hands what it is given to its nodes untouched.
    if not transposed:
        given = {node: Opaque(value) for node, value in given.items()}
    for ref in refs or ():
        if ref not in holding.held:
            return Answer("error", {"e": "Lost", "node": ref, "m": (
                f"the output of node {ref!r} is no longer here: the worker kept it for one "
                "forward, and it restarted or another forward began since")}, [])
        given[ref] = holding.held[ref] if transposed else Opaque(holding.held[ref])
    # its slices one at a time, what it shares one slice at a time, its own random state
    with held.turn, sessions.resident.within(held, stays):
        if held.left:  # what the last answer left, if nobody ran it yet
            _run_left(held)
        if held.failed is not None:  # said once, in place of this slice
            failure, held.failed = held.failed, None
            return failure
        piece = Slice(form.shape(held, tuple(given)), given, Opaque(values.get("i")),
                      bool(head.get("x")))
        held.live = True
        if not defers:
            return _run(piece, holding)
        left = afterwards_held_here()
        reply = _run(piece, holding)
        if not left:
            return reply
        held.left = left.copy()
        left.clear()
    return Answer(reply.kind, reply.header, reply.buffers, reply.said, reply.text,
                  functools.partial(run_afterwards, held, sessions.resident))


class _Both:
    """Two locks as one: taken in order, let go in reverse."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any):
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.acquire()  # a connection's thread: no signal interrupts a wait here
        self.second.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.second.release()
        self.first.release()


def run_afterwards(held: SessionHere, resident: Resident) -> None:
    """Runs, in the session's turn, the work its last answer left (unless a slice of it
    came first and ran it): a transport calls this once that answer has gone."""
    with held.turn, resident.within(held):
        _run_left(held)


def control(sessions: SessionsHere, head: Any, buffers: list[Any], stays: bool = True) -> Answer:
    """Answers a verb for the session a request header names (``s``): ``c`` the verb,
    ``v`` its arguments as packed values. ``"need"`` (with why it is gone, where it
    was held) when this host holds no such session: a verb never opens a session, nor
    lets one go to make room. ``end`` lets the session go; any other verb is answered
    by its handler (``_verbs.VERBS``) with the session's nodes, in the session's turn
    and within its random state, as its slices run (``stays`` as in ``answer``).

    A request that is not a verb of ours raises ProtocolError; whatever the handler
    raises is answered as an error, with its traceback."""
    session, name = head.get("s") if type(head) is dict else None, head.get("c")
    if type(session) is not bytes or type(name) is not str:
        raise ProtocolError("a control frame without its session or its verb")
    if name == END:
        return Answer("done", {"v": pack_values({"a": sessions.end(session)}, [])[0]}, [])
    held, gone = sessions.lookup(session)
    if held is None:
        return Answer("need", {"gone": gone} if gone else {}, [])
    handler = VERBS.get(name)
    if handler is None and _imported(head.get("m")):
        handler = VERBS.get(name)
    if handler is None:
        return failed(NameError(
            f"this host answers no verb {name!r} (it answers {sorted(VERBS) + [END]}); the "
            "module that registers it is not imported here: import it on the worker "
            "(somatize.torch registers its own)"), [])
    try:
        args = unpack_values(head.get("v", {}), buffers)
        args = args.get("a") if type(args) is dict else None
    except SomaError as exc:
        return failed(exc, [])
    seeds = name in SEEDING
    with held.turn, sessions.resident.within(held, stays, alone=seeds):
        if held.left:  # what the last slice left runs before anything reads its state
            _run_left(held)
        try:
            said = handler(held.graph.impls, args)
        except Exception as exc:  # the one boundary where a verb's failure is translated
            return failed(exc, [], f"verb {name!r} failed: {exc}")
        if seeds:  # what it set is the session's own from now on
            sessions.resident.owned(held)
        back: list[Any] = []
        try:
            trees, refused = pack_values({"a": said}, back)
        except Exception as exc:
            return failed(exc, [], f"verb {name!r}: its answer could not be packed: {exc}")
    if refused:
        return failed(ProtocolError(f"verb {name!r} answered what cannot travel: "
                                    f"{refused['a']}"), [])
    return Answer("done", {"v": trees}, back)


def _run_left(held: SessionHere) -> None:
    """Runs the work left for after an answer, in order, each node's whatever another's
    did; the first failure is what the session's next slice is answered with."""
    left, held.left = held.left, []
    for node, work in left:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001  (a node's exit is not this host's)
            if held.failed is not None:  # one said already; this one is in the log
                say.block(f"node {node!r}: the work it left for after its answer failed "
                          f"too: {exc}", traceback_text(exc))
                continue
            serves = ("" if isinstance(exc, Exception) else
                      "; a worker does not stop for a node's "
                      f"{type(exc).__name__} (it serves on)")
            error = NodeError(
                f"node {node!r} left work for after its answer (Ctx.afterwards), and it "
                f"raised {type(exc).__name__}: {exc}{serves}; the slice after it did not "
                "run, since the node's state is what that work left; fix the work, or do "
                "it in forward", node=str(node), kind=type(exc).__name__)
            error.__cause__ = exc
            held.failed = failed(error, [], f"node {node!r}: the work it left for after its "
                                              f"answer failed: {exc}")
            say.block(held.failed.said, held.failed.text)


def _run(piece: Slice, holding: Holding) -> Answer:
    facts: list[dict] = []
    began = time.perf_counter()
    try:
        out = run_slice(piece.shape.data, piece, facts)
    except Exception as exc:  # the one boundary where a slice's failure is translated
        return failed(exc, facts, f"slice {user_ids(piece.shape.nodes)} failed after "
                                  f"{(time.perf_counter() - began) * 1e3:.1f} ms: {exc}")
    except (KeyboardInterrupt, SystemExit) as exc:  # a node's, not this worker's to obey
        named = user_ids(piece.shape.nodes)
        node, kind = getattr(exc, "soma_node", named[0]), type(exc).__name__
        error = NodeError(
            f"node {node!r} raised {kind}({exc}) on the worker; a worker does not stop for a "
            f"node's {kind} (it serves on): raise an ordinary exception to fail a slice",
            node=node, kind=kind)
        error.__cause__ = exc
        return failed(error, facts, f"slice {named}: node {node!r} raised {kind}; serving on")
    buffers: list[Any] = []
    try:
        trees, refused = pack_values(out, buffers)
    except Exception as exc:  # a codec that failed otherwise than by refusing
        return failed(exc, facts, f"slice {user_ids(piece.shape.nodes)} ran, and its outputs "
                                  f"could not be packed: {exc}")
    for node in refused:
        holding.held[node] = out[node]
    header: dict[str, Any] = {"v": trees}
    if refused:
        header["l"] = refused
    if piece.watching:
        header["x"] = sendable(facts)
    return Answer("done", header, buffers)


def failed(exc: BaseException, facts: list[dict], said: str | None = None) -> Answer:
    """The answer saying what went wrong, the host's traceback included; ``said`` is
    the log's line for it, which the traceback follows there too."""
    header: dict[str, Any] = {"e": type(exc).__name__, "m": str(exc), "x": sendable(facts)}
    if isinstance(exc, NodeError):
        header["node"], header["kind"] = exc.node, exc.kind
        if exc.__cause__ is not None:
            header["cause"] = str(exc.__cause__)
    header["tb"] = text = traceback_text(exc)
    return Answer("error", header, [], said, text)


def traceback_text(exc: BaseException) -> str:
    """The traceback of what went wrong here, as text: the node's own exception when
    the walk wrapped one (everything chained to it included), or else ``exc``'s."""
    cause = exc.__cause__ if isinstance(exc, NodeError) and exc.__cause__ is not None else exc
    text = "".join(traceback.format_exception(cause))
    if len(text) > _TRACEBACK:  # its start says where, its end what: keep both
        head, tail = _TRACEBACK // 4, _TRACEBACK - _TRACEBACK // 4
        text = (f"{text[:head]}\n... ({len(text) - head - tail} characters of the traceback "
                f"left out) ...\n{text[-tail:]}")
    return text


def sendable(facts: list[dict]) -> list[dict]:
    """The host's facts the client has not said itself, as data msgpack carries."""
    out = []
    for fact in facts:
        if fact.get("fact") in _BRACKET:
            continue
        buffers: list[Any] = []
        trees, refused = pack_values(fact, buffers)
        if not buffers and not refused:
            out.append(trees)
    return out


def _imported(module: Any) -> bool:
    """Imports the module the client says registers a verb (one of somatize's own, and
    only those), for a host whose catalog never did; whether it could."""
    if type(module) is not str or not module.startswith("somatize.") or module in sys.modules:
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
