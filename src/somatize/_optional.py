"""Optional parts, reached by name when they are asked for.

The core imports none of the extras (plotly, boto3, the wire's libraries...): where a
core method is the door to one (``Graph.figure``, ``Store.on_bucket``), the part is
found by its module name at that moment, the way fsspec finds its implementations,
and a missing extra is an ImportError that says what to install.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["optional"]


def optional(module: str, extra: str, what: str) -> Any:
    """The module ``module``; if it (or what it needs) is missing, an ImportError saying
    that ``what`` needs ``pip install 'somatize[extra]'``."""
    try:
        return import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the {extra!r} extra: pip install 'somatize[{extra}]' "
                          f"({exc})") from exc
