"""The admin listener (proxy/admin.py) over real loopback sockets, with a raw asyncio client and
curl. curl runs as an asyncio subprocess: the server lives on the test's own event loop, so a
blocking subprocess call would starve it."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from support.admin import all_ready

from proxy.common.errors import ProxyError
from proxy.common.listeners import format_listen, parse_listen
from proxy.decide.asks import AskLimits, Asks
from proxy.ops.admin import MAX_HEAD_BYTES, AdminServer
from proxy.ops.readiness import Readiness

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

CURL = shutil.which("curl")
needs_curl = pytest.mark.skipif(CURL is None, reason="curl is not installed")


def fixed_metrics() -> tuple[bytes, str]:
    return b"egress_test_total 1\n", "text/plain; version=0.0.4; charset=utf-8"


class Admin:
    def __init__(self, server: AdminServer, readiness: Readiness, host: str, port: int) -> None:
        self.server = server
        self.readiness = readiness
        self.host = host
        self.port = port

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"


async def started(
    readiness: Readiness | None = None,
    metrics: Callable[[], tuple[bytes, str]] = fixed_metrics,
    **kwargs: float,
) -> Admin:
    readiness = readiness if readiness is not None else all_ready()
    server = AdminServer(readiness, metrics, **kwargs)  # type: ignore[arg-type]
    host, port = await server.start("127.0.0.1", 0)
    return Admin(server, readiness, host, port)


@pytest_asyncio.fixture
async def admin() -> AsyncIterator[Admin]:
    running = await started()
    try:
        yield running
    finally:
        await running.server.stop()


async def raw(admin: Admin, data: bytes, *, timeout: float = 3.0) -> bytes:
    """Send `data`, half-close, return everything until the server closes."""
    reader, writer = await asyncio.open_connection(admin.host, admin.port)
    try:
        writer.write(data)
        writer.write_eof()
        await writer.drain()
        async with asyncio.timeout(timeout):
            return await reader.read()
    finally:
        writer.close()


def parse(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


async def get(admin: Admin, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = f"{method} {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode()
    return parse(await raw(admin, request))


async def curl(*args: str) -> tuple[int, str]:
    assert CURL is not None
    process = await asyncio.create_subprocess_exec(
        CURL,
        "--noproxy",
        "*",
        "--silent",
        "--show-error",
        "--max-time",
        "5",
        "--include",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return process.returncode, out.decode("latin-1")


# ---- endpoints


@pytest.mark.asyncio
async def test_healthz(admin: Admin) -> None:
    status, headers, body = await get(admin, "/healthz")
    assert (status, body) == (200, b"ok\n")
    assert headers["content-length"] == "3"
    assert headers["cache-control"] == "no-store"
    assert headers["connection"] == "close"
    assert headers["content-type"].startswith("text/plain")


@pytest.mark.asyncio
@needs_curl
async def test_healthz_with_curl(admin: Admin) -> None:
    _, out = await curl(admin.url("/healthz"))
    assert out.startswith("HTTP/1.1 200")
    assert out.endswith("\r\n\r\nok\n")
    assert "Cache-Control: no-store" in out


@pytest.mark.asyncio
async def test_readyz_follows_readiness() -> None:
    readiness = Readiness()
    admin = await started(readiness)
    try:
        status, _, body = await get(admin, "/readyz")
        assert status == 503
        assert body.decode().splitlines() == [
            "not ready: policy not compiled",
            "not ready: listeners not bound",
            "not ready: boundary not verified",
        ]
        readiness.set("policy_compiled", True)
        readiness.set("listeners_bound", True)
        readiness.set("boundary_verified", False, "nft table\nmissing")
        status, _, body = await get(admin, "/readyz")
        assert (status, body) == (503, b"not ready: boundary not verified (nft table?missing)\n")
        readiness.set("boundary_verified", True)
        status, _, body = await get(admin, "/readyz")
        assert (status, body) == (200, b"ready\n")
    finally:
        await admin.server.stop()


@pytest.mark.asyncio
@needs_curl
async def test_draining_makes_readyz_fail_at_once(admin: Admin) -> None:
    _, out = await curl(admin.url("/readyz"))
    assert out.startswith("HTTP/1.1 200") and out.endswith("ready\n")
    admin.readiness.set("draining", True)
    assert admin.readiness.ready() == (False, ["not ready: draining"])
    _, out = await curl(admin.url("/readyz"))
    assert out.startswith("HTTP/1.1 503")
    assert out.endswith("\r\n\r\nnot ready: draining\n")
    # Still alive while draining.
    _, out = await curl(admin.url("/healthz"))
    assert out.startswith("HTTP/1.1 200")


def test_readiness_rejects_unknown_condition() -> None:
    with pytest.raises(ValueError, match="unknown readiness condition"):
        Readiness().set("policy_compiledd", True)


@pytest.mark.asyncio
@needs_curl
async def test_metrics_from_prometheus_registry() -> None:
    registry = CollectorRegistry()
    Counter("egress_test_requests", "test counter", registry=registry).inc(3)
    admin = await started(metrics=lambda: (generate_latest(registry), CONTENT_TYPE_LATEST))
    try:
        _, out = await curl(admin.url("/metrics"))
        assert out.startswith("HTTP/1.1 200")
        assert f"Content-Type: {CONTENT_TYPE_LATEST}" in out
        assert "egress_test_requests_total 3.0\n" in out
        status, headers, body = await get(admin, "/metrics")
        assert status == 200 and headers["content-type"] == CONTENT_TYPE_LATEST
        assert int(headers["content-length"]) == len(body) and body == generate_latest(registry)
    finally:
        await admin.server.stop()


@pytest.mark.asyncio
async def test_metrics_callable_raising_is_500_without_traceback() -> None:
    def broken() -> tuple[bytes, str]:
        raise RuntimeError("secret internals")

    for metrics in (broken, lambda: ("text", "text/plain"), lambda: (b"x", "a\r\nSet-Cookie: x")):
        admin = await started(metrics=metrics)  # type: ignore[arg-type]
        try:
            status, _, body = await get(admin, "/metrics")
            assert (status, body) == (500, b"metrics unavailable\n")
            # The server stays usable.
            assert (await get(admin, "/healthz"))[0] == 200
        finally:
            await admin.server.stop()


@pytest.mark.asyncio
async def test_unknown_path_is_404(admin: Admin) -> None:
    for path in ("/", "/healthz/", "/metricsx", "/../healthz"):
        assert (await get(admin, path))[0] == 404
    # A query string is ignored; absolute-form is accepted.
    assert (await get(admin, "/healthz?verbose=1"))[0] == 200
    assert (await get(admin, f"http://{admin.host}:{admin.port}/healthz"))[2] == b"ok\n"


@pytest.mark.asyncio
@needs_curl
async def test_other_methods_are_405_with_allow(admin: Admin) -> None:
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "TRACE", "BREW"):
        status, headers, _ = await get(admin, "/healthz", method)
        assert status == 405
        assert headers["allow"] == "GET, HEAD"
    _, out = await curl("-X", "DELETE", admin.url("/metrics"))
    assert out.startswith("HTTP/1.1 405") and "Allow: GET, HEAD" in out


@pytest.mark.asyncio
@needs_curl
async def test_head_has_headers_and_no_body(admin: Admin) -> None:
    for path, length in (("/healthz", 3), ("/readyz", 6), ("/metrics", 20)):
        response = await raw(admin, f"HEAD {path} HTTP/1.1\r\nHost: a\r\n\r\n".encode())
        status, headers, body = parse(response)
        assert (status, body) == (200, b"")
        assert headers["content-length"] == str(length)
    _, out = await curl("--head", admin.url("/healthz"))
    assert out.startswith("HTTP/1.1 200") and "Content-Length: 3" in out
    assert out.endswith("\r\n\r\n")


# ---- hostile clients


@pytest.mark.asyncio
@needs_curl
async def test_oversized_head_is_431(admin: Admin) -> None:
    big = b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"
    assert parse(await raw(admin, big))[0] == 431
    many = b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n"
    assert len(many) < MAX_HEAD_BYTES
    assert parse(await raw(admin, many))[0] == 431
    _, out = await curl("-H", "X-Big: " + "b" * 9000, admin.url("/healthz"))
    assert out.startswith("HTTP/1.1 431")


@pytest.mark.asyncio
async def test_malformed_requests_are_400(admin: Admin) -> None:
    for request in (
        b"GET /healthz\r\n\r\n",
        b"GET  /healthz HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTP/1.1 extra\r\n\r\n",
        b"G(T /healthz HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTQ/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nName : x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nNo-Colon\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nA: \x00\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: a\r\n",  # incomplete, then EOF
    ):
        status, _, body = parse(await raw(admin, request))
        assert status == 400, request
        assert body.startswith(b"bad request")
    assert parse(await raw(admin, b"GET /healthz HTTP/2.0\r\n\r\n"))[0] == 505
    # Bare LF line ends and a leading empty line are tolerated.
    assert parse(await raw(admin, b"\r\nGET /healthz HTTP/1.0\nHost: a\n\n"))[0] == 200


@pytest.mark.asyncio
async def test_request_with_body_is_413(admin: Admin) -> None:
    with_length = b"POST /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    chunked = b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    assert parse(await raw(admin, with_length))[0] == 413
    assert parse(await raw(admin, chunked))[0] == 413
    zero = b"GET /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    assert parse(await raw(admin, zero))[0] == 200


@pytest.mark.asyncio
async def test_slow_client_hits_header_timeout() -> None:
    admin = await started(header_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection(admin.host, admin.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")  # never finishes the head
        await writer.drain()
        begun = time.monotonic()
        async with asyncio.timeout(3):
            data = await reader.read()
        assert time.monotonic() - begun < 2
        assert data == b"" or data.startswith(b"HTTP/1.1 408")
        writer.close()
        assert admin.server.active_connections == 0
    finally:
        await admin.server.stop()


@pytest.mark.asyncio
async def test_overall_connection_limit() -> None:
    # The head timeout is long here, so only the per-connection limit can end this client.
    admin = await started(header_timeout=5, connection_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection(admin.host, admin.port)
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        begun = time.monotonic()
        async with asyncio.timeout(3):
            assert await reader.read() == b""
        assert time.monotonic() - begun < 2
        writer.close()
    finally:
        await admin.server.stop()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed this connection (within 2 s) without answering."""
    async with asyncio.timeout(2):
        with contextlib.suppress(ConnectionResetError):
            return await reader.read() == b""
    return True


@pytest.mark.asyncio
async def test_connection_limit_sheds_the_oldest_idle_connection() -> None:
    admin = await started(max_connections=2, header_timeout=30, connection_timeout=60)
    try:
        idle = [await asyncio.open_connection(admin.host, admin.port) for _ in range(2)]
        idle[1][1].write(b"GET /heal")  # half a head: still owed nothing
        async with asyncio.timeout(2):
            while admin.server.active_connections < 2:
                await asyncio.sleep(0.01)
        # A request over the cap is served; the oldest silent connection made room for it.
        assert (await get(admin, "/healthz"))[0] == 200
        assert await closed_by_server(idle[0][0])
        # With the cap full again, the half head is now the oldest and goes next.
        idle.append(await asyncio.open_connection(admin.host, admin.port))
        async with asyncio.timeout(2):
            while admin.server.active_connections < 2:
                await asyncio.sleep(0.01)
        assert (await get(admin, "/readyz"))[0] == 200
        assert await closed_by_server(idle[1][0])
        assert admin.server.active_connections >= 1  # the newest silent one is still there
        for _, writer in idle:
            writer.close()
    finally:
        await admin.server.stop()


@pytest.mark.asyncio
async def test_connection_limit_refuses_when_every_slot_is_answered() -> None:
    asks = Asks(AskLimits(timeout=10))
    server = AdminServer(all_ready(), fixed_metrics, asks=asks, max_connections=2)
    host, port = await server.start("127.0.0.1", 0)
    streams = []
    try:
        for _ in range(2):  # a stream is being answered for as long as it lasts
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /asks/stream HTTP/1.1\r\n\r\n")
            async with asyncio.timeout(2):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            streams.append((reader, writer))
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert await closed_by_server(reader)  # closed without an answer
        writer.close()
        # Once a slot frees, requests are served again.
        streams.pop()[1].close()
        async with asyncio.timeout(2):
            while server.active_connections > 1:
                await asyncio.sleep(0.01)
        admin = Admin(server, all_ready(), host, port)
        assert (await get(admin, "/healthz"))[0] == 200
    finally:
        for _, writer in streams:
            writer.close()
        asks.close()
        await server.stop()


@pytest.mark.asyncio
async def test_stop_closes_live_connections_promptly() -> None:
    admin = await started(header_timeout=30, connection_timeout=60)
    clients = [await asyncio.open_connection(admin.host, admin.port) for _ in range(3)]
    clients[0][1].write(b"GET /healthz HTTP/1.1\r\n")  # half a head
    async with asyncio.timeout(2):
        while admin.server.active_connections < 3:
            await asyncio.sleep(0.01)
    begun = time.monotonic()
    await admin.server.stop()
    assert time.monotonic() - begun < 1.5
    assert admin.server.active_connections == 0
    for reader, writer in clients:
        async with asyncio.timeout(2):
            with contextlib.suppress(ConnectionResetError):
                assert await reader.read() == b""
        writer.close()
    # The listener is gone.
    with pytest.raises(OSError):
        await asyncio.open_connection(admin.host, admin.port)


@pytest.mark.asyncio
async def test_bind_to_port_in_use_is_admin_bind() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = AdminServer(all_ready(), fixed_metrics)
        with pytest.raises(ProxyError) as caught:
            await server.start("127.0.0.1", port)
        assert caught.value.reason == "admin_bind"
        assert f"127.0.0.1:{port}" in caught.value.message
        assert "in use" in caught.value.message.lower()
        await server.stop()


@pytest.mark.asyncio
async def test_start_refuses_a_name() -> None:
    server = AdminServer(all_ready(), fixed_metrics)
    with pytest.raises(ProxyError) as caught:
        await server.start("localhost", 0)
    assert caught.value.reason == "invalid_listen"


@pytest.mark.asyncio
async def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    server = AdminServer(all_ready(), fixed_metrics)
    try:
        host, port = await server.start("::1", 0)
    except ProxyError:
        pytest.skip("::1 not available")
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\n\r\n")
        async with asyncio.timeout(3):
            assert (await reader.read()).endswith(b"\r\n\r\nok\n")
        writer.close()
        assert format_listen(host, port) == f"[::1]:{port}"
    finally:
        await server.stop()


# ---- parse_listen


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9901", ("127.0.0.1", 9901)),
        (":9901", ("127.0.0.1", 9901)),
        ("localhost:3128", ("127.0.0.1", 3128)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:9901", ("::1", 9901)),
        ("[::]:65535", ("::", 65535)),
        ("[0:0::1]:1", ("::1", 1)),
        # Canonical spelling of a mapped address differs between Python 3.12 and 3.13.
        ("[::ffff:127.0.0.1]:80", (str(ipaddress.IPv6Address("::ffff:7f00:1")), 80)),
    ],
)
def test_parse_listen_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "9901",
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:+80",
        "127.0.0.1: 80",
        "127.0.0.1:８０",  # fullwidth digits
        "127.0.0.1:99999999999",
        "127.1:80",
        "0x7f.0.0.1:80",
        "127.000.0.1:80",
        "example.com:80",
        "LOCALHOST:80",
        "localhost.:80",
        "::1:9901",
        "[::1]9901",
        "[::1:9901",
        "[127.0.0.1]:80",
        "[fe80::1%eth0]:80",
        "[::1]:",
        "http://127.0.0.1:80",
        " 127.0.0.1:80",
        "1" * 1000 + ":80",
    ],
)
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_listen(text)
    assert caught.value.reason == "invalid_listen"
    assert len(caught.value.message) < 300


def test_admin_does_not_import_mitmproxy() -> None:
    # The admin listener must be usable by a fast-path-only process without mitmproxy's imports.
    code = "import sys, proxy.ops.admin; sys.exit('mitmproxy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=30).returncode == 0


@pytest.mark.asyncio
async def test_head_arriving_byte_by_byte(admin: Admin) -> None:
    # The blank line split across reads must still be found (the search only covers new bytes).
    reader, writer = await asyncio.open_connection(admin.host, admin.port)
    for byte in b"\r\nGET /healthz HTTP/1.1\r\nHost: a\r\n\r\n":
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.002)
    async with asyncio.timeout(3):
        assert (await reader.read()).endswith(b"\r\n\r\nok\n")
    writer.close()
