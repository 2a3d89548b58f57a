"""Optional parts, reached by name when they are asked for.

The core imports none of the extras (plotly, boto3, the wire's libraries...): where a
core method is the door to one (``Graph.figure``, ``Store.on_bucket``), the part is
found by its module name at that moment, the way fsspec finds its implementations,
and a missing extra is an ImportError that says what to install. The parts above that
reach for a library of an extra when they use it (the trackers) ask the same way.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["optional"]


def optional(module: str, extra: str, what: str) -> Any:
    """The module ``module``; if it (or what it needs) is missing, an ImportError saying
    that ``what`` needs it and ``pip install 'somatize[extra]'``.

    The missing library is named when Python names it (or when ``module`` is not ours);
    where a module of ours refused to load, its own words follow in brackets."""
    try:
        return import_module(module)
    except ImportError as exc:
        lacking = (exc.name or module).split(".")[0]
        install = f"pip install 'somatize[{extra}]'"
        if lacking != __package__:
            said = f"{what} needs {lacking}, which is not installed: {install}"
        else:
            said = f"{what} needs the {extra!r} extra: {install} ({exc})"
        raise ImportError(said) from exc
