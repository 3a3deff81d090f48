"""Issue 11 through the real `egress-proxy run`: what the policy core refuses reaches a client
of the running proxy the same way, on CONNECT and on plain HTTP.

- A bracketed name (`CONNECT [github.com]:443`) is an invalid host, never `github.com`: no
  tunnel, no DNS query for the name.
- A DNS answer with no addresses (NOERROR, no A or AAAA) is a denial with a reason code, the
  same on CONNECT and on plain HTTP, as `explain --resolve HOST=` says.
- Blocked URL prefixes hold on every scheme and port of their host, and every request spelling
  a server may read as the blocked path is refused, while the bytes forwarded are the ones
  decided on.
- The proxy's own listeners (proxy, admin, DNS) are never a destination, on CONNECT and on plain
  HTTP: refused (`proxy_loop`) before any dial.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from support.dns_server import DNSServer
from support.running import (
    HTTPUpstream,
    RunningProxy,
    curl,
    exchange,
    http_upstream,
    tcp_server,
    wait_for,
)

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

LOOPBACK = "127.0.0.1"


@pytest.fixture
def upstream() -> Iterator[HTTPUpstream]:
    with http_upstream() as server:
        yield server


def head_of(response: bytes) -> tuple[int, dict[str, str]]:
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    lines = head.split("\r\n")
    assert lines and lines[0].startswith("HTTP/1."), response[:200]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


GITHUB = "network:\n  egress: [github.com, empty.test, up.test]\n"


BRACKETED = [
    b"[github.com]:443",
    b"[GitHub.com.]:443",
    b"[1.2.3.4]:443",
    b"[xn--n3h.com]:443",
    b"[]:443",
]


def test_a_bracketed_name_is_never_tunnelled(tmp_path: Path, dns: DNSServer) -> None:
    dns.set("github.com", a=["127.0.0.1"])
    with RunningProxy(tmp_path, GITHUB, dns=dns) as proxy:
        for target in BRACKETED:
            request = b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)
            response = exchange(proxy.port, request)
            status, headers = head_of(response)
            assert status in (400, 403), (target, response)
            denied = headers.get("x-egress-denied")
            assert denied in ("invalid_host", "invalid_request"), (target, response)
            assert b"200" not in response.split(b"\r\n", 1)[0]
        # Nothing was asked of DNS: no bracketed name was read as the name inside.
        assert dns.queries == []
        # One refusal, one line, for each CONNECT.
        denials = [line for line in proxy.audit() if line.get("decision") == "deny"]
        assert len(denials) == len(BRACKETED), proxy.audit()
        why = [line.get("message") or "" for line in denials]
        assert sum("brackets hold an IPv6 address" in m for m in why) >= 4, why
        assert not [line for line in proxy.audit() if line.get("decision") == "allow"]


def test_a_bracketed_name_in_a_plain_http_request_is_refused(
    tmp_path: Path, dns: DNSServer, upstream: HTTPUpstream
) -> None:
    dns.set("up.test", a=["127.0.0.1"])
    with RunningProxy(tmp_path, GITHUB, dns=dns) as proxy:
        request = b"GET http://[up.test]:%d/ HTTP/1.1\r\nHost: [up.test]:%d\r\n\r\n" % (
            upstream.port,
            upstream.port,
        )
        status, headers = head_of(exchange(proxy.port, request))
        # Brackets hold an IPv6 literal and nothing else: the target is refused as it is read,
        # a 400, no DNS, nothing upstream.
        assert (status, headers.get("x-egress-denied")) == (400, "invalid_request")
        assert dns.queries == [] and upstream.requests == []
        # A bracketed name in the Host header is no spelling of the request's host.
        request = b"GET http://up.test:%d/ HTTP/1.1\r\nHost: [up.test]:%d\r\n\r\n" % (
            upstream.port,
            upstream.port,
        )
        status, headers = head_of(exchange(proxy.port, request))
        assert (status, headers.get("x-egress-denied")) == (403, "host_mismatch")
        assert dns.queries == [] and upstream.requests == []


def test_an_answer_without_addresses_is_a_denial_on_connect_and_plain_http(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("empty.test")  # NOERROR, no A and no AAAA
    with RunningProxy(tmp_path, GITHUB, dns=dns) as proxy:
        tunnel = curl(proxy.port, "https://empty.test/")
        plain = curl(proxy.port, "http://empty.test/")
        assert tunnel.connect_status == 403, tunnel
        assert tunnel.headers.get("x-egress-denied") == "no_addresses", tunnel.headers
        assert plain.status == 403, plain
        assert plain.headers.get("x-egress-denied") == "no_addresses", plain.headers
        assert "denied: no_addresses" in plain.body
        denials = [
            (line["stage"], line["reason"])
            for line in proxy.audit()
            if line.get("decision") == "deny" and line.get("host") == "empty.test"
        ]
        assert denials == [("address", "no_addresses")] * 2, proxy.audit()


def test_paths_are_decided_on_every_reading_and_forwarded_as_sent(
    tmp_path: Path, dns: DNSServer, upstream: HTTPUpstream
) -> None:
    port = upstream.port
    # The block is written for https on 443; it holds on this plain-HTTP port too.
    manifest = (
        "schema_version: 1\nnetwork_access:\n"
        f"  allowed: ['http://up.test:{port}/api/']\n"
        "  blocked: ['https://up.test/api/secret/']\n"
    )
    dns.set("up.test", a=["127.0.0.1"])
    with RunningProxy(tmp_path, manifest, dns=dns) as proxy:

        def get(path: bytes) -> tuple[int, str | None]:
            request = b"GET http://up.test:%d%s HTTP/1.1\r\nHost: up.test:%d\r\n" % (
                port,
                path,
                port,
            )
            status, headers = head_of(exchange(proxy.port, request + b"Connection: close\r\n\r\n"))
            return status, headers.get("x-egress-denied")

        assert get(b"/api/a//b") == (200, None)
        assert get(b"/api/./x") == (200, None)
        assert get(b"/x//../api/") == (403, "path_not_allowed")  # RFC 3986: /x/api/
        assert get(b"/api//../x") == (403, "ambiguous_path")  # nginx, Go: /x
        assert get(b"/api/x/%2e%2e/%2e%2e/x") == (403, "path_not_allowed")
        for spelling in (
            b"/api/secret/",
            b"/api/SECRET",
            b"/api/secret./x",
            b"/api/secret%20/x",
            b"/api/secret;jsessionid=1/x",
            b"/api/x/../secret/",
            b"/api/secret//../x",
        ):
            assert get(spelling) == (403, "blocked"), spelling
        assert get(b"/api/%2573ecret/") == (403, "ambiguous_path")
    # Only what was allowed went upstream, byte for byte: the proxy decides, never rewrites.
    assert upstream.requests == ["/api/a//b", "/api/./x"]


@contextlib.contextmanager
def tls_upstream(ca: trustme.CA, name: str) -> Iterator[tuple[int, list[str]]]:
    """A TLS server for `name` on loopback answering every request with 200; yields its port
    and the request lines it was sent."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    requests: list[str] = []

    def handle(conn: socket.socket) -> None:
        conn.settimeout(5)
        with context.wrap_socket(conn, server_side=True) as tls:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = tls.recv(4096)
                if not chunk:
                    return
                data += chunk
            requests.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")

    with tcp_server(handle) as port:
        yield port, requests


def test_a_blocked_prefix_written_for_443_holds_inside_tls_on_another_port(
    tmp_path: Path, dns: DNSServer
) -> None:
    ca = trustme.CA()
    bundle = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    dns.set("whole.test", a=["127.0.0.1"])
    manifest = (
        "schema_version: 1\nnetwork_access:\n"
        "  allowed: ['whole.test']\n"
        "  blocked: ['https://whole.test/admin/']\n"
    )
    extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n"
    with (
        tls_upstream(ca, "whole.test") as (port, requests),
        RunningProxy(tmp_path, manifest, dns=dns, config_extra=extra) as proxy,
    ):
        proxy_ca = str(tmp_path / "ca" / "mitmproxy-ca-cert.pem")
        base = f"https://whole.test:{port}"
        ok = curl(proxy.port, f"{base}/docs", "--cacert", proxy_ca)
        assert (ok.status, ok.body) == (200, "ok\n"), ok
        for path in (
            "/admin/",
            "/ADMIN/x",
            "/admin./x",
            "/admin%20/x",
            "/admin;x/",
            "/x/../admin/",
        ):
            denied = curl(proxy.port, base + path, "--cacert", proxy_ca, "--path-as-is")
            assert denied.status == 403, (path, denied)
            assert denied.headers.get("x-egress-denied") == "blocked", (path, denied.headers)
    assert requests == ["GET /docs HTTP/1.1"]


def test_the_proxy_never_talks_to_its_own_listeners(tmp_path: Path, dns: DNSServer) -> None:
    # A name the operator's loopback allowance lets resolve to the proxy's own address: the
    # proxy, admin (/metrics) and DNS listeners are refused as destinations on CONNECT and on
    # plain HTTP alike, before any dial.
    dns.set("self.test", a=["127.0.0.1"])
    manifest = "network:\n  egress: [self.test]\n"
    args = ("--dns-listen", f"{LOOPBACK}:0")
    with RunningProxy(tmp_path, manifest, dns=dns, args=args) as proxy:
        dns_port = int(proxy.stderr().split(f"dns://{LOOPBACK}:")[1].split()[0])
        for port in (proxy.port, proxy.admin_port, dns_port):
            where = b"self.test:%d" % port
            tunnel = exchange(
                proxy.port, b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (where, where)
            )
            status, headers = head_of(tunnel)
            assert (status, headers.get("x-egress-denied")) == (403, "proxy_loop"), tunnel
            plain = exchange(
                proxy.port,
                b"GET http://%s/metrics HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                % (where, where),
            )
            status, headers = head_of(plain)
            assert (status, headers.get("x-egress-denied")) == (403, "proxy_loop"), plain
            assert b"egress_" not in plain  # nothing of /metrics came back
        # Each connection's close line says why it ended (the last is written once the proxy
        # saw the client go, which may be after the client read its answer).
        wait_for(lambda: len(proxy.closes()) == 6, what="six close lines")
        lines = proxy.audit()
        loops = [x for x in lines if x["event"] == "decision" and x["reason"] == "proxy_loop"]
        assert len(loops) == 6 and {x["stage"] for x in loops} == {"address"}
        closes = [x["reason"] for x in lines if x["event"] == "close"]
        assert closes.count("proxy_loop") == 6, closes
        assert not [x for x in proxy.audit() if x.get("decision") == "allow"]
