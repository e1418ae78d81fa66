"""A node's network link, for bench/pull.py: a TCP proxy in front of a registry that passes what the
registry sends at no more than a given rate, shared by every connection through it (one node's NIC,
however many layers it fetches at once). What the client sends goes through at once.

On this machine the registry is on the loopback, so a pull costs no network time at all and only the
unpack is timed. A GPU node fetches over a link: the issue's reports give about 190 MB/s (a 2.7 GiB
layer in 15 s; a 1.5 GB image in 8 s). How much a pull in layers gains depends on that: containerd
unpacks each layer as soon as it has arrived while it fetches the next, but a single layer is
unpacked only once it is all there.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

CHUNK = 256 << 10


class Pace:
    """When each chunk may go: a queue at `rate` bytes/s that every connection shares."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError("a link's rate is more than 0 bytes/s")
        self.rate, self.clock = rate, clock
        self._free = 0.0  # when the link has sent all it was given so far
        self._lock = threading.Lock()

    def wait(self, size: int) -> float:
        """Seconds to wait before sending `size` more bytes (they are booked at once)."""
        with self._lock:
            now = self.clock()
            start = max(now, self._free)
            self._free = start + size / self.rate
            return start - now


class Link:
    """127.0.0.1:<port> -> `upstream` (host, port), the upstream's bytes paced by `pace`."""

    def __init__(self, upstream: tuple[str, int], pace: Pace, sleep: Callable[[float], None] = time.sleep):
        self.upstream, self.pace, self.sleep = upstream, pace, sleep
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._closed = threading.Event()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Link:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                remote = socket.create_connection(self.upstream, timeout=30)
            except OSError:
                client.close()
                continue
            remote.settimeout(None)
            self._open += [client, remote]
            threading.Thread(target=self._pipe, args=(client, remote, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(remote, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while data := src.recv(CHUNK):
                if paced:
                    self.sleep(self.pace.wait(len(data)))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    sock.shutdown(how)
                except OSError:
                    pass

    def stop(self) -> None:
        self._closed.set()
        self.server.close()
        for sock in self._open:
            sock.close()


def link(upstream_host: str, mbit: float) -> Link:
    """A started Link to `upstream_host` ("host:port": a plain-HTTP registry, as the local ones
    are; a TLS registry's certificate would not name 127.0.0.1) at `mbit` Mbit/s."""
    host, _, port = upstream_host.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or not mbit > 0:
        raise SystemExit(f"--mbit: needs a registry given as host:port and a rate over 0 "
                         f"(got {upstream_host[:80]!r}, {mbit!r})")
    return Link((host, int(port)), Pace(mbit * 1e6 / 8)).start()
