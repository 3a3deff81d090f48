"""Dialling the checked addresses of one decision, for both planes (DESIGN 3.5): in answer
order, each with the connect timeout, falling back to the next on failure; never a fresh
resolution. How one address is connected is the caller's (`connect`): asyncio streams in the
engine, a raw non-blocking socket in the fast path.

    sock = await dial_checked("pypi.org", ("151.101.0.223",), 443, connect_socket,
                              timeout=10.0, metrics=metrics)
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from proxy.reasons import UPSTREAM_REFUSED, UPSTREAM_TIMEOUT, authority, shown

if TYPE_CHECKING:
    from proxy.decide.events import MetricsSink


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
            connected = await asyncio.wait_for(connect(address, port), timeout)
        except TimeoutError:  # before OSError: TimeoutError is one
            outcome = UPSTREAM_TIMEOUT
        except OSError:
            outcome = UPSTREAM_REFUSED
        else:
            if metrics is not None:
                metrics.upstream_connect(time.monotonic() - started, "ok")
            return connected
        if metrics is not None:
            metrics.upstream_connect(time.monotonic() - started, outcome)
        failures.append((address, outcome))
    timed_out = bool(failures) and all(outcome == UPSTREAM_TIMEOUT for _, outcome in failures)
    tried = ", ".join(
        f"{address} {'timed out' if outcome == UPSTREAM_TIMEOUT else 'refused'}"
        for address, outcome in failures
    )
    raise UpstreamError(
        UPSTREAM_TIMEOUT if timed_out else UPSTREAM_REFUSED,
        f"{shown(authority(name, port))} ({tried or 'no address'})",
    )


async def connect_socket(address: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to a numeric address (never a name lookup).

    The connect is driven here rather than by `loop.sock_connect`, which passes every address
    through its resolver path first: the address is numeric, and this runs once per tunnel."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM | _NONBLOCK)
    try:
        if not _NONBLOCK:
            sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = sock.connect_ex((address, port))
        if error in _IN_PROGRESS:
            loop = asyncio.get_running_loop()
            writable = loop.create_future()
            fd = sock.fileno()
            loop.add_writer(fd, _wake, writable)
            try:
                await writable
            finally:
                loop.remove_writer(fd)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, f"connect to {authority(address, port)} failed")
    except BaseException:
        sock.close()
        raise
    return sock


_IN_PROGRESS = frozenset({errno.EINPROGRESS, errno.EINTR})
# Linux: the socket is made non-blocking by socket() itself, one system call fewer.
_NONBLOCK = getattr(socket, "SOCK_NONBLOCK", 0)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
