"""Every place the engine goes beyond mitmproxy's extension points (addons, hooks, custom modes),
in one module, each checked against the mitmproxy source it was written for.

mitmproxy 12.3.1 offers no way to dial an upstream connection other than its own
`asyncio.open_connection(address)`: no connect timeout, no second address, no way to hand it a
connected socket. And an upstream failure reaches the client only as mitmproxy's own HTML error
page, which an addon cannot replace. So two subclasses, used for our connections only (nothing
of mitmproxy is modified in place; no other user of it in the process is affected):

- `DialingHandler` (a ProxyConnectionHandler): `open_connection` is mitmproxy's, step for step
  and hook for hook, except the dial: the checked addresses that the `server_connect` hook
  allowed (`Ledger.allow_dial`), in answer order, each with `limits.connect_timeout`, falling
  back to the next (`proxy.net.dialing.dial_checked`). A connection no hook allowed is refused.
- `AnsweringHttpLayer` (an HttpLayer): when a request's upstream connection failed, the answer
  an addon put in `flow.metadata[ANSWER]` (in the `error` hook) goes to the client instead of
  mitmproxy's error page: our 502/504 with X-Egress-Error, for HTTP/1.1 and HTTP/2 alike. So
  does a denial of a request mitmproxy found invalid itself (its error page otherwise), and of
  an HTTP/2 stream (a kill otherwise, which only resets the stream, without a reason: the hooks
  cannot answer a stream whose request body is still to come).
- `AnsweringHttpLayer` also picks the client connection's layer by ALPN as mitmproxy would,
  except for h3 (which mitmproxy would speak over this TCP connection): closed instead.
- `EgressHttp2Server` (an Http2Server, which AnsweringHttpLayer uses for an h2 client): a CONNECT
  inside HTTP/2, plain or RFC 8441's extended CONNECT (`:protocol`), reaches the request hooks
  as a request, to be refused with its reason; mitmproxy's own parser requires `:scheme` and
  `:path`, knows no `:protocol`, and ends the whole connection with a protocol error.

One addon relies on a contract of mitmproxy's rather than a hook: `addons.PreferH2` forces the
client's ALPN choice to h2 through the app data TlsConfig gives the client's TLS connection,
which its ALPN callback honours (as it does to mirror an upstream's choice).

`GUARDED` holds the sha256 of each mitmproxy function these rely on, as reviewed against
12.3.1. `changed()` names those whose source differs; the engine refuses to start then
(`verify`), and tests/test_patches.py fails, so that a new mitmproxy is reviewed before it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h2.events
from mitmproxy import http
from mitmproxy.addons import tlsconfig
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.net.http import url
from mitmproxy.proxy import commands, events, layer, mode_servers, server, server_hooks
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import _http2
from mitmproxy.proxy.layers.tls import HTTP1_ALPNS, HTTP2_ALPN

from proxy.common.errors import ProxyError
from proxy.common.refusals import Refused, upstream_refusal
from proxy.l7.state import NOT_VETTED
from proxy.net.dialing import UpstreamError, dial_checked

if TYPE_CHECKING:
    from proxy.l7.state import Dial

# The key under which an addon leaves the response for a request whose upstream failed.
ANSWER = "egress-proxy.answer"

GUARDED: dict[str, tuple[Callable[..., Any], str]] = {
    # DialingHandler.open_connection is this method with our dial in place of mitmproxy's.
    "mitmproxy.proxy.server.ConnectionHandler.open_connection": (
        server.ConnectionHandler.open_connection,
        "5e0b3cbaf7a4030a0a044c9ca36296c2c53a874e47cd861e5d7f70a88beff951",
    ),
    # InterceptInstance.serve (modes.py) is this method without its transparent-mode branch.
    "mitmproxy.proxy.mode_servers.ServerInstance.handle_stream": (
        mode_servers.ServerInstance.handle_stream,
        "21eea06f208c752e68bb82b2003211f126c84c45c31cdfc9632c049c20845381",
    ),
    # AnsweringHttpLayer relies on SendHttp(ResponseProtocolError) reaching the client's
    # connection layer through event_to_child, while the stream is still in `streams` ...
    "mitmproxy.proxy.layers.http.HttpLayer.event_to_child": (
        http_layers.HttpLayer.event_to_child,
        "1095f6e1581d1780afd5e87446b11eee0b12fb196c9be559f0fe15055436c8d7",
    ),
    # ... and on the `error` hook running before that ResponseProtocolError is sent. Likewise
    # for a request mitmproxy finds invalid (a CONNECT is, in our transparent HTTP mode) and
    # for a flow the requestheaders hook killed: that hook runs first, then the stream sends
    # its ResponseProtocolError (REQUEST_VALIDATION_FAILED, KILL) and goes to its errored state.
    "mitmproxy.proxy.layers.http.HttpStream.handle_protocol_error": (
        http_layers.HttpStream.handle_protocol_error,
        "59fc3b2eeeabf63a64d4cce98b4fe4cab5193ebefbd9c32ae186e65c7d25bfe2",
    ),
    "mitmproxy.proxy.layers.http.HttpStream.check_invalid": (
        http_layers.HttpStream.check_invalid,
        "ef0a126eef45d90335636512729510fffcf67f01e1f0121523f1659ea818824c",
    ),
    "mitmproxy.proxy.layers.http.validate_request": (
        http_layers.validate_request,
        "e7cec257ce91b7c58f5a7723d9cce1b81c46062a3baf9ae1dfda046345dcde06",
    ),
    "mitmproxy.proxy.layers.http.HttpStream.check_killed": (
        http_layers.HttpStream.check_killed,
        "368cad352d1e82b6907688a0d3196d2e586b4af9af2a8465ea00d46e2d3c3672",
    ),
    # AnsweringHttpLayer puts the client connection's layer in place (EgressHttp2Server for h2,
    # one that closes for h3 over TCP, else Http1Server as here) before this Start handler,
    # which keeps a client connection layer already set (connections.setdefault) ...
    "mitmproxy.proxy.layers.http.HttpLayer._handle_event": (
        http_layers.HttpLayer._handle_event,
        "6ba31883cc7a06b3c6e0c69dc231ae54618e6a9a7e543ec5ea43e1b698da31c7",
    ),
    # ... and EgressHttp2Server does for a CONNECT what this does for any other request.
    "mitmproxy.proxy.layers.http._http2.Http2Server.handle_h2_event": (
        _http2.Http2Server.handle_h2_event,
        "d24a023c678de6ced81275c0ebf2aba54d976e5326965d8c0e952b4cd4f5fb76",
    ),
    "mitmproxy.proxy.layers.http._http2.split_pseudo_headers": (
        _http2.split_pseudo_headers,
        "cbdea5c4efb047185d56b53686581c97a46bd25cc199eeb8489f152d301482e7",
    ),
    "mitmproxy.proxy.layers.http._http2.parse_h2_request_headers": (
        _http2.parse_h2_request_headers,
        "464eb8bb2fd7cae5737c1ae85e3751d50fc4fc8f19de8f73874d7fb55589dbdf",
    ),
    # addons.PreferH2 sets `client_alpn` in the app data this hook gives the client's TLS
    # connection, after it ran ...
    "mitmproxy.addons.tlsconfig.TlsConfig.tls_start_client": (
        tlsconfig.TlsConfig.tls_start_client,
        "d3093c897eeafc2fb7306d53250f9159b43e94575fb0d6ea352d31f5b0eeae7b",
    ),
    # ... and this callback picks `client_alpn` whenever the client offers it.
    "mitmproxy.addons.tlsconfig.alpn_select_callback": (
        tlsconfig.alpn_select_callback,
        "41a266755820fa3762f3c439cdae412f40518035ba1b001753f21670943730a9",
    ),
}


def source_digest(function: Callable[..., Any]) -> str | None:
    """sha256 of a function's source as installed, or None when it cannot be read."""
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def changed() -> list[str]:
    """The guarded mitmproxy functions whose source is not the one these patches were written
    against (or cannot be read)."""
    return [
        name for name, (function, digest) in GUARDED.items() if source_digest(function) != digest
    ]


def verify() -> None:
    """Raises ProxyError('mitmproxy_changed') unless every guarded function is as reviewed."""
    names = changed()
    if names:
        import mitmproxy.version

        raise ProxyError(
            "mitmproxy_changed",
            f"mitmproxy {mitmproxy.version.VERSION} changed what the interception engine "
            f"builds on ({', '.join(names)}); install the mitmproxy release this egress-proxy "
            "was reviewed with (12.3.1)",
        )


async def _open(address: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # An IP literal: the loop connects it without asking any resolver.
    return await asyncio.open_connection(address, port)


class DialingHandler(mode_servers.ProxyConnectionHandler):
    """mitmproxy's connection handler, dialling only what `server_connect` allowed."""

    def __init__(
        self,
        master: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        options: Any,
        mode: Any,
        take_dial: Callable[[Server], Dial | None],
        failed: Callable[[Refused, str | None], str],
    ) -> None:
        super().__init__(master, reader, writer, options, mode)
        self._take_dial = take_dial
        self._failed = failed

    async def open_connection(self, command: commands.OpenConnection) -> None:
        connection = command.connection
        assert isinstance(connection, Server)
        hook_data = server_hooks.ServerConnectionHookData(client=self.client, server=connection)
        if connection.address:
            await self.handle_hook(server_hooks.ServerConnectHook(hook_data))
        dial = self._take_dial(connection)
        if dial is None or connection.error or not connection.address:
            # Refused by a hook, or never allowed by one: nothing is dialled (fail closed).
            if not connection.error:
                connection.error = self._failed(NOT_VETTED, None)
            self.log(f"server connection refused before connect: {connection.error}")
            await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await self.server_event(events.OpenConnectionCompleted(command, connection.error))
            return
        async with self.max_conns[connection.address]:
            try:
                connection.timestamp_start = time.time()
                reader, writer = await dial_checked(
                    dial.name,
                    dial.addresses,
                    dial.port,
                    _open,
                    timeout=dial.timeout,
                    metrics=dial.metrics,
                )
            except (UpstreamError, asyncio.CancelledError) as exc:
                connection.error = str(exc) or "connection cancelled"
                if isinstance(exc, UpstreamError):
                    refused = upstream_refusal(exc.reason, exc.message)
                    self._failed(refused, connection.error)
                self.log(f"error establishing server connection: {connection.error}")
                await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
                await self.server_event(events.OpenConnectionCompleted(command, connection.error))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            await self._serve_upstream(command, hook_data, reader, writer)

    async def _serve_upstream(
        self,
        command: commands.OpenConnection,
        hook_data: server_hooks.ServerConnectionHookData,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """What mitmproxy does with a connected upstream: its state, its hooks, its reads."""
        connection = hook_data.server
        connection.timestamp_tcp_setup = time.time()
        connection.state = ConnectionState.OPEN
        connection.peername = writer.get_extra_info("peername")
        connection.sockname = writer.get_extra_info("sockname")
        self.transports[connection] = server.ConnectionIO(
            handler=asyncio.current_task(), reader=reader, writer=writer
        )
        self.log(f"server connect {connection.address} ({connection.peername})")
        await self.handle_hook(server_hooks.ServerConnectedHook(hook_data))
        await self.server_event(events.OpenConnectionCompleted(command, None))
        try:
            await self.handle_connection(connection)
        finally:
            self.log(f"server disconnect {connection.address}")
            connection.timestamp_end = time.time()
            await self.handle_hook(server_hooks.ServerDisconnectedHook(hook_data))


class AnsweringHttpLayer(http_layers.HttpLayer):
    """mitmproxy's HTTP layer, answering with the response an addon left: for a failed
    upstream, a request mitmproxy found invalid, and a killed HTTP/2 stream."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            # mitmproxy's Start keeps a client connection layer that is already there.
            alpn = self.context.client.alpn
            if alpn == HTTP2_ALPN:
                speaking: layer.Layer = EgressHttp2Server(self.context.fork())
            elif alpn and alpn not in HTTP1_ALPNS:
                # h3 over TCP, which mitmproxy would try (Pinning.tls_established_client
                # writes the refusal's line).
                speaking = _Closing(self.context.fork())
            else:
                speaking = http_layers.Http1Server(self.context.fork())
            self.connections.setdefault(self.context.client, speaking)
        yield from super()._handle_event(event)

    def event_to_child(
        self, child: layer.Layer | http_layers.HttpStream, event: events.Event
    ) -> layer.CommandGenerator[None]:
        if (
            isinstance(event, http_layers.ResponseProtocolError)
            and event.code in _ANSWERED
            and child is self.connections.get(self.context.client)
        ):
            answer = self._answer(event.stream_id)
            if answer is not None:
                yield from self._send(child, event.stream_id, answer)
                if event.code is not http_layers.ErrorCode.CONNECT_FAILED:
                    yield from self._end_request(child, event)
                return
        yield from super().event_to_child(child, event)

    def _answer(self, stream_id: int) -> http.Response | None:
        stream = self.streams.get(stream_id)
        flow = getattr(stream, "flow", None)
        if flow is None:
            return None
        answer = flow.metadata.pop(ANSWER, None)
        if isinstance(answer, http.Response):
            flow.response = answer  # what the client got, for the addons that look
            return answer
        return None

    def _send(
        self, child: layer.Layer | http_layers.HttpStream, stream_id: int, answer: http.Response
    ) -> layer.CommandGenerator[None]:
        body = answer.raw_content or b""
        yield from super().event_to_child(
            child, http_layers.ResponseHeaders(stream_id, answer, end_stream=not body)
        )
        if body:
            yield from super().event_to_child(child, http_layers.ResponseData(stream_id, body))
        yield from super().event_to_child(child, http_layers.ResponseEndOfMessage(stream_id))

    def _end_request(
        self, child: layer.Layer | http_layers.HttpStream, event: http_layers.ResponseProtocolError
    ) -> layer.CommandGenerator[None]:
        """The request was answered before its end was read. HTTP/1.1 cannot tell the rest of
        it from a next request: the connection closes, as after mitmproxy's own answer. HTTP/2:
        the stream is forgotten, so what the client still sends on it is read (its flow control
        credited) and dropped; no reset, which a gRPC client would report in place of the
        answer it already has. The connection's other streams go on."""
        if not isinstance(child, http_layers.Http2Server):
            yield commands.CloseConnection(self.context.client)
            return
        self.streams.pop(event.stream_id, None)


# The protocol errors for which an addon may have left the answer (AnsweringHttpLayer).
_ANSWERED = frozenset(
    {
        http_layers.ErrorCode.CONNECT_FAILED,
        http_layers.ErrorCode.REQUEST_VALIDATION_FAILED,
        http_layers.ErrorCode.KILL,
    }
)


class _Closing(layer.Layer):
    """The client connection's layer for a protocol the engine does not speak: closes it."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


class EgressHttp2Server(http_layers.Http2Server):
    """mitmproxy's HTTP/2 server, handing a CONNECT on to the request hooks as a request."""

    def handle_h2_event(self, event: h2.events.Event) -> layer.CommandGenerator[bool]:
        if isinstance(event, h2.events.RequestReceived):
            request = connect_request(event.headers)
            if request is not None:
                # What Http2Server.handle_h2_event does with a request it could parse.
                self.streams[event.stream_id] = _http2.StreamState.HEADERS_RECEIVED
                yield http_layers.ReceiveHttp(
                    http_layers.RequestHeaders(
                        event.stream_id, request, end_stream=bool(event.stream_ended)
                    )
                )
                return False
        handled = yield from super().handle_h2_event(event)
        return bool(handled)


def connect_request(fields: Any) -> http.Request | None:
    """An HTTP/2 CONNECT's header block as a request (None for any other method), with an
    extended CONNECT's `:protocol` kept among its fields for the refusal to name. Never sent
    on: a CONNECT inside interception is always refused."""
    try:
        pseudo, headers = _http2.split_pseudo_headers(fields)
    except ValueError:
        return None  # mitmproxy's own parser refuses it
    if pseudo.get(b":method", b"").upper() != b"CONNECT":
        return None
    authority = pseudo.get(b":authority", b"")
    try:
        host, port = url.parse_authority(authority, check=True)
    except ValueError:
        host, port = "", None
    if b":protocol" in pseudo:
        headers.insert(0, ":protocol", pseudo[b":protocol"].decode("latin-1"))
    return http.Request(
        host=host,
        port=port or 443,
        method=b"CONNECT",
        scheme=pseudo.get(b":scheme", b""),
        authority=authority,
        path=pseudo.get(b":path", b""),
        http_version=b"HTTP/2.0",
        headers=headers,
        content=None,
        trailers=None,
        timestamp_start=time.time(),
        timestamp_end=None,
    )
