"""A loopback HTTP server for the test channel (over HTTP, not file://: rattler checks sha256
only for downloads).

    with ChannelServer(info.root) as server:
        url = info.channel_url(server.url)
        ...
        server.requests  # [(method, path, status), ...] every request, in order

Options, for the error tests:
    login=("/private/", "user", "password")  everything is also served under /private/..., and
                                             there only with that HTTP basic login (401 without)
    server.corrupt("channel")                that channel's repodata.json is now not JSON
"""

from __future__ import annotations

import base64
import http.server
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any


class _Handler(http.server.SimpleHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = code.value if hasattr(code, "value") else code
        self.server.owner._record(self.command, self.path, int(status) if str(status).isdigit() else 0)

    def _route(self) -> str | None:
        """The path to serve, after the login check; None when the response is already sent."""
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if owner.login and path.startswith(owner.login[0]):
            expected = "Basic " + base64.b64encode(f"{owner.login[1]}:{owner.login[2]}".encode()).decode()
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="test channel"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            path = "/" + path[len(owner.login[0]):].lstrip("/")
        return path

    def _corrupt(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        if len(parts) == 3 and parts[0] in self.server.owner.corrupted and parts[2].startswith("repodata"):
            if parts[2] != "repodata.json":
                self.send_error(404)
                return True
            body = b'{"info": {"subdir": "' + parts[1].encode() + b'"}, "packages": {"truncated'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)
            return True
        return False

    def _serve(self) -> None:
        path = self._route()
        if path is None or self._corrupt(path):
            return
        self.path = path
        if self.command == "HEAD":
            super().do_HEAD()
        else:
            super().do_GET()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._serve()

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve()


LOG = logging.getLogger(__name__)


class QuietServer(http.server.ThreadingHTTPServer):
    """A ThreadingHTTPServer whose request errors (a client that hangs up mid-response: rattler
    cancels a subdir's download once another failed) are kept in `errors` and logged at debug
    level, never printed: socketserver's own handle_error writes a traceback to sys.stderr, which
    in a test is the output of the command under test."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.errors: list[str] = []

    def handle_error(self, request: object, client_address: object) -> None:
        text = "".join(traceback.format_exception(*sys.exc_info()))
        self.errors.append(text)
        LOG.debug("request from %s failed:\n%s", client_address, text)


class _Server(QuietServer):
    owner: ChannelServer


class ChannelServer:
    """Serves `root` on a free 127.0.0.1 port, in a thread, while the context is open."""

    def __init__(self, root: Path | str, login: tuple[str, str, str] | None = None) -> None:
        self.root = Path(root)
        self.login = login
        self.corrupted: set[str] = set()
        self._log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the server is not running")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self._log.append((method, path, status))

    @property
    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request so far."""
        with self._lock:
            return list(self._log)

    def paths(self, suffix: str = "") -> list[str]:
        """The paths requested so far that end with `suffix` (".conda": package downloads)."""
        return [p for _, p, _ in self.requests if p.split("?", 1)[0].endswith(suffix)]

    def clear(self) -> None:
        with self._lock:
            self._log.clear()

    def corrupt(self, channel: str, on: bool = True) -> None:
        """Serve a truncated repodata.json for every subdir of `channel` (its folder name)."""
        (self.corrupted.add if on else self.corrupted.discard)(channel.strip("/"))

    def start(self) -> ChannelServer:
        root = str(self.root)

        def handler(*args: object, **kwargs: object) -> _Handler:
            return _Handler(*args, directory=root, **kwargs)  # type: ignore[arg-type]
        self._httpd = _Server(("127.0.0.1", 0), handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="conda-channel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> ChannelServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


if __name__ == "__main__":  # python3 -m tests.conda_channel.server ROOT: serve until ^C
    import sys
    import time
    with ChannelServer(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()) as s:
        print(s.url, flush=True)
        while True:
            time.sleep(3600)
