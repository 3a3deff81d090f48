"""The DNS server's bounds (proxy/dns_responder/server.py, proxy/dns_responder/tcp_listener.py)
with small limits, in process,
on asyncio's loop and on uvloop's (skipped where uvloop is not installed): a real DnsServer on
loopback sockets, real dnspython and socket clients, a real Policy and our
resolver asking the tests' DNS server (tests/support/dns_server.py), whose `slow.test` never
answers, so a query for it stays in flight for the resolver's timeout. The same behaviour at the
default limits, through `egress-proxy run`, is tests/test_dns_responder.py's."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import dns.asyncquery
import dns.exception
import dns.message
import dns.rcode
import pytest
from support.dns_server import DNSServer
from support.running import metric_value

from policy import compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.common.listeners import Listener
from proxy.decide.vetting import Vetter
from proxy.dns_responder.responder import DnsResponder
from proxy.dns_responder.server import DnsServer, ServerLimits
from proxy.dns_responder.tcp_listener import MAX_BUFFERED
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

LOOPBACK = "127.0.0.1"
RESOLVER_TIMEOUT = 0.6  # how long a query for slow.test stays in flight


@dataclass
class Running:
    server: DnsServer
    port: int
    stream: io.StringIO
    metrics: Metrics

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def reasons(self) -> list[str]:
        return [x["reason"] for x in self.lines()]

    def dropped(self) -> float:
        text = self.metrics.render()[0].decode()
        return metric_value(text, "egress_dns_queries_total", rcode="dropped") or 0.0


Start = Callable[..., Awaitable[Running]]
Run = Callable[..., None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest, dns: DNSServer) -> Run:
    """`run(body)`: `await body(start)` on a fresh loop, asyncio's own or uvloop's (skipped
    where uvloop is not installed): the server must work on either. `await start(**limits)`
    serves a DnsServer on 127.0.0.1 with those limits; every one is stopped at the end."""
    runner: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    if request.param == "uvloop":
        runner = pytest.importorskip("uvloop").run
    dns.set("ok.test", a=["192.0.2.10"], aaaa=["2001:db8::10"])
    dns.blackhole("slow.test")

    def running(body: Callable[[Start], Awaitable[None]]) -> None:
        async def main() -> None:
            servers: list[DnsServer] = []

            async def start(**limits: Any) -> Running:
                config = load_config("addresses:\n  allow: [192.0.2.0/24, 2001:db8::/32]\n")
                manifest = load_manifest("network:\n  egress: [ok.test, slow.test]\n")
                policy = compile_policy(manifest, None, config.operator)
                stream, metrics = io.StringIO(), Metrics()
                resolver = Resolver([dns.address], timeout=RESOLVER_TIMEOUT)
                vetter = Vetter(policy, resolver, metrics, AuditLog(stream=stream), plane="l4")
                limits.setdefault("header_timeout", 1.0)
                limits.setdefault("idle_timeout", 5.0)
                server = DnsServer(DnsResponder(vetter, metrics), ServerLimits(**limits))
                servers.append(server)
                [bound] = await server.start([Listener("dns", LOOPBACK, 0)])
                return Running(server, bound.port, stream, metrics)

            try:
                await body(start)
            finally:
                for server in servers:
                    await server.stop()

        runner(main())

    return running


def wire(name: str, rdtype: str = "A") -> bytes:
    return dns.message.make_query(name, rdtype).to_wire()


async def udp(port: int, name: str, rdtype: str = "A", timeout: float = 5) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    return await dns.asyncquery.udp(query, LOOPBACK, timeout=timeout, port=port)


async def served(port: int) -> bool:
    """Whether another client, over UDP, gets its answer."""
    return (await udp(port, "ok.test")).rcode() == dns.rcode.NOERROR


class TcpClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> TcpClient:
        return cls(*await asyncio.open_connection(LOOPBACK, port))

    def send(self, *messages: bytes) -> None:
        self.writer.write(b"".join(struct.pack("!H", len(m)) + m for m in messages))

    async def answer(self, timeout: float = 5) -> dns.message.Message:
        async with asyncio.timeout(timeout):
            (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            return dns.message.from_wire(await self.reader.readexactly(length))

    async def closed(self, timeout: float = 5) -> bool:
        """Whether the server closes this connection within `timeout` (reading what it sent)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


def test_udp_queries_beyond_the_in_flight_bound_are_dropped(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(max_in_flight=2)
        slow = [asyncio.create_task(udp(running.port, "slow.test")) for _ in range(2)]
        await asyncio.sleep(0.1)  # both in flight, waiting for the resolver
        with pytest.raises(dns.exception.Timeout):
            await udp(running.port, "ok.test", timeout=0.3)
        assert "overload" in running.reasons() and running.dropped() == 1
        assert [m.rcode() for m in await asyncio.gather(*slow)] == [dns.rcode.SERVFAIL] * 2
        # Room again: answered.
        assert await served(running.port)

    run(body)


def test_a_tcp_connection_waits_for_room_and_every_query_is_answered(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(max_in_flight=2, max_pipelined=8)
        client = await TcpClient.open(running.port)
        started = time.monotonic()
        client.send(*(wire("slow.test") for _ in range(5)))
        answers = [await client.answer() for _ in range(5)]
        # Two at a time: three rounds of the resolver's timeout, none dropped.
        assert time.monotonic() - started >= 2.5 * RESOLVER_TIMEOUT
        assert [m.rcode() for m in answers] == [dns.rcode.SERVFAIL] * 5
        assert running.dropped() == 0
        client.close()

    run(body)


def test_pipelined_queries_per_connection_are_bounded(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(max_pipelined=2)
        client = await TcpClient.open(running.port)
        started = time.monotonic()
        client.send(*(wire("slow.test") for _ in range(4)), wire("ok.test"))
        answers = [await client.answer() for _ in range(5)]
        assert time.monotonic() - started >= 1.5 * RESOLVER_TIMEOUT  # two rounds of two
        rcodes = sorted(m.rcode() for m in answers)
        assert rcodes == [dns.rcode.NOERROR] + [dns.rcode.SERVFAIL] * 4
        # Other clients were never held up by this one.
        assert await served(running.port)
        client.close()

    run(body)


def test_at_the_connection_cap_an_idle_or_stuck_client_makes_room(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(max_tcp_clients=2)
        idle = await TcpClient.open(running.port)
        stuck = await TcpClient.open(running.port)
        stuck.writer.write(b"\x00\x20\x12")  # a message begun, never finished
        await asyncio.sleep(0.1)
        # A third client: the idle one goes (quietly), and the newcomer is served (its query stays
        # in flight for a while).
        third = await TcpClient.open(running.port)
        third.send(wire("slow.test"))
        assert await idle.closed(1)
        assert "overload" not in running.reasons()
        # A fourth: the stuck one goes, with its line (the busy one stays).
        fourth = await TcpClient.open(running.port)
        fourth.send(wire("ok.test"))
        assert (await fourth.answer()).rcode() == dns.rcode.NOERROR
        assert await stuck.closed(1)
        assert running.reasons().count("overload") == 1
        assert (await third.answer()).rcode() == dns.rcode.SERVFAIL
        for client in (third, fourth):
            client.close()

    run(body)


def test_when_every_connection_is_busy_a_new_one_is_refused(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(max_tcp_clients=2)
        busy = [await TcpClient.open(running.port) for _ in range(2)]
        for client in busy:
            client.send(wire("slow.test"))
        await asyncio.sleep(0.1)
        refused = await TcpClient.open(running.port)
        assert await refused.closed(1)
        assert running.reasons().count("overload") == 1 and running.dropped() == 1
        for client in busy:  # still served
            assert (await client.answer()).rcode() == dns.rcode.SERVFAIL
        # Idle now: room for a newcomer again.
        again = await TcpClient.open(running.port)
        again.send(wire("ok.test"))
        assert (await again.answer()).rcode() == dns.rcode.NOERROR
        for client in (*busy, again):
            client.close()

    run(body)


def test_a_client_that_floods_queries_is_held_to_a_bound(run: Run) -> None:
    """Twice MAX_BUFFERED bytes of queries that stay in flight, in one write: however the
    kernel hands them over, the server holds at most MAX_BUFFERED of them (it stops reading
    once a whole message waits for room, and closes a connection that brought more at once)."""

    async def body(start: Start) -> None:
        running = await start(max_pipelined=4)
        client = await TcpClient.open(running.port)
        query = wire("slow.test")
        client.send(*(query for _ in range(2 * MAX_BUFFERED // len(query))))
        for _ in range(10):
            await asyncio.sleep(0.05)
            assert all(len(connection.buffer) <= MAX_BUFFERED for connection in running.server.tcp)
        # Everyone else is still served meanwhile.
        assert await served(running.port)
        client.close()

    run(body)


def test_stop_ends_queries_in_flight_and_connections(run: Run) -> None:
    async def body(start: Start) -> None:
        running = await start(idle_timeout=60.0)
        client = await TcpClient.open(running.port)
        client.send(wire("slow.test"))
        pending = asyncio.create_task(udp(running.port, "slow.test", timeout=2))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await running.server.stop()
        assert time.monotonic() - started < RESOLVER_TIMEOUT
        assert await client.closed(1)
        with pytest.raises(dns.exception.Timeout):
            await pending  # cancelled before its answer: none is sent
        with pytest.raises(ConnectionRefusedError):
            await TcpClient.open(running.port)

    run(body)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a raw socket")
def test_a_datagram_from_our_own_address_is_never_answered(run: Run) -> None:
    """A query whose source is the server's own address and port (spoofed, with a raw socket):
    answering it would be a message to ourselves."""

    async def body(start: Start) -> None:
        running = await start()
        payload = wire("ok.test")
        udp_header = struct.pack("!HHHH", running.port, running.port, 8 + len(payload), 0)
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP) as raw:
            raw.sendto(udp_header + payload, (LOOPBACK, running.port))  # checksum 0: none (v4)
        for _ in range(50):
            if "proxy_loop" in running.reasons():
                break
            await asyncio.sleep(0.02)
        assert running.reasons() == ["proxy_loop"]  # and nothing decided: no other line
        assert running.dropped() == 1

    run(body)
