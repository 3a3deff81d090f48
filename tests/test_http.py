"""Plain HTTP through the front door's HTTP plane (proxy/dataplane/http*.py), as a user sees it:
absolute-form requests to the explicit listener, over real loopback sockets, against upstreams
of the tests' own that record the very bytes they receive; curl where a real client matters.

The proxy runs in-process (tests/support/in_process.py's `started`, no inspection) and resolves with
the tests' DNS server; its operator config allows 127.0.0.0/8, so loopback upstreams are
reachable. What is checked: statuses, headers and bodies at the client, bytes at the upstream,
the audit lines, and which names were (never) resolved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from support.dns_server import DNSServer
from support.in_process import Running, curl, started

from proxy.dataplane.http import MAX_HELD

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [up.test]\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
Asked = tuple[asyncio.StreamReader, asyncio.StreamWriter]

# -- messages ------------------------------------------------------------------------------


def fields_of(head: bytes) -> tuple[str, list[str], dict[str, str]]:
    """The first line, the field lines as sent, and the fields by lowercase name (repeated
    ones joined with ", ")."""
    lines = head.decode("latin-1").split("\r\n")[:-2]
    named: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        key = name.strip().lower()
        named[key] = f"{named[key]}, {value.strip()}" if key in named else value.strip()
    return lines[0], lines[1:], named


async def read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A chunked body, strictly (a bad frame raises): (decoded, bytes as framed)."""
    decoded, raw = bytearray(), bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line[:-2].split(b";")[0], 16)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                raw += trailer
            return bytes(decoded), bytes(raw + b"\r\n")
        data = await reader.readexactly(size + 2)
        assert data.endswith(b"\r\n"), data[-10:]
        raw += data
        decoded += data[:-2]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def reply(reader: asyncio.StreamReader, *, head_only: bool = False) -> Reply:
    """The next response from the proxy, body read by its framing (to EOF when it has none)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    first, _, headers = fields_of(head)
    status = int(first.split()[1])
    if head_only or status < 200 or status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", ""):
        body = (await asyncio.wait_for(read_chunked(reader), 5))[0]
    elif "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return Reply(status, headers, body)


async def closed(reader: asyncio.StreamReader, within: float = 3.0) -> bool:
    """True when the proxy closes the connection (EOF or reset) within `within` seconds."""
    try:
        return await asyncio.wait_for(reader.read(65536), within) == b""
    except ConnectionError:
        return True


def message(first: str, *fields: str, body: bytes = b"") -> bytes:
    return "\r\n".join([first, *fields, "", ""]).encode("latin-1") + body


# -- upstreams -----------------------------------------------------------------------------


@dataclass
class Origin:
    """An HTTP/1.1 server recording each request as the bytes it received (head and framed
    body) and its decoded body. Request i gets answers[i] (the last one repeats); `close`:
    close after each answer; `silent`: close after a request head without answering; `delay`:
    seconds before each answer. A request with `Expect: 100-continue` gets a `100 Continue`
    before its body is read."""

    answers: list[bytes] = field(default_factory=lambda: [OK])
    close: bool = False
    silent: bool = False
    delay: float = 0.0
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def head(self, index: int = 0) -> list[str]:
        """Request `index`'s request line and field lines, as received."""
        first, lines, _ = fields_of(self.requests[index].split(b"\r\n\r\n")[0] + b"\r\n\r\n")
        return [first, *lines]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while not reader.at_eof():
                head = await reader.readuntil(b"\r\n\r\n")
                if self.silent:
                    self.requests.append(head)
                    return
                _, _, headers = fields_of(head)
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                if "chunked" in headers.get("transfer-encoding", ""):
                    body, raw = await read_chunked(reader)
                else:
                    body = raw = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append(head + raw)
                self.bodies.append(body)
                if self.delay:
                    await asyncio.sleep(self.delay)  # a slow upstream: what the test is about
                writer.write(self.answers[min(len(self.requests), len(self.answers)) - 1])
                await writer.drain()
                if self.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(origin: Origin) -> AsyncIterator[Origin]:
    server = await asyncio.start_server(origin.handle, "127.0.0.1", 0)
    origin.port = server.sockets[0].getsockname()[1]
    try:
        yield origin
    finally:
        server.close()


def to(up: Origin | int, path: str = "/", *fields: str, method: str = "GET", host: str = "up.test",
       version: str = "1.1", body: bytes = b"") -> bytes:  # fmt: skip
    """An absolute-form request for `host` at the upstream's port, with a matching Host."""
    where = f"{host}:{up if isinstance(up, int) else up.port}"
    return message(
        f"{method} http://{where}{path} HTTP/{version}", f"Host: {where}", *fields, body=body
    )


# -- the proxy and its client ----------------------------------------------------------------


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    dns.set("up.test", a=["127.0.0.1"])
    async with started(dns, manifest=MANIFEST, inspection="") as running:
        yield running


@pytest_asyncio.fixture
async def up() -> AsyncIterator[Origin]:
    async with serving(Origin()) as origin:
        yield origin


async def ask(proxy: Running, data: bytes, *, head_only: bool = False) -> tuple[Reply, Asked]:
    """A new connection to the proxy, `data` sent on it; the reply, and the open connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(data)
    return await reply(reader, head_only=head_only), (reader, writer)


async def again(conn: Asked, data: bytes, *, head_only: bool = False) -> Reply:
    conn[1].write(data)
    return await reply(conn[0], head_only=head_only)


def decisions(proxy: Running, decision: str) -> list[dict[str, Any]]:
    return [x for x in proxy.lines() if x["event"] == "decision" and x["decision"] == decision]


def assert_denied(proxy: Running, got: Reply, status: int, reason: str) -> None:
    """The refusal a user sees, and its audit line."""
    assert (got.status, got.headers.get("x-egress-denied")) == (status, reason), got
    assert [x["reason"] for x in decisions(proxy, "deny")] == [reason]


# -- 1. what goes upstream ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_get_goes_upstream_in_origin_form_without_hop_by_hop_fields(
    proxy: Running, up: Origin
) -> None:
    up.answers = [
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Up-Hop\r\nKeep-Alive: timeout=9\r\n"
        b"X-Up-Hop: 1\r\nX-Up: kept\r\nContent-Length: 2\r\n\r\nok"
    ]
    path = "/a/./b/%2E%2e/c//d%2Fe?q=a%20b&r=/../x"
    where = f"UP.test:{up.port}"
    got, conn = await ask(
        proxy,
        message(
            f"GET http://{where}{path} HTTP/1.1",
            f"Host: {where}", "Connection: close, X-Secret", "Keep-Alive: timeout=5",
            "Proxy-Connection: keep-alive", "Proxy-Authorization: Basic dTpw", "TE: trailers",
            "X-Secret: s3cret", "Accept: */*", "X-End: to-end",
        ),
    )  # fmt: skip
    assert (got.status, got.body, got.headers["x-up"]) == (200, b"ok", "kept")
    assert "x-up-hop" not in got.headers and "keep-alive" not in got.headers
    assert up.head() == [f"GET {path} HTTP/1.1", f"Host: {where}", "Accept: */*", "X-End: to-end"]
    assert await closed(conn[0])  # the client asked for Connection: close


# -- 2. keep-alive and the pool ------------------------------------------------------------


@pytest.mark.asyncio
async def test_keep_alive_requests_share_one_pooled_upstream_connection(
    proxy: Running, up: Origin
) -> None:
    first, conn = await ask(proxy, to(up, "/one"))
    second = await again(conn, to(up, "/two"))
    third, _ = await ask(proxy, to(up, "/three", method="DELETE"))
    assert [r.status for r in (first, second, third)] == [200, 200, 200]
    assert [up.head(i)[0] for i in range(3)] == [
        "GET /one HTTP/1.1", "GET /two HTTP/1.1", "DELETE /three HTTP/1.1",
    ]  # fmt: skip
    assert up.connections == 1
    allowed = [(x["stage"], x["method"], x["path"]) for x in decisions(proxy, "allow")]
    assert allowed == [("address", "GET", "/one"), ("address", "GET", "/two"),
                       ("address", "DELETE", "/three")]  # fmt: skip


# -- 3. bodies -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_5_mib_request_body_from_curl_arrives_intact(
    proxy: Running, up: Origin, framing: str
) -> None:
    data = os.urandom(5 << 20)
    with tempfile.NamedTemporaryFile() as file:
        file.write(data)
        file.flush()
        extra = ["-H", "Transfer-Encoding: chunked"] if framing == "chunked" else []
        status, _, body = await curl(
            proxy, f"http://up.test:{up.port}/upload", "--data-binary", f"@{file.name}", *extra
        )
    assert (status, body) == (200, b"ok")
    assert len(up.bodies) == 1 and len(up.bodies[0]) == len(data) and up.bodies[0] == data
    _, _, headers = fields_of(up.requests[0].split(b"\r\n\r\n")[0] + b"\r\n\r\n")
    assert ("chunked" in headers.get("transfer-encoding", "")) == (framing == "chunked")


@pytest.mark.asyncio
async def test_a_chunked_request_body_is_reframed_by_the_proxy(proxy: Running, up: Origin) -> None:
    sent = b"5;ext=1\r\nhello\r\n0006\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    got, _ = await ask(proxy, to(up, "/c", "Transfer-Encoding: chunked", method="POST", body=sent))
    assert got.status == 200
    assert up.bodies == [b"hello world"]
    raw = up.requests[0].split(b"\r\n\r\n", 1)[1]
    assert raw.endswith(b"0\r\n\r\n") and b"ext" not in raw and b"X-Trailer" not in raw


RESPONSES = {
    "content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world",
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n",
    "close-delimited": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello world",
}


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", list(RESPONSES))
async def test_response_bodies_reach_an_http_1_1_client(proxy: Running, framing: str) -> None:
    delimited = framing == "close-delimited"
    async with serving(Origin([RESPONSES[framing]], close=delimited)) as up:
        got, conn = await ask(proxy, to(up, "/r"))
        assert (got.status, got.body) == (200, b"hello world")
        assert ("chunked" in got.headers.get("transfer-encoding", "")) == (framing == "chunked")
        if delimited:
            assert got.headers.get("connection", "").lower() == "close"
            assert conn[0].at_eof()
        else:
            assert (await again(conn, to(up, "/next"))).body == b"hello world"


@pytest.mark.asyncio
async def test_a_chunked_response_to_an_http_1_0_client_is_dechunked_and_closed(
    proxy: Running,
) -> None:
    async with serving(Origin([RESPONSES["chunked"]])) as up:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(to(up, "/old", version="1.0"))
        raw = await asyncio.wait_for(reader.read(), 5)  # to EOF: the proxy closes
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
    assert b"transfer-encoding" not in head.lower()
    assert body == b"hello world"


# -- 4. smuggling --------------------------------------------------------------------------

SMUGGLING = {
    "content-length-and-chunked": ("Content-Length: 5", "Transfer-Encoding: chunked"),
    "duplicate-content-length": ("Content-Length: 5", "Content-Length: 5"),
    "invalid-chunk-size": ("Transfer-Encoding: chunked",),
    "obs-fold": ("X-Folded: a\r\n b", "Content-Length: 5"),
    "gzip-then-chunked": ("Transfer-Encoding: gzip, chunked",),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(SMUGGLING))
async def test_smuggling_is_refused_with_400_and_nothing_goes_upstream(
    proxy: Running, up: Origin, case: str
) -> None:
    body = b"zz\r\nhello\r\n0\r\n\r\n" if case == "invalid-chunk-size" else b"0\r\n\r\n"
    if "Content-Length: 5" in SMUGGLING[case] and case != "content-length-and-chunked":
        body = b"hello"
    got, conn = await ask(proxy, to(up, "/s", *SMUGGLING[case], method="POST", body=body))
    assert_denied(proxy, got, 400, "invalid_request")
    # Whatever the connection does next, it does not take the refused framing's leftovers or
    # the refusal for another request: closed, or the next request served as its own.
    with contextlib.suppress(ConnectionError):
        conn[1].write(to(up, "/after"))
        after = await asyncio.wait_for(conn[0].read(65536), 3)
        assert after == b"" or after.startswith(b"HTTP/1.1 200"), after
    assert up.requests == [] or up.head(0)[0] == "GET /after HTTP/1.1"


@pytest.mark.asyncio
async def test_a_refused_framing_does_not_refuse_the_pipelined_request_before_it(
    proxy: Running, up: Origin
) -> None:
    bad = to(up, "/bad", "Transfer-Encoding: gzip, chunked", method="POST", body=b"0\r\n\r\n")
    first, conn = await ask(proxy, to(up, "/good") + bad)
    assert (first.status, first.body) == (200, b"ok")
    assert (await reply(conn[0])).status == 400
    assert [up.head(i)[0] for i in range(len(up.requests))] == ["GET /good HTTP/1.1"]


# -- 5. denials ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_undeclared_name_is_refused_and_never_resolved(proxy: Running) -> None:
    proxy.dns.clear_log()
    got, _ = await ask(proxy, to(8080, "/x", host="nope.test"))
    assert_denied(proxy, got, 403, "not_allowed")
    assert got.body.count(b"\n") == 1 and b"nope.test:8080" in got.body
    assert proxy.dns.queries == []


@pytest.mark.asyncio
async def test_a_denied_request_without_body_leaves_the_connection_usable(
    proxy: Running, up: Origin
) -> None:
    denied, conn = await ask(proxy, to(up, "/x", host="nope.test"))
    assert denied.status == 403
    allowed = await again(conn, to(up, "/y"))
    assert (allowed.status, allowed.body) == (200, b"ok")
    assert [up.head(0)[0]] == ["GET /y HTTP/1.1"]


@pytest.mark.asyncio
async def test_a_denied_request_with_a_large_body_is_answered_at_once_then_closed(
    proxy: Running,
) -> None:
    start = time.monotonic()
    head = to(80, "/big", "Content-Length: 50000000", method="PUT", host="nope.test")
    got, conn = await ask(proxy, head + b"x" * 4096)
    assert time.monotonic() - start < 1.5
    assert_denied(proxy, got, 403, "not_allowed")
    with contextlib.suppress(ConnectionError):
        conn[1].write(b"y" * 4096)
    assert await closed(conn[0], within=4)


# -- 6. Host --------------------------------------------------------------------------------

HOSTS = {
    "other-name": ["Host: other.test:{port}"],
    "other-port": ["Host: up.test:1"],
    "missing": [],
    "two": ["Host: up.test:{port}", "Host: up.test:{port}"],
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(HOSTS))
async def test_a_host_field_not_naming_the_target_is_refused(
    proxy: Running, up: Origin, case: str
) -> None:
    proxy.dns.clear_log()
    fields = [line.format(port=up.port) for line in HOSTS[case]]
    got, _ = await ask(proxy, message(f"GET http://up.test:{up.port}/h HTTP/1.1", *fields))
    assert_denied(proxy, got, 403, "host_mismatch")
    assert proxy.dns.queries == [] and up.connections == 0


# -- 7. upgrades ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_h2c_upgrade_is_refused(proxy: Running, up: Origin) -> None:
    got, _ = await ask(
        proxy,
        to(up, "/", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
           "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"),
    )  # fmt: skip
    assert_denied(proxy, got, 403, "upgrade_refused")
    assert up.connections == 0


# -- 8. header_timeout ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_header_timeout_bounds_every_head_on_a_keep_alive_connection(
    dns: DNSServer, up: Origin
) -> None:
    dns.set("up.test", a=["127.0.0.1"])
    limits = "limits:\n  header_timeout: 1s\n"
    async with started(dns, limits, manifest=MANIFEST, inspection="") as proxy:
        first, (reader, writer) = await ask(proxy, to(up, "/first"))
        assert first.status == 200
        start = time.monotonic()

        async def dribble() -> None:
            for byte in to(up, "/second")[:40]:  # 12 s at most; stopped once answered
                writer.write(bytes([byte]))
                await asyncio.sleep(0.3)

        dribbling = asyncio.create_task(dribble())
        try:
            got = await reply(reader)
            assert await closed(reader, within=1)
        finally:
            dribbling.cancel()
        assert time.monotonic() - start < 2.0
        assert (got.status, got.headers.get("x-egress-denied")) == (408, "header_timeout")
        assert len(up.requests) == 1


# -- 9. responses without a body -----------------------------------------------------------

BODYLESS = {
    "head": ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"),
    "204": ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
    "304": ("GET", b'HTTP/1.1 304 Not Modified\r\nETag: "e"\r\nContent-Length: 1000\r\n\r\n'),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BODYLESS))
async def test_a_response_without_body_completes_and_the_connection_goes_on(
    proxy: Running, case: str
) -> None:
    method, answer = BODYLESS[case]
    async with serving(Origin([answer, OK])) as up:
        got, conn = await ask(proxy, to(up, "/nobody", method=method), head_only=True)
        assert got.status == int(answer.split()[1])
        if case == "head":
            assert got.headers["content-length"] == "1000"
        following = await again(conn, to(up, "/next"))
        assert (following.status, following.body) == (200, b"ok")


# -- 10. Expect: 100-continue --------------------------------------------------------------


@pytest.mark.asyncio
async def test_expect_100_continue_passes_the_interim_response(proxy: Running, up: Origin) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(to(up, "/e", "Expect: 100-continue", "Content-Length: 5", method="POST"))
    interim = await reply(reader)
    assert interim.status == 100 and up.bodies == []
    writer.write(b"hello")
    final = await reply(reader)
    assert (final.status, final.body, up.bodies) == (200, b"ok", [b"hello"])


# -- 11. upstream errors -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_upstream_refusing_the_connection_is_a_502(proxy: Running) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens once it is closed
    got, _ = await ask(proxy, to(port, "/"))
    assert (got.status, got.headers.get("x-egress-error")) == (502, "upstream_refused")


@pytest.mark.asyncio
async def test_an_upstream_closing_without_an_answer_is_a_502(proxy: Running) -> None:
    async with serving(Origin(silent=True)) as up:
        got, _ = await ask(proxy, to(up, "/"))
        assert (got.status, got.headers.get("x-egress-error")) == (502, "upstream_error")
        assert up.connections == 1


# -- 12. scheme ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_https_target_on_the_explicit_listener_is_refused(proxy: Running) -> None:
    got, _ = await ask(proxy, message("GET https://up.test/ HTTP/1.1", "Host: up.test"))
    assert_denied(proxy, got, 403, "unsupported_scheme")


@pytest.mark.asyncio
async def test_an_origin_form_target_on_the_explicit_listener_is_a_bad_request(
    proxy: Running,
) -> None:
    proxy.dns.clear_log()
    got, _ = await ask(proxy, message("GET / HTTP/1.1", "Host: up.test"))
    assert got.status == 400
    assert proxy.dns.queries == []


@pytest.mark.asyncio
async def test_pipelined_requests_are_answered_in_order_until_the_one_that_closes(
    proxy: Running, up: Origin
) -> None:
    # Three requests in one write; the second asks to close: two answers, then the close, and
    # the third never reaches the upstream.
    first, (reader, writer) = await ask(
        proxy,
        to(up, "/1") + to(up, "/2", "Connection: close") + to(up, "/3"),
    )
    second = await reply(reader)
    assert (first.status, second.status) == (200, 200)
    assert second.headers.get("connection") == "close"
    assert await closed(reader)
    writer.close()
    assert [head.split(b" ")[1] for head in up.requests] == [b"/1", b"/2"]


@pytest.mark.asyncio
async def test_a_client_that_half_closes_after_its_requests_gets_every_answer(
    proxy: Running, up: Origin
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(to(up, "/a") + to(up, "/b"))
    writer.write_eof()
    answers = [await reply(reader), await reply(reader)]
    assert [x.status for x in answers] == [200, 200]
    assert await closed(reader)
    writer.close()
    assert len(up.requests) == 2


# -- 13. flow control -----------------------------------------------------------------------

# What the proxy may hold of request bodies that no upstream takes yet: MAX_HELD, and what the
# one read that crossed it brought (at most 256 KiB on either loop).
HELD_AT_MOST = MAX_HELD + (256 << 10)


@contextlib.asynccontextmanager
async def most_held(proxy: Running) -> AsyncIterator[list[int]]:
    """[the most request body bytes the proxy held for requests not yet sent upstream, looked
    at every millisecond while the block runs]"""
    most = [0]

    def held() -> int:
        planes = [conn.http for conn in proxy.front.door.connections if conn.http is not None]
        return sum(len(request.pending) for plane in planes for request in plane.requests)

    async def watch() -> None:
        while True:
            most[0] = max(most[0], held())
            await asyncio.sleep(0.001)

    watcher = asyncio.ensure_future(watch())
    try:
        yield most
    finally:
        watcher.cancel()


@pytest.mark.asyncio
async def test_a_large_body_behind_pipelined_requests_waits_within_the_limit(
    proxy: Running,
) -> None:
    # Three slow GETs, a POST whose 4 MiB body is written at once, one more GET: while the GETs
    # are served the body waits, the proxy reading no more of it than the limit (no request
    # served lets reading go on while another holds it); then every answer comes, in order.
    body = os.urandom(4 << 20)
    async with serving(Origin(delay=0.05)) as up, most_held(proxy) as most:
        post = to(up, "/post", f"Content-Length: {len(body)}", method="POST", body=body)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(to(up, "/1") + to(up, "/2") + to(up, "/3") + post + to(up, "/4"))
        answers = [await reply(reader) for _ in range(5)]
        writer.close()
    assert [(x.status, x.body) for x in answers] == [(200, b"ok")] * 5
    assert [head.split(b" ")[1] for head in up.requests] == [b"/1", b"/2", b"/3", b"/post", b"/4"]
    assert up.bodies[3] == body
    assert most[0] <= HELD_AT_MOST


@pytest.mark.asyncio
async def test_a_refused_request_whose_body_was_held_is_read_to_its_end_and_closed_cleanly(
    proxy: Running,
) -> None:
    # A PUT whose name DNS never answers, its 8 MiB body written at once: the body is held past
    # MAX_HELD while the name is looked up, the PUT is refused when the lookup times out, and
    # the rest of its body is read and dropped while the proxy lingers: the client's writes all
    # go out, it reads the refusal, then the close (an EOF, never a reset).
    proxy.dns.blackhole("slow.up.test")
    body = os.urandom(8 << 20)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(to(80, "/put", f"Content-Length: {len(body)}", method="PUT", host="slow.up.test"))
    writer.write(body)
    await asyncio.wait_for(writer.drain(), 5)
    got = await reply(reader)
    assert (got.status, got.headers.get("x-egress-error")) == (502, "dns_timeout"), got
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
