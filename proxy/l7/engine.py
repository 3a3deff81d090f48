"""The L7 engine: mitmproxy embedded in-process, with our addon enforcing the policy.

    engine = Engine(policy, resolver, config, metrics, audit, session_id)
    host, port = await engine.start("127.0.0.1", 3128)
    engine.set_policy(new_policy)  # reload: every later decision uses it
    await engine.stop()

Behind the front door (`egress-proxy run` without `--engine-only`) the engine has no listener
of its own: `Engine(..., fronted=True)`, `start(listeners=[])`, and the front door hands it each
connection it does not serve itself with `handoff(sock, bytes_already_read, scheme)`.

The addon (`EgressAddon`) is thin: mitmproxy's hooks are translated into calls of the policy core
(`Policy.decide`, `Policy.check_addresses`) and our resolver, and the answers back into
mitmproxy's terms (a 403 response, a refused server connection, a pinned address). What it
enforces (DESIGN 3):

- CONNECT (`http_connect`): name stage on the authority, one DNS lookup with our resolver,
  address stage, the checked addresses remembered for `server_connect`. Allowed tunnels carry
  TLS through unmodified (no interception); the first bytes must be a ClientHello whose SNI
  equals the CONNECT host (`next_layer`), anything else closes the tunnel before any upstream
  connection is opened.
- Plain HTTP (`requestheaders`): the same per request, on the URL, and the Host header must
  match the request's authority.
- Hosts with path rules (`needs_inspection`): the tunnel passes the same SNI gate, then TLS is
  intercepted (mitmproxy's TlsConfig with our CA, proxy/ca.py; upstream certificates verified
  against the name, 502 `upstream_tls` otherwise) and every request inside is decided on its
  own, with the Host header and the tunnel's host compared; only HTTP is spoken inside.
- SOCKS5 listeners (`egress_socks_connect`, proxy/socks.py): decided like a CONNECT before the
  SOCKS reply, dialled before it too, then the same SNI gate.
- A 101 upgrade (WebSocket) is decided as the request that opens it; after it the bytes are
  relayed as they come and nothing is kept.
- `limits.header_timeout`: the first request head, and a tunnel's ClientHello, must come in
  time (408 / closed).
- `server_connect`: the connection goes to a checked address (mitmproxy then does no DNS);
  anything our hooks did not vet is refused. The dial itself is ours (`_open_connection`, put
  in place of `asyncio.open_connection` inside mitmproxy.proxy.server while an engine runs):
  the checked addresses in answer order, each with `limits.connect_timeout`, falling back to
  the next on failure, never a fresh resolution. The upstream streams it returns count bytes
  (up = written to upstreams, down = read from them, HTTP heads included; nothing kept), which
  also covers passthrough tunnels, whose ignored TCP flows have no data hooks.
- Upstream errors (DESIGN 3.6): plain HTTP gets 502 `X-Egress-Error: upstream_refused` (every
  checked address failed, not all by timeout) or 504 `upstream_timeout` (all timed out), with
  `Connection: close` (mitmproxy closes the client after a failed connect). A CONNECT tunnel is
  lazy: its 200 was sent before the SNI gate, the dial comes after it, so a failed dial closes
  the tunnel (the client sees EOF); the audit line (stage `upstream`) has the reason.
- Overload: a client connection beyond `limits.max_connections` live ones is answered 503
  `X-Egress-Error: overload` at accept, before anything is read, and closed.
- Reload (`Engine.set_policy`): live client connections whose destinations the new policy
  denies (name stage on what was decided, address stage on the checked addresses) are closed.
- Every hook catches its own exceptions and denies: mitmproxy only logs an exception raised in
  a hook and carries on, which would fail open.

mitmproxy keeps process-global state (`mitmproxy.ctx.master`): one engine runs per process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mitmproxy import http, options, tcp
from mitmproxy.addons import next_layer as mitm_next_layer
from mitmproxy.addons import proxyserver, tlsconfig
from mitmproxy.master import Master
from mitmproxy.net.http import http1 as mitm_http1
from mitmproxy.net.http import url as mitm_url
from mitmproxy.proxy import commands, events, layer, layers, mode_servers, mode_specs
from mitmproxy.proxy import server as mitm_server
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.http import _http1 as mitm_http1_layer

from policy import PolicyError
from policy.urls import split_authority
from proxy.decide.events import CloseEvent
from proxy.decide.sni_gate import check_hello
from proxy.decide.vetting import Peer, Vetter, canonical_host
from proxy.errors import ProxyError
from proxy.l7.ca import CertificateAuthority, check_upstream_ca, ensure_ca
from proxy.l7.socks import (
    GENERAL_FAILURE,
    HOST_UNREACHABLE,
    NOT_ALLOWED,
    EgressSocks5,
    SocksRequest,
)
from proxy.net.dialing import UpstreamError, dial_checked
from proxy.netaddr import Listener
from proxy.reasons import (
    DENIED_HEADER,
    ERROR_HEADER,
    HEADER_TIMEOUT,
    HOST_MISMATCH,
    INTERNAL_ERROR,
    NOT_VETTED,
    OVERLOAD,
    POLICY_RELOAD,
    UNSUPPORTED_SCHEME,
    UPSTREAM_TIMEOUT,
    UPSTREAM_TLS,
    Refused,
    authority,
    refusal_parts,
    shown,
)

if TYPE_CHECKING:
    from mitmproxy.connection import Client
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData
    from mitmproxy.tls import ClientHelloData, TlsData

    from policy import Decision, Policy
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.net.resolver import Resolver
    from proxy.settings import Config

logger = logging.getLogger(__name__)

# Bodies above this many bytes are streamed, not buffered (DESIGN 4). Small bodies are buffered
# whole, which is cheaper per request and bounded by this size.
STREAM_LARGE_BODIES = "64k"
STREAM_THRESHOLD = 64 * 1024

_running: Engine | None = None


def _deny_response(
    status: int, host: str, port: int | None, reason: str, *, error: bool = False
) -> http.Response:
    # No "Connection: close": a denied plain-HTTP request leaves the client's keep-alive
    # connection usable for its next request (a refused CONNECT is closed by mitmproxy).
    headers, body = refusal_parts(status, host, port, reason, error=error)
    return http.Response.make(status, body, headers)


@dataclass(slots=True)
class _Tunnel:
    """An allowed CONNECT tunnel, waiting for its ClientHello."""

    host: str  # normalised, as the policy decided it
    port: int
    inspect: bool = False  # path rules: TLS is intercepted and every request decided
    decided: bool = False  # the SNI gate has chosen the tunnel's layer
    dial_first: bool = False  # SOCKS5: dialled before the reply, so before the SNI gate
    protocol: str = "connect"  # or "socks5", for audit lines and metrics


@dataclass(slots=True)
class _ClientState:
    opened: float
    # (host as mitmproxy will dial it, port) -> the checked addresses, in answer order.
    vetted: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    last_host: str | None = None
    last_port: int | None = None
    sni: str | None = None
    upstream: str | None = None
    pinned: tuple[str, ...] | None = None
    protocol: str = "http"
    tunnels: list[str] = field(default_factory=list)  # Server.id of its CONNECT tunnels
    # (host as mitmproxy will dial it, port) -> what the policy decided on (authority or URL),
    # so a reload can decide every live destination of this connection again.
    targets: dict[tuple[str, int], str] = field(default_factory=dict)
    inspected: set[tuple[str, int]] = field(default_factory=set)  # keys of intercepted tunnels
    counted: _Bytes = field(default_factory=lambda: _Bytes())
    close_reason: str = "closed"
    # Closes the connection unless its request head (or its tunnel's ClientHello) arrives in
    # time: limits.header_timeout, against clients that open connections and say nothing.
    head_timer: asyncio.TimerHandle | None = None
    awaiting: str = "request head"  # what the timer waits for, for the message


class _CloseClient(layer.Layer):
    """Closes the client connection at once; no upstream connection is ever opened."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._closed = False

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not self._closed:
            self._closed = True
            yield commands.CloseConnection(self.context.client)


@dataclass(slots=True)
class _Bytes:
    """Bytes moved by the upstream connections of one client connection."""

    up: int = 0  # written to upstreams (client to upstream)
    down: int = 0  # read from upstreams (upstream to client)


class _CountingReader:
    """An upstream StreamReader that counts what is read from it; it keeps no data."""

    __slots__ = ("_counted", "_reader")

    def __init__(self, reader: Any, counted: _Bytes) -> None:
        self._reader = reader
        self._counted = counted

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._counted.down += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class _CountingWriter:
    """An upstream StreamWriter that counts what is written to it; it keeps no data."""

    __slots__ = ("_counted", "_writer")

    def __init__(self, writer: Any, counted: _Bytes) -> None:
        self._writer = writer
        self._counted = counted

    def write(self, data: bytes) -> None:
        self._counted.up += len(data)
        self._writer.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


@dataclass(slots=True)
class _Dial:
    """What `server_connect` allowed one server connection to dial: checked addresses only."""

    name: str  # the host as requested, for messages
    addresses: tuple[str, ...]  # checked, in answer order
    port: int
    timeout: float
    counted: _Bytes
    metrics: MetricsSink | None


_ERROR_TEXT = re.compile(r"egress-proxy: (upstream_refused|upstream_timeout|not_vetted): .*")


async def _open_connection(host: str, port: int, **kwargs: Any) -> tuple[Any, Any]:
    """mitmproxy's server.py dials through this (see _AsyncioShim): the connection goes to the
    checked addresses that `server_connect` registered for this very task (the hook runs in the
    task that then dials), in answer order, each with limits.connect_timeout, falling back to
    the next on failure. Never a fresh resolution; nothing unregistered is dialled."""
    engine = _running
    task = asyncio.current_task()
    dial = None
    if engine is not None and task is not None:
        dial = engine.addon._dials.pop(task, None)
    if dial is None or host != dial.addresses[0] or port != dial.port:
        raise UpstreamError(NOT_VETTED, "server connection not vetted by policy")
    reader, writer = await dial_checked(
        dial.name,
        dial.addresses,
        port,
        lambda address, port: asyncio.open_connection(address, port, **kwargs),
        timeout=dial.timeout,
        metrics=dial.metrics,
    )
    return _CountingReader(reader, dial.counted), _CountingWriter(writer, dial.counted)


class _AsyncioShim:
    """Stands in for the `asyncio` module inside mitmproxy.proxy.server only, while an engine
    runs: its `open_connection` is ours, everything else is asyncio's."""

    open_connection = staticmethod(_open_connection)

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


_original_make_error_response = mitm_http1_layer.make_error_response


def _make_error_response(status_code: int, message: str = "") -> bytes:
    """mitmproxy's error page for a plain-HTTP request, except for our upstream errors: 502
    (refused) or 504 (timeout) with X-Egress-Error and a one-line body (DESIGN 3.6)."""
    match = _ERROR_TEXT.search(message or "")
    engine = _running
    if match is not None:
        reason, text = match.group(1), match.group(0)
    elif engine is not None and engine.addon.take_tls_failure(message):
        reason, text = UPSTREAM_TLS, f"egress-proxy: {UPSTREAM_TLS}: {message}"
    else:
        return _original_make_error_response(status_code, message)
    error = reason != NOT_VETTED
    status = 504 if reason == UPSTREAM_TIMEOUT else 502 if error else 403
    response = http.Response.make(
        status,
        (shown(text) + "\n").encode("ascii", "replace"),
        {
            ERROR_HEADER if error else DENIED_HEADER: reason,
            "Content-Type": "text/plain; charset=us-ascii",
            "Connection": "close",
        },
    )
    return mitm_http1.assemble_response(response)


class EgressAddon:
    """The mitmproxy addon that enforces one policy. See the module docstring."""

    name = "egress"

    def __init__(
        self,
        policy: Policy,
        resolver: Resolver,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
        *,
        connect_timeout: float = 10.0,
        max_connections: int | None = None,
        header_timeout: float | None = None,
    ) -> None:
        # Decisions, with their metrics and audit lines, are the shared code of both planes.
        self.vetter = Vetter(policy, resolver, metrics, audit, plane="l7")
        self.metrics = metrics
        self.audit = audit
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.can_inspect = False  # set by Engine.start when mitmproxy's TlsConfig is loaded
        self._dials: dict[asyncio.Task[Any], _Dial] = {}  # keyed by the dialling task
        self._rejected: set[str] = set()  # client ids refused for overload
        self._clients: dict[str, _ClientState] = {}
        self._tunnels: dict[str, _Tunnel] = {}  # keyed by the tunnel's Server.id
        self._names: dict[str, tuple[str, int]] = {}  # Server.id -> address before pinning
        # Messages of failed upstream TLS handshakes not yet answered: mitmproxy hands only
        # the message to make_error_response, so this is how its 502 learns the reason.
        self._tls_failures: collections.deque[str] = collections.deque(maxlen=64)

    # -- bookkeeping -------------------------------------------------------------------------

    def _state(self, client: Client) -> _ClientState:
        state = self._clients.get(client.id)
        if state is None:
            state = self._clients[client.id] = _ClientState(time.monotonic())
        return state

    @property
    def policy(self) -> Policy:
        return self.vetter.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.vetter.policy = policy

    @property
    def resolver(self) -> Resolver:
        return self.vetter.resolver

    @resolver.setter
    def resolver(self, resolver: Resolver) -> None:
        self.vetter.resolver = resolver

    def _requested(self, client: Client, host: str | None, port: int | None, protocol: str) -> None:
        """What the connection asked for last: its close line says so, denied or not."""
        state = self._clients.get(client.id)
        if state is not None and host is not None:
            if (host, port) != (state.last_host, state.last_port):
                state.pinned = None  # the pins of the previous destination are not this one's
            state.last_host, state.last_port, state.protocol = host, port, protocol

    def _refusal(
        self, refused: Refused, client: Client, host: str, port: int | None, protocol: str, **ctx
    ) -> None:
        """Metrics and audit for a denial the policy core did not produce itself."""
        stage = ctx.pop("stage", "engine")
        if stage != "upstream":
            self._requested(client, host, port, protocol)
        self.vetter.refusal(refused, _peer(client), host, port, protocol, stage=stage, **ctx)

    async def _vet(
        self, target: str, dial_host: str, port: int, client: Client, protocol: str, **ctx: Any
    ) -> tuple[Decision, tuple[str, ...]]:
        """Name stage, DNS once, address stage (proxy/vetting.py). Returns the decision and the
        checked addresses, also remembered for `server_connect`; raises Refused."""
        spelled = canonical_host(dial_host)
        self._requested(client, dial_host if spelled.startswith("\0") else spelled, port, protocol)
        # Inside an intercepted tunnel (https) the request is already inspected; a tunnel can
        # be intercepted when TlsConfig is loaded.
        inspecting = protocol == "https" or (protocol in ("connect", "socks5") and self.can_inspect)
        vetted = await self.vetter.vet(
            target, port, _peer(client), protocol, inspecting=inspecting, **ctx
        )
        state = self._state(client)
        state.vetted[(dial_host, port)] = vetted.pinned
        state.targets[(dial_host, port)] = target
        state.pinned = vetted.pinned
        return vetted.decision, vetted.pinned

    # -- hooks -------------------------------------------------------------------------------

    def client_connected(self, client: Client) -> None:
        try:
            if self.max_connections is not None and len(self._clients) >= self.max_connections:
                self._reject_overload(client)
                return
            self._arm_head_timer(client)
            if self.metrics is not None:
                socks = isinstance(client.proxy_mode, mode_specs.Socks5Mode)
                self.metrics.connection_opened("l7", "socks5" if socks else "http")
        except Exception:
            logger.exception("egress: client_connected failed")
            client.error = "egress-proxy: internal error"

    def _arm_head_timer(self, client: Client, awaiting: str = "request head") -> None:
        """(Re)start the wait for what the client must send next: its first request head, the
        ClientHello of the tunnel it just opened, or the first request head inside it."""
        state = self._state(client)
        self._disarm_head_timer(state)
        state.awaiting = awaiting
        if self.header_timeout is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: hooks called directly
                state.head_timer = asyncio.get_running_loop().call_later(
                    self.header_timeout, self._head_timed_out, client
                )

    @staticmethod
    def _disarm_head_timer(state: _ClientState | None) -> None:
        if state is not None and state.head_timer is not None:
            state.head_timer.cancel()
            state.head_timer = None

    def _head_timed_out(self, client: Client) -> None:
        try:
            state = self._clients.get(client.id)
            if state is None:
                return
            state.head_timer = None
            state.close_reason = HEADER_TIMEOUT
            waited = f"{self.header_timeout:g}s"
            refused = Refused(408, HEADER_TIMEOUT, f"no {state.awaiting} within {waited}")
            self._refusal(refused, client, state.last_host, state.last_port, state.protocol,
                          stage="accept")  # fmt: skip
            if not state.tunnels and not state.targets:
                # Nothing was answered on this connection yet: an HTTP client gets a 408.
                _write_to_client(client, _deny_response(408, "proxy", None, HEADER_TIMEOUT))
            _close_client(client.id, "egress-proxy: header timeout")
        except Exception:
            logger.exception("egress: header timeout failed")
            _close_client(client.id, "egress-proxy: header timeout")

    def _reject_overload(self, client: Client) -> None:
        """More than limits.max_connections live client connections: answer 503 at once,
        before reading anything, and close (mitmproxy closes a client whose `error` is set
        in client_connected). A client that already sent its request may see the close as a
        reset before it reads the 503."""
        self._rejected.add(client.id)
        client.error = "egress-proxy: overload"
        refused = Refused(503, OVERLOAD, "too many connections", error=True)
        self._refusal(refused, client, None, None, "http", stage="accept")
        _write_to_client(client, _deny_response(503, "proxy", None, OVERLOAD, error=True))

    def client_disconnected(self, client: Client) -> None:
        try:
            if client.id in self._rejected:
                self._rejected.discard(client.id)
                return
            state = self._clients.pop(client.id, None)
            self._disarm_head_timer(state)
            for server_id in state.tunnels if state is not None else ():
                self._tunnels.pop(server_id, None)
                self._names.pop(server_id, None)
            duration = time.monotonic() - state.opened if state is not None else 0.0
            counted = state.counted if state is not None else _Bytes()
            if self.metrics is not None:
                self.metrics.connection_closed("l7", counted.up, counted.down, duration)
            if self.audit is not None and state is not None:
                self.audit.closed(
                    CloseEvent(
                        host=state.last_host,
                        port=state.last_port,
                        plane="l7",
                        protocol=state.protocol,
                        client=client.peername,
                        connection=client.id,
                        sni=state.sni,
                        upstream=state.upstream,
                        bytes_up=counted.up,
                        bytes_down=counted.down,
                        duration=duration,
                        reason=state.close_reason,
                        pinned=state.pinned,
                    )
                )
        except Exception:
            logger.exception("egress: client_disconnected failed")

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        host, port = flow.request.host, flow.request.port
        try:
            self._disarm_head_timer(self._clients.get(client.id))
            # Decided on the authority as the client wrote it: mitmproxy strips brackets from
            # any name ('[github.com]:443'), and brackets hold an IPv6 literal only.
            target = flow.request.authority or authority(host, port)
            decision, _ = await self._vet(target, host, port, client, "connect", method="CONNECT")
            self._tunnels[flow.server_conn.id] = _Tunnel(
                decision.host, port, inspect=decision.needs_inspection
            )
            state = self._state(client)
            state.tunnels.append(flow.server_conn.id)
            if decision.needs_inspection:
                state.inspected.add((host, port))
            self._arm_head_timer(client, "ClientHello")
        except Refused as refused:
            flow.response = _deny_response(
                refused.status, host, port, refused.reason, error=refused.error
            )
        except Exception as exc:
            logger.exception("egress: http_connect failed")
            self._internal_error(flow, client, host, port, "connect", exc)

    async def egress_socks_connect(self, request: SocksRequest) -> None:
        """A SOCKS5 CONNECT request, before it is answered: decided like an HTTP CONNECT."""
        context = request.context
        client = context.client
        host, port = context.server.address or ("", 0)
        try:
            self._disarm_head_timer(self._clients.get(client.id))
            decision, _ = await self._vet(authority(host, port), host, port, client, "socks5")
            self._tunnels[context.server.id] = _Tunnel(
                decision.host,
                port,
                inspect=decision.needs_inspection,
                dial_first=True,
                protocol="socks5",
            )
            state = self._state(client)
            state.tunnels.append(context.server.id)
            if decision.needs_inspection:
                state.inspected.add((host, port))
            self._arm_head_timer(client, "ClientHello")
        except Refused as refused:
            request.reply = NOT_ALLOWED if refused.status == 403 else HOST_UNREACHABLE
            request.message = f"egress-proxy: {refused.reason}: {refused.message}"
        except Exception as exc:
            logger.exception("egress: egress_socks_connect failed")
            request.reply = GENERAL_FAILURE
            request.message = "egress-proxy: internal error"
            with contextlib.suppress(Exception):
                refused = Refused(403, INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
                self._refusal(refused, client, host, port, "socks5")

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        request = flow.request
        host, port = request.host, request.port
        try:
            if request.method == "CONNECT":  # not called for CONNECT; be sure anyway
                raise Refused(403, INTERNAL_ERROR, "unexpected CONNECT")
            ctx = {"method": request.method, "path": request.path}
            self._disarm_head_timer(self._clients.get(client.id))
            tunnel = self._tunnels.get(flow.server_conn.id)
            if _transparent(client):
                # Redirected plain HTTP: mitmproxy put the original destination (an address)
                # in the request; the name is the Host header's, and the connection goes to a
                # checked address of that name, never to the original destination.
                host = self._transparent_host(request, client, **ctx)
            if tunnel is not None:
                # A request inside an intercepted tunnel: it may only go where the tunnel goes.
                protocol = "https"
                self._check_tunnel_request(request, tunnel, client, **ctx)
            elif request.scheme != "http":
                refused = Refused(403, UNSUPPORTED_SCHEME, f"scheme {request.scheme!r}")
                self._refusal(refused, client, host, port, "http", stage="name", **ctx)
                raise refused
            else:
                protocol = "http"
            self._check_host_header(request, client, protocol, **ctx)
            url = f"{protocol}://{authority(host, port)}{request.path}"
            await self._vet(url, host, port, client, protocol, **ctx)
        except Refused as refused:
            self._answer(
                flow,
                _deny_response(refused.status, host, port, refused.reason, error=refused.error),
            )
        except Exception as exc:
            logger.exception("egress: requestheaders failed")
            self._internal_error(flow, client, host, port, "http", exc)

    @staticmethod
    def _answer(flow: http.HTTPFlow, response: http.Response) -> None:
        """Answer a request from the proxy. mitmproxy cannot stream a request body and answer
        the request at once (NotImplementedError in HttpStream.start_request_stream): a request
        whose body it would stream (above stream_large_bodies, or chunked, which may grow past
        it) is killed instead, which closes the client connection. Either way nothing goes
        upstream."""
        request = flow.request
        length = request.headers.get("content-length", "")
        chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
        declared_large = bool(length) and (not length.isdigit() or int(length) > STREAM_THRESHOLD)
        large = chunked or declared_large
        if request.stream or large:
            flow.kill()
        else:
            flow.response = response

    def _transparent_host(self, request: http.Request, client: Client, **ctx: Any) -> str:
        header = request.headers.get_all("host")
        name = None
        if len(header) == 1:
            with contextlib.suppress(ValueError, PolicyError):
                split_authority(header[0])  # brackets hold an IPv6 literal, never a name
                name, _ = mitm_url.parse_authority(header[0], check=True)
        if not name:
            refused = Refused(
                403, HOST_MISMATCH, "a redirected request needs exactly one valid Host header"
            )
            self._refusal(
                refused, client, None, request.port, "http", stage="host", **ctx
            )  # fmt: skip
            raise refused
        # Only the name moves into the request; the port stays the original destination's,
        # and the Host check below compares the header's port with it.
        request.data.host = name
        return name

    def _check_tunnel_request(
        self, request: http.Request, tunnel: _Tunnel, client: Client, **ctx: Any
    ) -> None:
        if (
            not tunnel.inspect
            or request.scheme != "https"
            or canonical_host(request.host) != tunnel.host
            or request.port != tunnel.port
        ):
            refused = Refused(
                403,
                HOST_MISMATCH,
                f"request for {shown(request.scheme)}://"
                f"{shown(authority(request.host, request.port))} inside the tunnel to "
                f"{authority(tunnel.host, tunnel.port)}",
            )
            self._refusal(refused, client, request.host, request.port, "https", stage="host", **ctx)
            raise refused

    def _check_host_header(
        self, request: http.Request, client: Client, protocol: str, **ctx: Any
    ) -> None:
        header = request.headers.get_all("host")
        reason_message = None
        if len(header) != 1:
            reason_message = f"{len(header)} Host headers"
        else:
            try:
                split_authority(header[0])  # brackets hold an IPv6 literal, never a name
                h_host, h_port = mitm_url.parse_authority(header[0], check=True)
            except (ValueError, PolicyError):
                h_host, h_port = None, None
                reason_message = "invalid Host header"
            if h_host is not None:
                h_port = h_port or mitm_url.default_port(request.scheme)
                if canonical_host(h_host) != canonical_host(request.host) or h_port != request.port:
                    reason_message = (
                        f"Host header {shown(header[0])!r} does not match "
                        f"{shown(authority(request.host, request.port))!r}"
                    )
        if reason_message is not None:
            refused = Refused(403, HOST_MISMATCH, reason_message)
            self._refusal(
                refused, client, request.host, request.port, protocol, stage="host", **ctx
            )
            raise refused

    def _internal_error(
        self,
        flow: http.HTTPFlow,
        client: Client,
        host: str,
        port: int,
        protocol: str,
        exc: BaseException,
    ) -> None:
        try:
            response = _deny_response(403, host, port, INTERNAL_ERROR)
            if flow.request.method == "CONNECT":
                flow.response = response
            else:
                self._answer(flow, response)
            refused = Refused(403, INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            self._refusal(refused, client, host, port, protocol)
        except Exception:
            flow.kill()

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """The layers of our tunnels (CONNECT and SOCKS5), chosen here alone: first the SNI
        gate (the first bytes must be a ClientHello whose SNI equals the tunnel's host), then
        either bytes passed through unmodified or, for hosts with path rules, interception with
        only HTTP inside. Other contexts are mitmproxy's NextLayer's (see _GuardedNextLayer)."""
        context = nextlayer.context
        tunnel = None
        try:
            tunnel = self._tunnels.get(context.server.id) if context.server is not None else None
            if nextlayer.layer is not None:
                return
            if tunnel is None:
                top = context.layers[-1] if context.layers else None
                if _transparent(context.client) and isinstance(top, modes.TransparentProxy):
                    # A redirected connection handed over by the front door, which keeps TLS
                    # to itself: only HTTP here, decided per request on its Host header.
                    nextlayer.layer = layers.HttpLayer(context, HTTPMode.transparent)
                return
            if tunnel.decided:
                # Past the gate, only an intercepted tunnel asks again (for what its TLS
                # carries): HTTP, each request decided; never raw TCP, whatever the client's
                # first bytes or ALPN look like.
                nextlayer.layer = (
                    layers.HttpLayer(context, HTTPMode.transparent)
                    if tunnel.inspect
                    else _CloseClient(context)
                )
                return
            data = nextlayer.data_client()
            if not data:
                return  # nothing yet: decide on the first bytes
            outcome = check_hello(data, tunnel.host)  # shared with the fast path
            if outcome is None:
                return  # a ClientHello split across reads: wait for the rest
            refused, sni = outcome.refused, outcome.sni
            tunnel.decided = True
            state = self._state(context.client)
            self._disarm_head_timer(state)
            state.sni = sni
            if refused is not None:
                self._refusal(
                    refused,
                    context.client,
                    tunnel.host,
                    tunnel.port,
                    tunnel.protocol,
                    stage="sni",
                    sni=sni,
                )
                nextlayer.layer = _CloseClient(context)
                return
            self.vetter.allowed(
                _peer(context.client),
                tunnel.protocol,
                stage="sni",
                host=tunnel.host,
                port=tunnel.port,
                sni=sni,
            )
            if tunnel.inspect:
                # Intercept: our CA's certificate to the client, a verified TLS connection to
                # the pinned upstream; the HTTP inside is decided per request, and its first
                # head must come within header_timeout too.
                self._arm_head_timer(context.client)
                server_tls = layers.ServerTLSLayer(context)
                server_tls.child_layer = layers.ClientTLSLayer(context)
                nextlayer.layer = server_tls
            else:
                nextlayer.layer = layers.TCPLayer(context, ignore=True)
        except Exception:
            logger.exception("egress: next_layer failed")
            with contextlib.suppress(Exception):
                if tunnel is not None:
                    tunnel.decided = True
                nextlayer.layer = _CloseClient(context)

    def claims(self, nextlayer: layer.NextLayer) -> bool:
        """True when the layer decision of this context is ours alone (one of our tunnels), and
        True when that cannot be told (fail closed: mitmproxy's NextLayer could pick raw TCP)."""
        try:
            context = nextlayer.context
            if _transparent(context.client):
                return True
            server = context.server
            return server is not None and server.id in self._tunnels
        except Exception:
            return True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # A 101 turns the connection into what it upgraded to; its close line says so.
        with contextlib.suppress(Exception):
            response = flow.response
            state = self._clients.get(flow.client_conn.id)
            if response is not None and response.status_code == 101 and state is not None:
                websocket = response.headers.get("upgrade", "").lower() == "websocket"
                secure = state.protocol == "https"
                state.protocol = ("wss" if secure else "ws") if websocket else "upgrade"

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        # After a 101 the connection is relayed as bytes (mitmproxy's TCPLayer), chunk by chunk
        # as they arrive; the layer appends each chunk to the flow before sending it on, so the
        # list is emptied here and a long-lived WebSocket keeps nothing.
        with contextlib.suppress(Exception):
            flow.messages.clear()

    def server_connect(self, data: ServerConnectionHookData) -> None:
        """Pin: dial a checked address; refuse anything our hooks did not vet."""
        try:
            address = data.server.address
            state = self._clients.get(data.client.id)
            pins = None
            if address is not None and state is not None:
                pins = state.vetted.get((address[0], address[1]))
            tunnel = self._tunnels.get(data.server.id)
            if tunnel is not None and not tunnel.decided and not tunnel.dial_first:
                pins = None  # a CONNECT tunnel connects only after the SNI gate let it through
            if not pins or address is None:
                data.server.error = "egress-proxy: destination not vetted by policy"
                host, port = (address[0], address[1]) if address else (None, None)
                self._refusal(
                    Refused(403, NOT_VETTED, "server connection not vetted by policy"),
                    data.client,
                    host,
                    port,
                    "http",
                    stage="connect",
                )
                return
            self._names[data.server.id] = (address[0], address[1])
            # The dial itself (fallback, timeout, byte counts) is _open_connection's; without a
            # registration for its task it refuses (fail closed).
            task = _current_task()
            if task is not None:
                self._dials[task] = _Dial(
                    address[0],
                    tuple(pins),
                    address[1],
                    self.connect_timeout,
                    state.counted if state is not None else _Bytes(),
                    self.metrics,
                )
            if tunnel is not None and tunnel.inspect:
                # The upstream certificate is verified against the name, not the pinned address.
                data.server.sni = tunnel.host
            data.server.address = (pins[0], address[1])
        except Exception:
            logger.exception("egress: server_connect failed")
            data.server.error = "egress-proxy: internal error"

    def server_connected(self, data: ServerConnectionHookData) -> None:
        # Put the name back, so mitmproxy's connection reuse (keyed by address) matches the next
        # request to the same host:port; the socket stays connected to the pinned address.
        try:
            name = self._names.pop(data.server.id, None)
            state = self._clients.get(data.client.id)
            peer = data.server.peername
            if state is not None and peer:
                state.upstream = authority(peer[0], peer[1])  # the address actually used
            if name is not None:
                # Server.__setattr__ refuses to change `address` on an open connection
                # (mitmproxy/connection.py, Server.__setattr__); the socket is already
                # connected, so only the reuse key changes.
                object.__setattr__(data.server, "address", name)
        except Exception:
            logger.exception("egress: server_connected failed")

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        try:
            task = _current_task()
            if task is not None:
                self._dials.pop(task, None)
            name = self._names.pop(data.server.id, None)
            match = _ERROR_TEXT.search(str(data.server.error or ""))
            if match is not None and match.group(1) != NOT_VETTED:
                reason = match.group(1)
                status = 504 if reason == UPSTREAM_TIMEOUT else 502
                host, port = name if name is not None else (None, None)
                state = self._clients.get(data.client.id)
                self._refusal(
                    Refused(status, reason, match.group(0), error=True),
                    data.client,
                    host,
                    port,
                    state.protocol if state is not None else "http",
                    stage="upstream",
                )
        except Exception:
            logger.exception("egress: server_connect_error failed")

    def tls_failed_server(self, data: TlsData) -> None:
        """An inspected upstream failed its TLS handshake (certificate not trusted, wrong name,
        no TLS): the request is answered 502 upstream_tls and nothing is sent upstream."""
        try:
            message = str(data.conn.error or "TLS handshake failed")
            self._tls_failures.append(message)
            tunnel = self._tunnels.get(data.context.server.id)
            host, port = (tunnel.host, tunnel.port) if tunnel is not None else (None, None)
            self._refusal(
                Refused(502, UPSTREAM_TLS, message, error=True),
                data.context.client,
                host,
                port,
                "https",
                stage="upstream",
            )
        except Exception:
            logger.exception("egress: tls_failed_server failed")

    def take_tls_failure(self, message: str) -> bool:
        """True (once) when `message` is a failed upstream handshake's."""
        try:
            self._tls_failures.remove(message)
        except ValueError:
            return False
        return True

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        with contextlib.suppress(Exception):
            self._names.pop(data.server.id, None)
            self._tunnels.pop(data.server.id, None)


class _ServerTlsFirst:
    """After TlsConfig (which asks for server TLS first only under the eager strategy): when
    the upstream is already connected (a SOCKS5 tunnel dials before its reply), its TLS is
    established before the client's, as mitmproxy's ServerTLSLayer then expects."""

    name = "egress-server-tls-first"

    def tls_clienthello(self, data: ClientHelloData) -> None:
        with contextlib.suppress(Exception):
            if data.context.server.connected:
                data.establish_server_tls_first = True


class _GuardedNextLayer(mitm_next_layer.NextLayer):
    """mitmproxy's NextLayer, except for our tunnels: their layer is chosen by the SNI gate only,
    also while it waits for the rest of a ClientHello (mitmproxy's would intercept TLS)."""

    name = "nextlayer"

    def __init__(self, egress: EgressAddon) -> None:
        self._egress = egress

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        if self._egress.claims(nextlayer):
            return
        super().next_layer(nextlayer)


def _connection_handler(client_id: str) -> Any:
    """mitmproxy's handler of one live client connection of the running engine, or None."""
    master = _running.master if _running is not None else None
    server = master.addons.get("proxyserver") if master is not None else None
    return server.connections.get(client_id) if server is not None else None


def _write_to_client(client: Client, response: http.Response) -> None:
    """Best effort, outside mitmproxy's layers: a response to a client about to be closed."""
    handler = _connection_handler(client.id)
    io = handler.transports.get(client) if handler is not None else None
    if io is not None and io.writer is not None:
        response.headers["Connection"] = "close"
        io.writer.write(mitm_http1.assemble_response(response))


def _close_client(client_id: str, why: str) -> None:
    handler = _connection_handler(client_id)
    for io in list(handler.transports.values()) if handler is not None else ():
        if io.handler is not None:
            io.handler.cancel(why)


_original_socks5_layer = mode_servers.Socks5Instance.make_top_layer


def _make_socks5_layer(self: Any, context: Any) -> layer.Layer:
    """Socks5Instance.make_top_layer while an engine runs: our layer, which decides before it
    replies (proxy/socks.py)."""
    return EgressSocks5(context)


_MODES = {"http": "regular", "socks5": "socks5", "transparent": "transparent"}


def _mode_spec(listener: Listener) -> str:
    """mitmproxy's mode spec for a listener: `regular@HOST:PORT`, `socks5@HOST:PORT`, ... (an
    IPv6 host unbracketed: mitmproxy splits host and port at the last colon)."""
    mode = _MODES[listener.scheme]
    return f"{mode}@{listener.host}:{listener.port}"


def _transparent(client: Client) -> bool:
    return isinstance(client.proxy_mode, mode_specs.TransparentMode)


def _peer(client: Client) -> Peer:
    return Peer(client.peername, client.id)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (hooks called directly, in unit tests)
        return None


class Engine:
    """The L7 engine as a component: start, stop, set_policy."""

    def __init__(
        self,
        policy: Policy,
        resolver: Resolver,
        config: Config,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
        session_id: str | None = None,
        *,
        fronted: bool = False,
    ) -> None:
        """`fronted`: connections come from the front door (`handoff`), which also enforces
        limits.max_connections over both planes, and the engine listens for nothing itself."""
        self.config = config
        self.session_id = session_id
        self.addon = EgressAddon(
            policy,
            resolver,
            metrics,
            audit,
            connect_timeout=config.limits.connect_timeout,
            max_connections=None if fronted else config.limits.max_connections,
            header_timeout=config.limits.header_timeout,
        )
        self.master: Master | None = None
        self.address: tuple[str, int] | None = None
        self.ca: CertificateAuthority | None = None
        self.listeners: tuple[Listener, ...] = ()
        # Mode instances that serve connections the front door hands over (never listening).
        self._instances: dict[str, mode_servers.ServerInstance[Any]] = {}

    def prepare(self) -> CertificateAuthority | None:
        """What must work before anything listens: when inspection is enabled and the policy
        has URL-prefix rules (only then can a host need inspection), the CA (created on first
        start) and the operator's upstream bundle. Raises ProxyError('ca_error')."""
        if not (self.config.operator.inspection_enabled and self.policy.has_url_rules):
            return None
        if self.ca is None:
            if self.config.upstream_ca:
                check_upstream_ca(self.config.upstream_ca)
            self.ca = ensure_ca(self.config.ca_dir)
        return self.ca

    @property
    def policy(self) -> Policy:
        return self.addon.policy

    def set_policy(self, policy: Policy) -> list[str]:
        """Every decision from now on uses `policy` (a reload), and every live client connection
        (CONNECT tunnel or keep-alive plain HTTP) with a destination the new policy denies is
        closed: each host:port it was allowed to reach is decided again (name stage on what was
        decided before, address stage on its checked addresses). Returns the ids closed."""
        self.addon.policy = policy
        closed: list[str] = []
        for client_id, state in list(self.addon._clients.items()):
            try:
                denied = any(
                    not self.addon.vetter.still_allowed(
                        target, state.vetted.get(key, ()), key in state.inspected
                    )
                    for key, target in state.targets.items()
                )
            except Exception:
                logger.exception("egress: re-deciding a live connection failed")
                denied = True  # fail closed
            if not denied:
                continue
            state.close_reason = POLICY_RELOAD
            closed.append(client_id)
            _close_client(client_id, "egress-proxy: denied by the reloaded policy")
        return closed

    async def handoff(self, sock: socket.socket, prefix: bytes, scheme: str) -> None:
        """Serve one connection accepted by the front door, as if mitmproxy had accepted it on a
        listener of `scheme` ("http" or "socks5"): `prefix` is what was already read from it.
        Returns when the connection has ended."""
        master = self.master
        if master is None:
            sock.close()
            raise ProxyError("engine_stopped", "the engine is not running")
        instance = self._instances.get(scheme)
        if instance is None:
            instance = mode_servers.ServerInstance.make(
                _mode_spec(Listener(scheme, "127.0.0.1", 0)), master.addons.get("proxyserver")
            )
            self._instances[scheme] = instance
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        if prefix:
            reader.feed_data(prefix)  # before the socket's own bytes, which follow it
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
        except BaseException:
            sock.close()
            raise
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        serving = loop.create_task(instance.handle_stream(reader, writer))
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            # The front door gave up on it (a drain that timed out). Cancelling mitmproxy's
            # handler mid-way would skip its own ending (no client_disconnected, no close
            # line): the connection is cut under it instead, and it winds down by itself.
            transport.abort()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(serving, 5)
            raise

    async def start(
        self,
        listen_host: str = "127.0.0.1",
        listen_port: int = 3128,
        *,
        listeners: Sequence[Listener] | None = None,
    ) -> tuple[str, int]:
        """Listen and return the first bound address; `self.listeners` has every one bound.
        Without `listeners`, one explicit HTTP proxy on listen_host:listen_port."""
        global _running
        wanted = list(
            listeners if listeners is not None else [Listener("http", listen_host, listen_port)]
        )
        if _running is not None:
            raise ProxyError("engine_running", "an engine already runs in this process")
        _running = self
        # Upstream dials go through _open_connection; our upstream errors get our responses.
        mitm_server.asyncio = _AsyncioShim()  # type: ignore[attr-defined]
        mitm_http1_layer.make_error_response = _make_error_response
        mode_servers.Socks5Instance.make_top_layer = _make_socks5_layer  # type: ignore[method-assign]
        try:
            ca = self.prepare()
            inspect = ca is not None
            opts = options.Options()
            # TlsConfig loads its CA from confdir as soon as it is added: point it at ours
            # (prepared above), never at mitmproxy's ~/.mitmproxy.
            opts.update(confdir=str(ca.directory) if ca is not None else "/nonexistent")
            master = Master(opts)
            self.master = master
            server = proxyserver.Proxyserver()
            # Order matters: our hooks run before mitmproxy's (server_connect pins before
            # Proxyserver's self-connect check; next_layer claims tunnels first).
            addons: list[Any] = [
                self.addon,
                server,
                _GuardedNextLayer(self.addon),
            ]
            if inspect:
                addons += [tlsconfig.TlsConfig(), _ServerTlsFirst()]
            master.addons.add(*addons)
            self.addon.can_inspect = inspect
            # Options of addons exist only once the addons are added. No Block, Onboarding or
            # DnsResolver addon is loaded: no global block page, no mitm.it, no name resolution
            # by mitmproxy. TlsConfig only when inspection is enabled.
            if inspect:
                opts.update(
                    # Upstreams of inspected hosts are verified (never ssl_insecure), against
                    # the operator's bundle when given.
                    ssl_insecure=False,
                    ssl_verify_upstream_trusted_ca=(
                        os.path.expanduser(self.config.upstream_ca)
                        if self.config.upstream_ca
                        else None
                    ),
                )
            opts.update(
                mode=[_mode_spec(listener) for listener in wanted],
                connection_strategy="lazy",
                stream_large_bodies=STREAM_LARGE_BODIES,
                tcp_timeout=max(1, int(self.config.limits.idle_timeout)),
                # A 101 upgrade (WebSocket included) was decided as the request that opened it;
                # after it the bytes are relayed as they come (TCPLayer) instead of as
                # WebSocket messages, which mitmproxy joins in memory, fragment by fragment,
                # without a bound. rawtcp only lets that relay exist: every context where
                # mitmproxy could pick raw TCP by itself is decided by our next_layer first.
                websocket=False,
                rawtcp=True,
                http3=False,
                # Inside interception HTTP/1.1 only: every request then carries the Host header
                # that the per-request check compares with the tunnel's host.
                http2=False,
            )
            ok = await server.setup_servers()
            if not ok:
                errors = [str(s.last_exception) for s in server.servers if s.last_exception]
                raise ProxyError(
                    "listen_failed",
                    f"cannot listen on {', '.join(str(x) for x in wanted)}: "
                    + ("; ".join(errors) or "unknown error"),
                )
            await master.running()
            bound: list[Listener] = []
            if not wanted:
                # Fronted: every connection comes through `handoff`, none from a listener.
                self.address = None
                return ("", 0)
            for listener, instance in zip(wanted, server.servers, strict=True):
                addresses = instance.listen_addrs
                if not addresses:
                    raise ProxyError("listen_failed", f"{listener} bound no address")
                bound.append(Listener(listener.scheme, addresses[0][0], addresses[0][1]))
            self.listeners = tuple(bound)
            self.address = (bound[0].host, bound[0].port)
            return self.address
        except BaseException:
            await self._shutdown()
            raise

    async def stop(self) -> None:
        """Stop listening, close live connections, run mitmproxy's done hooks."""
        await self._shutdown()

    async def _shutdown(self) -> None:
        global _running
        master, self.master = self.master, None
        try:
            if master is None:
                return
            server = master.addons.get("proxyserver")
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.servers.update([])
                for handler in list(server.connections.values()):
                    for io in list(handler.transports.values()):
                        if io.handler is not None:
                            io.handler.cancel("engine stopping")
                deadline = time.monotonic() + 5
                while server.connections and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            with contextlib.suppress(Exception):
                await master.done()
        finally:
            if _running is self:
                _running = None
                mitm_server.asyncio = asyncio  # type: ignore[attr-defined]
                mitm_http1_layer.make_error_response = _original_make_error_response
                mode_servers.Socks5Instance.make_top_layer = _original_socks5_layer  # type: ignore[method-assign]
                self.addon._dials.clear()
            self.address = None
