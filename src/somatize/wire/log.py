"""The worker's log: one line on stderr per thing done, and nothing a peer can forge.

Every line is escaped before it is written (a newline, a carriage return or a
terminal escape in it becomes ``\\n``, ``\\r``, ``\\x1b``), so text that came from the
network, however it is worded, cannot start a line of its own. Text an
unauthenticated peer chose is also cut short (``quoted``), so it cannot fill the log.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["Often", "quoted", "say"]


def _escaped(text: str) -> str:
    """``text`` with every character that is not printable written as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def quoted(text: Any, limit: int = 200) -> str:
    """Text a peer sent, fit for a log line: quoted, escaped, and at most ``limit``
    characters of it. A value nested deeper than ``str`` follows is named by its type."""
    try:
        text = str(text)
    except RecursionError:
        text = f"a {type(text).__name__} nested too deep to show"
    cut = f"... ({len(text) - limit} more characters)" if len(text) > limit else ""
    return repr(text[:limit]) + cut


class _Say:
    """One line on stderr per thing done: a single write, cheap enough for every slice.

    Not the logging module: its record, formatting and handler lock cost a fifth of a
    tiny slice's round trip, and a worker's log is only ever these lines.
    """

    def __init__(self) -> None:
        self._second = -1
        self._stamp = ""
        self.routine_too = True  # off with --quiet: only what is worth a look is said

    def _start(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        return f"{self._stamp}.{int((now - second) * 1000):03d} somatize.worker[{os.getpid()}] "

    def __call__(self, message: str, *args: Any) -> None:
        text = message % args if args else message
        if not text.isprintable():  # one C call on the way every line takes
            text = _escaped(text)
        self._write(self._start() + text + "\n")

    def routine(self, message: str, *args: Any) -> None:
        """A line for the everyday (a connection, a catalog, a slice): said unless the
        worker was started ``--quiet``, as a spawned one is by default."""
        if self.routine_too:
            self(message, *args)

    def block(self, message: str, text: str) -> None:
        """One line, then ``text`` (a traceback, say) indented beneath it, in one write;
        each of its lines escaped, so none of them reads as a line of the log."""
        lines = [self._start() + _escaped(message)]
        lines.extend("    " + _escaped(line) for line in text.rstrip("\n").split("\n"))
        self._write("\n".join(lines) + "\n")

    @staticmethod
    def _write(line: str) -> None:
        try:
            os.write(2, line.encode(errors="replace"))
        except OSError:  # nobody reads stderr any more: the work goes on
            pass


say = _Say()


class Often:
    """A line for something that may happen a thousand times a second (a flood of
    connections): said the first time, then at most once every ``period`` seconds,
    with how many times it happened since."""

    def __init__(self, period: float = 10.0):
        self.period = period
        self._last = -period
        self._since = 0
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if now - self._last < self.period:
                return
            times, self._since, self._last = self._since, 0, now
        if times > 1:
            message += f" ({times} times since this was last said)"
        say(message, *args)
