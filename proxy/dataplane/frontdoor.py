"""The front door of `egress-proxy run`: our own listeners on the event loop, for every protocol.

    door = FrontDoor(vetter, config, metrics, audit, engine=lazy_engine)
    bound = await door.start([Listener("http", "127.0.0.1", 3128)])
    door.configure(Update(policy=policy, config=config))   # a reload (proxy/decide/planes.py)
    await door.drain(5.0)

Every connection is accepted here, as an `asyncio.Protocol` of its listener's kind
(proxy/dataplane/kinds.py). Tunnels are decided, dialled, SNI-gated and relayed here
(proxy/dataplane/tunnel.py); plain HTTP is forwarded here (proxy/dataplane/http.py). Only a TLS
connection that is intercepted (`proxy.decide.interception.intercepted`: its host's rules decide
paths, or `inspection.mode: all`) is handed to the interception engine, after its SNI gate, on
the same socket with its ClientHello (`Door.intercept`); the engine (mitmproxy) is loaded only
when the first such connection arrives, unless the runtime loaded it at start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener
from proxy.dataplane.connection import Door
from proxy.dataplane.kinds import protocol_for
from proxy.net.sockets import listening_socket

if TYPE_CHECKING:
    from proxy.common.settings import Config
    from proxy.decide.attribution import Attribution
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.decide.interception import Interceptor
    from proxy.decide.planes import Update
    from proxy.decide.vetting import Vetter

logger = logging.getLogger(__name__)

__all__ = ["FrontDoor"]


class FrontDoor:
    """Our listeners, and every connection they accepted until it ends."""

    def __init__(
        self,
        vetter: Vetter,
        config: Config,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
        *,
        engine: Callable[[], Awaitable[Interceptor]],
        attribution: Attribution | None = None,
    ) -> None:
        self.door = Door(vetter, config, metrics, audit, engine, attribution)
        self.listeners: tuple[Listener, ...] = ()
        self._servers: list[asyncio.Server] = []

    @property
    def vetter(self) -> Vetter:
        return self.door.vetter

    @property
    def live(self) -> int:
        return self.door.live

    def configure(self, update: Update) -> list[str]:
        """A reload, as every plane takes it (proxy/decide/planes.py): later decisions use what
        changed, and when the policy, learning or asking changed, every live connection the
        update no longer allows is closed. Returns the connection ids closed. (The engine's
        connections are the engine's to re-decide.)"""
        self.door.vetter.configure(update)
        if update.config is not None:
            self._reconfigure(update.config)
        return self._redecide() if update.redecides else []

    def _reconfigure(self, config: Config) -> None:
        """A reloaded operator config: what it may change while running applies to later
        tunnels (`tls.ech`, read by each SNI gate as it runs) and requests (`credentials`, with
        their secrets read again: which hosts are intercepted, what plain HTTP carries); the rest
        of the door's config (limits, inspection) stays as it was at start (see
        proxy/app/runtime.py)."""
        self.door.config = dataclasses.replace(
            self.door.config, tls_ech=config.tls_ech, credentials=config.credentials
        )
        if self.door.attribution is not None:
            self.door.attribution.grace = config.attribution_grace

    # -- life cycle --------------------------------------------------------------------------

    async def start(self, listeners: Sequence[Listener]) -> tuple[Listener, ...]:
        """Bind every listener (all or none) and start accepting; returns them as bound."""
        sockets: list[socket.socket] = []
        bound: list[Listener] = []
        listener = None
        try:
            for listener in listeners:
                sock = listening_socket(listener)
                sockets.append(sock)
                host, port = sock.getsockname()[:2]
                bound.append(Listener(listener.scheme, host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            raise ProxyError(
                "listen_failed", f"cannot listen on {listener}: {exc.strerror or exc}"
            ) from None
        loop = asyncio.get_running_loop()
        # Ours before any accepts: no connection may be dialled to one of them.
        self.door.vetter.own.claim(bound)
        for sock, where in zip(sockets, bound, strict=True):
            self._servers.append(
                await loop.create_server(protocol_for(self.door, where), sock=sock)
            )
        self.listeners = tuple(bound)
        return self.listeners

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()

    async def drain(self, timeout: float) -> None:
        """Stop accepting; give live connections up to `timeout` to end, then close them."""
        self.stop_accepting()
        self.door.close_pool()
        for connection in list(self.door.connections):
            connection.quiesce()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.door.live and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.door.connections):
            connection.end(Reason.DRAIN_TIMEOUT if timeout else Reason.SHUTDOWN)
        handoffs = set(self.door.handoffs)
        for task in handoffs:
            task.cancel()
        if handoffs:
            await asyncio.wait(handoffs, timeout=5)
        self.door.close_pool()

    def _redecide(self) -> list[str]:
        """Every live connection decided again, as the door's Vetter now decides: the ids of
        those no longer allowed, closed."""
        closed: list[str] = []
        for connection in list(self.door.connections):
            try:
                allowed = connection.still_allowed()
            except Exception:
                logger.exception("egress: re-deciding a live connection failed")
                allowed = False  # fail closed
            if not allowed:
                connection.end(Reason.POLICY_RELOAD)
                closed.append(connection.peer.connection)
        return closed
