"""The web application: two pages, their data as JSON and as server-sent events, and
the server that serves them.

Every route is a GET and reads through one ``Board``; the store's reads run in
worker threads, so a slow bucket never stalls the event loop. A page opens one
event stream and is sent what changed about twice a second: the first message is the
whole state, the following ones only what moved. Bound to loopback (the default), a
request whose Host header names another machine is refused: that is how a web page
elsewhere would reach a local server through DNS rebinding.
"""

from __future__ import annotations

import html
import ipaddress
import json
import re
import socket
from importlib import resources
from typing import Any

from anyio import sleep
from anyio.to_thread import run_sync
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (HTMLResponse, JSONResponse, PlainTextResponse, Response,
                                 StreamingResponse)
from starlette.routing import Route

from ._board import Board, finite
from ._follow import Following

__all__ = ["application", "check_host", "serve"]

TICK = 0.5  # seconds between two looks at the store for an open page
QUIET = 15.0  # seconds of nothing new before a stream says it is still there
PORT = 8765


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, public: bool) -> None:
    """Refuses an address other than loopback unless ``public`` says it is meant."""
    if type(host) is not str or not host:
        raise TypeError(f"host is an address such as '127.0.0.1', not {host!r}")
    if not public and not _loopback(host):
        raise PermissionError(
            f"{host} is not a loopback address, and the page has no login: anyone who can "
            "reach it reads every run in the store. Pass --public (public=True) to serve it "
            f"there anyway, or keep it on 127.0.0.1 and tunnel to it: "
            f"ssh -L {PORT}:127.0.0.1:{PORT} HOST")


class _LocalOnly:
    """Refuses requests whose Host header is not a loopback name (DNS rebinding)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if not _loopback(name.strip("[]")):
                await PlainTextResponse(
                    f"this page is served to loopback only, and was asked for as {host!r}",
                    status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("page", name).read_bytes()


class _Assets:
    """The page's script and style, and plotly's script, read once."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}

    def __call__(self, name: str) -> bytes:
        if name not in self.kept:
            if name == "plotly.js":
                from plotly.offline import get_plotlyjs

                self.kept[name] = get_plotlyjs().encode()
            else:
                self.kept[name] = _asset(name)
        return self.kept[name]


_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
_SLOT = re.compile(r"\{\{(title|kind|where|run|plotly)\}\}")


def _page(kind: str, title: str, where: str, run: str = "") -> HTMLResponse:
    filling = {"title": html.escape(title), "kind": kind, "where": html.escape(where),
               "run": html.escape(run, quote=True),
               "plotly": "<script src='/static/plotly.js'></script>" if kind == "run" else ""}
    # One pass, so a run named like a slot ('{{plotly}}') is text, never a second slot.
    filled = _SLOT.sub(lambda slot: filling[slot.group(1)], _asset("page.html").decode())
    return HTMLResponse(filled, headers={"Cache-Control": "no-store"})


def _event(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"


def _json(value: Any) -> str:
    return json.dumps(finite(value), allow_nan=False, separators=(",", ":"))


class _Site:
    """The routes of the page over one store; each reads through the one Board."""

    def __init__(self, following: Following):
        self.following = following
        self.board = Board(following)
        self.assets = _Assets()

    def routes(self) -> list[Route]:
        return [Route("/", self.runs_page), Route("/run/{run:path}", self.run_page),
                Route("/api/runs", self.runs_json), Route("/api/run/{run:path}", self.run_json),
                Route("/events/runs", self.runs_events),
                Route("/events/run/{run:path}", self.run_events),
                Route("/static/{name}", self.static)]

    async def runs_page(self, request: Request) -> Response:
        return _page("runs", "runs", self.following.where)

    async def run_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        if not await run_sync(self.board.known, run):
            return await self.unknown(run)
        return _page("run", run, self.following.where, run)

    async def unknown(self, run: str) -> Response:
        rows = await run_sync(self.board.runs)
        said = ", ".join(row["name"] for row in rows[:10]) or "none yet"
        return PlainTextResponse(f"the store at {self.following.where} has no run {run!r}; "
                                 f"its newest runs are: {said}", status_code=404)

    async def runs_json(self, request: Request) -> Response:
        return JSONResponse(finite(await run_sync(self.board.runs)))

    async def run_json(self, request: Request) -> Response:
        run = request.path_params["run"]
        state = await run_sync(self.board.state, run)
        if state is None:
            return await self.unknown(run)
        drawn = await run_sync(self.board.sections, run)
        return Response(f'{{"state":{_json(state)},"sections":{drawn[1]}}}',
                        media_type="application/json")

    async def runs_events(self, request: Request) -> Response:
        return _streaming(self._runs_stream())

    async def _runs_stream(self) -> Any:
        yield "retry: 2000\n\n"  # how soon a page whose server went away asks again, in ms
        said, quiet = None, 0.0
        while True:
            text = _json(await run_sync(self.board.runs))
            if text != said:
                said, quiet = text, 0.0
                yield _event("runs", text)
            elif quiet >= QUIET:
                quiet = 0.0
                yield ": still here\n\n"
            await sleep(2 * TICK)
            quiet += 2 * TICK

    async def run_events(self, request: Request) -> Response:
        run = request.path_params["run"]
        if not await run_sync(self.board.known, run):
            return await self.unknown(run)
        return _streaming(self._run_stream(run))

    async def _run_stream(self, run: str) -> Any:
        """The run's state whenever it moved (its losses only from the last one sent on),
        and its sections whenever they were drawn again."""
        yield "retry: 2000\n\n"
        after, shown, drawn_shown, quiet = -1, None, None, 0.0
        while True:
            state = await run_sync(self.board.state, run, after)
            # Sent again when the run stops being recorded too, though nothing else moved:
            # a page must not go on saying "recording" about a run that ended.
            if state is not None and (state["version"], state["live"]) != shown:
                shown, quiet = (state["version"], state["live"]), 0.0
                if state["points"]:
                    after = state["points"][-1][0]
                yield _event("state", _json(state))
            drawn = await run_sync(self.board.sections, run)
            if drawn is not None and drawn[0] != drawn_shown:
                drawn_shown, quiet = drawn[0], 0.0
                yield _event("sections", drawn[1])
            if quiet >= QUIET:
                quiet = 0.0
                yield ": still here\n\n"
            await sleep(TICK)
            quiet += TICK

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ("page.js", "page.css", "plotly.js"):
            return PlainTextResponse(f"there is no {name} here", status_code=404)
        data = await run_sync(self.assets, name)
        return Response(data, media_type=_TYPES[name.rsplit(".", 1)[-1]],
                        headers={"Cache-Control": "max-age=3600"})


def application(store: Any, *, public: bool = False) -> Starlette:
    """The ASGI application of the page over ``store``, for any ASGI server.

    ``store`` is a Store (or a ``Following`` of one); the application only reads it.
    Unless ``public``, it answers only requests addressed to a loopback name.
    """
    site = _Site(store if isinstance(store, Following) else Following(store))
    app = Starlette(routes=site.routes())
    app.state.board = site.board
    if not public:
        app.add_middleware(_LocalOnly)
    return app


def _streaming(stream: Any) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _listening(host: str, port: int) -> socket.socket:
    """A socket bound and listening at ``host:port`` (port 0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}; choose "
                                 "another port (0 takes any free one)") from None
    return listener


def _warm() -> None:
    """Imports plotly's figures now, so the first drawing (which sets how often the
    sections are drawn again) does not count their import as drawing."""
    try:
        import plotly.graph_objects  # noqa: F401
        import plotly.subplots  # noqa: F401
    except ImportError:
        pass  # the page says what is missing where it would draw


def _say(line: str) -> None:
    print(line, flush=True)  # flushed: whoever started the server may be waiting for it


def serve(store: Any, *, host: str = "127.0.0.1", port: int = PORT, public: bool = False,
          announce: Any = _say) -> None:
    """Serves the live page over ``store`` at ``host:port`` until interrupted.

    Loopback unless ``public=True`` is given with another address (the page has no
    login). The store is listed once before the server starts, so a store that cannot
    be read says so here; then ``announce`` is handed one line with the address
    (``port=0`` picks a free port, which that line names).
    """
    import uvicorn

    check_host(host, public)
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"port is a number from 0 (any free one) to 65535, not {port!r}")
    following = store if isinstance(store, Following) else Following(store)
    following.scan(force=True)
    _warm()
    app = application(following, public=public)
    listener = _listening(host, port)
    bound = listener.getsockname()
    shown = f"[{bound[0]}]" if listener.family == socket.AF_INET6 else bound[0]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=1)
    announce(f"serving {following.where} at http://{shown}:{bound[1]}/ (read-only; Ctrl-C stops)")
    try:
        uvicorn.Server(config).run(sockets=[listener])
    finally:
        listener.close()
