"""The interception engine (proxy/l7/) behind the front door, over real loopback sockets: curl and
Python's ssl as clients, TLS upstreams of the test's own (trustme), the test DNS server.

In process, as `egress-proxy run` wires it: a FrontDoor (plane l4) that decides, vets and
SNI-gates each CONNECT and hands the intercepted ones to the Engine (plane l7) through
`Door.intercept`. The operator config here says `inspection.mode: all`, so every allowed TLS
connection is intercepted, hosts without path rules included. What is checked is what a user
sees: statuses and headers, what reached the upstream, the audit lines and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import trustme
from dns_server import DNSServer

from policy import Policy, compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener
from proxy.common.refusals import DENIED_HEADER, ERROR_HEADER
from proxy.dataplane.frontdoor import FrontDoor
from proxy.decide.interception import Destination, engine_needed
from proxy.decide.vetting import Peer, Vetter
from proxy.l7.engine import Engine
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics

CURL = "/usr/bin/curl"
MANIFEST = """\
network:
  egress: [up.test, private.test, nx.test, slow.test, tls.test, other.test]
"""
BODY = b"hello from upstream\n"
ALL = "  mode: all\n"  # inspection.mode: all, inside the `inspection:` section


# -- upstreams -------------------------------------------------------------------------------


@dataclass
class Upstream:
    """An HTTP/1.1 server (keep-alive) that records what it received; with raw=True it records
    the bytes of each connection and answers nothing; `answer` replaces its response."""

    raw: bool = False
    answer: bytes | None = None
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (request line, Host)
    heads: list[str] = field(default_factory=list)  # whole request heads, as received
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
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                host = next(
                    (ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("host:")),
                    None,
                )
                self.requests.append((lines[0], host))
                self.heads.append(head)
                writer.write(
                    self.answer
                    or b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(
    upstream: Upstream, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[Upstream]:
    server = await asyncio.start_server(upstream.handle, host, port, ssl=tls)
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


# One upstream CA and one inspection CA for the module (made on first use, removed at exit): a
# 2048-bit key per engine start would cost more than most tests here.
CA_DIR = tempfile.TemporaryDirectory(prefix="egress-ca-")
UPSTREAM_CA = trustme.CA()
UPSTREAM_BUNDLE = Path(CA_DIR.name) / "upstream-ca.pem"
UPSTREAM_CA.cert_pem.write_to_path(str(UPSTREAM_BUNDLE))
PROXY_CA = str(Path(CA_DIR.name) / "ca" / "mitmproxy-ca-cert.pem")


def tls_context(*names: str, ca: trustme.CA = UPSTREAM_CA) -> ssl.SSLContext:
    """A TLS server context with a certificate for `names` from `ca`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


@contextlib.asynccontextmanager
async def tls_serving(upstream: Upstream, *names: str) -> AsyncIterator[Upstream]:
    async with serving(upstream, tls_context(*(names or ("up.test", "tls.test")))) as served:
        yield served


# -- the proxy -------------------------------------------------------------------------------


@dataclass
class Running:
    front: FrontDoor
    engine: Engine
    port: int
    dns: DNSServer
    audit: io.StringIO
    metrics: Metrics
    listeners: tuple[Listener, ...] = ()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit.getvalue().splitlines()]

    def closes(self) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x["event"] == "close"]

    async def wait_closes(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        for _ in range(int(timeout / 0.02)):
            if len(self.closes()) >= count:
                break
            await asyncio.sleep(0.02)
        return self.closes()

    def set_policy(self, policy: Policy) -> list[str]:
        """A reload, as the runtime does it: both planes."""
        return self.front.set_policy(policy) + self.engine.set_policy(policy)

    def metric(self, text: str) -> bool:
        return text in self.metrics.render()[0].decode()


@contextlib.asynccontextmanager
async def started(
    dns: DNSServer,
    extra: str = "",
    manifest: str = MANIFEST,
    source: str = "agent.yaml",
    listeners: list[Listener] | None = None,
    *,
    inspection: str = ALL,
) -> AsyncIterator[Running]:
    """A front door on a random loopback port (or on `listeners`) and the engine behind it, set
    up as the runtime does; `extra` is more operator config (YAML), `inspection` more lines of
    its `inspection:` section (the CA directory and the upstream bundle are the module's)."""
    if "inspection:" not in extra:
        extra += (
            f"inspection:\n  ca_dir: {CA_DIR.name}/ca\n  upstream_ca: {UPSTREAM_BUNDLE}\n"
            + inspection
        )
    config = load_config(
        f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n" + extra
    )
    policy = compile_policy(load_manifest(manifest, source=source), None, config.operator)
    metrics = Metrics()
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="test-session", metrics=metrics)
    resolver = Resolver.from_config(config)
    engine = Engine(policy, resolver, config, metrics, audit)
    lock = asyncio.Lock()

    async def lazily() -> Engine:
        async with lock:
            if engine.master is None:
                await engine.start()
            return engine

    if engine_needed(policy, config):
        await lazily()
    front = FrontDoor(
        Vetter(policy, resolver, metrics, audit, plane="l4"), config, metrics, audit, engine=lazily
    )
    try:
        bound = await front.start(listeners or [Listener("http", "127.0.0.1", 0)])
        yield Running(front, engine, bound[0].port, dns, stream, metrics, bound)
    finally:
        await front.drain(0)
        await engine.stop()


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("up.test", "tls.test", "other.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    async with started(dns) as running:
        yield running


# -- clients ---------------------------------------------------------------------------------


async def curl(proxy: Any, url: str, *args: str) -> tuple[int, dict[str, str], bytes]:
    """Status, response headers (lowercase names) and body of one curl run through the proxy
    (the last response's, after a CONNECT's 200). Run from a thread, so the event loop goes on:
    the proxy under test serves on this very loop."""
    command = [
        CURL, "-sS", "-x", f"http://127.0.0.1:{proxy.port}", "--max-time", "5",
        "-D", "/dev/stderr", "-o", "-", url, *args,
    ]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, timeout=10)
    return (*last_head(done.stderr), done.stdout)


def last_head(dumped: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers (lowercase names) of the last response head in what curl's
    `-D` wrote (a CONNECT's 200 comes first)."""
    status = 0
    headers: dict[str, str] = {}
    for line in dumped.decode("latin-1").splitlines():
        if line.startswith("HTTP/"):
            status, headers = int(line.split()[1]), {}
        elif ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers (lowercase names) of the next response head."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1")
    lines = head.split("\r\n")
    headers = {
        ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
        for ln in lines[1:]
        if ":" in ln
    }
    return int(lines[0].split()[1]), headers


async def connect(
    proxy: Any, authority: str
) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    return *await read_head(reader), reader, writer


async def intercepted(
    proxy: Any, host: str, port: int, *, cafile: str = PROXY_CA
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT through the proxy, then TLS inside it verified against the proxy's CA."""
    status, _, reader, writer = await connect(proxy, f"{host}:{port}")
    assert status == 200
    await writer.start_tls(ssl.create_default_context(cafile=cafile), server_hostname=host)
    return reader, writer


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One request on an open connection; the status, headers and body of its response."""
    writer.write(request)
    await writer.drain()
    status, headers = await read_head(reader)
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 5)
    return status, headers, body


def get(host: str, path: str = "/", *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", *headers, "", ""]
    return "\r\n".join(lines).encode()


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
    except (ConnectionError, ssl.SSLError):
        return True


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


class ExplodingPolicy:
    """A policy whose every call raises: the hooks must deny, never let the request through."""

    operator = None
    has_url_rules = False

    def decide(self, target: object) -> object:
        raise RuntimeError("boom")

    def check_addresses(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("boom")


# -- interception of every TLS connection (inspection.mode: all) ------------------------------


@pytest.mark.asyncio
async def test_a_host_without_path_rules_is_intercepted_under_mode_all(
    proxy: Running, resolved_by_os: list[str]
) -> None:
    async with tls_serving(Upstream()) as upstream:
        url = f"https://up.test:{upstream.port}/hello?x=1"
        status, _, body = await curl(proxy, url, "--cacert", PROXY_CA)
        assert (status, body) == (200, BODY)
        # The client saw the proxy's certificate: trusting only the upstream's CA fails (the
        # last status curl saw is its CONNECT's).
        status, _, body = await curl(proxy, url, "--cacert", str(UPSTREAM_BUNDLE))
        assert (status, body) == (200, b"")
    assert upstream.requests == [("GET /hello?x=1 HTTP/1.1", f"up.test:{upstream.port}")]
    assert proxy.dns.count("up.test", "A") == 1  # at the CONNECT; each request then cached
    assert resolved_by_os == []
    # One decision, one line: the tunnel's allow at its last stage (the SNI gate), the
    # request's at its own last one (the address stage); the client that distrusts our
    # certificate sends no request, so its tunnel has the gate's line alone.
    decisions = [x for x in proxy.lines() if x["event"] == "decision"]
    shapes = [(x["plane"], x["protocol"], x["stage"], x["decision"]) for x in decisions]
    assert shapes == [
        ("l4", "connect", "sni", "allow"),
        ("l7", "https", "address", "allow"),
        ("l4", "connect", "sni", "allow"),
    ]
    tunnel, request = decisions[:2]
    assert (tunnel["rule"], tunnel["sni"]) == ("network.egress[0]", "up.test")
    assert tunnel["resolved"] == tunnel["pinned"] == ["127.0.0.1"]
    assert request["path"] == "/hello?x=1" and request["method"] == "GET"
    assert request["rule"] == "network.egress[0]" and request["pinned"] == ["127.0.0.1"]
    # One connection id across both planes: the front door's.
    assert tunnel["connection"] == request["connection"] != decisions[2]["connection"]
    close, distrusted = await proxy.wait_closes(2)
    assert distrusted["reason"] == "client_tls_failed"
    assert (close["plane"], close["protocol"], close["host"]) == ("l7", "connect", "up.test")
    assert close["upstream"] == f"127.0.0.1:{upstream.port}" and close["sni"] == "up.test"
    assert close["pinned"] == ["127.0.0.1"] and close["reason"] == "closed"
    assert close["bytes_up"] > 500 and close["bytes_down"] > 500  # TLS records, both ways
    assert proxy.metric('egress_connections_total{plane="l7",protocol="connect"} 2.0')


@pytest.mark.asyncio
async def test_a_host_header_other_than_the_sni_is_refused(proxy: Running) -> None:
    # Domain fronting: the SNI (and the CONNECT) names one host, the request inside another.
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        other = f"other.test:{upstream.port}"
        mine = f"up.test:{upstream.port}"
        for request in (
            get(other),  # another host, allowed on its own
            get("up.test:1"),  # the right host, another port
            get(mine, f"https://{other}/"),  # absolute form: an origin prefers it to Host
            get(mine, "/", f"Host: {other}"),  # two Host headers
            b"GET / HTTP/1.1\r\n\r\n",  # none
        ):
            status, headers, body = await exchange(reader, writer, request)
            assert status == 403, request
            assert headers[DENIED_HEADER.lower()] == "host_mismatch"
            assert body.count(b"\n") == 1 and f"{mine} denied: host_mismatch".encode() in body
        # The connection stays usable for a request that names its host.
        assert (await exchange(reader, writer, get(mine)))[0] == 200
        writer.close()
    assert upstream.requests == [("GET / HTTP/1.1", mine)]
    refusals = [x for x in proxy.lines() if x.get("reason") == "host_mismatch"]
    assert len(refusals) == 5 and {x["stage"] for x in refusals} == {"host"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "headers",
    [
        ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"),
        ("Connection: Upgrade", "Upgrade: TLS/1.0"),
        ("Connection: Upgrade", "Upgrade: websocket, h2c"),
        ("Connection: Upgrade", "Upgrade: h2c"),
        ("HTTP2-Settings: AAMAAABkAAQAAP__",),
        ("Connection: Upgrade", "Upgrade: "),
    ],
    ids=["h2c", "tls", "websocket_and_h2c", "h2c_without_settings", "settings_alone", "empty"],
)
async def test_upgrades_other_than_websocket_are_refused_inside(
    proxy: Running, headers: tuple[str, ...]
) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        host = f"up.test:{upstream.port}"
        status, answer, body = await exchange(reader, writer, get(host, "/", *headers))
        assert status == 403
        assert answer[DENIED_HEADER.lower()] == "upgrade_refused"
        assert b"upgrade_refused" in body
        # Nothing reached the upstream; the next plain request does, without either header.
        assert upstream.connections == 0
        assert (await exchange(reader, writer, get(host)))[0] == 200
        writer.close()
    (head,) = upstream.heads
    assert "upgrade" not in head.lower() and "http2-settings" not in head.lower()
    refusal = next(x for x in proxy.lines() if x.get("reason") == "upgrade_refused")
    assert (refusal["plane"], refusal["stage"], refusal["method"]) == ("l7", "request", "GET")


@pytest.mark.asyncio
async def test_a_101_the_request_did_not_ask_for_never_reaches_the_client(
    proxy: Running,
) -> None:
    switching = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    async with tls_serving(Upstream(answer=switching)) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        writer.write(get(f"up.test:{upstream.port}"))
        await writer.drain()
        assert await closed_by_peer(reader)  # closed, no 101 and nothing after it
        writer.close()
    refusal = next(x for x in proxy.lines() if x.get("reason") == "upgrade_refused")
    assert "h2c" in refusal["message"]


@pytest.mark.asyncio
async def test_an_http2_client_reaches_an_http1_upstream(proxy: Running) -> None:
    # ALPN h2 to the client; this upstream offers no ALPN, so it is spoken HTTP/1.1 to, with
    # the request's :authority as its Host (more: tests/test_h2_interception.py).
    async with tls_serving(Upstream()) as upstream:
        status, _, body = await curl(
            proxy, f"https://up.test:{upstream.port}/", "--http2", "--cacert", PROXY_CA
        )
    assert (status, body) == (200, BODY)
    assert upstream.requests == [("GET / HTTP/1.1", f"up.test:{upstream.port}")]


# -- upstream errors, fallback, pinning ------------------------------------------------------


@pytest.mark.asyncio
async def test_upstream_refused_is_502(proxy: Running) -> None:
    port = free_port()
    status, headers, body = await curl(proxy, f"https://up.test:{port}/", "--cacert", PROXY_CA)
    assert status == 502
    assert headers[ERROR_HEADER.lower()] == "upstream_refused"
    assert body.count(b"\n") == 1 and b"upstream_refused" in body and b"up.test" in body
    error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
    assert (error["reason"], error["host"], error["port"]) == ("upstream_refused", "up.test", port)
    assert (error["plane"], error["decision"]) == ("l7", "deny")
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0')


@pytest.mark.asyncio
async def test_upstream_connect_timeout_is_504(dns: DNSServer) -> None:
    async with started(dns, "limits:\n  connect_timeout: 1s\n") as proxy:
        with blackholed() as port:
            loop = asyncio.get_running_loop()
            started_at = loop.time()
            status, headers, body = await curl(
                proxy, f"https://up.test:{port}/", "--cacert", PROXY_CA
            )
            elapsed = loop.time() - started_at
        assert status == 504, body
        assert headers[ERROR_HEADER.lower()] == "upstream_timeout"
        assert 0.9 <= elapsed < 4
        error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
        assert error["reason"] == "upstream_timeout"


@pytest.mark.asyncio
async def test_fallback_to_the_next_checked_address(proxy: Running) -> None:
    proxy.dns.set("up.test", a=["127.0.0.9", "127.0.0.1"])
    # The order of the answer is the DNS server's; learn it through the proxy's own resolver
    # (its cache is the answer both planes check and use), then listen on the second.
    answer = await proxy.engine.vetter.resolver.resolve("up.test")
    first, second = answer.addresses
    async with serving(Upstream(), tls_context("up.test"), host=second) as upstream:
        url = f"https://up.test:{upstream.port}/"
        status, _, body = await curl(proxy, url, "--cacert", PROXY_CA)  # the first refuses
        assert (status, body) == (200, BODY)
        assert upstream.connections == 1
    assert proxy.dns.count("up.test", "A") == 1  # no fresh resolution for the fallback
    address = next(x for x in proxy.lines() if x.get("stage") == "address")
    assert address["pinned"] == [first, second]
    close = next(x for x in await proxy.wait_closes(1) if x["plane"] == "l7")
    assert close["upstream"] == f"{second}:{upstream.port}"
    assert not any(x.get("stage") == "upstream" for x in proxy.lines())  # no error: it worked
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0')
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="ok"} 1.0')


@pytest.mark.asyncio
async def test_a_changed_answer_within_the_ttl_still_goes_to_the_checked_address(
    proxy: Running,
) -> None:
    async with (
        tls_serving(Upstream()) as first,
        serving(Upstream(), tls_context("up.test"), "127.0.0.2", first.port) as second,
    ):
        proxy.dns.set("up.test", a=["127.0.0.1"], ttl=300)
        url = f"https://up.test:{first.port}/"
        assert (await curl(proxy, url, "--cacert", PROXY_CA))[0] == 200
        # The DNS server now answers the other address; within the TTL the checked answer
        # is used (a new connection, new decisions), and nothing reaches the second.
        proxy.dns.set("up.test", a=["127.0.0.2"], ttl=300)
        assert (await curl(proxy, url, "--cacert", PROXY_CA))[0] == 200
        assert first.connections == 2 and len(first.requests) == 2
        assert second.connections == 0
    assert proxy.dns.count("up.test", "A") == 1
    l7 = [x for x in await proxy.wait_closes(4) if x["plane"] == "l7"]
    assert [x["upstream"] for x in l7] == [f"127.0.0.1:{first.port}"] * 2
    assert all(x["pinned"] == ["127.0.0.1"] for x in proxy.lines() if x.get("stage") == "address")


@pytest.mark.asyncio
async def test_keep_alive_reuses_the_pinned_upstream_connection(proxy: Running) -> None:
    async with tls_serving(Upstream()) as upstream:
        url = f"https://up.test:{upstream.port}/"
        # HTTP/1.1 to the proxy as to this upstream: mitmproxy gives each HTTP/2 stream bound
        # for an HTTP/1.1 upstream a connection of its own (tests/test_h2_interception.py).
        status, _, body = await curl(proxy, url + "a", url + "b", "--cacert", PROXY_CA, "--http1.1")
        assert (status, body) == (200, BODY * 2)
    assert [r[0] for r in upstream.requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1"]
    assert upstream.connections == 1  # the upstream connection is reused, by name
    # Each request is still decided on its own: one allow line each.
    requests = [x for x in proxy.lines() if x.get("protocol") == "https"]
    assert [(x["path"], x["stage"], x["decision"]) for x in requests] == [
        ("/a", "address", "allow"),
        ("/b", "address", "allow"),
    ]


# -- reload, failing closed, timeouts ---------------------------------------------------------


@pytest.mark.asyncio
async def test_reload_closes_intercepted_connections_the_new_policy_denies(
    proxy: Running,
) -> None:
    async with tls_serving(Upstream()) as upstream:
        narrowed = await intercepted(proxy, "tls.test", upstream.port)
        kept = await intercepted(proxy, "up.test", upstream.port)
        for (reader, writer), host in ((narrowed, "tls.test"), (kept, "up.test")):
            assert (await exchange(reader, writer, get(f"{host}:{upstream.port}")))[0] == 200
        operator = proxy.engine.policy.operator
        policy = compile_policy(load_manifest("network:\n  egress: [up.test]\n"), None, operator)
        closed = proxy.set_policy(policy)
        assert len(closed) == 1
        assert await closed_by_peer(narrowed[0])
        # The allowed one stays open and keeps serving.
        assert (await exchange(*kept, get(f"up.test:{upstream.port}")))[0] == 200
        for _, writer in (narrowed, kept):
            writer.close()
    reasons = sorted((x["host"], x["reason"]) for x in await proxy.wait_closes(2))
    assert reasons == [("tls.test", "policy_reload"), ("up.test", "closed")]


@pytest.mark.asyncio
async def test_an_exception_in_a_hook_denies(proxy: Running) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        # The decision inside raises (the policy swapped under the engine, no reload).
        proxy.engine.vetter.policy = ExplodingPolicy()  # type: ignore[assignment]
        status, headers, _ = await exchange(reader, writer, get(f"up.test:{upstream.port}"))
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "internal_error"
        # A reload whose re-decision raises closes the connection (fail closed).
        assert len(proxy.engine.set_policy(ExplodingPolicy())) == 1  # type: ignore[arg-type]
        assert await closed_by_peer(reader)
        writer.close()
    assert upstream.connections == 0
    refusal = next(x for x in proxy.lines() if x.get("reason") == "internal_error")
    assert (refusal["plane"], refusal["stage"]) == ("l7", "engine")
    assert "requestheaders" in refusal["message"]
    (close,) = await proxy.wait_closes(1)
    assert close["reason"] == "policy_reload"


@pytest.mark.asyncio
async def test_a_silent_client_is_closed_after_the_header_timeout(dns: DNSServer) -> None:
    async with (
        tls_serving(Upstream()) as upstream,
        started(dns, "limits:\n  header_timeout: 1s\n") as proxy,
    ):
        # TLS completes, then no request head: closed, nothing dialled.
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.connections == 0
        # A client that asks in time keeps its connection past the timeout.
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        for _ in range(2):
            assert (await exchange(reader, writer, get(f"up.test:{upstream.port}")))[0] == 200
            await asyncio.sleep(1.3)
        writer.close()
    timeouts = [x for x in proxy.lines() if x["reason"] == "header_timeout"]
    assert [(x["event"], x["plane"]) for x in timeouts] == [("decision", "l7"), ("close", "l7")]


@pytest.mark.asyncio
async def test_a_refused_request_with_a_large_body_closes_and_sends_nothing(
    proxy: Running,
) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        # mitmproxy cannot answer a request whose body it streams: the refusal closes.
        head = (
            f"POST / HTTP/1.1\r\nHost: other.test:{upstream.port}\r\nContent-Length: 200000\r\n\r\n"
        )
        writer.write(head.encode() + b"x" * 200_000)
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
    assert upstream.connections == 0
    assert [x["reason"] for x in proxy.lines() if x.get("decision") == "deny"] == ["host_mismatch"]


# -- the hand-over itself ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_serves_a_socks5_hand_over(proxy: Running) -> None:
    """What the SOCKS5 listener does after its 0x00 reply and the SNI gate: Door.intercept with
    protocol socks5. Here the engine side directly: a real TLS client on a loopback socket."""
    async with tls_serving(Upstream()) as upstream:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        client_reader, client_writer = await asyncio.open_connection(*listener.getsockname()[:2])
        accepted, peer = await loop.sock_accept(listener)
        listener.close()
        handshake = loop.create_task(
            client_writer.start_tls(
                ssl.create_default_context(cafile=PROXY_CA), server_hostname="up.test"
            )
        )
        hello = await loop.sock_recv(accepted, 65536)  # the ClientHello, read first
        destination = Destination(
            host="up.test",
            port=upstream.port,
            sni="up.test",
            target=f"up.test:{upstream.port}",
            pinned=("127.0.0.1",),
            peer=Peer(peer[:2], "socks-1"),
            protocol="socks5",
        )
        served = loop.create_task(proxy.engine.intercept(accepted, hello, destination))
        await handshake
        status, _, body = await exchange(
            client_reader, client_writer, get(f"up.test:{upstream.port}")
        )
        assert (status, body) == (200, BODY)
        client_writer.close()
        await asyncio.wait_for(served, 5)
    (close,) = proxy.closes()
    assert (close["connection"], close["protocol"], close["plane"]) == ("socks-1", "socks5", "l7")
    # The request's one line (its allow, at the address stage) under the hand-over's id.
    decisions = [x for x in proxy.lines() if x["event"] == "decision"]
    assert [(x["protocol"], x["stage"], x["connection"]) for x in decisions] == [
        ("https", "address", "socks-1")
    ]


def test_server_connect_refuses_what_was_not_vetted() -> None:
    from mitmproxy.connection import Client, Server
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    from proxy.l7.addons import Pinning
    from proxy.l7.state import Intercepted, Ledger

    ledger = Ledger()
    vetter = Vetter(ExplodingPolicy(), None, plane="l7")  # type: ignore[arg-type]
    pinning = Pinning(vetter, ledger, connect_timeout=1.0, metrics=None)
    client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 3128))
    destination = Destination("up.test", 443, "up.test", "up.test:443", (), Peer(None, "c"), "tls")

    class Transport:
        def abort(self) -> None:
            pass

    connection = Intercepted(destination, Transport())  # type: ignore[arg-type]
    ledger.add(client.id, connection)
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=client))
    assert server.error and "not_vetted" in server.error
    assert ledger.take_dial(server.id) is None
    # A decided request's checked addresses: allowed, and the name kept for the certificate.
    connection.vetted[("up.test", 443)] = ("192.0.2.7", "192.0.2.8")
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=client))
    assert not server.error and server.address == ("up.test", 443)
    dial = ledger.take_dial(server.id)
    assert dial is not None and dial.addresses == ("192.0.2.7", "192.0.2.8")
    # ...but only for that client connection: another one is not ours, and is refused.
    other = Client(peername=("127.0.0.1", 5001), sockname=("127.0.0.1", 3128))
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=other))
    assert server.error and "internal_error" in server.error
    assert ledger.take_dial(server.id) is None


@pytest.mark.asyncio
async def test_passthrough_stays_passthrough_under_mode_prefixes(dns: DNSServer) -> None:
    # The default mode: a host allowed whole is relayed, its own certificate to the client.
    async with (
        tls_serving(Upstream()) as upstream,
        started(dns, inspection="") as proxy,
    ):
        url = f"https://up.test:{upstream.port}/"
        status, _, body = await curl(proxy, url, "--cacert", str(UPSTREAM_BUNDLE))
        assert (status, body) == (200, BODY)
        assert proxy.engine.master is None  # never loaded
        (close,) = await proxy.wait_closes(1)
        assert close["plane"] == "l4"


@pytest.mark.asyncio
async def test_an_engine_that_cannot_load_refuses_the_connection(dns: DNSServer) -> None:
    # The engine is loaded on the first connection that needs it (a reload can bring the first
    # URL-prefix rule); if it cannot load, that connection is refused, nothing is relayed.
    config = load_config(
        f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
        "addresses:\n  allow: [127.0.0.0/8]\ninspection:\n  mode: all\n"
    )
    policy = compile_policy(load_manifest(MANIFEST), None, config.operator)
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="test-session")
    resolver = Resolver.from_config(config)

    async def broken() -> Engine:
        raise ProxyError("ca_error", "inspection CA in /nowhere: cannot create the directory")

    front = FrontDoor(Vetter(policy, resolver, None, audit, plane="l4"), config, None, audit,
                      engine=broken)  # fmt: skip
    async with tls_serving(Upstream(raw=True)) as upstream:
        (bound,) = await front.start([Listener("http", "127.0.0.1", 0)])
        try:
            status, _, reader, writer = await connect(bound, f"up.test:{upstream.port}")
            assert status == 200
            writer.write(client_hello("up.test"))
            await writer.drain()
            assert await closed_by_peer(reader)
            writer.close()
        finally:
            await front.drain(0)
        assert upstream.connections == 0
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    refusal = next(x for x in lines if x.get("reason") == "ca_error")
    assert (refusal["plane"], refusal["stage"], refusal["host"]) == ("l4", "engine", "up.test")
    (close,) = [x for x in lines if x["event"] == "close"]
    assert close["reason"] == "ca_error"


def test_a_hook_for_a_connection_never_handed_over_denies() -> None:
    # Every connection of this engine comes through Door.intercept; anything else is refused
    # (fail closed), with the hook's own answer.
    from mitmproxy.test import tflow

    from proxy.l7.addons import RequestGate
    from proxy.l7.state import Ledger

    gate = RequestGate(Vetter(ExplodingPolicy(), None, plane="l7"), Ledger())  # type: ignore[arg-type]
    flow = tflow.tflow()
    asyncio.run(gate.requestheaders(flow))
    assert flow.response is not None and flow.response.status_code == 403
    assert flow.response.headers[DENIED_HEADER] == "internal_error"
    assert b"proxy denied: internal_error" in (flow.response.content or b"")
