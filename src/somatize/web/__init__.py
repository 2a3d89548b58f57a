"""A live page over a store, in a browser: ``serve`` (what ``somatize serve`` runs) and
``application`` (the same page for any ASGI server).

The page lists the runs a store holds and shows one run as its report does (progress,
health with its findings, the graph with the findings laid over it, where the time
went) while it trains, a new forward within a second or so. It only ever reads the
store. It needs the ``web`` extra (starlette, uvicorn, plotly); nothing below this
package imports it.
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the web page needs {missing.name}, which is not installed: pip install 'somatize[web]'"
    ) from missing

from ._app import application, serve
from ._follow import Following

__all__ = ["Following", "application", "serve"]
