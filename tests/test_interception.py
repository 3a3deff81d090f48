"""TLS interception, for hosts whose agent.toml rules are URL prefixes: the front door decides the
CONNECT, answers 200 and passes the SNI gate, then hands the connection to the engine (the
default `inspection.mode: prefixes`): the proxy's own CA (created on first start), per-request
decisions inside the tunnel, upstream certificates verified against the name, and refusal when
inspection is disabled. Real curl, real TLS with a test CA (trustme) for the upstream."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import trustme
from support.dns_server import DNSServer
from support.front_door import curl_socks
from support.hellos import python_hello
from support.in_process import Running, Upstream, closed_by_peer, connect, curl, serving, started
from support.tls import tls_context

from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener
from proxy.common.refusals import DENIED_HEADER
from proxy.tls.ca import ensure_ca

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    dns.set("paths.test", a=["127.0.0.1"])
    dns.set("whole.test", a=["127.0.0.1"])
    return dns


@contextlib.asynccontextmanager
async def intercepting(
    dns: DNSServer,
    tmp_path: Path,
    ca: trustme.CA,
    port: int,
    *,
    enabled: bool = True,
    listeners: list[Listener] | None = None,
) -> AsyncIterator[Running]:
    bundle = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    manifest = (
        "schema_version = 1\n[network_access]\n"
        f'allowed = ["https://paths.test:{port}/api/", "whole.test"]\n'
        f'blocked = ["https://whole.test:{port}/admin/"]\n'
    )
    extra = (
        f"inspection:\n  enabled: {'true' if enabled else 'false'}\n"
        f"  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n"
    )
    async with started(
        dns, extra, manifest=manifest, source="agent.toml", listeners=listeners
    ) as running:
        yield running


@pytest_asyncio.fixture
async def tls_upstream(upstream_ca: trustme.CA) -> AsyncIterator[Upstream]:
    context = tls_context(upstream_ca, "paths.test", "whole.test")
    async with serving(Upstream(), context) as upstream:
        yield upstream


def proxy_ca(tmp_path: Path) -> str:
    return str(tmp_path / "ca" / "mitmproxy-ca-cert.pem")


@pytest.mark.asyncio
async def test_requests_inside_are_decided_one_by_one(
    dns: DNSServer,
    tmp_path: Path,
    upstream_ca: trustme.CA,
    tls_upstream: Upstream,
    resolved_by_os: list[str],
) -> None:
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port) as proxy:
        ca = proxy_ca(tmp_path)
        base = f"https://paths.test:{port}"
        status, headers, body = await curl(proxy, f"{base}/api/items", "--cacert", ca)
        assert (status, body) == (200, b"hello from upstream\n")
        status, headers, body = await curl(proxy, f"{base}/admin", "--cacert", ca)
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "path_not_allowed"
        # Dot segments cannot walk out of the prefix (curl would squash them: --path-as-is).
        status, headers, _ = await curl(
            proxy, f"{base}/api/../admin", "--cacert", ca, "--path-as-is"
        )
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "path_not_allowed"
        # Only the allowed request reached the upstream, with the name as its Host.
        assert tls_upstream.requests == [("GET /api/items HTTP/1.1", f"paths.test:{port}")]
        assert dns.count("paths.test", "A") == 1  # resolved once, at the CONNECT
        assert resolved_by_os == []
        # One line per request: an allow at its last stage (the address), a denial at the
        # stage that denied it (the name, on its path).
        requests = [
            (x["decision"], x["reason"], x["stage"], x["path"])
            for x in proxy.lines()
            if x["event"] == "decision" and x["protocol"] == "https"
        ]
        assert requests == [
            ("allow", "allowed", "address", "/api/items"),
            ("deny", "path_not_allowed", "name", "/admin"),
            ("deny", "path_not_allowed", "name", "/api/../admin"),
        ]


@pytest.mark.asyncio
async def test_blocked_prefix_of_a_whole_host_is_enforced_inside(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port) as proxy:
        ca = proxy_ca(tmp_path)
        status, _, _ = await curl(proxy, f"https://whole.test:{port}/docs", "--cacert", ca)
        assert status == 200
        status, headers, _ = await curl(proxy, f"https://whole.test:{port}/ADMIN/x", "--cacert", ca)
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "blocked"
        assert [r[0] for r in tls_upstream.requests] == ["GET /docs HTTP/1.1"]


@pytest.mark.asyncio
async def test_the_client_sees_the_proxy_ca_not_the_upstream(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port) as proxy:
        # Trusting only the upstream's CA fails: the certificate the client sees is ours.
        bundle = tmp_path / "upstream-ca.pem"
        _, _, body = await curl(proxy, f"https://paths.test:{port}/api/x", "--cacert", str(bundle))
        assert body == b""
        assert tls_upstream.requests == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("issuer", "name"),
    [("rogue", "paths.test"), ("trusted", "other.test")],
    ids=["untrusted_issuer", "wrong_name"],
)
async def test_upstream_certificate_is_verified(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, issuer: str, name: str
) -> None:
    # A certificate from a CA the proxy does not trust, or one for another name: 502.
    ca = trustme.CA() if issuer == "rogue" else upstream_ca
    async with (
        serving(Upstream(), tls_context(ca, name)) as upstream,
        intercepting(dns, tmp_path, upstream_ca, upstream.port) as proxy,
    ):
        status, headers, _ = await curl(
            proxy, f"https://paths.test:{upstream.port}/api/x", "--cacert", proxy_ca(tmp_path)
        )
        assert status == 502
        assert headers["x-egress-error"] == "upstream_tls"
        assert upstream.requests == []
        assert any(x["reason"] == "upstream_tls" and x["decision"] == "deny" for x in proxy.lines())


@pytest.mark.asyncio
async def test_host_header_inside_must_match_the_tunnel(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port) as proxy:
        status, headers, _ = await curl(
            proxy,
            f"https://paths.test:{port}/api/x",
            "--cacert",
            proxy_ca(tmp_path),
            "-H",
            f"Host: whole.test:{port}",
        )
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "host_mismatch"
        assert tls_upstream.requests == []


@pytest.mark.asyncio
async def test_sni_gate_applies_before_interception(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    async with intercepting(dns, tmp_path, upstream_ca, tls_upstream.port) as proxy:
        status, _, reader, writer = await connect(proxy, f"paths.test:{tls_upstream.port}")
        assert status == 200
        writer.write(python_hello("whole.test"))
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        assert tls_upstream.connections == 0
        assert any(x["reason"] == "sni_mismatch" for x in proxy.lines())


@pytest.mark.asyncio
async def test_inspection_disabled_refuses_path_hosts(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port, enabled=False) as proxy:
        status, headers, _, writer = await connect(proxy, f"paths.test:{port}")
        writer.close()
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "inspection_disabled"
        assert dns.count("paths.test", "A") == 0
        assert not (tmp_path / "ca").exists()  # no CA is made when inspection is off


@pytest.mark.asyncio
async def test_passthrough_hosts_are_not_intercepted(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    # A host allowed whole (no path rules, no blocked prefixes) keeps its own certificate.
    dns.set("plain.test", a=["127.0.0.1"])
    async with serving(Upstream(), tls_context(upstream_ca, "plain.test")) as upstream:
        bundle = tmp_path / "upstream-ca.pem"
        upstream_ca.cert_pem.write_to_path(str(bundle))
        manifest = 'schema_version = 1\n[network_access]\nallowed = ["plain.test"]\n'
        extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n"
        async with started(dns, extra, manifest=manifest, source="agent.toml") as proxy:
            status, _, body = await curl(
                proxy, f"https://plain.test:{upstream.port}/", "--cacert", str(bundle)
            )
            assert (status, body) == (200, b"hello from upstream\n")


def test_ca_is_created_once_with_a_private_key(tmp_path: Path) -> None:
    directory = tmp_path / "nested" / "ca"
    first = ensure_ca(directory)
    assert first.created
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.key_path.stat().st_mode) & 0o077 == 0
    cert = first.cert_path.read_bytes()
    assert b"BEGIN CERTIFICATE" in cert
    second = ensure_ca(directory)
    assert not second.created
    assert second.cert_path.read_bytes() == cert  # the same CA, not a new one
    assert str(first.cert_path) in first.trust_hint()


def test_ca_problems_are_clear_errors(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    ca = ensure_ca(directory)
    ca.key_path.chmod(0o644)
    with pytest.raises(ProxyError, match="readable by others") as info:
        ensure_ca(directory)
    assert info.value.reason == "ca_error"
    ca.key_path.chmod(0o600)
    ca.key_path.write_bytes(b"not a key")
    with pytest.raises(ProxyError, match="cannot load the CA"):
        ensure_ca(directory)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ProxyError, match="cannot create the directory"):
        ensure_ca(blocker / "ca")


@pytest.mark.asyncio
async def test_socks5_tunnels_are_intercepted_too(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    port = tls_upstream.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        socks_port = s.getsockname()[1]
    listeners = [Listener("socks5", "127.0.0.1", socks_port)]
    async with intercepting(dns, tmp_path, upstream_ca, port, listeners=listeners) as proxy:
        statuses = []
        for path in ("/api/items", "/admin"):
            _, out, _ = await curl_socks(
                socks_port,
                f"https://paths.test:{port}{path}",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--cacert",
                proxy_ca(tmp_path),
            )
            statuses.append(out)
        assert statuses == [b"200", b"403"]
        assert tls_upstream.requests == [("GET /api/items HTTP/1.1", f"paths.test:{port}")]
        # Each tunnel's allow at the SOCKS5 SNI gate, then its request decided inside.
        decisions = [
            (x["protocol"], x["stage"], x["reason"], x["path"])
            for x in proxy.lines()
            if x["event"] == "decision"
        ]
        assert decisions == [
            ("socks5", "sni", "allowed", None),
            ("https", "address", "allowed", "/api/items"),
            ("socks5", "sni", "allowed", None),
            ("https", "name", "path_not_allowed", "/admin"),
        ]


@pytest.mark.asyncio
async def test_only_http_is_spoken_inside_interception(
    dns: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, tls_upstream: Upstream
) -> None:
    # A client that completes TLS and then speaks something else gets an HTTP error, never a
    # raw byte relay to a host whose rules are per path.
    port = tls_upstream.port
    async with intercepting(dns, tmp_path, upstream_ca, port) as proxy:
        status, _, reader, writer = await connect(proxy, f"paths.test:{port}")
        assert status == 200
        client_tls = ssl.create_default_context(cafile=proxy_ca(tmp_path))
        await writer.start_tls(client_tls, server_hostname="paths.test")
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert tls_upstream.connections == 0
