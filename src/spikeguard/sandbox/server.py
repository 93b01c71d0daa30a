"""The sandbox page's web server: FastAPI on 127.0.0.1 only (``spikeguard sandbox``).

Routes:

- ``GET /``: the page; ``GET /static/<file>``: its script, style and the vendored chart library.
  A path with ``..``, an empty segment, a backslash or a ``%`` left after the server's one
  decoding (a double-encoded path) is refused with 400 before the file system is touched.
- ``GET /api/simulate?<SimConfig fields>``: a simulated run (``simulation.simulate``).
- ``GET /api/clipping?<ClipPictureConfig fields>``: the clipping widget's bars.
- ``POST /api/real?<RealConfig fields>``: start a real run (``real.RealRuns``): the Guard
  training ``GPTConfig.tiny()`` in a child process. 202 with the run's id and its events URL; 409
  with a message while another run is running. ``GET /api/real``: the current run, if any.
  ``POST /api/real/stop``: stop it. ``GET /api/real/events?run=<id>``: the run's metrics records
  as server-sent events, then an ``end`` event.

Every error is JSON ``{"error": message}`` with a 4xx or 5xx status. Host headers other than
127.0.0.1 and localhost are refused (a page elsewhere cannot reach the server by DNS
rebinding), and a Content-Security-Policy keeps the page from loading anything from another
origin. A POST whose Origin or Sec-Fetch-Site header says it comes from another site is refused
(403), so no other page can start or stop a run.
"""

from __future__ import annotations

import contextlib
import mimetypes
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from ._params import config_from_query
from .clipping import ClipPictureConfig, clipping_picture
from .real import RealBusy, RealConfig, RealRuns
from .simulation import SimConfig, simulate

__all__ = ["HOST", "STATIC", "create_app", "serve"]

HOST = "127.0.0.1"
"""The only address the server listens on."""

STATIC = Path(__file__).resolve().parent / "static"
"""The page's files."""

_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'none'")

_HOSTS = ("127.0.0.1", "localhost")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _static_file(rel: str) -> Path:
    """The file under STATIC named by ``rel`` (already percent-decoded once), or _Refused."""
    if "%" in rel or "\\" in rel or "\x00" in rel:
        raise _Refused(400, "static paths may not contain '%', '\\' or NUL (encoded or "
                            "double-encoded paths are refused)")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _Refused(400, "static paths may not contain '..', '.' or empty segments")
    root = STATIC.resolve()
    full = root.joinpath(*parts).resolve()
    if not full.is_relative_to(root):
        raise _Refused(400, "static path leaves the static folder")
    if not full.is_file():
        raise _Refused(404, f"no file static/{rel}")
    return full


class _Guard:
    """ASGI middleware: refuse a Host header other than 127.0.0.1 or localhost, and add the
    security headers to every response (plain ASGI: no per-request task or body copy)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host.rsplit(":", 1)[0] not in _HOSTS:
            refusal = _error(400, f"Host header {host[:100]!r} refused: the sandbox answers to "
                                  f"127.0.0.1 and localhost only")
            await refusal(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = _CSP
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Referrer-Policy"] = "no-referrer"
                headers["Cache-Control"] = "no-store"
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _cross_site(request: Request) -> str | None:
    """Why a state-changing request looks like it comes from another site, or None."""
    origin = request.headers.get("origin")
    if origin is not None:
        host = origin.split("://", 1)[-1].rsplit(":", 1)[0]
        if host not in _HOSTS:
            return f"Origin {origin[:100]!r} refused"
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return f"Sec-Fetch-Site {request.headers['sec-fetch-site'][:40]!r} refused"
    return None


def _file_response(path: Path) -> Response:
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind in ("application/javascript", "text/javascript"):
        kind += "; charset=utf-8"
    return Response(path.read_bytes(), media_type=kind)


def create_app() -> FastAPI:
    """The sandbox's ASGI app (no network access of its own; serve() binds it)."""
    runs = RealRuns()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            runs.close()

    app = FastAPI(title="spikeguard sandbox", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.real = runs
    app.add_middleware(_Guard)

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: _Refused) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(404, f"nothing at {request.url.path[:200]!r}; the page is at /")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path[:200]!r}")
        return _error(exc.status_code, str(exc.detail))

    # The handlers are async: each takes a few ms of CPU, and a thread hop per request would
    # cost more than it saves on a page with one user.
    @app.get("/")
    async def index() -> Response:
        return _file_response(STATIC / "index.html")

    @app.get("/static/{rel:path}")
    async def static(rel: str) -> Response:
        return _file_response(_static_file(rel))

    @app.get("/api/simulate")
    async def api_simulate(request: Request) -> JSONResponse:
        try:
            cfg = config_from_query(SimConfig, request.query_params.multi_items())
        except ValueError as exc:
            return _error(400, str(exc))
        return JSONResponse(simulate(cfg).to_json())

    @app.get("/api/clipping")
    async def api_clipping(request: Request) -> JSONResponse:
        try:
            cfg = config_from_query(ClipPictureConfig, request.query_params.multi_items())
        except ValueError as exc:
            return _error(400, str(exc))
        return JSONResponse(clipping_picture(cfg))

    @app.get("/api/real")
    async def api_real_status() -> JSONResponse:
        cur = runs.current
        return JSONResponse({"run": None, "running": False} if cur is None else cur.describe())

    @app.post("/api/real")
    async def api_real_start(request: Request) -> JSONResponse:
        if (why := _cross_site(request)) is not None:
            return _error(403, f"{why}: real runs start from the sandbox page only")
        try:
            cfg = config_from_query(RealConfig, request.query_params.multi_items())
            run = runs.start(cfg)
        except ValueError as exc:
            return _error(400, str(exc))
        except RealBusy as exc:
            return _error(409, str(exc))
        return JSONResponse(run.describe(), status_code=202)

    @app.post("/api/real/stop")
    async def api_real_stop(request: Request) -> JSONResponse:
        if (why := _cross_site(request)) is not None:
            return _error(403, f"{why}: real runs are stopped from the sandbox page only")
        run = runs.stop()
        if run is None:
            return _error(409, "no real run is running")
        return JSONResponse(run.describe())

    @app.get("/api/real/events")
    async def api_real_events(request: Request) -> Response:
        q = request.query_params
        cur = runs.current
        if set(q) != {"run"} or len(q.getlist("run")) != 1 \
                or not (q["run"].isascii() and q["run"].isdigit()) or len(q["run"]) > 9:
            return _error(400, "give exactly one parameter, run=<id> (the id POST /api/real "
                               "answered)")
        if cur is None or cur.id != int(q["run"]):
            now = "none has started" if cur is None else f"the current run is {cur.id}"
            return _error(404, f"no real run {q['run'][:20]}: {now}")
        last = request.headers.get("last-event-id", "0")
        after = int(last) if last.isascii() and last.isdigit() and len(last) < 10 else 0
        return StreamingResponse(runs.events(cur, after), media_type="text/event-stream",
                                 headers={"X-Accel-Buffering": "no"})

    return app


def serve(port: int = 8765) -> int:
    """Serve the page on http://127.0.0.1:<port> until interrupted; returns an exit status.

    The socket is bound here (to 127.0.0.1 only) so a busy port is reported plainly, and port 0
    picks a free port, printed in the URL line.
    """
    import uvicorn

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        print(f"spikeguard sandbox: --port {port!r} must be an integer in 0..65535",
              file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        sock.close()
        print(f"spikeguard sandbox: cannot listen on {HOST}:{port} ({exc.strerror}); "
              f"choose another port with --port", file=sys.stderr)
        return 2
    url = f"http://{HOST}:{sock.getsockname()[1]}/"
    print(f"spikeguard sandbox: {url} (Ctrl+C stops)", flush=True)
    config = uvicorn.Config(create_app(), log_level="warning", access_log=False,
                            server_header=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
