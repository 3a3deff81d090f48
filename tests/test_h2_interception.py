"""HTTP/2 inside TLS interception (ALPN h2), gRPC among its clients: a real grpcio server with a
TLS certificate from the test's CA on loopback, real grpcio clients through the proxy's CONNECT
(`grpc.http_proxy`), curl with --http2 (through CONNECT and SOCKS5), and a raw HTTP/2 client
(hyper-h2) for what neither sends: CONNECT and extended CONNECT inside, a Host header beside
`:authority`. Every stream is decided as an HTTP/1.1 request is, one audit line per request.

In process, as `egress-proxy run` wires it (tests/support/in_process.py `started`): the front door
decides, vets and SNI-gates each tunnel and hands it to the engine, here because the manifest's
rules for the host are URL prefixes (`inspection.mode: prefixes`, the default)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import pytest_asyncio
from mitmproxy import http
from support.dns_server import DNSServer
from support.in_process import (
    CURL,
    PROXY_CA,
    UPSTREAM_CA,
    Running,
    Upstream,
    intercepted,
    last_head,
    serving,
    started,
    tls_serving,
)
from support.real_servers import free_port
from support.tls import tls_context

from policy.reasons import Reason
from proxy.common.listeners import Listener
from proxy.common.refusals import DENIED_HEADER, ERROR_HEADER, Refused
from proxy.decide.interception import Destination
from proxy.decide.vetting import Peer
from proxy.l7.request_checks import check_request, denial, grpc_message

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

SERVICE = "test.Echo"
TIMEOUT = 10.0  # every call and wait of a client below is bounded by it


def _identity(data: bytes) -> bytes:
    return data


# -- a gRPC server of the test's own ---------------------------------------------------------


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b"pong:" + request


def _server_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for index in range(5):
        yield b"message %d" % index
        time.sleep(0.05)  # apart in time: a buffering proxy would hand them over at once


def _chat(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield b"echo:" + request


@contextlib.contextmanager
def grpc_server() -> Iterator[int]:
    """A TLS gRPC server for grpc.test on loopback (raw bytes in and out); yields its port."""
    handlers = {
        "Ping": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Secret": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_server_stream, _identity, _identity),
        "Chat": grpc.stream_stream_rpc_method_handler(_chat, _identity, _identity),
        "Upload": grpc.stream_stream_rpc_method_handler(_chat, _identity, _identity),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    cert = UPSTREAM_CA.issue_cert("grpc.test")
    key, chain = cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)]))
    server.start()
    try:
        yield port
    finally:
        server.stop(0).wait(TIMEOUT)


@contextlib.contextmanager
def channel(proxy: Running, port: int) -> Iterator[grpc.Channel]:
    """A gRPC channel to grpc.test:PORT through the proxy's CONNECT, trusting the proxy's CA."""
    with open(PROXY_CA, "rb") as ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
    options = [("grpc.http_proxy", f"http://127.0.0.1:{proxy.port}")]
    with grpc.secure_channel(f"grpc.test:{port}", credentials, options=options) as opened:
        yield opened


def unary(opened: grpc.Channel, method: str, request: bytes = b"x") -> bytes:
    call = opened.unary_unary(f"/{SERVICE}/{method}", _identity, _identity)
    return call(request, timeout=TIMEOUT)  # type: ignore[no-any-return]


def ping_pong(opened: grpc.Channel, method: str, rounds: int) -> list[bytes]:
    """A bidi call that sends each message only once the answer to the last one came: through
    a proxy that buffers either body, it would wait forever (bounded: TIMEOUT)."""
    outgoing: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (item := outgoing.get(timeout=TIMEOUT)) is not None:
            yield item

    call = opened.stream_stream(f"/{SERVICE}/{method}", _identity, _identity)
    answers = call(requests(), timeout=TIMEOUT)
    got = []
    try:
        for index in range(rounds):
            outgoing.put(b"%d" % index)
            got.append(next(answers))
    finally:
        outgoing.put(None)
    return got


def open_stream_denied(opened: grpc.Channel, method: str) -> grpc.RpcError:
    """A client-streaming call to a refused path that never ends its requests: the refusal must
    come at once, not when the body ends."""
    hold = threading.Event()

    def requests() -> Iterator[bytes]:
        yield b"first"
        hold.wait(TIMEOUT)

    call = opened.stream_stream(f"/{SERVICE}/{method}", _identity, _identity)
    try:
        with pytest.raises(grpc.RpcError) as info:
            next(call(requests(), timeout=TIMEOUT))
    finally:
        hold.set()
    return info.value


# -- a raw HTTP/2 client ---------------------------------------------------------------------


class H2Client:
    """HTTP/2 over TLS through the proxy's CONNECT, with hyper-h2: sends header blocks as
    given (CONNECT, :protocol, Host beside :authority), which no ready client does."""

    def __init__(self, proxy_port: int, host: str, port: int) -> None:
        raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=TIMEOUT)
        raw.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = raw.recv(1)
            assert chunk, "the proxy closed during the CONNECT"
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        context = ssl.create_default_context(cafile=PROXY_CA)
        context.set_alpn_protocols(["h2"])
        self.sock = context.wrap_socket(raw, server_hostname=host)
        assert self.sock.selected_alpn_protocol() == "h2"
        # Sent as given: hyper-h2 would refuse to send a Host beside a different :authority.
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding="utf-8",
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())

    def request(
        self, headers: list[tuple[str, str]], *, end_stream: bool = True
    ) -> tuple[dict[str, str], bytes, str]:
        """One stream: the response's headers, its body, and how it ended: "ended" (the
        response's end), "reset" (the stream alone), "terminated" (the whole connection)."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, headers, end_stream=end_stream)
        self.sock.sendall(self.conn.data_to_send())
        answer: dict[str, str] = {}
        body = b""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            data = self.sock.recv(65536)
            assert data, "the proxy closed the connection"
            for event in self.conn.receive_data(data):
                if getattr(event, "stream_id", stream) != stream:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    answer = {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded):
                    self.sock.sendall(self.conn.data_to_send())
                    return answer, body, "ended"
                elif isinstance(event, h2.events.StreamReset):
                    return answer, body, "reset"
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return answer, body, "terminated"
            self.sock.sendall(self.conn.data_to_send())
        raise AssertionError("no answer in time")

    def close(self) -> None:
        self.sock.close()


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("grpc.test", "paths.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


@pytest.fixture(scope="module")
def grpc_port() -> Iterator[int]:
    with grpc_server() as port:
        yield port


@pytest_asyncio.fixture
async def http1_upstream() -> AsyncIterator[Upstream]:
    # An HTTP/1.1 upstream that offers no ALPN: an h2 client's requests reach it as HTTP/1.1.
    async with tls_serving(Upstream(), "paths.test") as upstream:
        yield upstream


@contextlib.asynccontextmanager
async def intercepting(
    dns: DNSServer, grpc_port: int, http_port: int, listeners: list[Listener] | None = None
) -> AsyncIterator[Running]:
    closed = free_port()
    allowed = [
        f"https://grpc.test:{grpc_port}/{SERVICE}/Ping",
        f"https://grpc.test:{grpc_port}/{SERVICE}/Stream",
        f"https://grpc.test:{grpc_port}/{SERVICE}/Chat",
        f"https://grpc.test:{closed}/{SERVICE}/",
        f"https://paths.test:{http_port}/api/",
    ]
    entries = ", ".join(f'"{entry}"' for entry in allowed)
    manifest = f"schema_version = 1\n[network_access]\nallowed = [{entries}]\n"
    async with started(
        dns, manifest=manifest, source="agent.toml", listeners=listeners, inspection=""
    ) as running:
        running.closed_port = closed  # type: ignore[attr-defined]
        yield running


def requests_of(proxy: Running) -> list[tuple[str, str, str | None]]:
    """(decision, reason, path) of each request decided inside interception."""
    return [
        (x["decision"], x["reason"], x["path"])
        for x in proxy.lines()
        if x["event"] == "decision" and x["plane"] == "l7" and x["stage"] != "upstream"
    ]


# -- gRPC --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_grpc_calls_are_decided_one_by_one(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream
) -> None:
    async with intercepting(dns, grpc_port, http1_upstream.port) as proxy:

        def calls() -> dict[str, Any]:
            with channel(proxy, grpc_port) as opened:
                streamed = opened.unary_stream(f"/{SERVICE}/Stream", _identity, _identity)
                arrivals = []
                for message in streamed(b"", timeout=TIMEOUT):
                    arrivals.append((message, time.monotonic()))
                with pytest.raises(grpc.RpcError) as denied:
                    unary(opened, "Secret")
                return {
                    "unary": unary(opened, "Ping", b"hello"),
                    "stream": arrivals,
                    "denied": denied.value,
                    "chat": ping_pong(opened, "Chat", 3),
                    "upload": open_stream_denied(opened, "Upload"),
                }

        done = await asyncio.to_thread(calls)
    assert done["unary"] == b"pong:hello"
    # Server streaming: every message, each as the server sent it (not held to the end).
    messages = [message for message, _ in done["stream"]]
    assert messages == [b"message %d" % index for index in range(5)]
    first, last = done["stream"][0][1], done["stream"][-1][1]
    assert last - first > 0.1
    # Bidi: each answer came before the next request was sent.
    assert done["chat"] == [b"echo:0", b"echo:1", b"echo:2"]
    # A path the manifest does not allow: PERMISSION_DENIED, with the proxy's reason and fix.
    denied = done["denied"]
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "path_not_allowed" in denied.details()
    assert f"'https://grpc.test:{grpc_port}/{SERVICE}/' to network_access.allowed" in (
        denied.details()
    )
    # Trailers-Only (headers that end the stream): grpcio shows them as trailing metadata.
    assert dict(denied.trailing_metadata())[DENIED_HEADER.lower()] == "path_not_allowed"
    upload = done["upload"]
    assert upload.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "path_not_allowed" in upload.details()
    # One line per call, with its path; the gRPC ones are POSTs.
    path = f"/{SERVICE}/"
    assert requests_of(proxy) == [
        ("allow", "allowed", path + "Stream"),
        ("deny", "path_not_allowed", path + "Secret"),
        ("allow", "allowed", path + "Ping"),
        ("allow", "allowed", path + "Chat"),
        ("deny", "path_not_allowed", path + "Upload"),
    ]
    lines = [x for x in proxy.lines() if x["plane"] == "l7" and x["event"] == "decision"]
    assert {(x["method"], x["protocol"], x["sni"]) for x in lines} == {
        ("POST", "https", "grpc.test")
    }


@pytest.mark.asyncio
async def test_an_upstream_failure_is_grpc_unavailable(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream
) -> None:
    async with intercepting(dns, grpc_port, http1_upstream.port) as proxy:
        closed = proxy.closed_port  # type: ignore[attr-defined]

        def call() -> grpc.RpcError:
            with channel(proxy, closed) as opened, pytest.raises(grpc.RpcError) as info:
                unary(opened, "Ping")
            return info.value

        failed = await asyncio.to_thread(call)
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert f"grpc.test:{closed} failed: upstream_refused" in failed.details()
    assert dict(failed.trailing_metadata())[ERROR_HEADER.lower()] == "upstream_refused"


# -- curl --http2 ------------------------------------------------------------------------------


def _curl_has_http2() -> bool:
    if not shutil.which(CURL):
        return False
    done = subprocess.run([CURL, "--version"], capture_output=True, timeout=10, check=False)
    return b"HTTP2" in done.stdout


needs_curl_http2 = pytest.mark.skipif(
    not _curl_has_http2(), reason="this curl has no HTTP/2 (nghttp2) support"
)


async def curl_h2(*args: str) -> tuple[str, int, dict[str, str], bytes]:
    """curl --http2: the HTTP version it used, the status and headers (lowercase names) of the
    last response, and its body."""
    command = [
        CURL, "-sS", "--http2", "--max-time", "5", "--cacert", PROXY_CA,
        "-D", "/dev/stderr", "-o", "-", "-w", "\n%{http_version}", *args,
    ]  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, timeout=15, check=False
    )
    status, headers = last_head(done.stderr)
    body, _, version = done.stdout.rpartition(b"\n")
    return version.decode(), status, headers, body


@needs_curl_http2
@pytest.mark.asyncio
async def test_curl_speaks_http2_inside_and_each_request_is_decided(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream
) -> None:
    port = http1_upstream.port
    base = f"https://paths.test:{port}"
    async with intercepting(dns, grpc_port, port) as proxy:
        via = ("-x", f"http://127.0.0.1:{proxy.port}")
        allowed = await curl_h2(*via, f"{base}/api/items")
        denied = await curl_h2(*via, f"{base}/admin")
        fronted = await curl_h2(*via, f"{base}/api/items", "-H", "Host: other.test")
        wrong_port = await curl_h2(*via, f"{base}/api/items", "-H", "Host: paths.test:1")
    assert allowed == ("2", 200, allowed[2], b"hello from upstream\n")
    version, status, headers, body = denied
    assert (version, status, headers[DENIED_HEADER.lower()]) == ("2", 403, "path_not_allowed")
    assert "connection" not in headers
    assert body.count(b"\n") == 1 and b"path_not_allowed" in body
    # curl sends a Host header as :authority: another host, or another port, is refused.
    for version, status, headers, body in (fronted, wrong_port):
        assert (version, status, headers[DENIED_HEADER.lower()]) == ("2", 403, "host_mismatch")
        assert b":authority" in body
    # The upstream offered no h2: the allowed request reached it as HTTP/1.1, with the name.
    assert http1_upstream.requests == [("GET /api/items HTTP/1.1", f"paths.test:{port}")]
    assert requests_of(proxy) == [
        ("allow", "allowed", "/api/items"),
        ("deny", "path_not_allowed", "/admin"),
        ("deny", "host_mismatch", "/api/items"),
        ("deny", "host_mismatch", "/api/items"),
    ]


@needs_curl_http2
@pytest.mark.asyncio
async def test_socks5_tunnels_speak_http2_inside_too(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream
) -> None:
    port = http1_upstream.port
    socks = free_port()
    listeners = [Listener("http", "127.0.0.1", 0), Listener("socks5", "127.0.0.1", socks)]
    async with intercepting(dns, grpc_port, port, listeners) as proxy:
        via = ("--socks5-hostname", f"127.0.0.1:{socks}")
        allowed = await curl_h2(*via, f"https://paths.test:{port}/api/x")
        denied = await curl_h2(*via, f"https://paths.test:{port}/other")
    assert allowed[:2] == ("2", 200)
    assert denied[:2] == ("2", 403) and denied[2][DENIED_HEADER.lower()] == "path_not_allowed"
    assert requests_of(proxy) == [
        ("allow", "allowed", "/api/x"),
        ("deny", "path_not_allowed", "/other"),
    ]


# -- what only a raw HTTP/2 client sends -------------------------------------------------------


@pytest.mark.asyncio
async def test_connect_and_host_headers_inside_http2(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream
) -> None:
    port = http1_upstream.port
    authority = f"paths.test:{port}"
    get = [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "/api/h2"),
        (":authority", authority),
    ]
    async with intercepting(dns, grpc_port, port) as proxy:

        def exchange() -> list[tuple[dict[str, str], bytes, str]]:
            client = H2Client(proxy.port, "paths.test", port)
            try:
                return [
                    client.request([(":method", "CONNECT"), (":authority", "elsewhere.test:22")]),
                    # RFC 8441: a WebSocket over an HTTP/2 stream (never advertised by us).
                    client.request(
                        [
                            (":method", "CONNECT"),
                            (":protocol", "websocket"),
                            (":scheme", "https"),
                            (":path", "/api/chat"),
                            (":authority", authority),
                        ],
                        end_stream=False,
                    ),
                    client.request([*get, ("host", authority)]),  # agreeing: fine
                    client.request(get),  # the connection outlived every refusal above
                ]
            finally:
                client.close()

        def alone(headers: list[tuple[str, str]]) -> tuple[dict[str, str], bytes, str]:
            client = H2Client(proxy.port, "paths.test", port)
            try:
                return client.request(headers)
            finally:
                client.close()

        answers = await asyncio.to_thread(exchange)
        fronted = await asyncio.to_thread(alone, [*get, ("host", "other.test")])
        doubled = await asyncio.to_thread(alone, [*get, ("host", authority), ("host", authority)])
    statuses = [(a[":status"], a.get(DENIED_HEADER.lower()), end) for a, _, end in answers]
    assert statuses == [
        ("403", "connect_refused", "ended"),
        ("403", "connect_refused", "ended"),
        ("200", None, "ended"),
        ("200", None, "ended"),
    ]
    assert all("connection" not in headers for headers, _, _ in answers)
    assert b"connect_refused" in answers[0][1] and b"connect_refused" in answers[1][1]
    # A Host other than :authority, or two Host headers: hyper-h2 in mitmproxy ends the
    # connection (a protocol error) before any hook runs; nothing goes upstream.
    assert fronted == doubled == ({}, b"", "terminated")
    # Nothing of the refused streams went upstream.
    assert [line for line, _ in http1_upstream.requests] == ["GET /api/h2 HTTP/1.1"] * 2
    refusals = [x for x in proxy.lines() if x["reason"] == "connect_refused"]
    assert [x["stage"] for x in refusals] == ["request", "request"]
    assert "extended CONNECT (RFC 8441) for 'websocket'" in refusals[1]["message"]


# -- the same rules for HTTP/1.1 ---------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("head", "status", "reason"),
    [
        (
            "CONNECT elsewhere.test:22 HTTP/1.1\r\nHost: elsewhere.test:22\r\n\r\n",
            403,
            "connect_refused",
        ),
        (
            "POST /api/x HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 3\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "invalid_request",
        ),
    ],
    ids=["connect", "smuggling_prone"],
)
async def test_http1_requests_mitmproxy_finds_invalid_get_our_answer(
    dns: DNSServer, grpc_port: int, http1_upstream: Upstream, head: str, status: int, reason: str
) -> None:
    # mitmproxy refuses these itself (HttpStream.check_invalid), after the requestheaders hook:
    # the hook's refusal is the line and the answer, and the connection closes (the rest of
    # the request is never read as a next one).
    port = http1_upstream.port
    async with intercepting(dns, grpc_port, port) as proxy:
        reader, writer = await intercepted(proxy, "paths.test", port)
        writer.write(head.format(authority=f"paths.test:{port}").encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), TIMEOUT)
        writer.close()
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert f"{DENIED_HEADER}: {reason}\r\n".encode() in answer
    assert answer.endswith(b"\n") and answer.count(b"egress-proxy:") == 1
    assert http1_upstream.connections == 0
    (line,) = [x for x in proxy.lines() if x["plane"] == "l7" and x["event"] == "decision"]
    assert (line["decision"], line["reason"], line["stage"]) == ("deny", reason, "request")


# -- the rules themselves (proxy/l7/request_checks.py, on mitmproxy's parsed requests) ---------

DESTINATION = Destination(
    host="paths.test",
    port=443,
    sni="paths.test",
    target="paths.test:443",
    pinned=("127.0.0.1",),
    peer=Peer(None, "c1"),
    protocol="connect",
)


def parsed(version: str, authority: str, *fields: tuple[str, str]) -> http.Request:
    return http.Request(
        host="paths.test",
        port=443,
        method=b"POST",
        scheme=b"https",
        authority=authority.encode(),
        path=b"/test.Echo/Ping",
        http_version=version.encode(),
        headers=http.Headers([(k.encode(), v.encode()) for k, v in fields]),
        content=b"",
        trailers=None,
        timestamp_start=0.0,
        timestamp_end=None,
    )


@pytest.mark.parametrize(
    ("version", "authority", "fields", "reason"),
    [
        ("HTTP/2.0", "paths.test", (), None),  # :authority alone, default port
        ("HTTP/2.0", "paths.test:443", (("host", "PATHS.test"),), None),
        ("HTTP/2.0", "", (("host", "paths.test:443"),), None),  # Host alone
        ("HTTP/2.0", "", (), "host_mismatch"),  # neither
        ("HTTP/2.0", "other.test", (), "host_mismatch"),
        ("HTTP/2.0", "paths.test:8443", (), "host_mismatch"),
        ("HTTP/2.0", "paths.test", (("host", "other.test"),), "host_mismatch"),
        (
            "HTTP/2.0",
            "paths.test",
            (("host", "paths.test"), ("host", "paths.test")),
            "host_mismatch",
        ),
        ("HTTP/1.1", "", (), "host_mismatch"),  # HTTP/1.1 still needs its one Host
        ("HTTP/1.1", "", (("host", "paths.test"),), None),
    ],
)
def test_the_authority_rule(
    version: str, authority: str, fields: tuple[tuple[str, str], ...], reason: str | None
) -> None:
    refused = check_request(parsed(version, authority, *fields), DESTINATION)
    assert (refused and refused.reason) == reason
    if refused is not None and version == "HTTP/2.0":
        assert refused.remedy is not None and ":authority" in refused.remedy


def test_grpc_message_is_percent_encoded() -> None:
    assert grpc_message("a 100% 'ok': é\n") == "a 100%25 'ok': %C3%A9%0A"


@pytest.mark.parametrize("error", [False, True], ids=["denial", "upstream_error"])
def test_denials_in_each_version(error: bool) -> None:
    refused = (
        Refused(502, Reason.UPSTREAM_REFUSED, "m", error=True)
        if error
        else Refused(403, Reason.PATH_NOT_ALLOWED, "m", remedy="add 'x' to y")
    )
    header = ERROR_HEADER if error else DENIED_HEADER
    h1 = denial(refused, "paths.test", 443, parsed("HTTP/1.1", "", ("host", "paths.test")))
    assert h1.http_version == "HTTP/1.1" and h1.headers[header] == refused.reason
    assert ("connection" in h1.headers) is error  # an upstream error closes an HTTP/1.1 client
    h2 = denial(refused, "paths.test", 443, parsed("HTTP/2.0", "paths.test"))
    assert h2.http_version == "HTTP/2.0" and "connection" not in h2.headers
    assert all(name == name.lower() for name in h2.headers)  # HTTP/2 field names
    assert h2.content == h1.content and h2.headers[header] == refused.reason
    # gRPC: Trailers-Only, the body's line in grpc-message.
    call = parsed("HTTP/2.0", "paths.test", ("content-type", "application/grpc+proto"))
    grpc_denial = denial(refused, "paths.test", 443, call)
    assert grpc_denial.content == b"" and grpc_denial.headers[header] == refused.reason
    assert grpc_denial.headers["content-type"] == "application/grpc"
    assert grpc_denial.headers["grpc-status"] == ("14" if error else "7")
    line = h2.content.decode().strip()
    assert grpc_denial.headers["grpc-message"] == grpc_message(line)


# -- ALPN --------------------------------------------------------------------------------------


@dataclass
class AlpnUpstream(Upstream):
    """The HTTP/1.1 upstream, recording the protocol it chose from what the proxy offered."""

    chosen: list[str | None] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.chosen.append(writer.get_extra_info("ssl_object").selected_alpn_protocol())
        await super().handle(reader, writer)


def tls_get(proxy_port: int, port: int, alpns: list[str]) -> tuple[str | None, bytes]:
    """A TLS client offering `alpns` through the proxy's CONNECT; what it was given and the
    first bytes of the answer to one HTTP/1.1 request (b"" when the proxy closed)."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=TIMEOUT)
    with raw:
        authority = f"paths.test:{port}"
        raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert raw.recv(1024).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=PROXY_CA)
        context.set_alpn_protocols(alpns)
        with context.wrap_socket(raw, server_hostname="paths.test") as tls:
            tls.sendall(f"GET /api/alpn HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            try:
                answer = tls.recv(1024)
            except (ConnectionError, ssl.SSLError):
                answer = b""
            return tls.selected_alpn_protocol(), answer


@pytest.mark.asyncio
async def test_alpn_offers_are_what_the_engine_speaks(dns: DNSServer, grpc_port: int) -> None:
    context = tls_context(UPSTREAM_CA, "paths.test")
    context.set_alpn_protocols(["grpc-exp", "h2", "http/1.1"])  # would pick the first offered
    async with (
        serving(AlpnUpstream(), context) as upstream,
        intercepting(dns, grpc_port, upstream.port) as proxy,
    ):
        offered = []
        for alpns in (["grpc-exp", "http/1.1"], ["http/1.1"], ["h3", "http/1.1"]):
            offered.append(await asyncio.to_thread(tls_get, proxy.port, upstream.port, alpns))
        await proxy.wait_closes(3)
    # A protocol the engine does not speak is never offered upstream, nor h2 for a client on
    # HTTP/1.1: this upstream would have chosen either.
    assert [alpn for alpn, _ in offered[:2]] == ["http/1.1", "http/1.1"]
    assert all(answer.startswith(b"HTTP/1.1 200 ") for _, answer in offered[:2])
    assert upstream.chosen == ["http/1.1", "http/1.1"]
    # h3 (a client's first choice here) over TCP: ended at once, with its reason.
    assert offered[2] == ("h3", b"")
    refusal = next(x for x in proxy.lines() if x["reason"] == "inspection_unsupported")
    assert (refusal["plane"], refusal["decision"]) == ("l7", "deny")
    assert [x["path"] for x in proxy.lines() if x.get("stage") == "address"] == ["/api/alpn"] * 2
