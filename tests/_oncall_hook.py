"""A real webhook receiver on 127.0.0.1 for the on-call tests: http.server in a thread.

``hook()`` yields a ``Hook`` with its ``url``; every POST is kept (path, headers, JSON body) and
answered 200 after ``delay`` seconds. ``wait(n)`` blocks until n posts arrived."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Hook", "closed_port", "hook"]


class Hook:
    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.delay = 0.0
        self.cond = threading.Condition()
        self.url = ""

    def wait(self, n: int, timeout: float = 180.0) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        with self.cond:
            while len(self.posts) < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.posts)} of {n} posts after {timeout}s")
                self.cond.wait(left)
            return list(self.posts)


@contextlib.contextmanager
def hook(delay: float = 0.0) -> Iterator[Hook]:
    h = Hook()
    h.delay = delay

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if h.delay:
                time.sleep(h.delay)
            with h.cond:
                h.posts.append({"path": self.path, "headers": dict(self.headers),
                                "body": json.loads(body)})
                h.cond.notify_all()
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")
            except OSError:  # the client timed out and left
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    h.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield h
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
