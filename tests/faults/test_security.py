"""The sandbox: bound to 127.0.0.1 only, and nothing served from outside its assets.

The server runs as a user starts it (``python -m spikeguard sandbox --port P``). Every request is
sent byte for byte (http.client does not normalise paths). A breach (lost) is a response whose
body holds the bytes of a file outside the page's static folder, or a 2xx for a path that is not
an asset. Every asset is also fetched and compared byte for byte, so refusing everything would
not pass. The planted-payload checkpoint rows are tests/test_checkpoint_integrity.py's, joined by
node id (tests/faults/_table.py).
"""

import contextlib
import http.client
import socket
import sys
from pathlib import Path

import pytest

from spikeguard.sandbox import server as sandbox_server
from tests.conftest import ROOT
from tests.test_sandbox_server import _listeners, _other_ipv4, raw_get, running_sandbox

STATIC = sandbox_server.STATIC
PKG = ROOT / "src" / "spikeguard"

# files outside the assets a traversal could aim at, and a marker of their contents
SECRETS = {"/etc/passwd": b"root:", "server.py": b"create_app",
           "pyproject.toml": b"[build-system]", "__init__.py": b"__all__"}

UP = ["..", "%2e%2e", ".%2e", "%252e%252e", "%c0%ae%c0%ae", "..;", "....",
      "%2E%2E", "%2e.", "%25252e%25252e", "%e0%80%ae%e0%80%ae", "..%00"]
SEP = ["/", "%2f", "%5c", "\\", "%252f", "%2F", "%c0%af", "//"]
TARGETS = ["server.py", "../../../pyproject.toml", "../../../../../../../../etc/passwd",
           "../pyproject.toml", "../__init__.py"]


def _attacks(full: bool) -> list[str]:
    """Traversal paths: ways to say '..' and '/' (encoded once, twice, overlong UTF-8), into
    the static route, below it and at the root, plus absolute paths, NUL bytes and dot segments.
    CI sends the first 7 spellings of '..', 5 of '/' and 3 targets; --faults-full all of them."""
    ups, seps, targets = (UP, SEP, TARGETS) if full else (UP[:7], SEP[:5], TARGETS[:3])
    out = set()
    for up in ups:
        for sep in seps:
            for target in targets:
                rest = target.replace("../", up + sep).replace("/", sep)
                out.add(f"/static/{up}{sep}{rest}")
                out.add(f"/{up}{sep}{rest}")
                if full or sep == "/":
                    out.add(f"/static/vendor/{up}{sep}{up}{sep}{rest}")
    out.update(["/static//etc/passwd", "/static/%2fetc%2fpasswd", "//etc/passwd",
                "/static/sandbox.js%00.html", "/static/./sandbox.js", "/static/%2e/sandbox.js",
                "/static/vendor/./../sandbox.js", "/static/" + "../" * 20 + "etc/passwd",
                "/static/~/.bashrc", "/static/%7e/.bashrc", "/static/..", "/static/.",
                "/static/", "/static", "/static/vendor/", "/api/../static/../server.py",
                "/api/simulate/../../server.py", "/%2e%2e%2fserver.py"])
    return sorted(out)


def _leaks(body: bytes) -> list[str]:
    return [name for name, marker in SECRETS.items() if marker in body]


@pytest.fixture(scope="module")
def sandbox_port():
    with running_sandbox() as (_, port, _):
        yield port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_sandbox_listens_on_127_0_0_1_only(fault_table, sandbox_port):
    port = sandbox_port
    with fault_table.run("sandbox binds 127.0.0.1 only") as run:
        refused = []
        for family, host in ((socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1"),
                             (socket.AF_INET, _other_ipv4())):
            if host is None:
                continue
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(5)
                    s.connect((host, port))
            except OSError:
                refused.append(host)
            else:
                run.lost += 1  # reachable on another address
        run.held = _listeners(port) == ["0100007F"] and raw_get(port, "/")[0] == 200
    assert run.held and run.lost == 0, (_listeners(port), refused)


class _Client:
    """One keep-alive connection, reopened when the server closes it; paths sent as written."""

    def __init__(self, port: int) -> None:
        self.port, self.conn = port, None

    def get(self, path: str) -> tuple[int, dict, bytes]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self.conn.request("GET", path)
                r = self.conn.getresponse()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def test_nothing_outside_the_assets_is_served_encoded_traversal_included(fault_table, request,
                                                                        sandbox_port):
    assets = sorted(p for p in STATIC.rglob("*") if p.is_file())
    attacks = _attacks(request.config.getoption("faults_full"))
    port = sandbox_port
    with contextlib.closing(_Client(port)) as client:
        for path in attacks:
            with fault_table.run("sandbox serves nothing outside its assets") as run:
                status, headers, body = client.get(path)
                run.lost = len(_leaks(body)) + int(200 <= status < 300)
                # a 3xx may only point back into this server (/static -> /static/)
                run.held = 400 <= status < 500 or (
                    300 <= status < 400 and headers.get("location", "").startswith(
                        ("/", f"http://127.0.0.1:{port}/")))
            assert run.held and run.lost == 0, (path, status, headers, body[:200])
        with fault_table.run("sandbox serves nothing outside its assets") as run:
            for asset in assets:  # every asset is served, byte for byte
                status, _, body = client.get("/static/" + asset.relative_to(STATIC).as_posix())
                run.held &= status == 200 and body == asset.read_bytes()
        assert run.held, "an asset was not served as it is on disk"


def test_a_symlink_in_the_static_folder_leading_out_is_refused(fault_table, tmp_path,
                                                                monkeypatch):
    """The resolve check: a link inside the folder that points outside it is not followed out."""
    static = tmp_path / "static"
    static.mkdir()
    (static / "ok.js").write_text("ok")
    (static / "out.py").symlink_to(PKG / "sandbox" / "server.py")
    (static / "up").symlink_to(PKG)
    monkeypatch.setattr(sandbox_server, "STATIC", static)
    with fault_table.run("sandbox serves nothing outside its assets") as run:
        assert sandbox_server._static_file("ok.js") == (static / "ok.js").resolve()
        for rel in ("out.py", "up/__init__.py", "up/sandbox/server.py"):
            try:
                served = sandbox_server._static_file(rel)
            except sandbox_server._Refused as e:
                run.held &= e.status == 400 and "leaves the static folder" in str(e)
            else:
                run.lost += 1 if Path(served).is_file() else 0
    assert run.held and run.lost == 0
