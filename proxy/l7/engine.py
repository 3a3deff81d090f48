"""The interception engine: mitmproxy embedded in-process, serving the TLS connections the front
door hands it, each from the TLS layer on with its destination decided.

    engine = Engine(Vetter(policy, resolver, metrics, audit, plane="l7"), config, metrics, audit)
    engine.prepare()                    # the CA and the upstream bundle, before anything listens
    await engine.start()
    await engine.intercept(sock, hello, destination)    # Door.intercept; returns when it ended
    engine.configure(Update(policy=new_policy))   # a reload: live connections it denies close
    await engine.drain(5.0)
    await engine.stop()

The engine listens on nothing. A connection reaches it only through `intercept`, after the
front door decided its name, vetted its addresses, passed its SNI gate and answered the
client's proxy protocol (a CONNECT's 200, a SOCKS5 reply; nothing on a transparent listener).
Then: our CA's certificate to the client (proxy/tls/ca.py); HTTP/1.1 inside, or HTTP/2
to a client that offers it (ALPN h2); each request (each HTTP/2 stream) decided on its own, its
Host or :authority naming the connection's host (the SNI's), a CONNECT and every upgrade but
WebSocket refused (proxy/l7/addons.py, rules.py); the dial pinned to checked addresses, with the
connect timeout and fallback in answer order (proxy/l7/patches.py); the upstream verified
against the name (`inspection.upstream_ca`, or certifi's bundle), 502 upstream_tls otherwise.
The engine writes each connection's close line (plane l7; bytes as the client sent and
received them).

mitmproxy keeps process-global state (`mitmproxy.ctx.master`): one engine runs per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from mitmproxy import options
from mitmproxy.addons import proxyserver, tlsconfig
from mitmproxy.master import Master

from policy.dimensions import Plane, Stage
from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.refusals import too_slow
from proxy.decide.closes import close_line
from proxy.decide.events import CloseEvent
from proxy.l7 import patches
from proxy.l7.addons import STREAM_LARGE_BODIES, Pinning, PreferH2, RequestGate
from proxy.l7.injector import CredentialInjector
from proxy.l7.modes import InterceptInstance, InterceptMode
from proxy.l7.state import Bytes, Intercepted, Ledger
from proxy.tls.ca import CertificateAuthority, check_upstream_ca, ensure_ca

if TYPE_CHECKING:
    from policy import Policy
    from proxy.common.settings import Config
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.decide.interception import Destination
    from proxy.decide.planes import Update
    from proxy.decide.vetting import Vetter

logger = logging.getLogger(__name__)

_running: Engine | None = None
SHUTDOWN_GRACE = 5.0  # how long a connection cut at shutdown may take to wind down


class _CountingProtocol(asyncio.StreamReaderProtocol):
    """The client's side: counts what the client sent (its TLS records), keeps nothing."""

    def __init__(self, reader: asyncio.StreamReader, counted: Bytes) -> None:
        super().__init__(reader)
        self._counted = counted

    def data_received(self, data: bytes) -> None:
        self._counted.up += len(data)
        super().data_received(data)


class _CountingWriter(asyncio.StreamWriter):
    """The client's side: counts what is written to the client, keeps nothing."""

    def __init__(self, *args: Any, counted: Bytes) -> None:
        super().__init__(*args)
        self._counted = counted

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._counted.down += len(data)
        super().write(data)


class Engine:
    """TLS interception as a component: prepare, start, intercept, configure, drain, stop.
    `vetter` decides for it (plane `l7`), made by the runtime with the session's modes as every
    plane's is."""

    def __init__(
        self,
        vetter: Vetter,
        config: Config,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.audit = audit
        # Decisions, with their metrics and audit lines, are the shared code of both planes.
        self.vetter = vetter
        self.ledger = Ledger()
        # Operator credentials, put into allowed requests to their hosts (RequestGate).
        self.credentials = CredentialInjector(config.credentials, metrics)
        self.master: Master | None = None
        self.ca: CertificateAuthority | None = None
        self._instance: InterceptInstance | None = None
        self._live: set[Intercepted] = set()

    @property
    def policy(self) -> Policy:
        return self.vetter.policy

    @property
    def live(self) -> int:
        """Intercepted connections not yet closed."""
        return len(self._live)

    def prepare(self) -> CertificateAuthority:
        """What must work before anything listens: mitmproxy as reviewed (patches.verify),
        the operator's upstream bundle, and the CA (created on first start). Raises
        ProxyError ('mitmproxy_changed', 'ca_error', 'inspection_disabled')."""
        if self.ca is None:
            if not self.config.operator.inspection_enabled:
                raise ProxyError("inspection_disabled", "TLS inspection is disabled")
            patches.verify()
            if self.config.upstream_ca:
                check_upstream_ca(self.config.upstream_ca)
            self.ca = ensure_ca(self.config.ca_dir)
        return self.ca

    def configure(self, update: Update) -> list[str]:
        """A reload, as every plane takes it (proxy/decide/planes.py): later requests use what
        changed (the credentials through the injector), and when the policy, learning or asking
        changed, every live connection whose destination the update no longer allows is closed:
        the name the connection was decided for, and the URL that opened its WebSocket, decided
        again on their checked addresses. Returns the front door's connection ids of those
        closed."""
        self.vetter.configure(update)
        self.credentials.configure(update)
        if not update.redecides:
            return []
        closed: list[str] = []
        for connection in list(self._live):
            try:
                allowed = self._still_allowed(connection)
            except Exception:
                logger.exception("egress: re-deciding an intercepted connection failed")
                allowed = False  # fail closed
            if not allowed:
                connection.end(Reason.POLICY_RELOAD)
                closed.append(connection.destination.peer.connection)
        return closed

    def _still_allowed(self, connection: Intercepted) -> bool:
        pinned = connection.pinned
        targets = [connection.destination.target]
        if connection.upgraded is not None:
            targets.append(connection.upgraded)
        return all(self.vetter.still_allowed(target, pinned, True) for target in targets)

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load mitmproxy with our addons (no listener). Raises ProxyError."""
        global _running
        if _running is not None:
            raise ProxyError("engine_running", "an engine already runs in this process")
        ca = self.prepare()
        _running = self
        try:
            self.master = self._master(ca)
            await self.master.running()
            server = self.master.addons.get("proxyserver")
            self._instance = InterceptInstance.make(InterceptMode.type_name, server)
        except BaseException:
            await self.stop()
            raise

    def _master(self, ca: CertificateAuthority) -> Master:
        # TlsConfig loads its CA from confdir as soon as it is added: ours, never ~/.mitmproxy.
        opts = options.Options(confdir=str(ca.directory))
        master = Master(opts)
        limits = self.config.limits
        # Our hooks run before mitmproxy's, but PreferH2's: it amends what TlsConfig made. No
        # Block, Onboarding, NextLayer or DnsResolver addon: no global block page, no mitm.it, no
        # layer chosen by mitmproxy, no name resolution.
        master.addons.add(
            RequestGate(self.vetter, self.ledger, self.credentials),
            Pinning(
                self.vetter,
                self.ledger,
                connect_timeout=limits.connect_timeout,
                metrics=self.metrics,
            ),
            proxyserver.Proxyserver(),
            tlsconfig.TlsConfig(),
            PreferH2(self.vetter, self.ledger),
        )
        # Options of addons exist only once the addons are added.
        upstream_ca = self.config.upstream_ca
        opts.update(
            # Upstreams are verified (never ssl_insecure), against the operator's bundle if any.
            ssl_insecure=False,
            ssl_verify_upstream_trusted_ca=os.path.expanduser(upstream_ca) if upstream_ca else None,
            mode=[],
            connection_strategy="lazy",
            stream_large_bodies=STREAM_LARGE_BODIES,
            tcp_timeout=max(1, int(limits.idle_timeout)),
            # A 101 (WebSocket only: addons.py) is relayed as bytes (TCPLayer), not as messages
            # mitmproxy would join in memory without bound.
            websocket=False,
            rawtcp=True,
            http3=False,
            # HTTP/2 to clients that offer it (ALPN h2), each stream a request decided on its own
            # (its :authority checked against the SNI); upstream offers: Pinning.tls_start_server.
            http2=True,
        )
        return master

    async def stop(self) -> None:
        """Close every live connection, run mitmproxy's done hooks."""
        global _running
        try:
            await self.drain(0)
            master, self.master = self.master, None
            if master is not None:
                with contextlib.suppress(Exception):
                    await master.done()
        finally:
            self._instance = None
            if _running is self:
                _running = None

    async def drain(self, timeout: float) -> None:
        """Give live connections up to `timeout` to end by themselves, then close the rest and
        wait (briefly) for them to wind down."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self._live):
            connection.end(Reason.DRAIN_TIMEOUT if timeout else Reason.SHUTDOWN)
        deadline = loop.time() + SHUTDOWN_GRACE
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.01)

    # -- the connections -----------------------------------------------------------------------

    async def intercept(self, sock: socket.socket, hello: bytes, destination: Destination) -> None:
        """Serve one connection the front door decided (proxy.decide.interception), `hello`
        its ClientHello as read; returns when it has ended, its close line written."""
        master, instance = self.master, self._instance
        if master is None or instance is None:
            sock.close()
            raise ProxyError("engine_stopped", "the engine is not running")
        loop = asyncio.get_running_loop()
        counted = Bytes(up=len(hello))
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        reader.feed_data(hello)  # before the socket's own bytes, which follow it
        protocol = _CountingProtocol(reader, counted)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
        except BaseException:
            sock.close()
            raise
        writer = _CountingWriter(transport, protocol, reader, loop, counted=counted)
        connection = Intercepted(destination, transport, counted=counted)
        self._opened(connection)
        serving = loop.create_task(instance.serve(master, reader, writer, connection, self.ledger))
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            # The front door gave up on it (a drain that timed out). Cancelling mitmproxy's
            # handler mid-way would skip its own ending: the connection is cut under it instead.
            connection.end(Reason.SHUTDOWN)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(serving, SHUTDOWN_GRACE)
            raise
        finally:
            transport.abort()  # a no-op when mitmproxy closed it; else nothing is left open
            self._closed(connection)

    def _opened(self, connection: Intercepted) -> None:
        self._live.add(connection)
        if self.metrics is not None:
            self.metrics.connection_opened(Plane.L7, connection.protocol)
        # TLS and the first request head must come within limits.header_timeout.
        timeout = self.config.limits.header_timeout
        loop = asyncio.get_running_loop()
        connection.head_timer = loop.call_later(timeout, self._head_timed_out, connection)

    def _head_timed_out(self, connection: Intercepted) -> None:
        connection.head_timer = None
        destination = connection.destination
        try:
            refused = too_slow("request head", self.config.limits.header_timeout)
            self.vetter.refusal(
                refused, destination.peer, destination.host, destination.port,
                connection.protocol, stage=Stage.ACCEPT,
            )  # fmt: skip
        finally:
            connection.end(Reason.HEADER_TIMEOUT)

    def _closed(self, connection: Intercepted) -> None:
        """The close line and the close metrics, once per connection."""
        if connection not in self._live:
            return
        self._live.discard(connection)
        connection.cancel_head_timer()
        destination = connection.destination
        peer, counted = destination.peer, connection.counted
        event = CloseEvent(
            host=destination.host, port=destination.port, plane=Plane.L7,
            protocol=connection.protocol, client=peer.client, connection=peer.connection,
            sni=destination.sni, ech=destination.ech, upstream=connection.upstream,
            bytes_up=counted.up, bytes_down=counted.down,
            duration=time.monotonic() - connection.opened, reason=connection.close_reason,
            pinned=connection.pinned or None,
        )  # fmt: skip
        close_line(self.metrics, self.audit, event)
