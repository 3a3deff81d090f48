"""Dialling the checked addresses of one decision, for every plane: in answer
order, each with the connect timeout, falling back to the next on failure; never a fresh
resolution. How one address is connected is the caller's (`connect`): a transport with an
`Upstream` protocol in the data plane (`connect_upstream`), asyncio streams in the engine.

    transport, upstream = await dial_checked("pypi.org", ("151.101.0.223",), 443,
                                             connect_upstream, timeout=10.0, metrics=metrics)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, cast

from policy.reasons import Reason
from proxy.common.refusals import authority, shown
from proxy.net.flow import Hold, Reading

if TYPE_CHECKING:
    from proxy.decide.events import MetricsSink
    from proxy.net.bytecount import Counter


class UpstreamError(OSError):
    """Every checked address failed. The text carries the reason (mitmproxy stores str(exc) as
    the server connection's error and hands only that text on)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"egress-proxy: {reason}: {message}")
        self.reason = reason
        self.message = message


async def dial_checked[T](
    name: str,
    addresses: Sequence[str],
    port: int,
    connect: Callable[[str, int], Awaitable[T]],
    *,
    timeout: float,
    metrics: MetricsSink | None = None,
) -> T:
    """The first of `addresses` that connects; raises UpstreamError (upstream_timeout when every
    address timed out, else upstream_refused) naming each address and what happened."""
    failures: list[tuple[str, str]] = []
    for address in addresses:
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                connected = await connect(address, port)
        except TimeoutError:  # before OSError: TimeoutError is one
            outcome = Reason.UPSTREAM_TIMEOUT
        except OSError:
            outcome = Reason.UPSTREAM_REFUSED
        else:
            if metrics is not None:
                metrics.upstream_connect(time.monotonic() - started, "ok")
            return connected
        if metrics is not None:
            metrics.upstream_connect(time.monotonic() - started, outcome)
        failures.append((address, outcome))
    timed_out = bool(failures) and all(
        outcome == Reason.UPSTREAM_TIMEOUT for _, outcome in failures
    )
    tried = ", ".join(
        f"{address} {'timed out' if outcome == Reason.UPSTREAM_TIMEOUT else 'refused'}"
        for address, outcome in failures
    )
    raise UpstreamError(
        Reason.UPSTREAM_TIMEOUT if timed_out else Reason.UPSTREAM_REFUSED,
        f"{shown(authority(name, port))} ({tried or 'no address'})",
    )


class Upstream(asyncio.Protocol):
    """An upstream connection before its relay (or HTTP exchange) takes it: what it sends early
    is kept (bounded: reading pauses past EARLY_LIMIT), and an EOF or a loss is remembered, so
    whoever takes the transport over knows where it stands. `forward_to` sends it on to the
    client instead, for a server that speaks first while the client's bytes are still being
    decided. `reading` is the transport's read side (proxy/net/flow.py), which whoever takes
    the transport over takes with it."""

    __slots__ = ("counter", "early", "eof", "lost", "lost_error", "reading", "sink")

    reading: Reading  # from connection_made on

    def __init__(self) -> None:
        self.early = bytearray()
        self.eof = False
        self.lost = False
        self.lost_error: Exception | None = None
        self.sink: asyncio.Transport | None = None
        self.counter: Counter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.reading = Reading(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink.write(data)
            if self.counter is not None:
                self.counter.down += len(data)
            if sink.get_write_buffer_size() > EARLY_LIMIT:
                self.reading.pause(Hold.CLIENT_SLOW)  # until the relay takes it over
            return
        self.early += data
        if len(self.early) > EARLY_LIMIT:
            self.reading.pause(Hold.EARLY_FULL)

    def eof_received(self) -> bool:
        self.eof = True
        if self.sink is not None and not self.sink.is_closing():
            self.sink.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.lost_error = exc
        if self.sink is not None and not self.sink.is_closing():
            # The client heard the server; it hears the end the way the server ended.
            if exc is None:
                self.sink.close()
            else:
                self.sink.abort()

    def forward_to(self, client: asyncio.Transport, counter: Counter) -> None:
        """From now on what the upstream sends goes to `client` as it arrives (counted as
        bytes down), what it sent before first: only the client's bytes wait for a decision.
        The relay that takes the transport over carries on from there."""
        self.sink, self.counter = client, counter
        early = self.take_early()
        if early:
            client.write(early)
            counter.down += len(early)
        if self.eof:
            client.write_eof()
        else:
            self.reading.resume(Hold.EARLY_FULL)

    def take_early(self) -> bytes:
        data = bytes(self.early)
        self.early.clear()
        return data


EARLY_LIMIT = 64 << 10


async def connect_upstream(address: str, port: int) -> tuple[asyncio.Transport, Upstream]:
    """A transport connected to a numeric address (never a name lookup: the loop is given an IP
    literal, which it connects without asking any resolver), with an `Upstream` protocol."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(Upstream, address, port)
    return transport, protocol
