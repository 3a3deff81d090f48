"""Plain HTTP through the front door: forward proxying on an explicit listener (absolute-form
requests), redirected HTTP on a transparent one (origin form, the name from Host, the port the
client dialled), and plain HTTP inside a CONNECT or SOCKS5 tunnel (the same, its Host naming
the tunnel's host). The client's bytes are parsed by httptools (llhttp, strict: smuggling refused);
each request is decided on its own, in order, before anything goes upstream:

1. the request itself: HTTP/1.0 or 1.1, not CONNECT, its target; every upgrade but WebSocket is
   refused (`upgrade_refused`); exactly one Host field naming the target (`host_mismatch`);
2. the name stage on `http://host:port/path` (URL-prefix rules read the path as the policy does),
   DNS once, the address stage and the loop guard (proxy/dataplane/tunnel.py's `vet`);
3. an idle pooled connection to one of the checked addresses, or a dial of them; then the
   request's one allow line (proxy/dataplane/http_forward.py), and the exchange
   (proxy/dataplane/http_upstream.py).

A denial is a 403 with X-Egress-Denied that leaves the connection usable, unless the request has
a body still on its way: then it is answered at once and the connection closed, the body never
read whole. Bodies stream both ways with flow control. `limits.header_timeout` bounds every
request head from its first byte; `limits.idle_timeout` a connection on which nothing moves.
A WebSocket upgrade, once the upstream switched, is relayed as bytes (proxy/net/relay.py).

Flow control: the client is read through the connection's `Reading` (proxy/net/flow.py), each
pause for its reason, each lifted when that reason is over: PIPELINED while a whole request
waits behind the one served, BODY_HELD while a request holds more than MAX_HELD of its body
without an upstream, UPGRADE_HELD for bytes after an upgrade head, UPSTREAM_SLOW while the
exchange's upstream cannot take more (http_upstream.py); the upstream is not read while the
client cannot take more (CLIENT_SLOW on the exchange's Reading).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Final

import httptools

from policy.dimensions import Protocol, Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, refusal_response, too_slow
from proxy.dataplane.http_forward import serve
from proxy.dataplane.http_messages import (
    MAX_FIELDS,
    MAX_HEAD,
    Fields,
    RequestHead,
    body_framing,
)
from proxy.dataplane.http_requests import Request
from proxy.dataplane.http_upstream import Exchange
from proxy.decide.events import NO_DETAILS, Details
from proxy.decide.http_checks import WEBSOCKET
from proxy.net.flow import Hold
from proxy.net.idle import IdleTimer
from proxy.net.relay import Relay

if TYPE_CHECKING:
    from proxy.dataplane.connection import Connection

logger = logging.getLogger(__name__)

# Request body bytes held for a request whose upstream is not connected yet (or for a pipelined
# request behind another): past this, the client is not read until they have gone on.
MAX_HELD: Final = 256 << 10
# A refused request's body is read and dropped for at most this long after the answer, so the
# client sees the answer rather than a reset for bytes still in flight.
LINGER: Final = 2.0


class HttpPlane(asyncio.Protocol):
    """The client transport's protocol once its first bytes turned out to be plain HTTP."""

    def __init__(
        self,
        conn: Connection,
        *,
        transparent: bool,
        tunnel_hosts: tuple[str, ...] | None = None,
    ) -> None:
        self.conn = conn
        self.door = conn.door
        self.transport = conn.transport
        self.reading = conn.reading
        self.transparent = transparent
        # Inside a tunnel (plain HTTP after a CONNECT or SOCKS5 request): every request's Host
        # must name its host (one of them, for an address DNS answered for several).
        self.tunnel_hosts = tunnel_hosts
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.requests: deque[Request] = deque()  # parsed, not yet answered; [0] is served
        self.parsing: Request | None = None  # the request whose body the parser is in
        self.url = bytearray()
        self.fields: Fields = []
        self.size = 0
        self.in_head = False
        self.head_error: Refused | None = None
        self.upgraded: bytearray | None = None  # bytes after an upgrade request's head
        self.exchange: Exchange | None = None
        self.serving: asyncio.Task[None] | None = None
        self.closing = False  # no request after the current one
        self.lingering = False
        self.head_timer: asyncio.TimerHandle | None = None
        self.idle = IdleTimer(self.loop, self.door.config.limits.idle_timeout, self._idled)

    # -- taking over ---------------------------------------------------------------------------

    def start(self) -> None:
        conn = self.conn
        conn.take_over(self)
        if conn.attribution is None:
            conn.attribution = "host"  # each request names its host
        self.transport.set_protocol(self)
        self.transport.set_write_buffer_limits(high=256 << 10)
        self.idle.start()
        data = bytes(conn.buffer)
        conn.buffer.clear()
        self.data_received(data)
        if self.reading.ended:
            self.eof_received()
        # The front door's pending bytes are parsed now; what they hold (a pipelined request,
        # a body) holds reading for its own reason.
        self.reading.resume(Hold.PENDING_FULL)

    # -- asyncio.Protocol: the client --------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.moved()
        if self.lingering or self._closes_before_it():
            return
        if self.upgraded is not None:
            self.upgraded += data  # for the WebSocket, once switched
            if len(self.upgraded) > MAX_HELD:
                self.reading.pause(Hold.UPGRADE_HELD)  # until a relay takes them over
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.upgraded = bytearray(data[upgrade.args[0] :])
        except httptools.HttpParserCallbackError as exc:
            if self.head_error is None:
                self.fail(exc.__context__ or exc)
                return
            self.refuse_unparsed(self.head_error)
        except httptools.HttpParserError as exc:
            if self._closes_before_it():
                return  # bytes after a request that closes the connection are not read
            self.refuse_unparsed(
                Refused(400, Reason.INVALID_REQUEST, f"invalid HTTP request: {exc}")
            )
        except Exception as exc:
            self.fail(exc)

    def _closes_before_it(self) -> bool:
        """Whether the last request read whole asked to close the connection after it: what
        follows it is never a request (llhttp refuses it as such), and is dropped unread."""
        last = self.requests[-1] if self.requests else self.parsing
        return last is not None and last.ended and not last.head.keep_alive

    def eof_received(self) -> bool:
        self.reading.end()
        parsing = self.parsing
        if (self.exchange is None and not self.requests) or self.in_head:
            self.close()
        elif parsing is not None and not parsing.ended:
            self.close()  # a body cut short: nothing of it may look whole upstream
        # Otherwise every request it sent whole is answered, then the connection goes
        # (`_serve_all`).
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost()
        self._stop_timers()
        if self.serving is not None and not self.serving.done():
            self.serving.cancel()
        if self.exchange is not None and not self.exchange.done.done():
            self.exchange.transport.abort()
        if self.conn.relay is None:
            self.conn.finish(self.conn.reason)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.reading.pause(Hold.CLIENT_SLOW)  # the client reads slower than it comes

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.reading.resume(Hold.CLIENT_SLOW)

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.url.clear()
        self.fields = []
        self.size = 0
        if self.head_timer is None:
            limit = self.door.config.limits.header_timeout
            self.head_timer = self.loop.call_later(limit, self._head_expired)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:  # not a trailer: those are dropped
            self.fields.append((name, value))
            self._grow(len(name) + len(value) + 4)

    def _grow(self, size: int) -> None:
        self.size += size
        if self.size > MAX_HEAD or len(self.fields) > MAX_FIELDS:
            self.head_error = Refused(431, Reason.INVALID_REQUEST, "the request head is too large")
            raise ValueError(self.head_error.message)

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        parser = self.parser
        head = RequestHead(
            method=parser.get_method().decode("ascii"),
            target=self.url.decode("latin-1"),
            version=parser.get_http_version(),
            fields=self.fields,
            keep_alive=parser.should_keep_alive(),
        )
        framing = body_framing(head.fields)
        has_body, chunked = framing if not isinstance(framing, Refused) else (True, False)
        request = Request(head, has_body, chunked)
        request.websocket = parser.should_upgrade()
        if isinstance(framing, Refused):
            request.refused = framing  # answered in turn: the requests before it are served
        self.parsing = request
        self.requests.append(request)
        if len(self.requests) > 1:
            self.reading.pause(Hold.PIPELINED)  # one at a time: the next waits to be served
        if self.serving is None:
            self.serving = self.loop.create_task(self._serve_all())
            self.serving.add_done_callback(self._served)

    def on_body(self, data: bytes) -> None:
        request = self.parsing
        assert request is not None
        if request.sink is not None:
            request.body_started = True
            request.sink.body(data)
            return
        request.pending += data
        if len(request.pending) > MAX_HELD:
            self.reading.pause(Hold.BODY_HELD)

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        request.ended = True
        if request.sink is not None:
            request.sink.body_end()
        # Whether the connection ends after it is the request's own (`closes_after`): a
        # pipelined `Connection: close` must not end the connection before the requests ahead
        # of it are answered.

    # -- serving the requests, one at a time ---------------------------------------------------

    async def _serve_all(self) -> None:
        life = self.conn.life
        while self.requests and not life.lost:
            request = self.requests[0]
            keep = await serve(self, request)
            self.requests.popleft()
            if self.conn.relay is not None:
                return  # a WebSocket: the relay has both transports, and ends the connection
            if not keep or self.closing:
                if not self.lingering:
                    self.close()
                return
            if len(self.requests) <= 1:
                self.reading.resume(Hold.PIPELINED)
            self.held_less()  # what the request served held went with it
        self.serving = None
        if self.reading.ended and not life.lost:
            self.close()  # the client has sent all it will, and has every answer

    def held_less(self) -> None:
        """A held body went upstream or was dropped: the client is read again once no request
        waiting for its upstream holds more than MAX_HELD of its body."""
        if self.reading.holds(Hold.BODY_HELD) and all(
            len(request.pending) <= MAX_HELD for request in self.requests
        ):
            self.reading.resume(Hold.BODY_HELD)

    def _served(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]

    def refusal(
        self,
        refused: Refused,
        host: str | None,
        port: int | None,
        stage: Stage,
        details: Details,
    ) -> Refused:
        conn = self.conn
        conn.door.vetter.refusal(
            refused, conn.peer, host, port, conn.protocol, stage=stage,
            details=conn.attribution_details(details),
        )  # fmt: skip
        return refused

    # -- answers -------------------------------------------------------------------------------

    def closes_after(self, request: Request) -> bool:
        """Whether the connection ends after `request`'s response."""
        return self.closing or not request.head.keep_alive or request.websocket

    def answer_refusal(
        self, request: Request, refused: Refused, host: str | None, port: int | None
    ) -> bool:
        """The refusal's answer; True when the connection goes on to the next request."""
        body_due = not request.ended
        # A request whose framing or form was refused leaves the parser's reading of what
        # follows in doubt: nothing more is read from that connection.
        close = (
            body_due
            or refused.error
            or refused.reason == Reason.INVALID_REQUEST
            or self.closes_after(request)
            or self.upgraded is not None
        )
        self.write(refusal_response(refused, host or "proxy", port, close=close))
        self.conn.reason = refused.reason
        if body_due:
            self._linger()
            return False
        if close:
            return False
        self.conn.reason = Reason.CLIENT_CLOSED
        return True

    def refuse_unparsed(self, refused: Refused) -> None:
        """A request the parser refused (or one too large): answered when no response is on its
        way, the connection closed either way."""
        details = Details(path=self.url.decode("latin-1") if self.url else None)
        self.refusal(
            refused, None, self.conn.port if self.transparent else None, Stage.REQUEST, details
        )
        if self._answerable():
            if self.exchange is not None:
                self.exchange.transport.abort()  # nothing more of this request goes upstream
            self.write(refusal_response(refused, "proxy", None, close=True))
        self.conn.reason = refused.reason
        self.close()

    def _answerable(self) -> bool:
        """Whether the request the parser just refused is the next one owed an answer: a head
        when no earlier request waits for its response, a body when its own request is the one
        served and nothing of its response went out."""
        if self.in_head:
            return not self.requests
        exchange = self.exchange
        return (
            bool(self.requests)
            and self.parsing is self.requests[0]
            and (exchange is None or not exchange.started)
        )

    def failed_exchange(
        self, request: Request, refused: Refused, *, stage: Stage, answered: bool
    ) -> None:
        """An exchange ended in error (proxy/dataplane/http_upstream.py): its line; the 502
        when nothing of the response went out, else the client is cut off."""
        conn = self.conn
        host, port = conn.host, conn.port
        details = Details(method=request.head.method, path=request.head.target)
        self.refusal(refused, host, port, stage, details)
        conn.reason = refused.reason
        if answered:
            self.transport.abort()
            return
        self.write(refusal_response(refused, host or "proxy", port, close=True))
        self.close()

    def write(self, data: bytes) -> None:
        conn = self.conn
        if not conn.life.lost:
            self.transport.write(data)
            conn.counter.down += len(data)
            conn.mark_answered()
            self.idle.moved()

    def switch(self, exchange: Exchange, rest: bytes) -> None:
        """The upstream switched to WebSocket: both transports go to a relay."""
        conn = self.conn
        conn.protocol = Protocol.WS
        self._stop_timers()
        relay = Relay(
            self.loop, self.reading, exchange.reading, conn.counter,
            self.door.config.limits.idle_timeout, conn.finish,
        )  # fmt: skip
        conn.take_over(relay)
        relay.start(
            to_upstream=bytes(self.upgraded or b""), to_client=rest, client_eof=self.reading.ended
        )

    # -- ends ----------------------------------------------------------------------------------

    def moved(self) -> None:
        self.idle.moved()

    def close(self) -> None:
        self._stop_timers()
        if not self.conn.life.lost:
            self.transport.close()

    def quiesce(self) -> None:
        """The drain: an idle connection goes now, a busy one after its response."""
        self.closing = True
        if self.serving is None and not self.in_head:
            self.conn.reason = Reason.SHUTDOWN
            self.close()

    def fail(self, exc: BaseException) -> None:
        """Fail closed: a bug of ours on this connection is a denial (or, mid-response, a cut)."""
        logger.error("egress: the HTTP plane failed on a connection", exc_info=exc)
        refused = Refused(403, Reason.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        conn = self.conn
        try:
            self.refusal(refused, conn.host, conn.port, Stage.ENGINE, NO_DETAILS)
            if not conn.life.answered:
                self.write(refusal_response(refused, conn.host or "proxy", conn.port))
            conn.reason = Reason.INTERNAL_ERROR
        finally:
            if self.exchange is not None:
                self.exchange.transport.abort()
            self.close()

    def _linger(self) -> None:
        """Answered while the client still sends a body: its bytes are dropped for a moment, so
        it reads the answer instead of a reset; then the connection closes."""
        self.lingering = True
        self._stop_timers()
        # From here what comes is read only to be dropped: nothing holds reading back.
        self.reading.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.close)

    def _head_expired(self) -> None:
        self.head_timer = None
        refused = too_slow("whole request head")
        self.refuse_unparsed(refused)

    def _idled(self) -> None:
        self.conn.reason = Reason.IDLE_TIMEOUT
        if self.exchange is not None:
            self.exchange.transport.abort()
        self.close()

    def _stop_timers(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        self.idle.stop()


__all__ = ["WEBSOCKET", "HttpPlane"]
