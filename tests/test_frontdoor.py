"""The front door of `egress-proxy run` (proxy/frontdoor.py) over real loopback sockets: the L4
fast path for CONNECT (decided, dialled eagerly, answered, SNI-gated, relayed), its refusals, its
limits (header, idle, connect timeouts, max_connections), reload and drain, and the hand-off of
everything else to the L7 engine on the same socket.

In process: a FrontDoor with its own Vetter (plane l4), the test DNS server, Metrics and an audit
log to a StringIO; its `engine` starts a real Engine on first use (never before), so a
test that does not need the engine never starts it. What is checked is what a user sees: the
status and headers of the answer, the bytes through the tunnel, the audit lines and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import trustme
from support.dns_server import DNSServer
from support.front_door import Door, opened, received
from support.hellos import python_hello
from support.in_process import (
    ExplodingPolicy,
    Upstream,
    answering,
    closed_by_peer,
    connect,
    curl,
    serving,
)
from support.real_servers import free_port
from support.running import eventually, full_listener
from support.tls import tls_context, trusted_ca

from policy import compile_policy, load_manifest
from proxy.dataplane.heads import MAX_CONNECT_HEAD
from proxy.decide.planes import Update

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

NARROWER = "network:\n  egress: [up.test]\n"
BODY = b"hello from upstream\n"


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("tls.test", "up.test", "other.test", "denied.test"):
        dns.set(name, a=["127.0.0.1"])
    dns.nxdomain("nx.test")
    dns.blackhole("slow.test")
    dns.clear_log()
    return dns


# -- the front door ----------------------------------------------------------------------------


# -- clients and upstreams ---------------------------------------------------------------------


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
        for ln in lines[1:]
        if ":" in ln
    }
    return int(lines[0].split()[1]), headers


async def ask(
    port: int, request: bytes
) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    """Send `request` (a head) and read the answer's head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return *parse_head(head), reader, writer


async def refusal(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """A refused request: the answer's status, headers and body; the proxy then closes."""
    status, headers, reader, writer = await ask(port, request)
    body = await asyncio.wait_for(reader.read(), 5)  # Content-Length, then the close
    writer.close()
    assert len(body) == int(headers["content-length"])
    return status, headers, body


async def open_tunnel(
    door: Door, host: str, upstream: Upstream
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An allowed tunnel through the SNI gate, its ClientHello arrived upstream."""
    status, _, reader, writer = await connect(door, f"{host}:{upstream.port}")
    assert status == 200
    hello = python_hello(host)
    writer.write(hello)
    await writer.drain()
    before = len(upstream.received)
    assert len(await received(upstream, before + len(hello))) >= len(hello)
    return reader, writer


# -- the fast path: an allowed tunnel ------------------------------------------------------------


@pytest.mark.asyncio
async def test_allowed_connect_passes_tls_through_to_the_verified_upstream(
    dns: DNSServer, resolved_by_os: list[str]
) -> None:
    ca = trustme.CA()
    async with serving(Upstream(), tls_context(ca, "tls.test")) as upstream, opened(dns) as door:
        status, headers, reader, writer = await connect(door, f"tls.test:{upstream.port}")
        assert status == 200 and headers == {}
        # The client verifies the upstream's own certificate: TLS passed through, not
        # intercepted (inspection is off, and the proxy has no key for tls.test anyway).
        client = ssl.create_default_context()
        ca.configure_trust(client)
        await asyncio.wait_for(writer.start_tls(client, server_hostname="tls.test"), 5)
        tls = writer.get_extra_info("ssl_object")
        assert tls.getpeercert()["subjectAltName"] == (("DNS", "tls.test"),)
        request = f"GET /x HTTP/1.1\r\nHost: tls.test:{upstream.port}\r\n\r\n".encode()
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert parse_head(head)[0] == 200
        assert await asyncio.wait_for(reader.readexactly(len(BODY)), 5) == BODY
        writer.close()
        (close,) = await door.wait_closes(1)
        assert upstream.requests == [("GET /x HTTP/1.1", f"tls.test:{upstream.port}")]
        assert upstream.connections == 1
    # One lookup of each family, for that name only; none by the OS resolver.
    assert (dns.count("tls.test", "A"), dns.count("tls.test", "AAAA")) == (1, 1)
    assert {q[0] for q in dns.queries} == {"tls.test"}
    assert resolved_by_os == []
    decisions = door.decisions()
    # One decision, one line: the allow at the tunnel's last stage, naming all it went through.
    (decision,) = decisions
    assert (decision["stage"], decision["decision"], decision["reason"]) == (
        "sni",
        "allow",
        "allowed",
    )
    assert (decision["plane"], decision["protocol"], decision["connection"]) == (
        "l4",
        "connect",
        close["connection"],
    )
    assert decision["pinned"] == ["127.0.0.1"] and decision["resolved"] == ["127.0.0.1"]
    assert decision["rule"] == "network.egress[0]" and decision["sni"] == "tls.test"
    assert decision["host"] == "tls.test"
    assert {k: close[k] for k in ("plane", "protocol", "host", "port", "sni", "reason")} == {
        "plane": "l4",
        "protocol": "connect",
        "host": "tls.test",
        "port": upstream.port,
        "sni": "tls.test",
        "reason": "closed",
    }
    assert close["pinned"] == ["127.0.0.1"]
    assert close["upstream"] == f"127.0.0.1:{upstream.port}"
    assert close["session"] == "test-session" and close["client"].startswith("127.0.0.1:")
    # Both directions carried the handshake and the request / response.
    assert close["bytes_up"] > len(request) and close["bytes_down"] > len(BODY)
    assert door.metric("egress_bytes_total", direction="up", plane="l4") == close["bytes_up"]
    assert door.metric("egress_bytes_total", direction="down", plane="l4") == close["bytes_down"]
    assert door.metric("egress_connections_total", plane="l4", protocol="connect") == 1
    assert door.metric("egress_active_connections", plane="l4") == 0
    assert door.metric("egress_upstream_connect_seconds_count", outcome="ok") == 1
    assert door.metric("egress_decisions_total", plane="l4", stage="sni", reason="allowed") == 1
    assert door.engines == []  # the fast path never needed the engine
    assert door.metric("egress_engine_loaded") == 0


@pytest.mark.asyncio
async def test_close_line_counts_the_bytes_of_each_direction(dns: DNSServer) -> None:
    answer = b"server says hello" * 100
    async with answering(answer) as port, opened(dns) as door:
        status, _, reader, writer = await connect(door, f"tls.test:{port}")
        assert status == 200
        hello = python_hello("tls.test")
        writer.write(hello + b"extra")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(answer)), 5) == answer
        writer.close()
        (close,) = await door.wait_closes(1)
    assert (close["bytes_up"], close["bytes_down"]) == (len(hello) + 5, len(answer))
    assert close["reason"] == "closed" and close["duration_seconds"] >= 0


@pytest.mark.asyncio
async def test_connect_is_answered_only_once_the_upstream_accepted(dns: DNSServer) -> None:
    # Eager dial: while the upstream's accept queue is full the CONNECT gets no answer; once a
    # place frees up, the proxy's retransmitted SYN is accepted and only then comes the 200.
    async with opened(dns, connect_timeout=8.0) as door:
        with full_listener() as (listener, _):
            port = listener.getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
            writer.write(
                f"CONNECT tls.test:{port} HTTP/1.1\r\nHost: tls.test:{port}\r\n\r\n".encode()
            )
            await writer.drain()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.5)
            listener.accept()[0].close()  # the filler: its place in the queue frees up
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 6)
            assert parse_head(head)[0] == 200
            # The proxy's connection was already waiting in the queue when the 200 came.
            listener.settimeout(0)
            accepted, _ = listener.accept()
            with accepted:
                hello = python_hello("tls.test")
                writer.write(hello)
                await writer.drain()
                accepted.settimeout(5)
                got = b""
                while len(got) < len(hello):
                    chunk = await asyncio.to_thread(accepted.recv, 65536)
                    assert chunk
                    got += chunk
                assert got == hello
            writer.close()
        (close,) = await door.wait_closes(1)
    assert close["upstream"] == f"127.0.0.1:{port}"


# -- the fast path: refusals before the 200 ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("target", "reason"),
    [("denied.test", "not_allowed"), ("[::1]", "ip_literal"), ("%%%", "invalid_host")],
    ids=["not_allowed", "ip_literal", "not_a_name"],
)
async def test_denied_connect_is_403_never_resolved_nor_dialled(
    dns: DNSServer, target: str, reason: str
) -> None:
    # denied.test does resolve (to the listening upstream): only the policy stops it.
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        authority = f"{target}:{upstream.port}"
        status, headers, body = await refusal(
            door.port, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        )
        assert status == 403
        assert headers["x-egress-denied"] == reason
        assert "x-egress-error" not in headers
        assert body.count(b"\n") == 1 and reason.encode() in body
        if target == "denied.test":
            # The line ends with the change that would allow it (policy/remedies.py).
            remedy = "add 'denied.test' to network.egress"
            assert body == f"egress-proxy: {authority} denied: {reason}: {remedy}\n".encode()
        (close,) = await door.wait_closes(1)
        assert upstream.connections == 0
    assert dns.queries == []
    (decision,) = door.decisions()
    assert (decision["stage"], decision["decision"], decision["reason"], decision["plane"]) == (
        "name",
        "deny",
        reason,
        "l4",
    )
    assert (close["reason"], close["upstream"], close["pinned"]) == (reason, None, None)
    assert (close["bytes_up"], close["bytes_down"]) == (0, 0)
    assert door.metric("egress_decisions_total", decision="deny", reason=reason, plane="l4") == 1
    assert door.metric("egress_upstream_connect_seconds_count") is None  # nothing dialled


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("host", "reason"), [("nx.test", "dns_nxdomain"), ("slow.test", "dns_timeout")]
)
async def test_dns_failure_is_502(dns: DNSServer, host: str, reason: str) -> None:
    async with opened(dns) as door:
        status, headers, body = await refusal(
            door.port, f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode()
        )
        assert status == 502
        assert headers["x-egress-error"] == reason
        assert "x-egress-denied" not in headers
        assert body == f"egress-proxy: {host}:443 failed: {reason}\n".encode()
        (close,) = await door.wait_closes(1)
    failure = next(x for x in door.decisions() if x["stage"] == "dns")
    assert (failure["decision"], failure["reason"], failure["host"]) == ("deny", reason, host)
    assert close["reason"] == reason and close["upstream"] is None
    assert door.metric("egress_dns_lookup_seconds_count", outcome=reason) == 1


@pytest.mark.asyncio
async def test_upstream_refused_is_502(dns: DNSServer) -> None:
    port = free_port()
    async with opened(dns) as door:
        status, headers, body = await refusal(
            door.port, f"CONNECT up.test:{port} HTTP/1.1\r\nHost: up.test:{port}\r\n\r\n".encode()
        )
        assert status == 502
        assert headers["x-egress-error"] == "upstream_refused"
        assert b"upstream_refused" in body and f"up.test:{port}".encode() in body
        (close,) = await door.wait_closes(1)
    error = next(x for x in door.decisions() if x["stage"] == "upstream")
    assert (error["reason"], error["host"], error["port"]) == ("upstream_refused", "up.test", port)
    assert "127.0.0.1 refused" in error["message"]
    assert close["reason"] == "upstream_refused" and close["pinned"] == ["127.0.0.1"]
    assert door.metric("egress_upstream_connect_seconds_count", outcome="upstream_refused") == 1


@pytest.mark.asyncio
async def test_upstream_that_never_accepts_is_504(dns: DNSServer) -> None:
    async with opened(dns, connect_timeout=0.5) as door:
        with full_listener() as (listener, _):
            port = listener.getsockname()[1]
            started = time.monotonic()
            status, headers, _ = await refusal(
                door.port,
                f"CONNECT up.test:{port} HTTP/1.1\r\nHost: up.test:{port}\r\n\r\n".encode(),
            )
            elapsed = time.monotonic() - started
        assert status == 504
        assert headers["x-egress-error"] == "upstream_timeout"
        assert 0.4 <= elapsed < 3
        (close,) = await door.wait_closes(1)
    assert close["reason"] == "upstream_timeout"
    assert door.metric("egress_upstream_connect_seconds_count", outcome="upstream_timeout") == 1


# -- the fast path: the SNI gate ---------------------------------------------------------------


def invalid_hello() -> bytes:
    """A real ClientHello with a legacy_session_id length of 64 (over the RFC's 32)."""
    hello = python_hello("tls.test")
    assert hello[43] == 32  # after the record (5) and handshake (4) headers, version, random
    return hello[:43] + b"\x40" + hello[44:]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("first_bytes", "reason", "sni"),
    [
        (lambda: python_hello("other.test"), "sni_mismatch", "other.test"),
        (lambda: python_hello(None), "sni_missing", None),
        (invalid_hello, "invalid_client_hello", None),
    ],
    ids=["sni_mismatch", "sni_missing", "invalid_client_hello"],
)
async def test_sni_gate_closes_the_tunnel_and_the_upstream_gets_nothing(
    dns: DNSServer, first_bytes: Any, reason: str, sni: str | None
) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        status, _, reader, writer = await connect(door, f"tls.test:{upstream.port}")
        assert status == 200
        writer.write(first_bytes())
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        (close,) = await door.wait_closes(1)
        await upstream.wait_closed(1)
        assert upstream.received == b""  # dialled (eagerly), but never sent a byte
    gate = next(x for x in door.decisions() if x["stage"] == "sni")
    assert (gate["decision"], gate["reason"], gate["sni"], gate["plane"]) == (
        "deny",
        reason,
        sni,
        "l4",
    )
    assert (close["reason"], close["sni"], close["bytes_up"], close["bytes_down"]) == (
        reason,
        sni,
        0,
        0,
    )
    assert door.metric("egress_decisions_total", decision="deny", reason=reason, stage="sni") == 1


@pytest.mark.asyncio
async def test_client_hello_split_across_many_small_writes_passes(dns: DNSServer) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        status, _, _, writer = await connect(door, f"tls.test:{upstream.port}")
        assert status == 200
        hello = python_hello("tls.test")
        for offset in range(0, len(hello) - 1, 7):
            writer.write(hello[offset : min(offset + 7, len(hello) - 1)])
            await writer.drain()
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # nothing must arrive: a stray byte gets its chance
        assert upstream.received == b""  # nothing relayed before the whole hello passed
        writer.write(hello[-1:] + b"and more")
        await writer.drain()
        assert await received(upstream, len(hello) + 8) == hello + b"and more"
        writer.close()
        (close,) = await door.wait_closes(1)
    assert close["sni"] == "tls.test" and close["bytes_up"] == len(hello) + 8


@pytest.mark.asyncio
async def test_client_hello_with_the_connect_head_passes(dns: DNSServer) -> None:
    # A client may send its ClientHello right behind the CONNECT head, in the same segment.
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        hello = python_hello("tls.test")
        authority = f"tls.test:{upstream.port}"
        status, _, _, writer = await ask(
            door.port, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode() + hello
        )
        assert status == 200
        assert await received(upstream, len(hello)) == hello
        writer.close()


@pytest.mark.asyncio
async def test_client_hello_never_sent_closes_after_the_header_timeout(dns: DNSServer) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns, header_timeout=0.5) as door:
        status, _, reader, writer = await connect(door, f"tls.test:{upstream.port}")
        assert status == 200
        started = time.monotonic()
        assert await closed_by_peer(reader)
        elapsed = time.monotonic() - started
        writer.close()
        (close,) = await door.wait_closes(1)
        assert upstream.received == b""
    assert 0.3 <= elapsed < 3
    assert close["reason"] == "header_timeout"
    timeout = next(x for x in door.decisions() if x["reason"] == "header_timeout")
    assert timeout["decision"] == "deny" and "ClientHello" in timeout["message"]


# -- malformed heads, silent clients -----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "request_head",
    [
        b"CONNECT up.test HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT up.test:443:1 HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT http://up.test:443/ HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT up.test:99999 HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT :443 HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT up.test:443 HTTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT up test:443 HTTP/1.1\r\nHost: up.test\r\n\r\n",
        b"CONNECT up.test:443 HTTP/1.1\r\nno colon here\r\n\r\n",
        b"CONNECT up.test:443 HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host (RFC 9112 3.2)
    ],
    ids=[
        "no_port",
        "two_ports",
        "url",
        "port_range",
        "no_host",
        "bad_version",
        "space_in_target",
        "bad_header",
        "no_host_header",
    ],
)
async def test_malformed_connect_head_is_400(dns: DNSServer, request_head: bytes) -> None:
    async with opened(dns) as door:
        status, headers, body = await refusal(door.port, request_head)
    assert status == 400
    assert headers["x-egress-denied"] == "invalid_request"
    assert headers["connection"] == "close"
    assert body == b"egress-proxy: proxy denied: invalid_request\n"
    assert dns.queries == []
    (decision,) = door.decisions()
    assert (decision["decision"], decision["reason"], decision["plane"]) == (
        "deny",
        "invalid_request",
        "l4",
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [MAX_CONNECT_HEAD + 1024, 1 << 20], ids=["17KiB", "1MiB"])
async def test_oversized_connect_head_is_refused_clearly(dns: DNSServer, size: int) -> None:
    # 431 once the head passes MAX_CONNECT_HEAD without ending; the client still writing the
    # rest of a 1 MiB head must see that answer, not a reset.
    async with opened(dns) as door:
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        head = b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test\r\nX-Pad: "
        head += b"a" * (size - len(head) - 4) + b"\r\n\r\n"

        async def send() -> None:
            with contextlib.suppress(ConnectionError):
                writer.write(head)
                await writer.drain()

        sending = asyncio.create_task(send())
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await asyncio.wait_for(sending, 5)
        writer.close()
    status, headers = parse_head(answer)
    assert status == 431
    assert headers["x-egress-denied"] == "invalid_request"
    assert dns.queries == []


@pytest.mark.asyncio
@pytest.mark.parametrize("sent", [b"", b"CONNECT up.te"], ids=["nothing", "half_a_head"])
async def test_silent_client_gets_408_after_the_header_timeout(dns: DNSServer, sent: bytes) -> None:
    async with opened(dns, header_timeout=0.5) as door:
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        writer.write(sent)
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)  # the 408, then the close
        elapsed = time.monotonic() - started
        writer.close()
    status, headers = parse_head(answer.partition(b"\r\n\r\n")[0])
    assert status == 408
    assert headers["x-egress-denied"] == "header_timeout"
    assert 0.3 <= elapsed < 3
    (decision,) = door.decisions()
    assert (decision["reason"], decision["stage"], decision["plane"]) == (
        "header_timeout",
        "accept",
        "l4",
    )


# -- the relay: half-close, idle timeout ----------------------------------------------------------


@pytest.mark.asyncio
async def test_half_close_passes_through_and_the_upstream_still_answers(dns: DNSServer) -> None:
    async def answer_at_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the client's EOF comes through the tunnel
        writer.write(b"got %d bytes" % len(data))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_at_eof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with opened(dns) as door:
            status, _, reader, writer = await connect(door, f"tls.test:{port}")
            assert status == 200
            hello = python_hello("tls.test")
            writer.write(hello + b"last words")
            await writer.drain()
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 5)  # all of it, then EOF
            writer.close()
            (close,) = await door.wait_closes(1)
    finally:
        server.close()
    sent = len(hello) + len(b"last words")
    assert answer == b"got %d bytes" % sent
    assert (close["reason"], close["bytes_up"], close["bytes_down"]) == (
        "closed",
        sent,
        len(answer),
    )


@pytest.mark.asyncio
async def test_idle_timeout_closes_an_idle_tunnel(dns: DNSServer) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns, idle_timeout=0.5) as door:
        reader, writer = await open_tunnel(door, "tls.test", upstream)
        started = time.monotonic()
        assert await closed_by_peer(reader)
        elapsed = time.monotonic() - started
        writer.close()
        (close,) = await door.wait_closes(1)
    assert 0.3 <= elapsed < 3
    assert close["reason"] == "idle_timeout"
    assert close["bytes_up"] == len(python_hello("tls.test"))


# -- hand-off to the engine ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_connect_that_needs_inspection_is_handed_to_the_engine(
    dns: DNSServer, tmp_path: Path
) -> None:
    upstream_ca, bundle = trusted_ca(tmp_path)
    dns.set("paths.test", a=["127.0.0.1"])
    context = tls_context(upstream_ca, "paths.test", "tls.test")
    async with serving(Upstream(), context) as upstream:
        port = upstream.port
        manifest = (
            "schema_version = 1\n[network_access]\n"
            f'allowed = ["https://paths.test:{port}/api/", "tls.test"]\n'
        )
        extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n"
        async with opened(dns, extra, manifest=manifest, source="agent.toml") as door:
            proxy_ca = str(tmp_path / "ca" / "mitmproxy-ca-cert.pem")
            # A whole host stays on the fast path (its own certificate reaches the client)...
            status, _, body = await curl(
                door, f"https://tls.test:{port}/any", "--cacert", str(bundle)
            )
            assert (status, body) == (200, BODY)
            # ...a host with path rules is intercepted by the engine: the client trusts the
            # proxy's CA, and each request inside is decided on its path.
            base = f"https://paths.test:{port}"
            status, _, body = await curl(door, f"{base}/api/items", "--cacert", proxy_ca)
            assert (status, body) == (200, BODY)
            status, headers, _ = await curl(door, f"{base}/admin", "--cacert", proxy_ca)
            assert status == 403 and headers["x-egress-denied"] == "path_not_allowed"
            assert len(door.engines) == 1
            await door.wait_closes(3)
    assert [r[0] for r in upstream.requests] == ["GET /any HTTP/1.1", "GET /api/items HTTP/1.1"]
    planes = {(x["host"], x["plane"]) for x in door.closes()}
    assert planes == {("tls.test", "l4"), ("paths.test", "l7")}


# -- reload ----------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_reload_closes_the_tunnels_the_new_policy_denies(dns: DNSServer) -> None:
    async with (
        serving(Upstream(raw=True)) as narrowed,
        serving(Upstream(raw=True)) as kept,
        opened(dns) as door,
    ):
        denied_reader, denied_writer = await open_tunnel(door, "tls.test", narrowed)
        kept_reader, kept_writer = await open_tunnel(door, "up.test", kept)
        operator = door.door.vetter.policy.operator
        narrower = compile_policy(load_manifest(NARROWER), None, operator)
        closed = door.door.configure(Update(policy=narrower))
        assert len(closed) == 1
        assert await closed_by_peer(denied_reader)
        (close,) = await door.wait_closes(1)
        assert (close["host"], close["reason"]) == ("tls.test", "policy_reload")
        # The allowed tunnel stays open and carries bytes.
        before = len(kept.received)
        kept_writer.write(b"still here")
        await kept_writer.drain()
        assert (await received(kept, before + 10))[before:] == b"still here"
        with pytest.raises(TimeoutError):  # not closed: nothing to read, no EOF
            await asyncio.wait_for(kept_reader.read(1), 0.2)
        # New decisions use the new policy.
        status, headers, _ = await refusal(
            door.port, b"CONNECT tls.test:443 HTTP/1.1\r\nHost: tls.test:443\r\n\r\n"
        )
        assert status == 403 and headers["x-egress-denied"] == "not_allowed"
        denied_writer.close()
        kept_writer.close()
        closes = await door.wait_closes(3)
    assert sorted((x["host"], x["reason"]) for x in closes) == [
        ("tls.test", "not_allowed"),
        ("tls.test", "policy_reload"),
        ("up.test", "closed"),
    ]


@pytest.mark.asyncio
async def test_reload_also_closes_a_tunnel_still_waiting_for_its_client_hello(
    dns: DNSServer,
) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        status, _, reader, writer = await connect(door, f"tls.test:{upstream.port}")
        assert status == 200
        operator = door.door.vetter.policy.operator
        door.door.configure(Update(policy=compile_policy(load_manifest(NARROWER), None, operator)))
        with contextlib.suppress(ConnectionError):
            writer.write(python_hello("tls.test"))
            await writer.drain()
        await asyncio.sleep(0.3)  # nothing must arrive: a stray byte gets its chance
        assert upstream.received == b""  # today: the ClientHello arrives, the tunnel relays
        assert await closed_by_peer(reader)
        writer.close()
        (close,) = await door.wait_closes(1)
    assert close["reason"] == "policy_reload"


# -- overload, drain, failing closed -------------------------------------------------------------


@pytest.mark.asyncio
async def test_overload_answers_503_to_the_excess(dns: DNSServer) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns, max_connections=2) as door:
        held = [await asyncio.open_connection("127.0.0.1", door.port) for _ in range(2)]
        await door.wait_live(2)
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        answer = await asyncio.wait_for(reader.read(), 5)  # the 503, then the close
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        status, headers = parse_head(head)
        assert status == 503
        assert headers["x-egress-error"] == "overload"
        assert body == b"egress-proxy: proxy failed: overload\n"
        overload = next(x for x in door.decisions() if x["reason"] == "overload")
        assert (overload["stage"], overload["plane"]) == ("accept", "l4")
        # Below the limit again, a tunnel opens.
        held[0][1].close()
        await door.wait_live(1)
        _, tunnel_writer = await open_tunnel(door, "tls.test", upstream)
        tunnel_writer.close()
        held[1][1].close()
    assert door.metric("egress_decisions_total", reason="overload", plane="l4") == 1


@pytest.mark.asyncio
async def test_a_burst_over_the_limit_refuses_only_the_excess(dns: DNSServer) -> None:
    # 30 held, then 15 at once against a limit of 40: exactly 5 are answered 503, 10 admitted.
    async with opened(dns, max_connections=40, header_timeout=30.0) as door:
        held = [await asyncio.open_connection("127.0.0.1", door.port) for _ in range(30)]
        await door.wait_live(30)
        burst = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", door.port) for _ in range(15))
        )

        async def answered(reader: asyncio.StreamReader) -> bool:
            try:
                return (await asyncio.wait_for(reader.read(), 1.0)).startswith(b"HTTP/1.1 503")
            except TimeoutError:
                return False  # admitted: nothing is said until it asks something

        refused = await asyncio.gather(*(answered(reader) for reader, _ in burst))
        assert sum(refused) == 5
        await door.wait_live(40)
        for _, writer in (*held, *burst):
            writer.close()
    assert door.metric("egress_decisions_total", reason="overload", plane="l4") == 5


@pytest.mark.asyncio
async def test_drain_stops_accepting_and_closes_what_remains_after_the_timeout(
    dns: DNSServer,
) -> None:
    async with (
        serving(Upstream(raw=True)) as lingering,
        serving(Upstream(raw=True)) as finishing,
        opened(dns) as door,
    ):
        lingering_reader, lingering_writer = await open_tunnel(door, "tls.test", lingering)
        _, finishing_writer = await open_tunnel(door, "up.test", finishing)
        started = time.monotonic()
        drain = asyncio.create_task(door.door.drain(1.0))

        # The drain's first step closes the listeners (a probe connection would be one more
        # client, so the servers are asked instead).
        await eventually(lambda: not door.door._servers, what="the drain to stop accepting")
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", door.port)
        # A tunnel that ends by itself during the drain ends as usual.
        finishing_writer.close()
        (close,) = await door.wait_closes(1)
        assert (close["host"], close["reason"]) == ("up.test", "closed")
        assert not drain.done()
        # The other one is closed once the timeout has passed.
        assert await closed_by_peer(lingering_reader)
        await asyncio.wait_for(drain, 5)
        elapsed = time.monotonic() - started
        lingering_writer.close()
        closes = await door.wait_closes(2)
    assert 0.9 <= elapsed < 3
    assert door.door.live == 0
    lingered = next(x for x in closes if x["host"] == "tls.test")
    assert lingered["reason"] == "drain_timeout"  # closed by the drain, not by a peer
    assert lingered["bytes_up"] == len(python_hello("tls.test"))


@pytest.mark.asyncio
async def test_an_exception_in_the_decision_denies_with_403(dns: DNSServer) -> None:
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        door.door.configure(Update(policy=ExplodingPolicy()))
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        authority = f"tls.test:{upstream.port}"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert upstream.connections == 0  # fails closed in any case
        status, headers = parse_head(answer.partition(b"\r\n\r\n")[0])
        assert status == 403
        assert headers["x-egress-denied"] == "internal_error"
        assert any(x["reason"] == "internal_error" for x in door.decisions())


async def closed_soon(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the proxy closes the connection within `timeout` seconds (EOF or a reset)."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.mark.asyncio
async def test_drain_also_closes_connections_handed_to_the_engine(
    dns: DNSServer, tmp_path: Path
) -> None:
    upstream_ca, bundle = trusted_ca(tmp_path)
    async with serving(Upstream(), tls_context(upstream_ca, "up.test")) as upstream:
        # inspection.mode: all: every TLS connection is the engine's once its SNI passed.
        extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n  mode: all\n"
        async with opened(dns, extra) as door:
            authority = f"up.test:{upstream.port}"
            status, _, reader, writer = await connect(door, authority)
            assert status == 200
            client_tls = ssl.create_default_context(
                cafile=str(tmp_path / "ca" / "mitmproxy-ca-cert.pem")
            )
            await writer.start_tls(client_tls, server_hostname="up.test")
            writer.write(f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            assert (await asyncio.wait_for(reader.readuntil(BODY), 5)).startswith(b"HTTP/1.1 200")
            await door.wait_live(1)  # the intercepted connection counts as live
            await asyncio.wait_for(door.door.drain(0.3), 10)  # the client keeps it alive, idle
            closed = await closed_soon(reader, 1.0)
            writer.close()
            assert closed
            (close,) = await door.wait_closes(1, timeout=1.0)
    assert (close["plane"], close["reason"]) == ("l7", "shutdown")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, as a client that crashed or gave up."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.asyncio
async def test_a_client_that_resets_early_is_not_logged_as_a_failure(dns: DNSServer) -> None:
    records = _Records()
    logger = logging.getLogger("proxy.dataplane.frontdoor")
    logger.addHandler(records)
    try:
        async with (
            serving(Upstream(raw=True)) as upstream,
            opened(dns, connect_timeout=0.3) as door,
        ):
            # Gone after the 200, before any ClientHello.
            status, _, _, writer = await connect(door, f"tls.test:{upstream.port}")
            assert status == 200
            reset(writer)
            await door.wait_closes(1)
            # Gone while its CONNECT was being dialled (the 504 then meets a reset socket).
            with full_listener() as (listener, _):
                port = listener.getsockname()[1]
                _, writer = await asyncio.open_connection("127.0.0.1", door.port)
                writer.write(f"CONNECT up.test:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.1)
                reset(writer)
                await door.wait_closes(2)
            assert upstream.received == b""
    finally:
        logger.removeHandler(records)
    assert [r.getMessage() for r in records.records] == []


@pytest.mark.asyncio
async def test_a_connection_refused_before_its_target_has_a_close_line(dns: DNSServer) -> None:
    async with opened(dns, header_timeout=0.3) as door:
        status, _, _ = await refusal(door.port, b"CONNECT up.test HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 400
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 408 ")
        writer.close()
        closes = await door.wait_closes(2, timeout=1.0)
    assert sorted(x["reason"] for x in closes) == ["header_timeout", "invalid_request"]
    assert door.metric("egress_connections_total", plane="l4") == 2
