"""The admin listener of the real `egress-proxy run` process under a crowd of idle clients: a
kubelet's probe must still be answered, within its default 1 s timeout, while hundreds of
connections sit on the admin port saying nothing or trickling a head a byte at a time (and
reconnecting when dropped, as a client that means it would). Loopback only, every wait
bounded."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dns_server import DNSServer
from support.running import LOOPBACK, RunningProxy, curl, http_upstream, metric_value

from proxy.ops.admin import MAX_CONNECTIONS

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

SILENT = 200
TRICKLING = 50
TRICKLE_EVERY = 0.2  # seconds between two bytes of a trickled head
# The requirement: a kubelet's probe gives up after 1 s (timeoutSeconds' default).
PROBE_DEADLINE = 1.0
TRICKLED_HEAD = b"GET /healthz HTTP/1.1\r\nHost: admin\r\nX-Slow: " + b"a" * 4000


def probe(port: int, path: str) -> tuple[int, float]:
    """GET `path` on the admin port: (status, seconds until the whole answer came); status 0
    when the connection was refused, reset or closed without an answer."""
    begun = time.monotonic()
    data = b""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode())
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return 0, time.monotonic() - begun
    elapsed = time.monotonic() - begun
    if not data.startswith(b"HTTP/1.1 "):
        return 0, elapsed
    return int(data.split(b" ", 2)[1]), elapsed


class Crowd:
    """SILENT connections that never send a byte, and TRICKLING ones that send one byte of a
    head every TRICKLE_EVERY seconds, reopened when the server drops them (at most TRICKLING
    reopens a round), in a thread of its own until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent: list[socket.socket] = []
        self.trickling: list[tuple[socket.socket, int]] = []  # (socket, bytes sent)
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket:
        sock = socket.create_connection((LOOPBACK, self.port), timeout=2)
        sock.setblocking(False)
        return sock

    def start(self) -> None:
        self.silent = [self._open() for _ in range(SILENT)]
        self.trickling = [(self._open(), 0) for _ in range(TRICKLING)]
        self._thread.start()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            while not self._stop.wait(TRICKLE_EVERY):
                for index, (sock, sent) in enumerate(self.trickling):
                    try:
                        # Whatever the server sent (a 408, an EOF) ends this one's head.
                        selector.register(sock, selectors.EVENT_READ)
                        closed = bool(selector.select(0))
                        selector.unregister(sock)
                        if not closed and sent < len(TRICKLED_HEAD):
                            sock.send(TRICKLED_HEAD[sent : sent + 1])
                            self.trickling[index] = (sock, sent + 1)
                            continue
                    except OSError:
                        pass
                    sock.close()
                    with contextlib.suppress(OSError):
                        self.trickling[index] = (self._open(), 0)
                        self.reopened += 1

    def dropped(self) -> int:
        """How many of the silent connections the server has closed."""
        with selectors.DefaultSelector() as selector:
            for sock in self.silent:
                selector.register(sock, selectors.EVENT_READ)
            return len(selector.select(0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in [*self.silent, *(sock for sock, _ in self.trickling)]:
            sock.close()


@contextlib.contextmanager
def crowd(port: int) -> Iterator[Crowd]:
    gathered = Crowd(port)
    try:
        gathered.start()
        yield gathered
    finally:
        gathered.stop()


def test_probes_are_answered_within_a_second_under_idle_connections(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("up.test", a=["127.0.0.1"])
    with (
        http_upstream() as upstream,
        RunningProxy(tmp_path, "network:\n  egress: [up.test]\n", dns=dns) as proxy,
        crowd(proxy.admin_port) as idle,
    ):
        time.sleep(1.0)  # the crowd settles: every admin slot is taken, heads are trickling
        for _ in range(3):
            for path in ("/readyz", "/healthz", "/metrics"):
                status, elapsed = probe(proxy.admin_port, path)
                assert status == 200, f"{path} not answered under {SILENT + TRICKLING} idle"
                assert elapsed < PROBE_DEADLINE, f"{path} took {elapsed:.2f}s"
            time.sleep(TRICKLE_EVERY * 2)
        # The proxy itself serves its clients as ever.
        result = curl(proxy.port, f"http://up.test:{upstream.port}/")
        assert (result.status, upstream.requests) == (200, ["/"])
        assert metric_value(proxy.metrics(), "egress_connections_total") == 1
        # Room was made by dropping the oldest silent ones, not by refusing the probes.
        assert idle.dropped() >= SILENT + TRICKLING - MAX_CONNECTIONS
