"""``spikeguard watch RUN_DIR``: a run's live state, its incident and the answers, on 127.0.0.1.

Routes: ``GET /`` the page and ``GET /static/<name>`` its script and style (a fixed list);
``GET /api/state`` the run's last records, its incident (summary, commands, status) and the
page counts; ``GET /api/plot`` the incident's PNG; ``POST /api/answer`` a JSON answer
(``{"incident", "action", "to", "skip_data": "A:B", "set": ["z_loss=1e-4"]}``), checked and
written exactly as ``spikeguard respond`` does (400 with the one-line refusal).

The same protections as the sandbox page: it listens on 127.0.0.1 only, answers to the Host
names 127.0.0.1 and localhost only (no DNS rebinding), sends a Content-Security-Policy that loads
nothing from another origin, and refuses a POST whose Origin or Sec-Fetch-Site says another site
sent it, or whose body is not JSON (a cross-site form cannot send one without a preflight).
"""


import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from .answer import Answer, AnswerError, incident_path, parse_range, read_incident, write_answer
from .settings import split_setting

__all__ = ["HOST", "STATIC", "add_arguments", "create_app", "post_answer", "run", "state"]

HOST = "127.0.0.1"
"""The only address the server listens on."""
STATIC = Path(__file__).resolve().parent / "static"
_FILES = {"watch.js": "text/javascript; charset=utf-8", "watch.css": "text/css; charset=utf-8"}
_HOSTS = ("127.0.0.1", "localhost")
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'none'")
_TAIL = 400
"""Metrics records the page plots (the last ones)."""
_MAX_BODY = 16384


def _tail(path: Path, n: int) -> list[dict[str, Any]]:
    """The last ``n`` JSON lines of ``path`` (a partial last line skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 400 * n))
            lines = f.read().splitlines()[-n:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _num(x: Any) -> float | None:
    return x if isinstance(x, (int, float)) and x == x and abs(x) != float("inf") else None


def state(run_dir: Path) -> dict[str, Any]:
    """What the page shows: the last records, the incident and the page outcomes."""
    records = _tail(run_dir / "metrics.jsonl", _TAIL)
    rows = [{"step": r.get("step"), "loss": _num(r.get("loss")), "log_z": _num(r.get("log_z")),
             "grad_norm": _num(r.get("grad_norm")), "action": r.get("action")} for r in records]
    try:
        incident = read_incident(run_dir)
    except AnswerError:
        incident = None
    if incident is not None:
        incident = {k: v for k, v in incident.items() if k != "page"} | {
            "answers": incident.get("page", {}).get("answers", {})}
    pages = _tail(run_dir / "pages.jsonl", 200)
    return {"run_dir": str(run_dir), "records": rows, "incident": incident,
            "pages": {"sent": sum(p.get("status") == "sent" for p in pages),
                      "unsent": sum(p.get("status") == "unsent" for p in pages)},
            "answer_waiting": (run_dir / "oncall" / "answer.json").exists()}


def _answer_from(body: Any) -> Answer:
    if not isinstance(body, dict):
        raise AnswerError("the answer must be a JSON object")
    unknown = set(body) - {"incident", "action", "to", "skip_data", "set"}
    if unknown:
        raise AnswerError(f"unknown fields {sorted(unknown)}")
    to = body.get("to")
    if to not in (None, ""):
        if not (isinstance(to, int) or (isinstance(to, str) and to.strip().isdigit())):
            raise AnswerError(f"--to {to!r} must be a checkpoint step (an integer)")
        to = int(to)
    else:
        to = None
    skip = body.get("skip_data")
    sets = body.get("set") or []
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise AnswerError("set must be a list of NAME=VALUE strings")
    settings = dict(split_setting(s) for s in sets if s.strip())
    return Answer(incident=str(body.get("incident", "")), action=str(body.get("action", "")),
                  to=to, skip_data=parse_range(skip) if skip not in (None, "") else None,
                  settings=settings)


class _Protect:
    """ASGI middleware: refuse a Host header other than 127.0.0.1 or localhost; add the
    security headers to every response."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from fastapi.responses import JSONResponse
        from starlette.datastructures import MutableHeaders

        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host.rsplit(":", 1)[0] not in _HOSTS:
            refusal = JSONResponse({"error": f"Host header {host[:100]!r} refused: the watch "
                                             "page answers to 127.0.0.1 and localhost only"},
                                   status_code=400)
            await refusal(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                h = MutableHeaders(scope=message)
                h["Content-Security-Policy"] = _CSP
                h["X-Content-Type-Options"] = "nosniff"
                h["Referrer-Policy"] = "no-referrer"
                h["Cache-Control"] = "no-store"
            await send(message)

        await self.inner(scope, receive, send_with_headers)


def post_answer(run_dir: Path, headers: Any, raw: bytes) -> tuple[int, dict[str, Any]]:
    """POST /api/answer: (status, JSON body). Refuses another site's request (403), a body that
    is not JSON (415) or too large (413); an answer refused as ``spikeguard respond`` refuses it
    is 400 with its one line; an accepted one is written as respond writes it."""
    origin = headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1].rsplit(":", 1)[0] not in _HOSTS:
        return 403, {"error": f"Origin {origin[:100]!r} refused: answer from the watch page"}
    site = headers.get("sec-fetch-site", "same-origin")
    if site not in ("same-origin", "none"):
        return 403, {"error": f"Sec-Fetch-Site {site[:40]!r} refused: answer from the watch page"}
    if headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return 415, {"error": "the answer must be sent as application/json"}
    if len(raw) > _MAX_BODY:
        return 413, {"error": "the answer is too large"}
    try:
        answer = _answer_from(json.loads(raw))
        write_answer(run_dir, answer)
    except (AnswerError, ValueError) as exc:
        return 400, {"error": str(exc).splitlines()[0]}
    return 200, {"ok": True, "answer": answer.to_dict()}


def _plot(run_dir: Path) -> Path | None:
    """The open incident's PNG, when it is drawn (only a file in RUN_DIR/oncall)."""
    inc = incident_path(run_dir)
    try:
        png = Path(json.loads(inc.read_text())["plot"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if png.parent.resolve() != inc.parent.resolve() or not png.is_file():
        return None
    return png


def create_app(run_dir: str | Path) -> Any:
    """The watch page's ASGI app for ``run_dir`` (``run`` binds it)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    run_dir = Path(run_dir).resolve()
    app = FastAPI(title="spikeguard watch", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Protect)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": f"{request.method} {request.url.path[:200]!r}: "
                                      f"{exc.detail}"}, status_code=exc.status_code)

    @app.get("/")
    async def index() -> Response:
        return Response((STATIC / "watch.html").read_bytes(),
                        media_type="text/html; charset=utf-8")

    @app.get("/favicon.ico")
    async def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in _FILES:
            return JSONResponse({"error": f"no static file {name[:60]!r}"}, status_code=404)
        return Response((STATIC / name).read_bytes(), media_type=_FILES[name])

    @app.get("/api/state")
    async def api_state() -> JSONResponse:
        return JSONResponse(state(run_dir))

    @app.get("/api/plot")
    async def api_plot() -> Response:
        png = _plot(run_dir)
        if png is None:
            return JSONResponse({"error": "no incident plot is drawn yet"}, status_code=404)
        return Response(png.read_bytes(), media_type="image/png")

    @app.post("/api/answer")
    async def api_answer(request: Request) -> JSONResponse:
        status, body = post_answer(run_dir, request.headers, await request.body())
        return JSONResponse(body, status_code=status)

    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (spikeguard train --out)")
    p.add_argument("--port", type=int, default=8766,
                   help="port on 127.0.0.1 (default 8766; 0 picks a free one)")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; an exit status."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"spikeguard watch: {run_dir} is not a directory; give the run's --out directory",
              file=sys.stderr)
        return 2
    try:
        import uvicorn
    except ImportError:
        print("spikeguard watch: uvicorn is not installed; the page needs the web extra: pip "
              "install 'spikeguard[web]'", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"spikeguard watch: --port {args.port} must be in 0..65535", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, args.port))
    except OSError as exc:
        sock.close()
        print(f"spikeguard watch: cannot listen on {HOST}:{args.port} ({exc.strerror}); choose "
              "another port with --port", file=sys.stderr)
        return 2
    print(f"spikeguard watch: http://{HOST}:{sock.getsockname()[1]}/ (Ctrl+C stops)", flush=True)
    config = uvicorn.Config(create_app(run_dir), log_level="warning", access_log=False,
                            server_header=False, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    return 0
