"""bench/link.py, the node's link bench/pull.py pulls through: the pace it books (a fake clock, no
timing) and the bytes it passes (a real socket pair through it, unchanged both ways)."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from link import Link, Pace, link  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_link_is_shared_chunks_queue_behind_each_other_at_the_rate():
    clock = Clock()
    pace = Pace(1000.0, clock)
    assert pace.wait(500) == 0.0  # an idle link sends at once
    assert pace.wait(500) == pytest.approx(0.5)  # behind the first 500 bytes, from any connection
    assert pace.wait(1000) == pytest.approx(1.0)
    clock.now += 2.0  # the link is idle again: nothing is saved up for later
    assert pace.wait(100) == 0.0
    clock.now += 10.0
    assert pace.wait(100) == 0.0


def test_a_link_of_no_rate_is_refused():
    with pytest.raises(ValueError):
        Pace(0)


def test_the_upstreams_bytes_pass_unchanged_and_are_paced():
    upstream = socket.create_server(("127.0.0.1", 0))
    payload = bytes(range(256)) * 4096  # 1 MiB, 4 chunks or more
    got_request: list[bytes] = []

    def serve() -> None:
        conn, _ = upstream.accept()
        with conn:
            got_request.append(conn.recv(1024))
            conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    slept: list[float] = []
    link = Link(upstream.getsockname(), Pace(1e12), sleep=slept.append).start()
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=10) as client:
            client.sendall(b"GET /v2/ HTTP/1.1\r\n\r\n")
            received = b""
            while chunk := client.recv(1 << 16):
                received += chunk
    finally:
        link.stop()
        upstream.close()
    assert got_request == [b"GET /v2/ HTTP/1.1\r\n\r\n"]
    assert received == payload
    assert len(slept) >= 4  # every chunk from the upstream asked the pace when it may go


@pytest.mark.parametrize("host,mbit", [("registry.example", 100.0), ("127.0.0.1:0", 100.0),
                                       ("127.0.0.1:5000", 0.0), ("127.0.0.1:5000", -1.0)])
def test_a_link_without_a_port_or_a_rate_is_refused(host, mbit):
    with pytest.raises(SystemExit, match="--mbit"):
        link(host, mbit)
