"""The L7 engine (mitmproxy embedded, our addon enforcing) over real loopback sockets: curl and
raw Python clients, an HTTP/TCP upstream of the test's own, and the test DNS server."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import socket
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from dns_server import DNSServer

from policy import compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.l7.engine import DENIED_HEADER, ERROR_HEADER, Engine
from proxy.net.resolver import Resolver
from proxy.netaddr import Listener
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics

CURL = "/usr/bin/curl"
MANIFEST = """\
network:
  egress: [up.test, private.test, nx.test, slow.test, tls.test]
"""


# -- upstreams -------------------------------------------------------------------------------


@dataclass
class Upstream:
    """An HTTP/1.1 server (keep-alive) that records what it received; with raw=True it records
    the bytes of each connection and answers nothing."""

    raw: bool = False
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (request line, Host)
    connections: int = 0
    received: bytearray = field(default_factory=bytearray)
    port: int = 0
    got_data: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.raw:
                while chunk := await reader.read(65536):
                    self.received += chunk
                    self.got_data.set()
                return
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                host = next(
                    (ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("host:")),
                    None,
                )
                self.requests.append((lines[0], host))
                body = b"hello from upstream\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(upstream: Upstream, tls: ssl.SSLContext | None = None) -> AsyncIterator[Upstream]:
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0, ssl=tls)
    upstream.port = server.sockets[0].getsockname()[1]
    try:
        yield upstream
    finally:
        server.close()


@contextlib.asynccontextmanager
async def answering(answer: bytes) -> AsyncIterator[int]:
    """An upstream that reads the first bytes of each connection, answers `answer`, then reads
    until the peer closes; yields its port."""

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(answer)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


# -- the engine ------------------------------------------------------------------------------


@dataclass
class Running:
    engine: Engine
    port: int
    dns: DNSServer
    audit: io.StringIO
    metrics: Metrics

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.audit.getvalue().splitlines()]


# One inspection CA for the module (made on first use, removed at exit): a 2048-bit key per
# engine start would cost more than most tests here.
CA_DIR = tempfile.TemporaryDirectory(prefix="egress-ca-")


@contextlib.asynccontextmanager
async def started(
    dns: DNSServer,
    extra: str = "",
    manifest: str = MANIFEST,
    source: str = "agent.yaml",
    listeners: list[Listener] | None = None,
) -> AsyncIterator[Running]:
    """An engine on a random loopback port (or on `listeners`); `extra` is more operator
    config (YAML)."""
    if "inspection:" not in extra:
        extra += f"inspection:\n  ca_dir: {CA_DIR.name}\n"
    config = load_config(
        f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n" + extra
    )
    policy = compile_policy(load_manifest(manifest, source=source), None, config.operator)
    metrics = Metrics()
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="test-session", metrics=metrics)
    engine = Engine(policy, Resolver.from_config(config), config, metrics, audit, "test-session")
    try:
        host, port = await engine.start("127.0.0.1", 0, listeners=listeners)
        assert host == "127.0.0.1"
        yield Running(engine, port, dns, stream, metrics)
    finally:
        await engine.stop()


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    async with started(dns) as running:
        yield running


async def curl(proxy: Running, url: str, *args: str) -> tuple[int, dict[str, str], bytes]:
    """Status, response headers (lowercase names) and body of one curl run through the proxy.
    Run from a thread, so the event loop goes on: the proxy under test serves on this very
    loop. (Not the loop's own subprocess support: curl spawned by uvloop's loop here crashes.)"""
    command = [
        CURL, "-sS", "-x", f"http://127.0.0.1:{proxy.port}", "--max-time", "5",
        "-D", "/dev/stderr", "-o", "-", url, *args,
    ]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, timeout=10)
    out, err = done.stdout, done.stderr
    head = err.decode("latin-1")
    status = 0
    headers: dict[str, str] = {}
    for line in head.splitlines():
        if line.startswith("HTTP/"):
            status, headers = int(line.split()[1]), {}
        elif ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return status, headers, out


async def connect(
    proxy: Running, authority: str
) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1")
    lines = head.split("\r\n")
    headers = {
        ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
        for ln in lines[1:]
        if ":" in ln
    }
    return int(lines[0].split()[1]), headers, reader, writer


def client_hello(sni: str | None) -> bytes:
    """The first flight of a real TLS client (Python's ssl), with or without SNI."""
    context = ssl.create_default_context()
    if sni is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), 5) == b""
    except ConnectionError:
        return True


# -- plain HTTP ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_plain_http_allowed(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        status, headers, body = await curl(proxy, f"http://up.test:{upstream.port}/hello?x=1")
        assert status == 200, (headers, body)
        assert body == b"hello from upstream\n"
        assert upstream.requests == [("GET /hello?x=1 HTTP/1.1", f"up.test:{upstream.port}")]
        # Exactly one lookup of each family, for that name only.
        assert proxy.dns.count("up.test", "A") == 1
        assert proxy.dns.count("up.test", "AAAA") == 1
        assert {q[0] for q in proxy.dns.queries} == {"up.test"}
    lines = proxy.lines()
    decisions = [x for x in lines if x["event"] == "decision"]
    assert [(x["stage"], x["decision"], x["reason"]) for x in decisions] == [
        ("name", "allow", "allowed"),
        ("address", "allow", "allowed"),
    ]
    assert decisions[1]["pinned"] == ["127.0.0.1"]
    assert decisions[1]["rule"] == "network.egress[0]"
    assert decisions[0]["method"] == "GET" and decisions[0]["path"] == "/hello?x=1"
    assert all(x["session"] == "test-session" for x in lines)
    text = proxy.metrics.render()[0].decode()
    assert (
        'egress_decisions_total{decision="allow",plane="l7",reason="allowed",stage="name"}' in text
    )


@pytest.mark.asyncio
async def test_plain_http_keep_alive_reuses_the_pinned_connection(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        url = f"http://up.test:{upstream.port}/"
        # Two URLs in one curl run share its proxy connection.
        status, _, body = await curl(proxy, url + "a", url + "b")
        assert status == 200
        assert body == b"hello from upstream\n" * 2
        assert [r[0] for r in upstream.requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1"]
        # Each request was decided, the name resolved once (cached), and mitmproxy reused the
        # upstream connection (the name was restored after the pinned connect).
        assert proxy.dns.count("up.test", "A") == 1
        assert upstream.connections == 1
        names = [x for x in proxy.lines() if x.get("stage") == "name"]
        assert len(names) == 2


@pytest.mark.asyncio
async def test_denied_name_is_never_resolved(proxy: Running) -> None:
    status, headers, body = await curl(proxy, "http://denied.test/")
    assert status == 403
    assert headers[DENIED_HEADER.lower()] == "not_allowed"
    assert body.count(b"\n") == 1 and b"denied.test:80" in body and b"not_allowed" in body
    assert proxy.dns.queries == []
    (line,) = proxy.lines()[:1]
    assert (line["decision"], line["reason"], line["stage"]) == ("deny", "not_allowed", "name")


@pytest.mark.asyncio
async def test_private_answer_is_refused_and_nothing_connects(proxy: Running) -> None:
    proxy.dns.set("private.test", a=["10.0.0.1"])
    status, headers, _ = await curl(proxy, "http://private.test/")
    assert status == 403
    assert headers[DENIED_HEADER.lower()] == "private"
    lines = proxy.lines()
    address = next(x for x in lines if x.get("stage") == "address")
    assert (address["decision"], address["resolved"], address["pinned"]) == (
        "deny",
        ["10.0.0.1"],
        [],
    )
    # No connection was attempted: no connect-stage line, no upstream on the close line.
    assert not any(x.get("stage") == "connect" for x in lines)
    assert all(x.get("upstream") is None for x in lines if x["event"] == "close")


@pytest.mark.asyncio
async def test_host_header_must_match_the_authority(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        status, headers, _ = await curl(
            proxy, f"http://up.test:{upstream.port}/", "-H", "Host: evil.test"
        )
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "host_mismatch"
        assert upstream.requests == []
        assert proxy.dns.queries == []  # refused before the name stage


@pytest.mark.asyncio
async def test_nxdomain_is_502(proxy: Running) -> None:
    proxy.dns.nxdomain("nx.test")
    status, headers, body = await curl(proxy, "http://nx.test/")
    assert status == 502
    assert headers[ERROR_HEADER.lower()] == "dns_nxdomain"
    assert b"dns_nxdomain" in body


@pytest.mark.asyncio
async def test_dns_timeout_is_502(proxy: Running) -> None:
    proxy.dns.blackhole("slow.test")
    status, headers, _ = await curl(proxy, "http://slow.test/")
    assert status == 502
    assert headers[ERROR_HEADER.lower()] == "dns_timeout"


@pytest.mark.asyncio
async def test_no_name_reaches_the_os_resolver(proxy: Running, resolved_by_os: list[str]) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        status, _, body = await curl(proxy, f"http://up.test:{upstream.port}/")
        assert status == 200 and body == b"hello from upstream\n"
        async with serving(Upstream(raw=True)) as tls_upstream:
            proxy.dns.set("tls.test", a=["127.0.0.1"])
            status, _, _, writer = await connect(proxy, f"tls.test:{tls_upstream.port}")
            assert status == 200
            writer.write(client_hello("tls.test"))
            await writer.drain()
            await asyncio.wait_for(tls_upstream.got_data.wait(), 5)
            writer.close()
    assert resolved_by_os == []


# -- CONNECT ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_connect_passes_tls_through_unmodified(proxy: Running) -> None:
    async with serving(Upstream(raw=True)) as upstream:
        proxy.dns.set("tls.test", a=["127.0.0.1"])
        status, _, _, writer = await connect(proxy, f"tls.test:{upstream.port}")
        assert status == 200
        hello = client_hello("tls.test")
        # Split across two writes: the gate waits for the whole ClientHello.
        writer.write(hello[:20])
        await writer.drain()
        await asyncio.sleep(0.05)
        assert upstream.connections == 0  # lazy: nothing dialled before the SNI gate
        writer.write(hello[20:] + b"more bytes")
        await writer.drain()
        for _ in range(100):
            if len(upstream.received) >= len(hello) + 10:
                break
            await asyncio.sleep(0.02)
        assert bytes(upstream.received) == hello + b"more bytes"
        assert upstream.connections == 1
        writer.close()
    assert proxy.dns.count("tls.test", "A") == 1
    stages = [(x["stage"], x["decision"]) for x in proxy.lines() if x["event"] == "decision"]
    assert stages == [("name", "allow"), ("address", "allow"), ("sni", "allow")]


@pytest.mark.asyncio
@pytest.mark.parametrize(("sni", "reason"), [("other.test", "sni_mismatch"), (None, "sni_missing")])
async def test_connect_sni_gate_closes_the_tunnel(
    proxy: Running, sni: str | None, reason: str
) -> None:
    async with serving(Upstream(raw=True)) as upstream:
        proxy.dns.set("tls.test", a=["127.0.0.1"])
        status, _, reader, writer = await connect(proxy, f"tls.test:{upstream.port}")
        assert status == 200
        writer.write(client_hello(sni))
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.connections == 0 and upstream.received == b""
    sni_line = next(x for x in proxy.lines() if x.get("stage") == "sni")
    assert (sni_line["decision"], sni_line["reason"]) == ("deny", reason)


@pytest.mark.asyncio
async def test_connect_refuses_non_tls_bytes(proxy: Running) -> None:
    async with serving(Upstream(raw=True)) as upstream:
        proxy.dns.set("tls.test", a=["127.0.0.1"])
        status, _, reader, writer = await connect(proxy, f"tls.test:{upstream.port}")
        assert status == 200
        writer.write(b"GET / HTTP/1.1\r\nHost: tls.test\r\n\r\n")
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.connections == 0


@pytest.mark.asyncio
async def test_connect_denied(proxy: Running) -> None:
    status, headers, _, writer = await connect(proxy, "denied.test:443")
    assert status == 403
    assert headers[DENIED_HEADER.lower()] == "not_allowed"
    writer.close()
    assert proxy.dns.queries == []
    # curl sees the same refusal of its CONNECT (and never a 407).
    process = await asyncio.create_subprocess_exec(
        CURL, "-s", "-o", "/dev/null", "-w", "%{http_connect}", "--max-time", "5",
        "-x", f"http://127.0.0.1:{proxy.port}", "https://denied.test/",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate()
    assert out == b"403"
    # The close lines say what was asked for, though nothing was allowed.
    closes = [x for x in proxy.lines() if x["event"] == "close"]
    assert len(closes) == 2
    assert {(x["host"], x["port"], x["protocol"], x["bytes_up"]) for x in closes} == {
        ("denied.test", 443, "connect", 0)
    }


@pytest.mark.asyncio
async def test_connect_private_answer_denied(proxy: Running) -> None:
    proxy.dns.set("private.test", a=["127.0.0.1", "10.0.0.1"])
    status, headers, _, writer = await connect(proxy, "private.test:443")
    writer.close()
    assert status == 403
    assert headers[DENIED_HEADER.lower()] == "mixed_answer"


@pytest.mark.asyncio
async def test_set_policy_applies_to_the_next_decision(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        url = f"http://up.test:{upstream.port}/"
        assert (await curl(proxy, url))[0] == 200
        config_operator = proxy.engine.policy.operator
        proxy.engine.set_policy(
            compile_policy(
                load_manifest("network:\n  egress: [other.test]\n"), None, config_operator
            )
        )
        status, headers, _ = await curl(proxy, url)
        assert status == 403 and headers[DENIED_HEADER.lower()] == "not_allowed"


# -- failing closed --------------------------------------------------------------------------


class ExplodingPolicy:
    """A policy whose every call raises: the hooks must deny, never let the request through."""

    operator = None

    def decide(self, target: object) -> object:
        raise RuntimeError("boom")

    def check_addresses(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("boom")


@pytest.mark.asyncio
async def test_an_exception_in_a_hook_denies(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        proxy.engine.set_policy(ExplodingPolicy())  # type: ignore[arg-type]
        status, headers, _ = await curl(proxy, f"http://up.test:{upstream.port}/")
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "internal_error"
        status, headers, _, writer = await connect(proxy, f"up.test:{upstream.port}")
        writer.close()
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "internal_error"
        assert upstream.connections == 0


def test_server_connect_refuses_what_was_not_vetted() -> None:
    from mitmproxy.connection import Client, Server
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    from proxy.l7.engine import EgressAddon

    addon = EgressAddon(ExplodingPolicy(), None)  # type: ignore[arg-type]
    client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 3128))
    addon.client_connected(client)
    server = Server(address=("up.test", 80))
    addon.server_connect(ServerConnectionHookData(server=server, client=client))
    assert server.error
    assert server.address == ("up.test", 80)
    # A vetted destination is dialled at its checked address, never by name.
    addon._state(client).vetted[("up.test", 80)] = ("192.0.2.7", "192.0.2.8")
    server = Server(address=("up.test", 80))
    addon.server_connect(ServerConnectionHookData(server=server, client=client))
    assert not server.error
    assert server.address == ("192.0.2.7", 80)
    # ...but only for that client connection.
    other = Client(peername=("127.0.0.1", 5001), sockname=("127.0.0.1", 3128))
    server = Server(address=("up.test", 80))
    addon.server_connect(ServerConnectionHookData(server=server, client=other))
    assert server.error


@pytest.mark.asyncio
async def test_keep_alive_mix_of_allowed_denied_and_mismatched(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        ok = f"http://up.test:{upstream.port}/"
        process = await asyncio.create_subprocess_exec(
            CURL, "-s", "-o", "/dev/null", "-w", "%{http_code} %{num_connects}\\n",
            "--max-time", "5", "-x", f"http://127.0.0.1:{proxy.port}",
            ok + "1", "http://denied.test/", ok + "2", "http://private.test/", ok + "3",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        proxy.dns.set("private.test", a=["10.0.0.1"])
        out, _ = await asyncio.wait_for(process.communicate(), 10)
        # -o applies to the first URL only; the other bodies are on stdout too.
        rows = [ln.split() for ln in out.decode().splitlines() if re.fullmatch(r"\d{3} \d+", ln)]
        assert [code for code, _ in rows] == ["200", "403", "200", "403", "200"]
        # One proxy connection carried all five requests (a denial does not close it).
        assert sum(int(n) for _, n in rows) == 1
        assert [r[0] for r in upstream.requests] == [f"GET /{i} HTTP/1.1" for i in (1, 2, 3)]


@pytest.mark.asyncio
async def test_denied_request_with_a_large_body(proxy: Running, tmp_path) -> None:  # type: ignore[no-untyped-def]
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    status, headers, _ = await curl(proxy, "http://denied.test/", "--data-binary", f"@{small}")
    assert status == 403
    assert headers[DENIED_HEADER.lower()] == "not_allowed"
    # Above stream_large_bodies mitmproxy would stream the body, and it cannot stream a request
    # and answer it at once: the denial closes the connection instead (still no upstream, no DNS).
    large = tmp_path / "large"
    large.write_bytes(b"x" * 200_000)
    status, _, _ = await curl(proxy, "http://denied.test/", "--data-binary", f"@{large}")
    assert status == 0
    denials = [x for x in proxy.lines() if x.get("decision") == "deny"]
    assert [x["reason"] for x in denials] == ["not_allowed", "not_allowed"]
    assert proxy.dns.queries == []


# -- upstream errors, fallback, pinning ------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def blackholed() -> Iterator[int]:
    """A loopback port whose connects hang: a listener with a full accept queue (Linux drops
    the SYNs of a listener whose backlog is full; nothing leaves loopback)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.socket()
    filler.connect(("127.0.0.1", port))  # fills the queue (never accepted)
    try:
        yield port
    finally:
        filler.close()
        listener.close()


def closes(proxy: Running) -> list[dict]:
    return [x for x in proxy.lines() if x["event"] == "close"]


@pytest.mark.asyncio
async def test_upstream_refused_is_502(proxy: Running) -> None:
    port = free_port()
    proxy.dns.set("up.test", a=["127.0.0.1"])
    status, headers, body = await curl(proxy, f"http://up.test:{port}/")
    assert status == 502
    assert headers[ERROR_HEADER.lower()] == "upstream_refused"
    assert body.count(b"\n") == 1 and b"upstream_refused" in body and b"up.test" in body
    error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
    assert (error["reason"], error["host"], error["port"]) == ("upstream_refused", "up.test", port)
    text = proxy.metrics.render()[0].decode()
    assert 'egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0' in text


@pytest.mark.asyncio
async def test_upstream_refused_closes_the_tunnel(proxy: Running) -> None:
    # CONNECT is lazy: the 200 comes before any upstream connect (which waits for the SNI
    # gate), so a refused upstream closes the tunnel; the client sees the close.
    port = free_port()
    proxy.dns.set("tls.test", a=["127.0.0.1"])
    status, _, reader, writer = await connect(proxy, f"tls.test:{port}")
    assert status == 200
    writer.write(client_hello("tls.test"))
    await writer.drain()
    assert await closed_by_peer(reader)
    writer.close()
    error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
    assert error["reason"] == "upstream_refused"


@pytest.mark.asyncio
async def test_upstream_connect_timeout_is_504(dns: DNSServer) -> None:
    async with started(dns, "limits:\n  connect_timeout: 1s\n") as proxy:
        with blackholed() as port:
            proxy.dns.set("up.test", a=["127.0.0.1"])
            started_at = asyncio.get_running_loop().time()
            status, headers, body = await curl(proxy, f"http://up.test:{port}/")
            elapsed = asyncio.get_running_loop().time() - started_at
        assert status == 504, body
        assert headers[ERROR_HEADER.lower()] == "upstream_timeout"
        assert 0.9 <= elapsed < 4
        error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
        assert error["reason"] == "upstream_timeout"


@pytest.mark.asyncio
async def test_fallback_to_the_next_checked_address(proxy: Running) -> None:
    proxy.dns.set("up.test", a=["127.0.0.9", "127.0.0.1"])
    # The order of the answer is the DNS server's; learn it through the engine's own resolver
    # (its cache is the answer the engine will check and use), then listen on the second.
    answer = await proxy.engine.addon.resolver.resolve("up.test")
    first, second = answer.addresses
    upstream = Upstream()
    server = await asyncio.start_server(upstream.handle, second, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        status, _, body = await curl(proxy, f"http://up.test:{port}/")  # first refuses
        assert status == 200 and body == b"hello from upstream\n"
        assert upstream.connections == 1
    finally:
        server.close()
    assert proxy.dns.count("up.test", "A") == 1  # no fresh resolution for the fallback
    address = next(x for x in proxy.lines() if x.get("stage") == "address")
    assert address["pinned"] == [first, second]
    (close,) = closes(proxy)
    assert close["upstream"] == f"{second}:{port}"
    assert not any(x.get("stage") == "upstream" for x in proxy.lines())  # no error: it worked
    text = proxy.metrics.render()[0].decode()
    assert 'egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0' in text
    assert 'egress_upstream_connect_seconds_count{outcome="ok"} 1.0' in text


@pytest.mark.asyncio
async def test_changed_answer_within_ttl_still_goes_to_the_checked_address(
    proxy: Running,
) -> None:
    first = Upstream()
    async with serving(first):
        second = Upstream()
        server = await asyncio.start_server(second.handle, "127.0.0.2", first.port)
        try:
            proxy.dns.set("up.test", a=["127.0.0.1"], ttl=300)
            url = f"http://up.test:{first.port}/"
            assert (await curl(proxy, url))[0] == 200
            # The DNS server now answers the other address; within the TTL the checked answer
            # is used (a new client connection, a new decision), and nothing reaches the second.
            proxy.dns.set("up.test", a=["127.0.0.2"], ttl=300)
            assert (await curl(proxy, url))[0] == 200
            assert first.connections == 2 and len(first.requests) == 2
            assert second.connections == 0
            assert proxy.dns.count("up.test", "A") == 1
            assert [x["upstream"] for x in closes(proxy)] == [f"127.0.0.1:{first.port}"] * 2
            assert all(
                x["pinned"] == ["127.0.0.1"] for x in proxy.lines() if x.get("stage") == "address"
            )
        finally:
            server.close()


# -- reload, byte counts, overload -----------------------------------------------------------


async def open_tunnel(
    proxy: Running, host: str, upstream: Upstream
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An allowed tunnel through the SNI gate, its ClientHello arrived upstream."""
    status, _, reader, writer = await connect(proxy, f"{host}:{upstream.port}")
    assert status == 200
    writer.write(client_hello(host))
    await writer.drain()
    await asyncio.wait_for(upstream.got_data.wait(), 5)
    return reader, writer


@pytest.mark.asyncio
async def test_reload_closes_live_connections_the_new_policy_denies(proxy: Running) -> None:
    async with (
        serving(Upstream(raw=True)) as narrowed,
        serving(Upstream(raw=True)) as kept,
        serving(Upstream()) as web,
    ):
        proxy.dns.set("tls.test", a=["127.0.0.1"])
        proxy.dns.set("up.test", a=["127.0.0.1"])
        proxy.dns.set("slow.test", a=["127.0.0.1"])
        denied_reader, denied_writer = await open_tunnel(proxy, "tls.test", narrowed)
        kept_reader, kept_writer = await open_tunnel(proxy, "up.test", kept)
        # A keep-alive plain-HTTP client connection to a host the new policy denies.
        http_reader, http_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        authority = f"slow.test:{web.port}"
        http_writer.write(f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        await http_writer.drain()
        head = await asyncio.wait_for(http_reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(http_reader.readexactly(len(b"hello from upstream\n")), 5)

        operator = proxy.engine.policy.operator
        narrower = compile_policy(load_manifest("network:\n  egress: [up.test]\n"), None, operator)
        closed = proxy.engine.set_policy(narrower)
        assert len(closed) == 2
        assert await closed_by_peer(denied_reader)
        assert await closed_by_peer(http_reader)
        # The allowed tunnel stays open and keeps carrying bytes.
        before = len(kept.received)
        kept_writer.write(b"still here")
        await kept_writer.drain()
        for _ in range(100):
            if len(kept.received) >= before + 10:
                break
            await asyncio.sleep(0.02)
        assert bytes(kept.received[before:]) == b"still here"
        with pytest.raises(TimeoutError):  # not closed: nothing to read, no EOF
            await asyncio.wait_for(kept_reader.read(1), 0.2)
        for writer in (denied_writer, kept_writer, http_writer):
            writer.close()
        for _ in range(100):
            if len(closes(proxy)) == 3:
                break
            await asyncio.sleep(0.02)
    reasons = sorted((x["host"], x["reason"]) for x in closes(proxy))
    assert reasons == [
        ("slow.test", "policy_reload"),
        ("tls.test", "policy_reload"),
        ("up.test", "closed"),
    ]


@pytest.mark.asyncio
async def test_close_events_count_bytes_of_plain_http(proxy: Running) -> None:
    async with serving(Upstream()) as upstream:
        proxy.dns.set("up.test", a=["127.0.0.1"])
        url = f"http://up.test:{upstream.port}/"
        status, _, _ = await curl(proxy, url + "a", url + "b")
        assert status == 200
    for _ in range(100):
        if closes(proxy):
            break
        await asyncio.sleep(0.02)
    (close,) = closes(proxy)
    body = b"hello from upstream\n"
    response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    assert close["bytes_down"] == 2 * len(response)
    assert close["bytes_up"] > 2 * len(b"GET /a HTTP/1.1\r\n\r\n")
    text = proxy.metrics.render()[0].decode()
    down = rf'egress_bytes_total\{{[^}}]*"down"[^}}]*\}} {2 * len(response)}\.0'
    assert re.search(down, text), text


@pytest.mark.asyncio
async def test_close_events_count_bytes_of_tunnels(proxy: Running) -> None:
    answer = b"server says hello" * 100
    async with answering(answer) as port:
        proxy.dns.set("tls.test", a=["127.0.0.1"])
        status, _, reader, writer = await connect(proxy, f"tls.test:{port}")
        assert status == 200
        hello = client_hello("tls.test")
        writer.write(hello)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(answer)), 5) == answer
        writer.close()
        for _ in range(100):
            if closes(proxy):
                break
            await asyncio.sleep(0.02)
    (close,) = closes(proxy)
    assert (close["bytes_up"], close["bytes_down"]) == (len(hello), len(answer))
    assert close["upstream"] == f"127.0.0.1:{port}"


@pytest.mark.asyncio
async def test_overload_answers_503_to_the_excess(dns: DNSServer) -> None:
    async with started(dns, "limits:\n  max_connections: 2\n") as proxy:
        held = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        data = await asyncio.wait_for(reader.read(), 5)  # the 503, then the close
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert f"{ERROR_HEADER}: overload".lower().encode() in head.lower()
        assert b"overload" in body
        overload = next(x for x in proxy.lines() if x.get("reason") == "overload")
        assert overload["stage"] == "accept"
        # Below the limit again, requests are served.
        held[0][1].close()
        await asyncio.sleep(0.1)
        async with serving(Upstream()) as upstream:
            proxy.dns.set("up.test", a=["127.0.0.1"])
            assert (await curl(proxy, f"http://up.test:{upstream.port}/"))[0] == 200
        held[1][1].close()


@pytest.mark.asyncio
async def test_header_timeout_closes_silent_clients(dns: DNSServer) -> None:
    async with (
        serving(Upstream(raw=True)) as upstream,
        started(dns, "limits:\n  header_timeout: 1s\n") as proxy,
    ):
        dns.set("tls.test", a=["127.0.0.1"])
        # Connects and says nothing: 408, then closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"X-Egress-Denied: header_timeout" in answer
        # An allowed CONNECT whose ClientHello never comes: closed, nothing dialled.
        status, _, reader, writer = await connect(proxy, f"tls.test:{upstream.port}")
        assert status == 200
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.connections == 0
        # A client that asks in time keeps its connection past the timeout (idle is not silent).
        async with serving(Upstream()) as web:
            dns.set("up.test", a=["127.0.0.1"])
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            request = f"GET http://up.test:{web.port}/ HTTP/1.1\r\nHost: up.test:{web.port}\r\n\r\n"
            for _ in range(2):
                writer.write(request.encode())
                head = await asyncio.wait_for(reader.readuntil(b"hello from upstream\n"), 5)
                assert head.startswith(b"HTTP/1.1 200 ")
                await asyncio.sleep(1.5)
            writer.close()
        await asyncio.sleep(0.1)
    denials = [x for x in proxy.lines() if x["reason"] == "header_timeout"]
    assert [x["event"] for x in denials] == ["decision", "close", "decision", "close"]
    assert denials[2]["host"] == "tls.test"
    assert "ClientHello" in denials[2]["message"]
