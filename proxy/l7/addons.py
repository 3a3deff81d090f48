"""The engine's mitmproxy addons: its hooks translated into calls of the decision code both
planes share (`Vetter`: name stage on the request's URL, DNS once, address stage), and the
answers back into mitmproxy's terms (a response, a refused dial, a killed flow).

- `RequestGate`: every request inside an intercepted connection, HTTP/1.1 or an HTTP/2 stream, is
  decided on its own (`requestheaders`): its Host (or `:authority`, and an absolute-form authority)
  must name the connection's host (proxy/l7/request_checks.py), a CONNECT and every upgrade but
  WebSocket are refused, then the policy decides its path and the checked addresses are kept for the
  dial. gRPC bodies are streamed both ways (messages pass as they come, trailers after). A 101 is
  accepted only for the WebSocket the request asked for, then relayed as bytes with nothing kept
  (`tcp_message`). When the upstream failed, `error` leaves our 502/504 for the client
  (patches.AnsweringHttpLayer sends it).
- `Pinning`: `server_connect` allows a dial only to the checked addresses of a decided request
  (patches.DialingHandler dials them); the upstream's certificate is verified against the name,
  and is offered only the HTTP versions the client offered (h2 only to an h2 client).
  Upstream failures and failed upstream handshakes get their audit lines.
- `PreferH2`: a client that offers h2 gets h2, wherever h2 stands in its list.

Fail closed: mitmproxy only logs an exception raised in a hook and carries on, so
every hook is wrapped by `fail_closed`, which denies in the hook's own terms.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mitmproxy import http, tcp
from mitmproxy.proxy.layers.tls import HTTP1_ALPNS, HTTP2_ALPN

from policy.dimensions import Protocol, Stage
from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.refusals import Refused, authority, shown
from proxy.decide.events import NO_DETAILS, Details
from proxy.l7.modes import CloseClient
from proxy.l7.patches import ANSWER
from proxy.l7.request_checks import (
    WEBSOCKET,
    check_request,
    denial,
    is_grpc,
    is_websocket,
    upgrade_tokens,
)
from proxy.l7.state import NOT_VETTED, Dial

if TYPE_CHECKING:
    from mitmproxy.connection import Client
    from mitmproxy.proxy.layer import NextLayer
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData
    from mitmproxy.tls import TlsData

    from proxy.decide.events import MetricsSink
    from proxy.decide.vetting import Vetter
    from proxy.l7.injector import CredentialInjector
    from proxy.l7.state import Intercepted, Ledger

logger = logging.getLogger(__name__)

# Bodies above this many bytes are streamed, not buffered (docs/limits.md); smaller ones are
# buffered whole, cheaper per request and bounded by this size.
STREAM_LARGE_BODIES = "64k"
STREAM_THRESHOLD = 64 * 1024
_UPGRADE_URL = "egress-proxy.upgrade"  # flow.metadata: the URL a WebSocket upgrade decided

H = TypeVar("H", bound=Callable[..., Any])


def fail_closed(deny: Callable[[Any, Any], None]) -> Callable[[H], H]:
    """A hook that raises is a denial: the exception is logged with its traceback, an audit
    line says internal_error, and `deny(addon, argument)` refuses in the hook's terms."""

    def decorate(hook: H) -> H:
        name = hook.__name__
        if inspect.iscoroutinefunction(hook):

            @functools.wraps(hook)
            async def guarded(self: _Hooks, argument: Any) -> None:
                try:
                    await hook(self, argument)
                except Exception as exc:
                    self.failed(name, argument, exc, deny)

            return guarded  # type: ignore[return-value]

        @functools.wraps(hook)
        def guarded_sync(self: _Hooks, argument: Any) -> None:
            try:
                hook(self, argument)
            except Exception as exc:
                self.failed(name, argument, exc, deny)

        return guarded_sync  # type: ignore[return-value]

    return decorate


def _client_of(argument: Any) -> Client | None:
    """The client connection a hook's argument belongs to (a flow, hook data, TLS data...)."""
    for path in ("client_conn", "client", "context.client"):
        value: Any = argument
        for name in path.split("."):
            value = getattr(value, name, None)
        if value is not None:
            return cast("Client", value)
    return None


def answer(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answers a request from the proxy; either way nothing goes upstream.

    A request mitmproxy found invalid (its error set before this hook) gets `response` in place
    of mitmproxy's error page (patches.AnsweringHttpLayer). An HTTP/2 stream is answered at once,
    in place of the reset a kill sends, whatever of its body is still to come (a gRPC call that
    streams its requests is not left waiting); the connection's other streams go on.
    HTTP/1.1: mitmproxy cannot stream a request body and answer the request at once
    (NotImplementedError in HttpStream.start_request_stream): a request whose body it would
    stream (above STREAM_THRESHOLD, or chunked, which may grow past it) is killed instead, which
    closes the client connection."""
    request = flow.request
    if flow.error is not None or request.is_http2:
        flow.metadata[ANSWER] = response
        if flow.error is None:
            flow.kill()
        return
    length = request.headers.get("content-length", "")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    # Only ASCII digits of a sane length are a length; anything else may be streamed, so large.
    readable = length.isascii() and length.isdigit() and len(length) <= 18
    large = chunked or (bool(length) and (not readable or int(length) > STREAM_THRESHOLD))
    if request.stream or large:
        flow.kill()
    else:
        flow.response = response


class _Hooks:
    """What both addons share: the decisions, the live connections, the failure path."""

    def __init__(self, vetter: Vetter, ledger: Ledger) -> None:
        self.vetter = vetter
        self.ledger = ledger

    def connection(self, client: Client | None) -> Intercepted:
        """Our state of a client connection; a connection we did not hand over is denied."""
        connection = self.ledger.get(client.id) if client is not None else None
        if connection is None:
            raise ProxyError("not_ours", "a client connection the engine was not handed")
        return connection

    def refusal(
        self,
        connection: Intercepted,
        refused: Refused,
        *,
        stage: Stage,
        details: Details = NO_DETAILS,
    ) -> None:
        """The line of a refusal inside interception: a request's protocol is `https`."""
        destination = connection.destination
        self.vetter.refusal(
            refused, destination.peer, destination.host, destination.port, Protocol.HTTPS,
            stage=stage, details=details,
        )  # fmt: skip

    def failed(
        self, hook: str, argument: Any, exc: Exception, deny: Callable[[Any, Any], None]
    ) -> None:
        logger.error("egress: the %s hook failed; denied", hook, exc_info=exc)
        connection = None
        try:
            client = _client_of(argument)
            connection = self.ledger.get(client.id) if client is not None else None
            if connection is not None:
                message = f"internal error in {hook}: {type(exc).__name__}"
                self.refusal(
                    connection, Refused(403, Reason.INTERNAL_ERROR, message), stage=Stage.ENGINE
                )
            deny(self, argument)
        except Exception:
            logger.exception("egress: denying after the %s hook failed failed too", hook)
            if connection is not None:
                connection.end(Reason.INTERNAL_ERROR)
            elif callable(getattr(argument, "kill", None)):
                argument.kill()  # a flow of no connection of ours: it goes nowhere


def _deny_request(addon: _Hooks, flow: http.HTTPFlow) -> None:
    connection = addon.ledger.get(flow.client_conn.id)
    host, port = (
        (connection.destination.host, connection.destination.port)
        if connection
        else ("proxy", None)
    )
    refused = Refused(403, Reason.INTERNAL_ERROR, "internal error")
    answer(flow, denial(refused, host, port, flow.request))


def _invalid(flow: http.HTTPFlow) -> Refused | None:
    """mitmproxy found the request invalid (HttpStream.check_invalid: a scheme it does not
    serve, smuggling-prone headers) and runs this hook before it answers: refused as such."""
    if flow.error is None:
        return None
    return Refused(400, Reason.INVALID_REQUEST, f"invalid request: {shown(flow.error.msg)}")


def _kill(addon: _Hooks, flow: http.HTTPFlow | tcp.TCPFlow) -> None:
    flow.kill()


def _end_connection(addon: _Hooks, argument: Any) -> None:
    addon.connection(_client_of(argument)).end(Reason.INTERNAL_ERROR)


def _refuse_dial(addon: _Hooks, data: ServerConnectionHookData) -> None:
    addon.ledger.forget_dial(data.server.id)
    refused = Refused(502, Reason.INTERNAL_ERROR, "internal error", error=True)
    data.server.error = addon.ledger.fail(data.client.id, refused)


def _close_client(addon: _Hooks, nextlayer: NextLayer) -> None:
    nextlayer.layer = CloseClient(nextlayer.context)


class RequestGate(_Hooks):
    """Every request inside interception decided on its own; WebSocket the only upgrade."""

    name = "egress-requests"

    def __init__(
        self, vetter: Vetter, ledger: Ledger, credentials: CredentialInjector | None = None
    ) -> None:
        super().__init__(vetter, ledger)
        self.credentials = credentials  # proxy/l7/injector.py

    @fail_closed(_deny_request)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        connection = self.connection(flow.client_conn)
        connection.cancel_head_timer()
        request = flow.request
        destination = connection.destination
        # Every line of a request names the SNI its connection was gated on.
        details = Details(method=request.method, path=request.path, sni=destination.sni)
        target = f"https://{authority(destination.host, destination.port)}{request.path}"
        try:
            refused = check_request(request, destination) or _invalid(flow)
            if refused is not None:
                stage = Stage.HOST if refused.reason == Reason.HOST_MISMATCH else Stage.REQUEST
                self.refusal(connection, refused, stage=stage, details=details)
                raise refused
            vetted = await self.vetter.vet(
                target, destination.port, destination.peer, Protocol.HTTPS, inspecting=True,
                final=False, details=details,
            )  # fmt: skip
        except Refused as refused:
            answer(flow, denial(refused, destination.host, destination.port, request))
            return
        # Allowed (never merely let through by learning): the host's credential goes in now,
        # and the request's one allow line names it.
        credential = None
        if self.credentials is not None and not vetted.decision.would_deny:
            credential = self.credentials.apply(request, destination.host)
        if credential is not None:  # named on the request's one allow line
            details = dataclasses.replace(details, credential=credential)
        self.vetter.allowed(
            destination.peer, Protocol.HTTPS, stage=Stage.ADDRESS, vetted=vetted,
            port=destination.port, details=details,
        )  # fmt: skip
        connection.vetted[(destination.host, destination.port)] = vetted.pinned
        connection.pinned = vetted.pinned
        if is_websocket(request):
            flow.metadata[_UPGRADE_URL] = target
        if is_grpc(request):
            # A streaming call's messages must pass as they come: buffered, a bidi call would
            # wait for the end of a body that waits for its answers.
            request.stream = True

    @fail_closed(_kill)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None:
            return
        if response.status_code != 101:
            if is_grpc(flow.request):
                # A server-streaming call's messages reach the client as they come, then the
                # trailers (grpc-status), which mitmproxy sends after a streamed body.
                response.stream = True
            return
        connection = self.connection(flow.client_conn)
        upgraded = flow.metadata.get(_UPGRADE_URL)
        if upgraded is not None and upgrade_tokens(response.headers) == [WEBSOCKET]:
            # The WebSocket was decided as the request that opened it; its bytes follow.
            connection.protocol = Protocol.WSS
            connection.upgraded = upgraded
            return
        asked = ", ".join(upgrade_tokens(response.headers)) or "nothing named"
        refused = Refused(
            403,
            Reason.UPGRADE_REFUSED,
            f"the upstream switched protocols to {shown(asked)!r} unasked",
        )
        self.refusal(
            connection, refused, stage=Stage.REQUEST, details=Details(method=flow.request.method)
        )
        flow.kill()

    @fail_closed(_kill)
    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        # After a 101 the connection is relayed as bytes (mitmproxy's TCPLayer), which appends
        # each chunk to the flow before sending it on: emptied here, so a long-lived WebSocket
        # keeps nothing.
        flow.messages.clear()

    @fail_closed(_end_connection)
    def error(self, flow: http.HTTPFlow) -> None:
        """The upstream of a request failed before any response: our answer, not mitmproxy's
        page (502 upstream_refused or upstream_tls, 504 upstream_timeout, 403 not_vetted)."""
        if flow.error is None or flow.response is not None:
            return
        connection = self.connection(flow.client_conn)
        refused = self.ledger.forget_failure(flow.client_conn.id, flow.error.msg)
        if refused is None:
            return  # not an upstream failure of ours: mitmproxy's own answer stands
        destination = connection.destination
        flow.metadata[ANSWER] = denial(refused, destination.host, destination.port, flow.request)


class Pinning(_Hooks):
    """Upstream connections go to checked addresses only, and are verified against the name."""

    name = "egress-pinning"

    def __init__(
        self,
        vetter: Vetter,
        ledger: Ledger,
        *,
        connect_timeout: float,
        metrics: MetricsSink | None,
    ) -> None:
        super().__init__(vetter, ledger)
        self.connect_timeout = connect_timeout
        self.metrics = metrics

    @fail_closed(_end_connection)
    def tls_start_server(self, data: TlsData) -> None:
        """mitmproxy offers an upstream every protocol the client offered (TlsConfig, which runs
        after us and keeps offers set here). An upstream that chose one it cannot speak
        (`grpc-exp`, `acme-tls/1`) would be spoken HTTP/1.1 to; and h2 offered for a client on
        HTTP/1.1 would turn each request into another version. So: the client's HTTP offers in
        its order, h2 only when the client itself speaks h2; the upstream then picks h2 or
        HTTP/1.1."""
        client = data.context.client
        if data.conn.alpn_offers or not client.alpn_offers:
            return  # no ALPN from the client: none upstream either (TlsConfig mirrors that)
        speaks = (*HTTP1_ALPNS, HTTP2_ALPN) if client.alpn == HTTP2_ALPN else HTTP1_ALPNS
        offers = tuple(alpn for alpn in client.alpn_offers if alpn in speaks)
        data.conn.alpn_offers = offers or (b"http/1.1",)

    @fail_closed(_refuse_dial)
    def server_connect(self, data: ServerConnectionHookData) -> None:
        connection = self.connection(data.client)
        server = data.server
        address = server.address
        pins = connection.vetted.get((address[0], address[1])) if address else None
        if not pins or address is None:
            server.error = self.ledger.fail(data.client.id, NOT_VETTED)
            self.refusal(connection, NOT_VETTED, stage=Stage.CONNECT)
            return
        if server.tls:
            server.sni = connection.destination.host  # verified against the name, not an IP
        dial = Dial(address[0], pins, address[1], self.connect_timeout, self.metrics)
        self.ledger.allow_dial(server.id, dial)

    @fail_closed(_end_connection)
    def server_connected(self, data: ServerConnectionHookData) -> None:
        peer = data.server.peername
        if peer:
            self.connection(data.client).upstream = authority(peer[0], peer[1])

    @fail_closed(_end_connection)
    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self.ledger.forget_dial(data.server.id)
        refused = self.ledger.failure(data.client.id, str(data.server.error or ""))
        if refused is None or refused.reason not in (
            Reason.UPSTREAM_REFUSED,
            Reason.UPSTREAM_TIMEOUT,
        ):
            return  # refused before any dial: that refusal has its own line
        self.refusal(self.connection(data.client), refused, stage=Stage.UPSTREAM)

    @fail_closed(_end_connection)
    def tls_failed_server(self, data: TlsData) -> None:
        """The upstream's certificate is not trusted or not for the name, or it spoke no TLS:
        the request gets 502 upstream_tls, and nothing was sent upstream."""
        connection = self.connection(data.context.client)
        message = str(data.conn.error or "TLS handshake failed")
        refused = Refused(502, Reason.UPSTREAM_TLS, message, error=True)
        # Kept as the value its line is written from, by the text mitmproxy carries on to the
        # request's flow (its error), as a failed dial's is: the `error` hook answers it.
        self.ledger.fail(data.context.client.id, refused, message)
        self.refusal(connection, refused, stage=Stage.UPSTREAM)

    @fail_closed(_end_connection)
    def tls_established_client(self, data: TlsData) -> None:
        """mitmproxy lets the client pick any HTTP version by ALPN, h3 among them, and would
        then speak HTTP/3 over this TCP connection, where no request ever completes: such a
        connection is ended at once, its line saying why."""
        alpn = data.conn.alpn
        if not alpn or alpn in (HTTP2_ALPN, *HTTP1_ALPNS):
            return
        connection = self.connection(data.context.client)
        message = f"ALPN {shown(alpn.decode('latin-1'))!r} is not spoken inside interception"
        refused = Refused(403, Reason.INSPECTION_UNSUPPORTED, message)
        self.refusal(connection, refused, stage=Stage.REQUEST)
        connection.end(Reason.INSPECTION_UNSUPPORTED)

    @fail_closed(_end_connection)
    def tls_failed_client(self, data: TlsData) -> None:
        # Most often the client does not trust the session CA: its close line says so.
        connection = self.connection(data.context.client)
        if connection.close_reason == Reason.CLOSED:
            connection.close_reason = Reason.CLIENT_TLS_FAILED

    @fail_closed(_close_client)
    def next_layer(self, nextlayer: NextLayer) -> None:
        # Our stack is fixed (proxy/l7/modes.py); mitmproxy asks only where it would pick a
        # protocol of its own (raw TCP, passthrough): never allowed here.
        if nextlayer.layer is None:
            nextlayer.layer = CloseClient(nextlayer.context)


class PreferH2(_Hooks):
    """h2 for every client that offers it. Added after mitmproxy's TlsConfig, whose
    `tls_start_client` has made the client's TLS connection by then."""

    name = "egress-prefer-h2"

    @fail_closed(_end_connection)
    def tls_start_client(self, data: TlsData) -> None:
        """Left alone, TlsConfig's ALPN callback picks the client's first HTTP offer, so a
        client offering `http/1.1, h2` (httpx with http2=True) would get HTTP/1.1, each request
        waiting for the one before. The callback honours a `client_alpn` in the connection's app
        data (it mirrors an upstream's pick that way): h2 is set there when the client offers
        it and nothing was chosen yet (patches.GUARDED holds both to this contract). The
        upstream is still offered only what the client offered (Pinning.tls_start_server)."""
        ssl_conn = data.ssl_conn
        if ssl_conn is None or HTTP2_ALPN not in data.context.client.alpn_offers:
            return
        app_data = ssl_conn.get_app_data()
        if app_data["client_alpn"] is None and app_data["server_alpn"] is None:
            app_data["client_alpn"] = HTTP2_ALPN
