"""Live: a watcher that shows a run while it happens.

In a Jupyter kernel it keeps one output up to date (a display handle, redrawn at most
twice a second); on a terminal it rewrites one line of stderr in place; anywhere else
it keeps count and says nothing. It never writes anything down: that is the
Recorder's job, and the two are meant to be watching side by side.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

__all__ = ["Live"]

_NOTEBOOK_EVERY = 0.5  # seconds between redraws of a notebook output
_TERMINAL_EVERY = 0.1  # seconds between rewrites of a terminal line
_WINDOW = 20  # forwards the time per forward is averaged over


def _kernel() -> Any:
    """The IPython shell of a Jupyter kernel we run in, or None."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    ask = getattr(ipython, "get_ipython", None)
    shell = ask() if callable(ask) else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return shell


class Live:
    """Shows a run as it goes: the loss curve in a notebook, one line on a terminal.

    Pass it in ``watching`` (beside a Recorder); end a notebook cell with it to show
    the final figure there. Where it is shown is decided when it is made: a Jupyter
    kernel, else a terminal on stderr, else nowhere (``mode`` says which). Drawing
    needs plotly; without it a notebook gets the terminal's line.
    """

    def __init__(self, title: str | None = None):
        if title is not None and not isinstance(title, str):
            raise TypeError(f"a Live title is a str, not a {type(title).__qualname__}")
        self.title = title
        self.forwards = 0
        self.losses: list[tuple[int, float]] = []  # (forward, value)
        self._took: deque[int] = deque(maxlen=_WINDOW)
        self._lock = threading.Lock()
        self._shown_at = 0.0
        self._handle: Any = None
        self._shown_in: Any = None  # the cell the handle was made in
        self._stale = False  # something arrived that the notebook output does not show
        self._hooked = False
        self._line = _Line()
        shell = _kernel()
        if shell is not None:
            self.mode: str | None = "notebook"
        elif _isatty(sys.stderr):
            self.mode = "terminal"
        else:
            self.mode = None
        if self.mode == "terminal":
            # At exit the last state is written and the line ended; a Live collected
            # earlier only ends its line.
            weakref.finalize(self, _end, self._line, weakref.ref(self))

    # -- watching ---------------------------------------------------------------------
    def __call__(self, fact: dict[str, Any]) -> None:
        kind = fact.get("fact") if type(fact) is dict else None
        if kind == "finished":
            with self._lock:
                self.forwards += 1
                took = fact.get("took_us")
                if isinstance(took, (int, float)):
                    self._took.append(took)
        elif kind == "loss":
            value = fact.get("value")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                with self._lock:
                    self.losses.append((max(self.forwards - 1, 0), float(value)))
        else:
            return
        if self.mode is not None:
            self._maybe_show()

    def _maybe_show(self) -> None:
        self._stale = True
        now = time.monotonic()
        every = _NOTEBOOK_EVERY if self.mode == "notebook" else _TERMINAL_EVERY
        if now - self._shown_at < every:
            return
        self._shown_at = now
        if self.mode == "terminal":
            self._line.write(self.line())
        else:
            self._redraw(here=self._handle is None)

    # -- what is shown ----------------------------------------------------------------
    def ms_per_forward(self) -> float | None:
        """The mean time of the last few forwards, end to end, in milliseconds."""
        with self._lock:
            took = list(self._took)
        return sum(took) / len(took) / 1000 if took else None

    def line(self) -> str:
        """The compact line a terminal shows."""
        return " · ".join(([self.title] if self.title else []) + self._parts())

    def _parts(self) -> list[str]:
        parts = [f"{self.forwards} forward" + ("" if self.forwards == 1 else "s")]
        if self.losses:
            parts.append(f"loss {self.losses[-1][1]:.5g}")
        ms = self.ms_per_forward()
        if ms is not None:
            parts.append(f"{ms:.3g} ms/forward")
        return parts

    def figure(self) -> Any:
        """The loss so far as a plotly figure, raw and smoothed."""
        from ._figures import curve_figure

        with self._lock:
            found = list(self.losses)
        said = " · ".join(self._parts())
        title = f"<b>{_escape(self.title)}</b> — {said}" if self.title else said
        return curve_figure([f for f, _ in found], [v for _, v in found], title=title)

    def _bundle(self) -> dict[str, Any]:
        try:
            figure = self.figure()
        except ImportError:
            return {"text/plain": self.line()}
        return figure._repr_mimebundle_()

    def redraw_if_stale(self) -> None:
        """Draws again what arrived since the notebook's output was last drawn."""
        if self._stale:
            self._redraw()

    def _redraw(self, here: bool = False) -> None:
        """Brings the notebook output up to date; ``here`` shows it in the running cell
        too when the output so far belongs to another one."""
        shell = _kernel()
        if shell is None:
            return
        from IPython.display import display

        bundle = self._bundle()
        self._stale = False
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
            if not here or self._shown_in == shell.execution_count:
                return
        _activate_plotly()
        self._handle = display(bundle, raw=True, display_id=True)
        self._shown_in = shell.execution_count
        if not self._hooked:
            self._hooked = True
            shell.events.register("post_run_cell", _after_cell(weakref.ref(self), shell))

    def _ipython_display_(self) -> None:
        # The last expression of a cell: bring the output this cell already shows up
        # to date, or show one here if the curve was drawn in another cell.
        self._shown_at = time.monotonic()
        if _kernel() is None:
            from IPython.display import display

            display(self._bundle(), raw=True)
            return
        self._redraw(here=True)

    def _repr_html_(self) -> str:
        try:
            return self.figure().to_html(full_html=False, include_plotlyjs=True)
        except ImportError:
            return f"<pre>{_escape(self.line())}</pre>"

    def close(self) -> None:
        """Shows the final state and ends a terminal line."""
        if self.mode == "terminal":
            self._line.write(self.line())
            self._line.end()
        elif self.mode == "notebook":
            self._redraw(here=self._handle is None)

    def __repr__(self) -> str:
        return f"Live({self.line()!r})"


class _Line:
    """One line of stderr, rewritten in place with a carriage return."""

    def __init__(self) -> None:
        self.width = 0

    def write(self, text: str) -> None:
        pad = " " * max(0, self.width - len(text))
        self.width = len(text)
        try:
            sys.stderr.write("\r" + text + pad)
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed or broken stderr is no reason to stop training
            pass

    def end(self) -> None:
        if self.width:
            self.width = 0
            try:
                sys.stderr.write("\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass


def _after_cell(live: weakref.ref[Live], shell: Any) -> Any:
    """What runs after each notebook cell: the last redraw a throttle held back."""
    def after(*_: Any) -> None:
        shown = live()
        if shown is None:
            shell.events.unregister("post_run_cell", after)
        else:
            shown.redraw_if_stale()
    return after


def _end(line: _Line, live: weakref.ref[Live]) -> None:
    shown = live()
    if shown is not None and line.width:
        line.write(shown.line())
    line.end()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _activate_plotly() -> None:
    """Lets plotly inject what its notebook renderers need once, before the first raw
    bundle is shown (``display`` of a raw bundle skips that step)."""
    import plotly.io as pio

    activate = getattr(pio.renderers, "_activate_pending_renderers", None)
    if callable(activate):  # private to plotly: without it the mimetype bundle still shows
        activate()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
