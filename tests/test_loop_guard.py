"""Issue 20: the loop guard refuses before any dial. The proxy's own listeners (proxy, SOCKS5,
admin, the DNS listener's TCP port; every address of a wildcard bind) are never a destination,
on any plane, whatever the bind address: a name the operator's loopback allowance lets resolve
to one of them is refused (`proxy_loop`: 403, SOCKS5 reply 2, a 403 inside interception) and no
second connection reaches the proxy (no dial is even tried: `upstream_connect_seconds` stays
empty, and every close line is a client's own). Only loopback addresses are used.

`OwnListeners` (proxy/netaddr.py) is the one guard; the Vetter asks it at the end of the address
stage, which every plane takes before it dials (tunnels, plain HTTP, the interception engine's
requests, transparent connections)."""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dns_server import DNSServer, running_dns_server
from support.running import RunningProxy, http_get

from proxy.common.listeners import Listener, OwnListeners, format_listen

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

SELF = "network:\n  egress: [self.test]\n"
# Loopback in every spelling a name may resolve to: the unspecified address is dialled as
# loopback by the kernel.
ALLOW = ("'127.0.0.0/8'", "'::1/128'", "'0.0.0.0/32'", "'::/128'")


@pytest.fixture(scope="module")
def dns() -> Iterator[DNSServer]:
    with running_dns_server() as server:
        yield server


def exchange(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """`data` on a fresh connection, then everything read until the proxy closes it."""
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(data)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got


def denied(response: bytes) -> tuple[int, str | None]:
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), fields.get("X-Egress-Denied")


def socks5(host: str, port: int, name: str, to: int) -> int:
    """A SOCKS5 CONNECT to name:to (ATYP 3): the reply code."""
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall(b"\x05\x01\x00")
        assert conn.recv(2) == b"\x05\x00"
        wire = name.encode()
        conn.sendall(b"\x05\x01\x00\x03" + bytes([len(wire)]) + wire + to.to_bytes(2, "big"))
        return conn.recv(10)[1]


def dns_port(proxy: RunningProxy) -> int:
    match = re.search(r" and dns://\S+:(\d+)", proxy.stderr())
    assert match, proxy.stderr()
    return int(match[1])


def assert_no_dial(proxy: RunningProxy, clients: int, host: str = "127.0.0.1") -> None:
    """Nothing was dialled, and every connection the proxy saw was one of ours (`clients`)."""
    status, metrics = http_get(f"http://{format_listen(host, proxy.admin_port)}/metrics")
    assert status == 200, metrics
    assert "egress_upstream_connect_seconds_count" not in metrics, metrics
    lines = proxy.audit()
    closes = [x for x in lines if x["event"] == "close"]
    assert len(closes) == clients, closes
    assert {x["reason"] for x in closes} == {"proxy_loop"}, closes
    loops = [x for x in lines if x["event"] == "decision" and x["reason"] == "proxy_loop"]
    assert len(loops) == clients and {x["stage"] for x in loops} == {"address"}, loops
    assert not [x for x in lines if x.get("decision") == "allow"]


@pytest.mark.parametrize(
    ("bind", "client", "answers"),
    [
        # A v4 wildcard: all of 127/8 is ours, and the unspecified address.
        ("0.0.0.0", "127.0.0.1", {"a": ["127.0.0.1"]}),
        ("0.0.0.0", "127.0.0.1", {"a": ["127.0.0.2"]}),
        ("0.0.0.0", "127.0.0.1", {"a": ["0.0.0.0"]}),
        # A v6 wildcard: ::1, and the unspecified address.
        ("[::]", "::1", {"aaaa": ["::1"]}),
        ("[::]", "::1", {"aaaa": ["::"]}),
        # A specific bind: the unspecified address reaches it (the kernel dials loopback).
        ("127.0.0.1", "127.0.0.1", {"a": ["0.0.0.0"]}),
        ("[::1]", "::1", {"aaaa": ["::"]}),
    ],
)
def test_every_listener_is_refused_before_any_dial(
    tmp_path: Path, dns: DNSServer, bind: str, client: str, answers: dict[str, list[str]]
) -> None:
    dns.set("self.test", **answers)
    args = ("--listen", f"socks5://{bind}:0", "--dns-listen", f"{bind}:0")
    listen = f"{bind}:0"
    with RunningProxy(
        tmp_path, SELF, dns=dns, allow=ALLOW, listen=listen, admin=listen, args=args
    ) as proxy:
        socks_port = int(re.findall(r"socks5://\S+:(\d+)", proxy.stderr())[0])
        ports = (proxy.port, socks_port, proxy.admin_port, dns_port(proxy))
        for port in ports:
            where = b"self.test:%d" % port
            tunnel = exchange(client, proxy.port, b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n"
                              % (where, where))  # fmt: skip
            assert denied(tunnel) == (403, "proxy_loop"), tunnel
            plain = exchange(client, proxy.port, b"GET http://%s/metrics HTTP/1.1\r\nHost: %s"
                             b"\r\nConnection: close\r\n\r\n" % (where, where))  # fmt: skip
            assert denied(plain) == (403, "proxy_loop"), plain
            assert b"egress_" not in plain  # nothing of /metrics came back
            assert socks5(client, socks_port, "self.test", port) == 2
        assert_no_dial(proxy, 3 * len(ports), client)


def test_a_v6_only_wildcard_does_not_claim_ipv4(tmp_path: Path, dns: DNSServer) -> None:
    # `[::]` is v6-only: 127.0.0.1 on the same port is another socket, not ours, and reached.
    dns.set("self.test", a=["127.0.0.1"])
    with RunningProxy(tmp_path, SELF, dns=dns, allow=ALLOW, listen="[::]:0") as proxy:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", proxy.port))
        server.listen(1)
        with server:
            where = b"self.test:%d" % proxy.port
            with socket.create_connection(("::1", proxy.port), timeout=5) as conn:
                conn.sendall(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (where, where))
                assert conn.recv(100).startswith(b"HTTP/1.1 200 "), proxy.audit()
                upstream, _ = server.accept()
                upstream.close()


def test_a_request_inside_interception_to_our_own_listener_is_refused(
    tmp_path: Path, dns: DNSServer
) -> None:
    # The tunnel's name pointed elsewhere when the front door vetted it; by the request inside
    # interception it resolves to the proxy itself (TTL 0): refused there, never dialled.
    dns.set("self.test", a=["127.0.0.2"], ttl=0)
    manifest = (
        "schema_version: 1\nnetwork_access:\n  allowed: ['self.test']\n"
        "  blocked: ['https://self.test/admin/']\n"
    )
    extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n"
    with RunningProxy(tmp_path, manifest, dns=dns, allow=ALLOW, config_extra=extra) as proxy:
        port = proxy.port
        context = ssl.create_default_context(cafile=str(tmp_path / "ca" / "mitmproxy-ca-cert.pem"))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"CONNECT self.test:%d HTTP/1.1\r\nHost: self.test\r\n\r\n" % port)
            assert conn.recv(100).startswith(b"HTTP/1.1 200 ")
            with context.wrap_socket(conn, server_hostname="self.test") as tls:
                dns.set("self.test", a=["127.0.0.1"], ttl=0)
                tls.sendall(b"GET /x HTTP/1.1\r\nHost: self.test:%d\r\nConnection: close\r\n\r\n"
                            % port)  # fmt: skip
                response = b""
                while chunk := tls.recv(65536):
                    response += chunk
        assert denied(response) == (403, "proxy_loop"), response
        assert "egress_upstream_connect_seconds_count" not in proxy.metrics()
        lines = proxy.audit()
        closes = [x for x in lines if x["event"] == "close"]
        assert len(closes) == 1, closes  # the client's: nothing else reached the proxy
        loops = [x for x in lines if x.get("reason") == "proxy_loop"]
        assert [(x["plane"], x["stage"]) for x in loops] == [("l7", "address")], loops


# -- the guard itself ----------------------------------------------------------------------------


def test_the_guard_covers_every_address_of_a_wildcard_bind_and_no_other() -> None:
    listeners = [
        Listener("dns", "127.0.0.1", 53),
        Listener("http", "0.0.0.0", 3128),
        Listener("admin", "::", 9901),
        Listener("socks5", "::1", 1080),
    ]
    own = OwnListeners(listeners)
    assert own.listener("127.0.0.1", 53) == listeners[0]
    assert own.listener("::ffff:127.0.0.1", 53) == listeners[0]  # IPv4-mapped is IPv4
    assert own.listener("127.0.0.2", 53) is None  # a specific bind: that address alone
    assert own.listener("127.0.0.2", 3128) == listeners[1]  # all of 127/8 is local
    assert own.listener("::ffff:127.9.9.9", 3128) == listeners[1]
    assert own.listener("::1", 9901) == listeners[2]
    assert own.listener("::1", 3128) is None  # a v4 wildcard: v4 addresses only
    assert own.listener("127.0.0.1", 9901) is None  # ours are v6-only
    assert own.listener("::1", 1080) == listeners[3]
    # The unspecified address is dialled as loopback: ours on every port we listen on.
    for port in (53, 3128, 9901, 1080):
        assert own.is_own("0.0.0.0", port) and own.is_own("::", port)
        assert own.is_own("::ffff:0.0.0.0", port)
        assert own.is_own("not an address", port)  # fail closed
    # Addresses of other hosts (documentation ranges, never assigned here) are not ours...
    assert own.listener("192.0.2.1", 3128) is None
    assert own.listener("2001:db8::1", 9901) is None
    # ... and no address on a port we do not listen on.
    assert not own.is_own("127.0.0.1", 3129)
    assert not own.is_own("0.0.0.0", 3129)


def test_the_guard_asks_the_kernel_for_a_wildcard_bind() -> None:
    # Every address a socket here can bind to is this host's: a wildcard listener's. (The
    # address is only bound, never connected to.)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # sends nothing: only picks the outgoing address
        except OSError:
            pytest.skip("no IPv4 route out of this host")
        local = probe.getsockname()[0]
    own = OwnListeners([Listener("http", "0.0.0.0", 3128), Listener("dns", "127.0.0.1", 53)])
    assert own.is_own(local, 3128)
    assert own.is_own(local, 53) is (local == "127.0.0.1")
