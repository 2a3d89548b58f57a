"""Whose random state a host process's generators hold: each session's own, in turn.

torch, Python's ``random`` and numpy draw from one generator each per process, and a
host runs many clients' sessions; ``Resident`` is how a session that owns a random
state draws from it alone (see the class). What reads and sets a process's state is
the layer above's (``somatize._verbs.RANDOM``, which ``somatize.torch`` fills), so this
module imports nothing that draws.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .._verbs import RANDOM

__all__ = ["Resident", "Turns"]


class Resident:
    """Whose random state the process's generators hold, so that a session that owns
    one — its owner seeded it or restored it (a verb in ``_verbs.SEEDING``) — draws
    from it alone, and another client's seed, resume or dropout never moves it.

    torch, Python and numpy draw from one generator each per process, which every node
    uses without being handed one; so an owned state is swapped in around the session's
    slices and verbs (``within``), and only when another's is in: on a worker nothing
    else draws between two slices, so one client's steps in a row swap nothing. A host
    in the client's own process puts the process's own state back after each call
    (``stays=False``), since the client draws from it between them.

    While an owned state is in, nothing else runs: one such session's slice at a time,
    and none of the others (``exclusive``), since any draw would move it. The sessions
    that own none draw from the process's own state, as every session did before,
    side by side (``shared``). A slice that waits for other sessions' (a shared
    trainer) lets them run meanwhile (``Sharing``'s lock hands its turn over) and takes
    its own state back when it wakes."""

    def __init__(self) -> None:
        self.who: Any = None  # whose owned state is in; None: the process's own
        self.own: Any = None  # the process's own state, while a session's is in
        self._turns = threading.Condition()
        self._drawing = 0  # slices of sessions that own no state, under way
        self._alone = False  # a slice of a session that owns one is under way
        self._queued = 0  # such slices waiting for the others to end
        self._holder = threading.local()  # what this thread holds, for a wait

    @contextlib.contextmanager
    def within(self, session: Any, stays: bool = True, alone: bool = False) -> Any:
        """The process's generators hold ``session``'s state (or the process's own, for
        a session that owns none) while this runs; ``alone`` runs it alone even so (a
        seeding verb, whose state becomes the session's, starting from the process's
        own)."""
        if not RANDOM:  # nothing that draws is loaded here: nothing to swap
            yield
            return
        self._take(session, alone or session.owns)
        try:
            yield
        finally:
            self._give(stays)

    def owned(self, session: Any) -> None:
        """``session`` owns the state it runs within from now on: a seeding verb ran in
        it, alone (``within(..., alone=True)``), so that state is the one in."""
        session.owns = True

    def _take(self, session: Any, alone: bool) -> None:
        with self._turns:
            if alone:
                self._queued += 1
                while self._alone or self._drawing:
                    self._turns.wait()
                self._queued -= 1
                self._alone = True
                self._enter(session)
            else:
                while self._alone or self._queued:
                    self._turns.wait()
                if self.who is not None:  # nobody draws now: the owned state goes out
                    self._home()
                self._drawing += 1
            self._holder.held = (session, alone)

    def _give(self, stays: bool = True) -> None:
        with self._turns:
            session, alone = self._holder.held
            self._holder.held = None
            if alone:
                if not stays:
                    self._home()
                self._alone = False
            else:
                self._drawing -= 1
            self._turns.notify_all()

    def holding(self) -> tuple[Any, bool] | None:
        """What this thread holds: its session, and whether it runs alone; or None."""
        return getattr(self._holder, "held", None)

    def hand_over(self) -> tuple[Any, bool] | None:
        """Lets the others run while this thread waits (see ``Sharing``)."""
        held = self.holding()
        if held is not None:
            self._give()
        return held

    def take_back(self, held: tuple[Any, bool] | None) -> None:
        if held is not None:
            self._take(*held)

    def _enter(self, session: Any) -> None:
        """Puts ``session``'s owned state in, keeping whoever's was there."""
        if self.who is session:
            return
        take, put = RANDOM[0]
        now = take()
        if self.who is None:
            self.own = now
        else:
            self.who.random = now
        if session.random is not None:
            put(session.random)
        elif self.who is not None:  # a state of its own starts as the process's own
            put(self.own)
        session.random = None
        self.who = session

    def _home(self) -> None:
        """Puts the process's own state back in."""
        if self.who is not None:
            take, put = RANDOM[0]
            self.who.random = take()
            put(self.own)
            self.who, self.own = None, None


class Turns(threading.Condition):
    """The sharing lock: a slice that waits on it for other sessions' lets them run
    (and draw) meanwhile, and has its own random state back when it wakes."""

    def __init__(self, resident: Resident) -> None:
        super().__init__()
        self.resident = resident

    def wait(self, timeout: float | None = None) -> bool:
        held = self.resident.hand_over()  # taken after this lock, never before: no cycle
        try:
            return super().wait(timeout)
        finally:
            self.resident.take_back(held)
