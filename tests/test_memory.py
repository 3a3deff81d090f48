"""10,000 sequential plain-HTTP requests through the real `egress-proxy run` process: its RSS
must grow by less than 10 MB after a warm-up, and the audit log must hold exactly the lines
those requests make.

The upstream is an asyncio server in a thread of its own and the client writes raw requests on
sockets, so the proxy is the slow part. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.dns_server import running_dns_server
from support.running import RunningProxy, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MANIFEST = "network:\n  egress: [up.test]\n"
BODY = b"ok\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
# Per round: one keep-alive connection of KEEP_ALIVE requests (one of them denied) and SINGLE
# requests on a connection each (one of them denied every DENIED_SINGLE_EVERY rounds).
KEEP_ALIVE = 95
SINGLE = 5
DENIED_AT = 47
DENIED_SINGLE_EVERY = 10
WARM_UP_ROUNDS = 10  # 1,000 requests
ROUNDS = 100  # 10,000 requests
TIME_LIMIT = 240.0
MAX_GROWTH_KIB = 10 * 1024


# -- a fast upstream -------------------------------------------------------------------------


@dataclass
class Upstream:
    port: int
    requests: int = 0


async def _serve(
    upstream: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")  # GETs only: no body follows
            upstream.requests += 1
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.contextmanager
def fast_upstream() -> Iterator[Upstream]:
    loop = asyncio.new_event_loop()
    upstream = Upstream(0)

    async def start() -> asyncio.Server:
        return await asyncio.start_server(
            lambda r, w: _serve(upstream, r, w), "127.0.0.1", 0, limit=65536
        )

    server = loop.run_until_complete(start())
    upstream.port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:

        async def stop() -> None:
            server.close()
            server.close_clients()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


# -- a raw client ----------------------------------------------------------------------------


class Client:
    """One client connection to the proxy; requests are written and read by hand."""

    def __init__(self, proxy_port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def get(self, host: str, port: int, path: str) -> tuple[int, bytes, bytes]:
        """(status, head, body) of one GET through the proxy."""
        authority = f"{host}:{port}".encode()
        self.sock.sendall(
            b"GET http://%s%s HTTP/1.1\r\nHost: %s\r\n\r\n" % (authority, path.encode(), authority)
        )
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(head.split(b" ", 2)[1]), head, body

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the proxy closed the connection; buffered {self.buffer!r}")
        self.buffer += chunk


@dataclass
class Tally:
    allowed: int = 0
    denied: int = 0
    connections: int = 0


def run_rounds(proxy_port: int, upstream_port: int, rounds: int, deadline: float) -> Tally:
    tally = Tally()

    def request(client: Client, denied: bool, i: int) -> None:
        host = "denied.test" if denied else "up.test"
        status, head, body = client.get(host, upstream_port, f"/r{i}")
        if denied:
            assert status == 403 and b"X-Egress-Denied: not_allowed" in head, head
            tally.denied += 1
        else:
            assert (status, body) == (200, BODY), (head, body)
            tally.allowed += 1

    for n in range(rounds):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{TIME_LIMIT:g}s time limit exceeded after {n} of {rounds} rounds "
                f"({tally.allowed + tally.denied} requests)"
            )
        client = Client(proxy_port)
        tally.connections += 1
        try:
            for i in range(KEEP_ALIVE):
                request(client, i == DENIED_AT, i)
        finally:
            client.close()
        for i in range(SINGLE):
            client = Client(proxy_port)
            tally.connections += 1
            try:
                request(client, i == 0 and n % DENIED_SINGLE_EVERY == 0, KEEP_ALIVE + i)
            finally:
                client.close()
    return tally


def test_rss_growth_over_10000_requests_is_under_10_mb(tmp_path: Path) -> None:
    started = time.monotonic()
    deadline = started + TIME_LIMIT
    with running_dns_server() as dns, fast_upstream() as upstream:
        dns.set("up.test", a=["127.0.0.1"])
        with RunningProxy(tmp_path, MANIFEST, dns=dns, allow=["127.0.0.1/32"]) as proxy:

            def lines_after(tally: Tally) -> int:
                # One line per decision (an allow at the address stage, a denial at the name
                # stage), plus one close line per client connection.
                return tally.allowed + tally.denied + tally.connections

            warm = run_rounds(proxy.port, upstream.port, WARM_UP_ROUNDS, deadline)
            assert warm.allowed + warm.denied == 1000
            # The close lines are written once the proxy has seen each connection end.
            wait_for(lambda: proxy.audit_count() == lines_after(warm), timeout=30, what="audit")
            before = proxy.rss_kib()

            measured_from = time.monotonic()
            tally = run_rounds(proxy.port, upstream.port, ROUNDS, deadline)
            took = time.monotonic() - measured_from
            assert (tally.allowed, tally.denied) == (9890, 110)
            assert tally.connections == ROUNDS * (1 + SINGLE)

            total = Tally(
                warm.allowed + tally.allowed,
                warm.denied + tally.denied,
                warm.connections + tally.connections,
            )
            wait_for(lambda: proxy.audit_count() >= lines_after(total), timeout=30, what="audit")
            after = proxy.rss_kib()
            lines = proxy.audit()
            stderr = proxy.stderr()

    growth = after - before
    print(
        f"\n10,000 requests in {took:.1f}s ({10_000 / took:.0f}/s); RSS {before} KiB -> "
        f"{after} KiB ({growth:+d} KiB); whole test {time.monotonic() - started:.1f}s"
    )
    assert growth < MAX_GROWTH_KIB, f"RSS grew by {growth} KiB ({before} -> {after} KiB)"

    # The audit log has exactly one line per decision and per connection, no more.
    assert len(lines) == lines_after(total), (len(lines), lines_after(total))
    decisions = [line for line in lines if line["event"] == "decision"]
    closes = [line for line in lines if line["event"] == "close"]
    assert len(closes) == total.connections
    denied = [line for line in decisions if line["decision"] == "deny"]
    assert len(denied) == total.denied
    assert {(line["reason"], line["stage"], line["host"]) for line in denied} == {
        ("not_allowed", "name", "denied.test")
    }
    allowed = [line for line in decisions if line["decision"] == "allow"]
    assert len(allowed) == total.allowed
    assert {line["stage"] for line in allowed} == {"address"}
    assert upstream.requests == total.allowed
    assert sum(line["bytes_down"] for line in closes) > total.allowed * len(BODY)
    # No hook failed along the way (each logs "egress: <hook> failed" and denies).
    assert "Traceback" not in stderr and not re.search(r"egress: \w+ failed", stderr), stderr
