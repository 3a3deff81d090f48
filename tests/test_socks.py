"""SOCKS5 listeners: the same policy as the HTTP proxy, decided before the SOCKS reply (so a
denial is reply 2 and nothing is dialled), then the SNI gate. Real curl where a user would use
it, a raw client of our own where the reply code matters."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import trustme
from dns_server import DNSServer
from test_engine import (
    CURL,
    Running,
    Upstream,
    client_hello,
    closed_by_peer,
    serving,
    started,
)

from proxy.cli import main
from proxy.netaddr import Listener, parse_listener


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    dns.set("tls.test", a=["127.0.0.1"])
    dns.set("up.test", a=["127.0.0.1"])
    dns.set("private.test", a=["10.0.0.1"])
    return dns


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    # mitmproxy binds port 0 only once per host: the SOCKS listener gets a port of its own.
    listeners = [Listener("http", "127.0.0.1", 0), Listener("socks5", "127.0.0.1", free_port())]
    async with started(dns, listeners=listeners) as running:
        yield running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def socks_port(proxy: Running) -> int:
    (socks,) = [x for x in proxy.listeners if x.scheme == "socks5"]
    return socks.port


async def curl_socks(port: int, url: str, *args: str) -> tuple[int, bytes, bytes]:
    """curl through the SOCKS5 listener on `port`, names resolved by the proxy (socks5h):
    exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        CURL, "-sS", "--max-time", "5", "--socks5-hostname", f"127.0.0.1:{port}", *args, url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 10)
    return process.returncode or 0, out, err


async def socks_connect(
    proxy: Running, host: str, port: int, *, atyp: int = 3
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """A SOCKS5 handshake of our own (no auth, CONNECT); returns the reply code."""
    reader, writer = await asyncio.open_connection("127.0.0.1", socks_port(proxy))
    writer.write(b"\x05\x01\x00")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x05\x00"
    if atyp == 3:
        address = bytes([3, len(host)]) + host.encode()
    else:
        address = bytes([1]) + socket.inet_aton(host)
    writer.write(b"\x05\x01\x00" + address + struct.pack("!H", port))
    await writer.drain()
    reply = await asyncio.wait_for(reader.readexactly(10), 5)
    assert reply[0] == 5
    return reply[1], reader, writer


@pytest.mark.asyncio
async def test_allowed_name_passes_tls_through_with_the_real_certificate(
    proxy: Running, tmp_path: Path, resolved_by_os: list[str]
) -> None:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("tls.test").configure_cert(context)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    async with serving(Upstream(), context) as upstream:
        code, out, err = await curl_socks(
            socks_port(proxy), f"https://tls.test:{upstream.port}/", "--cacert", str(bundle)
        )
        assert code == 0, err
        assert out == b"hello from upstream\n"
        assert upstream.requests == [("GET / HTTP/1.1", f"tls.test:{upstream.port}")]
    assert resolved_by_os == []
    allowed = [x for x in proxy.lines() if x["event"] == "decision" and x["stage"] == "sni"]
    assert [(x["decision"], x["protocol"], x["sni"]) for x in allowed] == [
        ("allow", "socks5", "tls.test")
    ]


@pytest.mark.asyncio
async def test_denied_name_is_reply_2_and_never_resolved(proxy: Running) -> None:
    code, _, writer = await socks_connect(proxy, "denied.test", 443)
    writer.close()
    assert code == 2
    assert proxy.dns.count("denied.test", "A") == 0
    denial = next(x for x in proxy.lines() if x["decision"] == "deny")
    assert (denial["reason"], denial["protocol"]) == ("not_allowed", "socks5")
    registry = proxy.metrics.registry
    labels = {"plane": "l7", "protocol": "socks5"}
    assert registry.get_sample_value("egress_connections_total", labels) == 1
    labels = {"decision": "deny", "reason": "not_allowed", "stage": "name", "plane": "l7"}
    assert registry.get_sample_value("egress_decisions_total", labels) == 1


@pytest.mark.asyncio
async def test_curl_reports_the_refusal(proxy: Running) -> None:
    code, _, err = await curl_socks(socks_port(proxy), "https://denied.test/")
    assert code == 97  # CURLE_PROXY: the SOCKS proxy refused
    assert b"not allowed" in err.lower() or b"(2)" in err


@pytest.mark.asyncio
async def test_private_answer_is_reply_2_and_nothing_is_dialled(proxy: Running) -> None:
    code, _, writer = await socks_connect(proxy, "private.test", 443)
    writer.close()
    assert code == 2
    assert any(x["reason"] == "private" for x in proxy.lines()), proxy.lines()


@pytest.mark.asyncio
async def test_ip_literal_destination_is_refused(proxy: Running) -> None:
    code, _, writer = await socks_connect(proxy, "127.0.0.1", 443, atyp=1)
    writer.close()
    assert code == 2
    assert any(x["reason"] == "ip_literal" for x in proxy.lines())


@pytest.mark.asyncio
async def test_upstream_refused_is_reply_5(proxy: Running) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # bound, not listening: connections are refused
        code, _, writer = await socks_connect(proxy, "up.test", closed_port)
    writer.close()
    assert code == 5


@pytest.mark.asyncio
async def test_sni_mismatch_closes_and_upstream_sees_no_hello(proxy: Running) -> None:
    async with serving(Upstream(raw=True)) as upstream:
        code, reader, writer = await socks_connect(proxy, "tls.test", upstream.port)
        assert code == 0
        writer.write(client_hello("up.test"))
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        await asyncio.sleep(0.1)
        assert upstream.received == b""
    assert any(x["reason"] == "sni_mismatch" for x in proxy.lines())


@pytest.mark.asyncio
async def test_non_tls_bytes_are_refused(proxy: Running) -> None:
    async with serving(Upstream(raw=True)) as upstream:
        code, reader, writer = await socks_connect(proxy, "up.test", upstream.port)
        assert code == 0
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.received == b""
    assert any(x["reason"] == "not_tls" for x in proxy.lines())


@pytest.mark.asyncio
async def test_the_http_listener_still_works_beside_it(proxy: Running) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 403")


def test_listen_addresses_parse_with_their_scheme() -> None:
    assert parse_listener("127.0.0.1:3128") == Listener("http", "127.0.0.1", 3128)
    assert parse_listener("socks5://[::1]:1080") == Listener("socks5", "::1", 1080)
    assert str(parse_listener("SOCKS5://:1080")) == "socks5://127.0.0.1:1080"


@pytest.mark.parametrize(
    ("listen", "message"),
    [
        ("socks4://127.0.0.1:1080", "scheme 'socks4' is not one of http://, socks5://"),
        ("socks5://example.com:1080", "not an IP address"),
        ("http://127.0.0.1:99999", "port '99999'"),
    ],
)
def test_bad_listen_addresses_exit_2_before_anything_runs(
    listen: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "examples/agent.yaml", "--listen", listen])
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_same_address_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["run", "examples/agent.yaml", "--listen", ":4128", "--listen", "socks5://127.0.0.1:4128"]
    )
    assert code == 2
    assert "use the same address" in capsys.readouterr().err
