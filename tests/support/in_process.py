"""The proxy in process, as `egress-proxy run` wires it, for the tests of the data plane: a
FrontDoor (plane l4) that decides, vets and SNI-gates each CONNECT and hands the intercepted ones
to the Engine (plane l7); HTTP upstreams of the test's own (asyncio, plain or TLS from one
upstream CA) and raw clients (curl, a CONNECT, a request on an open connection).

One upstream CA and one inspection CA serve every test that uses this module (made on import,
removed at exit): a 2048-bit key per engine start would cost more than most tests.
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

import trustme

from policy import Policy, compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.common.listeners import Listener
from proxy.dataplane.frontdoor import FrontDoor
from proxy.decide.interception import engine_needed
from proxy.decide.planes import Update
from proxy.decide.vetting import Vetter
from proxy.l7.engine import Engine
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics
from support.dns_server import DNSServer
from support.tls import tls_context

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
    closed: int = 0  # connections whose handler ended (the proxy closed its side)
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
            self.closed += 1

    async def wait_closed(self, count: int, timeout: float = 5.0) -> None:
        """Until `count` connections have ended on this side (bounded)."""
        async with asyncio.timeout(timeout):
            while self.closed < count:
                await asyncio.sleep(0.01)


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


@contextlib.asynccontextmanager
async def tls_serving(upstream: Upstream, *names: str) -> AsyncIterator[Upstream]:
    async with serving(
        upstream, tls_context(UPSTREAM_CA, *(names or ("up.test", "tls.test")))
    ) as served:
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

    def reload(self, policy: Policy) -> list[str]:
        """A reload to `policy`, as the runtime gives it: one update to both planes."""
        update = Update(policy=policy)
        return self.front.configure(update) + self.engine.configure(update)

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
    engine = Engine(Vetter(policy, resolver, metrics, audit, plane="l7"), config, metrics, audit)
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


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), 5) == b""
    except (ConnectionError, ssl.SSLError):
        return True


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
