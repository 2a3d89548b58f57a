"""The seam every transport fills: what a request is, how its answer is read, and the
two small classes a transport subclasses.

A transport is a ``Place`` (how a host is declared: how its nodes are packed, where it
is, what its link is) and a ``Link`` (the client's end: ``submit`` a ``Request`` and get
a ``Pending`` whose ``result()`` is the ``Outcome``). Everything the transports share is
here once: the request and its header, the catalog a session stages, what the client
knows of each session it holds somewhere (``SessionThere``), reading an answer into an
Outcome or the error it stands for, and ``StateLost``'s words. The host's side is
``host.answer``, which every transport's host calls. The socket (``client``,
``connection``), Ray (``somatize.ray``) and this process (``inprocess``) are one link
each, side by side; ``docs/concepts.md`` says how to add one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _errors
from .._errors import (DeclarationError, Lost, NodeError, ProtocolError, StateLost,
                       UnwritableError, WireError)
from .._graph import user_ids
from .._slices import Outcome
from .._verbs import VERBS
from .catalog import MODES, pack_nodes, pack_values, unpack_values
from .protocol import Limits

__all__ = ["FORMS", "Link", "Pending", "Place", "RemoteTraceback", "Request", "SessionThere",
           "SliceForm", "Staged", "catalog_refused", "checked_deadline", "checked_mode",
           "checked_timeout", "outcome_of", "state_lost", "verb_answered", "verb_request"]


# -- what a client sends ------------------------------------------------------------------
@dataclass(frozen=True)
class Staged:
    """A catalog waiting to be sent, if and when the far side asks for it; ``nodes``
    are the user's ids of what it holds, to name them when its state is lost."""

    ident: str
    kind: str
    blob_id: str
    blob: bytes
    runtime: dict[str, Any]
    nodes: tuple[str, ...] = ()


@dataclass(eq=False)
class SessionThere:
    """One client session on one host, as this client knows it: a ``broker.Session``
    is one per owner, across its hosts, and holds one of these for each; the host
    holds the same session as a ``host.SessionHere``. Its id, whether its
    owner keeps state there (a Trainer's trainers) and shares it with other clients
    (a shared trainer, whose slices wait there for theirs), the catalog staged for it, and
    what the host was last known to hold for it (which catalog, in which process, and
    whether a slice has run there since)."""

    session: bytes
    keeps: bool = False
    staged: Staged | None = None
    shares: bool = False  # its slices may wait there for other clients' (a shared trainer)
    declared: str | None = None
    instance: str | None = None
    live: bool = False

    def declared_in(self, instance: str | None) -> bool:
        """Whether the host process ``instance`` holds this session's staged catalog."""
        return (self.staged is None or
                (self.declared == self.staged.ident and self.instance == instance))

    @property
    def learnt(self) -> bool:
        """Whether the host holds something of this session's that its first copy
        cannot make again: it keeps state, and a slice has run there."""
        return self.keeps and self.live

    def lost_in(self, instance: str | None) -> bool:
        """Whether what this session learnt is gone: the host is another process than
        the one that held it."""
        return self.learnt and self.instance not in (None, instance)


#: How many forms one connection names by number (its worker keeps each for the
#: connection's life); past that, a request says its form in full every time.
FORMS = 1024


@dataclass(eq=False)  # one per session and shape: two alike are still two forms
class SliceForm:
    """What a slice's request says that is the same every time its shape is sent:
    which session, host and nodes, what is wanted back, whether it walks its nodes
    back. Made once per session and shape; a link may say it to its host once per
    connection and name it after that (``header``), noting in ``said`` which of its
    connections that was and the number the form goes by there. ``named`` are its
    nodes as the user knows them (a trainer's made positions are its node): what a
    message about the slice says. A host reads it into a ``host.SliceFormHere``."""

    there: SessionThere
    host: str
    nodes: list[str]
    wanted: list[str]
    transposed: bool = False
    said: tuple[int, int] | None = None
    named: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.named = user_ids(self.nodes)

    def header(self) -> dict[str, Any]:
        """These fields as a request header says them; what is off is left out."""
        header: dict[str, Any] = {"n": self.nodes, "w": self.wanted, "s": self.there.session}
        if self.transposed:
            header["t"] = True
        return header


@dataclass(slots=True)
class Request:
    """One slice to send, whichever transport carries it: its ``SliceForm`` (session, host,
    nodes, what is wanted back, whether it walks back), the values' trees and buffers,
    what stayed there that it reads (``refs``), whether it is watched, and which
    forward it is part of."""

    form: SliceForm
    tree: Any
    buffers: list[Any]
    refs: list[str]
    watching: bool
    forward: str | None

    @property
    def there(self) -> SessionThere:
        return self.form.there

    @property
    def host(self) -> str:
        return self.form.host

    @property
    def nodes(self) -> list[str]:
        """The slice's nodes as the user knows them, for what is said about it."""
        return self.form.named

    def header(self, form: dict[str, Any] | None = None) -> dict[str, Any]:
        """The slice's request header: the form's fields (or ``form``, what stands for
        them: a link's name for a form it said before) and this call's; what is off is
        left out, so the common request stays small."""
        header = self.form.header() if form is None else form
        header["f"] = bytes.fromhex(self.forward) if self.forward else bytes(16)
        header["v"] = self.tree
        if self.refs:
            header["r"] = self.refs
        if self.watching:
            header["x"] = True
        return header


# -- the two classes a transport subclasses ---------------------------------------------------
class Pending:
    """A slice handed to a link and not read back yet: ``result()`` answers its Outcome,
    or raises what went wrong, naming the host and (``nodes``, as the user knows them)
    the slice. A link answers it by setting ``outcome`` or ``error`` and ``answered``;
    ``Link.read_reply`` is how it reads the answer of one it has not."""

    __slots__ = ("error", "host", "link", "nodes", "outcome", "sent", "answered", "there",
                 "took_sent", "watching")

    def __init__(self, link: Link, request: Request):
        form = request.form
        self.link, self.host, self.nodes, self.there = link, form.host, form.named, form.there
        self.watching = request.watching
        self.answered = False
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self.sent = self.took_sent = 0

    def done(self) -> bool:
        return self.answered

    def result(self) -> Outcome:
        if not self.answered:
            self.link.read_reply(self)
        if self.error is not None:
            raise self.error
        return self.outcome


class Link:
    """The client's end of one transport to one host: the interface the Broker uses.

    ``submit`` sends a request now and answers a ``Pending``; ``run`` is one round
    trip. ``ordered`` says that a host runs one caller's requests in the order they
    were submitted, which lets a wave and a pipeline send ahead. ``end`` tells the host
    a session is over, ``close`` lets the transport go. ``instance`` names the host
    process the link reaches, so a session can tell that it restarted. ``traffic``
    says the bytes that crossed, where the transport counts them."""

    ordered = True
    instance: str | None = None

    def traffic(self) -> dict[str, int] | None:
        """``{"sent": bytes, "received": bytes}`` over the link's life, or None where
        this transport does not count what it carries."""
        return None

    def submit(self, request: Request) -> Pending:
        raise NotImplementedError(f"{type(self).__qualname__} does not say how it sends a slice")

    def read_reply(self, pending: Pending) -> None:
        """Reads the answer of a pending slice (a link that answers at once never needs to)."""
        raise NotImplementedError(f"{type(self).__qualname__} left a slice unanswered")

    def run(self, request: Request) -> Outcome:
        return self.submit(request).result()

    def control(self, there: SessionThere, verb: str, args: Any = None, *, host: str = "") -> Any:
        """Asks the host a verb for a session (``_verbs``: a trainer's weights or state,
        the session's random state, ...) and answers what its handler answered, or
        raises what it raised, naming the host. The host's answer to a session it does
        not hold is read as a slice's is: the catalog given again where the session
        never learnt there, ``StateLost`` where it did; a verb opens no other session.
        ``host`` names the host in what is said."""
        raise NotImplementedError(f"{type(self).__qualname__} does not say how it asks a verb")

    def end(self, there: SessionThere) -> None:
        return None

    def close(self) -> None:
        return None


class Place:
    """Where a host is, for one transport: a declaration, which opens nothing.

    ``mode="project"`` sends nodes by reference (the host imports their code);
    ``"network"`` sends the code as well, and ``send=["my_package"]`` makes those
    modules travel by value. ``timeout`` bounds a silence, ``deadline`` (off by
    default) each call in all. A subclass sets ``_link`` and ``_wire``, and says
    ``where`` a host is in words."""

    _link: Link
    _wire: bytes

    def __init__(self, mode: str = "project", send: Sequence[str] = (), *,
                 timeout: float | None = None, deadline: float | None = None,
                 limits: Limits | None = None):
        self.mode, self.send = checked_mode(mode, send)
        self.timeout = checked_timeout(timeout)
        self.deadline = checked_deadline(deadline)
        self.limits = limits or Limits()

    @property
    def link(self) -> Link:
        """The client's end of this place's transport, which every slice for it uses."""
        return self._link

    def link_for(self, there: SessionThere) -> Link:
        """The link a session's slices go over: the place's own, unless the transport
        must carry a session whose slices wait there for other clients' (``shares``)
        apart from the rest, lest another session's request queue behind one that is
        waiting for it."""
        return self._link

    def end(self, there: SessionThere) -> None:
        """Tells the host the session's owner is done with it (see ``Link.end``)."""
        self.link_for(there).end(there)

    def control(self, there: SessionThere, verb: str, args: Any = None, *, host: str = "") -> Any:
        """Asks the host a verb for a session (see ``Link.control``)."""
        return self.link_for(there).control(there, verb, args, host=host)

    def traffic(self) -> dict[str, int] | None:
        """What every link of this place carried over its life (``Link.traffic``), or
        None where the transport does not count it."""
        return self._link.traffic()

    @property
    def wire(self) -> bytes:
        """What names this place's wire: two places that are one host share it."""
        return self._wire

    def where(self, host: str) -> str:
        """Where the host is, in words, for messages."""
        return type(self).__qualname__

    def packed(self, nodes: dict[str, Any]) -> tuple[str, str, bytes]:
        """These nodes the way this place wants them: ``(kind, id, bytes)``."""
        if not isinstance(nodes, dict):
            raise TypeError(f"packed takes {{node_id: node}}, not a {type(nodes).__qualname__}")
        return pack_nodes(nodes, self.mode, self.send)

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__qualname__} holds a connection or a process and "
                        "cannot be pickled; declare it where it is used")


# -- what a declaration is checked for ----------------------------------------------------
def checked_mode(mode: Any, send: Any) -> tuple[str, tuple[str, ...]]:
    """``(mode, send)`` as a place holds them, or the DeclarationError saying what is wrong."""
    if mode not in MODES:
        raise DeclarationError(f"a worker's mode is 'project' or 'network', not {mode!r}")
    if isinstance(send, str) or not all(isinstance(m, str) and m for m in send):
        raise DeclarationError(f"send is a list of module names, e.g. ['my_package'], not {send!r}")
    if send and mode != "network":
        raise DeclarationError(
            f"send={list(send)!r} only means something with mode='network', where code "
            "travels; in mode='project' the worker imports it from its own installation")
    return mode, tuple(send)


def checked_timeout(timeout: Any) -> float:
    """A silence's bound in seconds: given, or ``SOMATIZE_TIMEOUT``, or 30."""
    if timeout is None:
        said = os.environ.get("SOMATIZE_TIMEOUT")
        if not said:
            return 30.0
        try:
            timeout = float(said)
        except ValueError:
            raise DeclarationError(f"SOMATIZE_TIMEOUT={said!r} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise DeclarationError(f"a worker's timeout is a positive number of seconds, not {timeout!r}")
    return float(timeout)


def checked_deadline(deadline: Any) -> float | None:
    """A per-call deadline in seconds, or None for none (the default: a slice may
    compute for hours while the worker says it is alive)."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0:
        raise DeclarationError(f"a worker's deadline is a positive number of seconds (or None "
                               f"for none), not {deadline!r}")
    return float(deadline)


# -- reading an answer ----------------------------------------------------------------------
class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, as the text it printed there.

    It is the ``__cause__`` of the error raised here (or of that error's own cause), so
    printing the error's traceback shows the worker's frames above it, the way
    ``concurrent.futures`` shows a child process's.
    """

    def __init__(self, text: str, host: str):
        super().__init__(text)
        self.text, self.host = text, host

    def __reduce__(self) -> tuple[Any, ...]:  # pickle's default gives the text alone
        return RemoteTraceback, (self.text, self.host)

    def __str__(self) -> str:
        return f"on host {self.host!r}:\n{self.text.rstrip()}"


# What a host's refusal is called there, and what it becomes here.
_PLAIN = {name: getattr(_errors, name) for name in (
    "EdgeError", "DeclarationError", "UnwritableError", "CacheError", "OutOfStep", "NoGradient")}


def outcome_of(host: str, nodes: list[str], kind: str, head: dict[str, Any], buffers: list[Any],
               *, sent: int = 0, took_sent: int = 0, size: int = 0, took_us: int = 0,
               watching: bool = False) -> Outcome:
    """The Outcome a ``done`` answer stands for, or the error an ``error`` answer does
    (raised), with the host's facts between the client's ``sent`` and ``received``."""
    facts = []
    if watching:
        facts.append({"fact": "sent", "host": host, "bytes": sent, "took_us": took_sent})
        facts.extend(_facts(head, host))
        facts.append({"fact": "received", "host": host, "bytes": size, "took_us": took_us})
    if kind == "error":
        raise refusal(host, nodes, head, facts)
    if kind != "done":
        raise ProtocolError(f"host {host!r} answered a slice with {kind!r}", host=host)
    try:
        values = unpack_values(head.get("v", {}), buffers)
    except UnwritableError as exc:
        raise UnwritableError(f"host {host!r} answered slice {nodes} with {exc}") from None
    except (ProtocolError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"host {host!r} answered slice {nodes} with malformed values "
                            f"({exc})", host=host) from None
    lost = head.get("l") or {}
    if type(values) is not dict or type(lost) is not dict:
        raise ProtocolError(f"host {host!r} answered with malformed values", host=host)
    return Outcome(values, lost, facts)


def _facts(head: dict[str, Any], host: str) -> list[dict]:
    facts = []
    for fact in head.get("x") or []:
        if type(fact) is dict:
            fact = unpack_values(fact, [])
            fact["host"] = host
            facts.append(fact)
    return facts


def refusal(host: str, nodes: list[str], head: dict[str, Any], facts: list[dict]) -> Exception:
    """The error a host's ``error`` answer to a slice stands for, naming the host, with
    the host's traceback as its cause."""
    what, message = head.get("e"), str(head.get("m", ""))
    remote = RemoteTraceback(str(head["tb"]), host) if head.get("tb") else None
    if what == "NodeError":
        kind = str(head.get("kind", ""))
        exc: Exception = NodeError(f"{message} on host {host!r}", node=str(head.get("node")),
                                   host=host, kind=kind)
        if kind in _PLAIN:  # one of ours (OutOfStep, say): the same cause as here
            exc.__cause__ = _PLAIN[kind](f"{head.get('cause', message)} (on host {host!r})")
            exc.__cause__.__cause__ = remote
        else:
            exc.__cause__ = remote
        exc.facts = facts  # type: ignore[attr-defined]
        return exc
    if what == "Lost":
        exc = Lost(f"{message} (host {host!r})", node=str(head.get("node")), host=host)
    elif what in _PLAIN:
        exc = _PLAIN[what](f"{message} (on host {host!r})")
    else:
        exc = WireError(f"host {host!r} could not run slice {nodes}: {what}: {message}", host=host)
    exc.__cause__ = remote
    exc.facts = facts  # type: ignore[attr-defined]
    return exc


def verb_request(there: SessionThere, verb: str, args: Any) -> tuple[dict[str, Any], list[Any]]:
    """A verb's request header and buffers: the session, the verb, its arguments packed
    as a slice's values are."""
    buffers: list[Any] = []
    trees, refused = pack_values({"a": args}, buffers)
    if refused:
        raise UnwritableError(f"the arguments of verb {verb!r} cannot travel: {refused['a']}")
    head = {"s": there.session, "c": verb, "v": trees}
    # Where the verb's handler is registered here, so that a host whose catalog never
    # imported it (a worker that has only run plain nodes) can import it there.
    module = getattr(VERBS.get(verb), "__module__", None)
    if type(module) is str and module.startswith("somatize."):
        head["m"] = module
    return head, buffers


# What a verb's handler may raise that is raised here as it was (with the host said).
_VERB_PLAIN = {**_PLAIN, "TypeError": TypeError, "ValueError": ValueError}


def verb_answered(host: str, verb: str, kind: str, head: dict[str, Any],
                  buffers: list[Any]) -> Any:
    """What a host's ``done`` answer to a verb holds, or the error its ``error`` answer
    stands for (raised, naming the host, with the host's traceback as its cause)."""
    if kind == "error":
        what, message = head.get("e"), str(head.get("m", ""))
        made = _VERB_PLAIN.get(what)
        exc: Exception = (made(f"{message} (on host {host!r})") if made is not None else
                          WireError(f"host {host!r} could not answer verb {verb!r}: {what}: "
                                    f"{message}", host=host))
        if head.get("tb"):
            exc.__cause__ = RemoteTraceback(str(head["tb"]), host)
        raise exc
    if kind != "done":
        raise ProtocolError(f"host {host!r} answered verb {verb!r} with {kind!r}", host=host)
    try:
        values = unpack_values(head.get("v", {}), buffers)
    except (ProtocolError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"host {host!r} answered verb {verb!r} with malformed values "
                            f"({exc})", host=host) from None
    if type(values) is not dict:
        raise ProtocolError(f"host {host!r} answered verb {verb!r} with malformed values",
                            host=host)
    return values.get("a")


def catalog_refused(host: str, where: str, head: dict[str, Any]) -> Exception:
    """The error a host's refusal of a catalog stands for: another session's rule, or
    a catalog it cannot load (a module it lacks, most often, with both ways out)."""
    if head.get("e") == "session":
        return DeclarationError(f"host {host!r} ({where}) refused the catalog: {head.get('m')}")
    module = head.get("module")
    hint = ""
    if module:
        hint = (f"; in mode='project' the worker imports module {module!r} from its own "
                "installation: install it there (or put it on its PYTHONPATH), or use "
                f"mode='network', send=[{module!r}] so the code travels")
    refused = WireError(f"host {host!r} cannot load the catalog it was sent: "
                        f"{head.get('m')}{hint}", host=host)
    if head.get("tb"):
        refused.__cause__ = RemoteTraceback(str(head["tb"]), host)
    return refused


def state_lost(host: str, where: str, there: SessionThere, why: str) -> StateLost:
    """The error for a session whose state on a host is gone, naming what was there."""
    nodes = there.staged.nodes if there.staged is not None else ()
    held = ", ".join(map(repr, nodes)) or "its nodes"
    return StateLost(
        f"host {host!r} ({where}) no longer holds what {held} learnt there: {why}. Their "
        "weights, optimizer state and open groups lived only there, and this client will "
        "not start them again from its own first copy; resume from a checkpoint "
        "(Trainer.resume(store, name)), which starts the session afresh and restores them",
        host=host, nodes=list(nodes))
