"""ALPN inside interception on the real `egress-proxy run` process (`inspection.mode: all`): a
client that offers h2 gets h2 wherever h2 stands in its list (httpx with `http2=True` offers
`http/1.1, h2`, in that order), one that offers only HTTP/1.1 gets HTTP/1.1, and the upstream is
offered only what the client offered. The upstream here speaks HTTP/1.1 alone, so an h2 client's
requests are carried across versions. Loopback only, every wait bounded."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
import trustme
from support.dns_server import DNSServer
from support.running import LOOPBACK, RunningProxy, recv_head, tcp_server, wait_for

from proxy.decide.clienthello import parse_client_hello

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

HOST = "h2.test"
BODY = b"hello over http/1.1\n"
TIMEOUT = 10.0


class Upstream:
    """A TLS server for HOST speaking HTTP/1.1 only, recording the ALPN offers of each
    ClientHello it gets."""

    def __init__(self, directory: Path) -> None:
        ca = trustme.CA()
        self.ca_file = directory / "upstream-ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(HOST).configure_cert(self.context)
        self.context.set_alpn_protocols(["http/1.1"])
        self.offers: list[tuple[str, ...]] = []
        self._lock = threading.Lock()

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        hello = None
        deadline = time.monotonic() + 5
        while hello is None and time.monotonic() < deadline:
            # Peeked, not read: the TLS handshake below reads the same bytes.
            hello = parse_client_hello(conn.recv(65536, socket.MSG_PEEK))
        assert hello is not None, "no whole ClientHello"
        with self._lock:
            self.offers.append(tuple(alpn.decode() for alpn in hello.alpn_protocols))
        with self.context.wrap_socket(conn, server_side=True) as tls:
            if b"\r\n\r\n" not in recv_head(tls):
                return
            tls.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY)
                + BODY
            )


@pytest.fixture
def upstream(tmp_path: Path) -> Upstream:
    return Upstream(tmp_path)


@pytest.fixture
def port(upstream: Upstream) -> Iterator[int]:
    with tcp_server(upstream.handle) as bound:
        yield bound


def tunnel(proxy_port: int, port: int, alpns: list[str], ca: Path) -> ssl.SSLSocket:
    """A TLS connection to HOST:port through the proxy's CONNECT, offering `alpns` in order."""
    raw = socket.create_connection((LOOPBACK, proxy_port), timeout=TIMEOUT)
    authority = f"{HOST}:{port}"
    raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = recv_head(raw, 8192, size=1)  # not a byte of the TLS that follows
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n"), head
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(alpns)
    return context.wrap_socket(raw, server_hostname=HOST)


def h2_get(tls: ssl.SSLSocket, authority: str) -> tuple[int, bytes]:
    """One HTTP/2 GET of `/` on an established h2 connection: (status, body)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    headers = [(":method", "GET"), (":path", "/"), (":scheme", "https")]
    conn.send_headers(stream, [*headers, (":authority", authority)], end_stream=True)
    tls.sendall(conn.data_to_send())
    status, body = 0, b""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        data = tls.recv(65536)
        assert data, "the proxy closed the h2 connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
            elif isinstance(event, h2.events.StreamEnded):
                return status, body
        tls.sendall(conn.data_to_send())
    raise AssertionError("no whole h2 answer in time")


def http1_get(tls: ssl.SSLSocket, authority: str) -> bytes:
    tls.sendall(f"GET / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
    answer = b""
    while len(answer) < 65536 and (chunk := tls.recv(65536)):
        answer += chunk
    return answer


def test_h2_is_preferred_whenever_the_client_offers_it(
    tmp_path: Path, dns: DNSServer, upstream: Upstream, port: int
) -> None:
    dns.set(HOST, a=["127.0.0.1"])
    ca = tmp_path / "ca"
    config = f"inspection:\n  ca_dir: {ca}\n  upstream_ca: {upstream.ca_file}\n  mode: all\n"
    manifest = f"network:\n  egress: [{HOST}]\n"
    with RunningProxy(tmp_path / "run", manifest, dns=dns, config_extra=config) as proxy:
        proxy_ca = ca / "mitmproxy-ca-cert.pem"
        authority = f"{HOST}:{port}"
        # h2 second in the client's list: h2 all the same.
        with tunnel(proxy.port, port, ["http/1.1", "h2"], proxy_ca) as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert h2_get(tls, authority) == (200, BODY)
        # Only HTTP/1.1 offered: HTTP/1.1.
        with tunnel(proxy.port, port, ["http/1.1"], proxy_ca) as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"
            answer = http1_get(tls, authority)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(BODY), answer
        wait_for(lambda: len(proxy.closes()) == 2, what="two close lines")
    # The upstream was offered what each client offered, in its order, and nothing else.
    assert upstream.offers == [("http/1.1", "h2"), ("http/1.1",)]
    # Each request decided inside, whichever version it came in.
    requests = [(x["plane"], x["method"], x["path"]) for x in proxy.decisions() if x["path"]]
    assert requests == [("l7", "GET", "/")] * 2
    assert proxy.returncode == 0
