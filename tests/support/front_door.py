"""The front door (plane l4) alone in this process, as `egress-proxy run` wires it: an HTTP
door (`opened`: inspection off unless the config says otherwise, the engine started on first
hand-off) and a SOCKS5 door (`socks_door`: never the engine), to break on purpose or to read
their audit lines and metrics directly; and curl through a SOCKS5 listener."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from policy import compile_policy, load_manifest
from proxy.app.config import Config, load_config
from proxy.common.listeners import Listener
from proxy.dataplane.frontdoor import FrontDoor
from proxy.decide.interception import engine_needed
from proxy.decide.vetting import Vetter
from proxy.l7.engine import Engine
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics
from support.dns_server import DNSServer
from support.in_process import Upstream
from support.running import CURL, make_config, metric_value

# What `opened` allows unless the test gives its own manifest.
DOOR_MANIFEST = "network:\n  egress: [tls.test, up.test, nx.test, slow.test, other.test]\n"


@dataclass
class Door:
    door: FrontDoor
    port: int  # the listener (named like in_process.Running's, so its curl() takes a Door)
    dns: DNSServer
    config: Config
    audit: io.StringIO
    metrics: Metrics
    engines: list[Engine] = field(default_factory=list)  # started on first hand-off

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit.getvalue().splitlines()]

    def decisions(self) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x["event"] == "decision"]

    def closes(self) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x["event"] == "close"]

    def metric(self, name: str, **labels: str) -> float | None:
        return metric_value(self.metrics.render()[0].decode(), name, **labels)

    async def wait_closes(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The close lines, once there are `count` of them."""
        deadline = time.monotonic() + timeout
        while len(self.closes()) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        closes = self.closes()
        assert len(closes) == count, closes
        return closes

    async def wait_live(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.door.live != count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert self.door.live == count


@contextlib.asynccontextmanager
async def opened(
    dns: DNSServer,
    extra: str = "",
    *,
    manifest: str = DOOR_MANIFEST,
    source: str = "agent.yaml",
    **limits: float,
) -> AsyncIterator[Door]:
    """A front door on a random loopback port. `extra`: more operator config (YAML); inspection
    is off unless it says otherwise. `limits`: Limits fields, set directly so that they can be
    shorter than the config's one-second grain."""
    if "inspection:" not in extra:
        extra += "inspection:\n  enabled: false\n"
    config = load_config(make_config(dns, extra=extra))
    if limits:
        config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, **limits))
    policy = compile_policy(load_manifest(manifest, source=source), None, config.operator)
    metrics = Metrics()
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="test-session", metrics=metrics)
    resolver = Resolver.from_config(config)
    engines: list[Engine] = []
    lock = asyncio.Lock()

    async def engine() -> Engine:
        async with lock:
            if not engines:
                vetter = Vetter(policy, resolver, metrics, audit, plane="l7")
                started = Engine(vetter, config, metrics, audit)
                await started.start()
                metrics.engine_loaded(True)
                engines.append(started)
            return engines[0]

    if engine_needed(policy, config):
        await engine()  # as the runtime does: loaded at start when the session can need it
    vetter = Vetter(policy, resolver, metrics, audit, plane="l4")
    door = FrontDoor(vetter, config, metrics, audit, engine=engine)
    try:
        (bound,) = await door.start([Listener("http", "127.0.0.1", 0)])
        yield Door(door, bound.port, dns, config, stream, metrics, engines)
    finally:
        await door.drain(0)
        for started in engines:
            await started.stop()


async def received(upstream: Upstream, size: int, timeout: float = 5.0) -> bytes:
    """What a raw upstream received, once it is `size` bytes (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while len(upstream.received) < size and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return bytes(upstream.received)


async def curl_socks(port: int, url: str, *args: str) -> tuple[int, bytes, bytes]:
    """curl through the SOCKS5 listener on `port`, names resolved by the proxy (socks5h):
    exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        CURL, "-sS", "--max-time", "5", "--socks5-hostname", f"127.0.0.1:{port}", *args, url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 10)
    return process.returncode or 0, out, err


@dataclass
class InProcess:
    door: FrontDoor
    port: int
    audit: io.StringIO
    metrics: Metrics


@contextlib.asynccontextmanager
async def socks_door(dns: DNSServer, extra: str, manifest: str) -> AsyncIterator[InProcess]:
    """A front door with one SOCKS5 listener, in this process (to break it on purpose, or to
    read its lines and metrics directly); `extra`: more operator config (YAML)."""
    config = load_config(make_config(dns, extra=extra))
    policy = compile_policy(load_manifest(manifest, source="agent.yaml"), None, config.operator)
    audit_text = io.StringIO()
    metrics = Metrics()
    audit = AuditLog(stream=audit_text, session="test-session", metrics=metrics)
    vetter = Vetter(policy, Resolver.from_config(config), metrics, audit, plane="l4")

    async def no_engine() -> Any:
        raise AssertionError("a SOCKS5 tunnel never needs the engine here")

    door = FrontDoor(vetter, config, metrics, audit, engine=no_engine)
    (bound,) = await door.start([Listener("socks5", "127.0.0.1", 0)])
    try:
        yield InProcess(door, bound.port, audit_text, metrics)
    finally:
        await door.drain(0)
