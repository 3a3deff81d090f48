"""The upstream side of one plain-HTTP request: the protocol of the upstream transport while the
request goes out and its response comes back, parsed by httptools and passed to the client with
our own framing as it arrives (never held whole).

    exchange = Exchange(plane, request, reading, reused=False)  # reading: the upstream's
    exchange.send()                    # the head, the body so far, the rest as it arrives
    outcome = await exchange.done      # REUSABLE, SPENT, STALE, SWITCHED or FAILED

Response framing to the client (RFC 9112 6): a Content-Length body passes as it is; a chunked one
is re-chunked for an HTTP/1.1 client and sent until close to an HTTP/1.0 one; a body that ends
with the connection ends the client's too. A 101 is taken only for the WebSocket the request
asked for; any other switch, a malformed response or one larger than MAX_HEAD fails the request.

Flow control, each for its reason (proxy/net/flow.py): while the upstream cannot take the body
as fast as it comes, the client is not read (UPSTREAM_SLOW on the client's Reading); while the
client cannot take the response, the upstream is not (CLIENT_SLOW, set by the plane).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final, Protocol

import httptools

from policy.dimensions import Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, shown
from proxy.dataplane.http_messages import (
    CHUNKED,
    LAST_CHUNK,
    MAX_FIELDS,
    MAX_HEAD,
    Fields,
    chunk,
    field_values,
    forwarded_fields,
    response_head,
)
from proxy.decide.http_checks import WEBSOCKET, upgrade_tokens
from proxy.net.flow import Hold, Reading

if TYPE_CHECKING:
    from proxy.dataplane.connection import Connection
    from proxy.dataplane.http_requests import Request


class Client(Protocol):
    """What an exchange needs of the client's side (proxy/dataplane/http.py's HttpPlane)."""

    conn: Connection
    transport: asyncio.Transport
    reading: Reading  # the client's
    closing: bool

    def write(self, data: bytes) -> None: ...

    def moved(self) -> None: ...

    def held_less(self) -> None: ...

    def closes_after(self, request: Request) -> bool: ...

    def switch(self, exchange: Exchange, rest: bytes) -> None: ...

    def failed_exchange(
        self, request: Request, refused: Refused, *, stage: Stage, answered: bool
    ) -> None: ...


# How an exchange ended, for the plane: what to do with the upstream connection and the client.
REUSABLE: Final = "reusable"  # complete; the upstream connection may serve another request
SPENT: Final = "spent"  # complete; the upstream connection is closed
STALE: Final = "stale"  # a reused connection the server had closed: nothing was sent or read
SWITCHED: Final = "switched"  # a WebSocket: both transports now belong to a relay
FAILED: Final = "failed"  # the client has its answer (or was cut off); close it

_NO_BODY: Final = frozenset({204, 304})


class Exchange(asyncio.Protocol):
    """See the module docstring."""

    def __init__(self, plane: Client, request: Request, reading: Reading, *, reused: bool) -> None:
        self.plane = plane
        self.request = request
        self.reading = reading  # the upstream transport's read side
        self.transport = reading.transport
        self.reused = reused
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.reason = b""
        self.fields: Fields = []
        self.size = 0
        self.in_head = False
        self.heard = False  # a byte came from the upstream
        self.started = False  # the response head went to the client
        self.to_client_chunked = False
        self.until_close = False  # the response body ends when the upstream closes
        self.head_only = False  # a response to HEAD: its head is all of it
        self.sent_all = False  # the request's body (if any) went out whole
        self.error: Refused | None = None
        self.out: list[bytes] = []  # for the client, written once the read is parsed

    # -- the request, out --------------------------------------------------------------------

    def send(self) -> None:
        request = self.request
        self.transport.set_protocol(self)
        self.transport.set_write_buffer_limits(high=256 << 10)
        self.write(request.upstream_head)
        if request.pending:
            self.body(bytes(request.pending))
            request.pending.clear()
            # From here its body goes straight on, held back only by this transport's flow
            # control: the client is read again unless something else holds it.
            self.plane.held_less()
        request.sink = self
        if request.ended:
            self.body_end()
        self.reading.clear()  # the exchange holds the upstream now, and reads it

    def write(self, data: bytes) -> None:
        self.transport.write(data)
        self.plane.conn.counter.up += len(data)
        self.plane.moved()

    def body(self, data: bytes) -> None:
        """A piece of the request body, as the client's parser decoded it."""
        if self.done.done():
            return  # the response came first: the rest of the body is read and dropped
        self.write(chunk(data) if self.request.chunked else data)

    def body_end(self) -> None:
        if not self.done.done() and self.request.chunked:
            self.write(LAST_CHUNK)
        self.sent_all = True

    # -- asyncio.Protocol: the upstream transport ---------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.heard = True
        self.plane.moved()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._flush()
            self._switched(data[upgrade.args[0] :])
        except httptools.HttpParserError as exc:
            refused = self.error or Refused(
                502, Reason.UPSTREAM_ERROR, f"invalid response from the upstream: {exc}", error=True
            )
            self._fail(refused)
        self._flush()

    def _to_client(self, data: bytes) -> None:
        # What one read of the upstream yields (a head and the body after it, say) goes to the
        # client in one write: a system call per read, not per piece.
        self.out.append(data)

    def _flush(self) -> None:
        if self.out:
            data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
            self.out.clear()
            self.plane.write(data)

    def eof_received(self) -> bool:
        self._ended(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def pause_writing(self) -> None:
        # The upstream reads the body slower than it comes.
        self.plane.reading.pause(Hold.UPSTREAM_SLOW)

    def resume_writing(self) -> None:
        self.plane.reading.resume(Hold.UPSTREAM_SLOW)

    def _ended(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self.until_close and self.started and exc is None:
            self._finish(SPENT)
        elif self.reused and not self.heard and not self.request.body_started:
            self.done.set_result(STALE)
        else:
            how = "reset the connection" if exc is not None else "closed the connection"
            self._fail(
                Refused(
                    502,
                    Reason.UPSTREAM_ERROR,
                    f"the upstream {how} before the response ended",
                    error=True,
                )
            )

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.fields = []
        self.reason = b""
        self.size = 0

    def on_status(self, reason: bytes) -> None:
        self.reason += reason
        self._grow(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:  # not a trailer: those are dropped
            self.fields.append((name, value))
            self._grow(len(name) + len(value))

    def _grow(self, size: int) -> None:
        self.size += size + 4
        if self.size > MAX_HEAD or len(self.fields) > MAX_FIELDS:
            self.error = Refused(
                502, Reason.UPSTREAM_ERROR, "the upstream's response head is too large", error=True
            )
            raise ValueError(self.error.message)

    def on_headers_complete(self) -> None:
        self.in_head = False
        status = self.status = self.parser.get_status_code()
        if status < 200:
            if status == 100 and self.request.head.version == "1.1":
                self._to_client(b"HTTP/1.1 100 Continue\r\n\r\n")
            return  # interim (101 is taken when the parser stops for it)
        fields = forwarded_fields(self.fields)
        extra: list[bytes] = []
        codings = [v.strip().lower() for v in field_values(self.fields, b"transfer-encoding")]
        if codings and codings != [CHUNKED]:
            # Only chunked is decoded here; another coding would reach the client unannounced.
            self.error = Refused(
                502,
                Reason.UPSTREAM_ERROR,
                f"Transfer-Encoding {shown(', '.join(codings))!r}",
                error=True,
            )
            raise ValueError(self.error.message)
        chunked = bool(codings)
        lengths = field_values(self.fields, b"content-length")
        self.head_only = self.request.head.method == "HEAD"
        if self.head_only or status in _NO_BODY:
            pass
        elif chunked:
            fields = [(k, v) for k, v in fields if k.lower() != b"content-length"]
            if self.request.head.version == "1.1":
                self.to_client_chunked = True
                extra.append(b"Transfer-Encoding: chunked")
            else:
                self.until_close = True
        elif not lengths:
            self.until_close = True
        if self.until_close or self.plane.closes_after(self.request):
            extra.append(b"Connection: close")
            self.plane.closing = True
        elif self.request.head.version == "1.0":
            extra.append(b"Connection: keep-alive")
        reason = self.reason if self.reason else b"-"
        self._to_client(response_head(status, reason, fields, extra))
        self.started = True
        if self.head_only:
            self._finish(SPENT)  # llhttp would wait for the body its Content-Length announces

    def on_body(self, data: bytes) -> None:
        if self.status >= 200 and not self.done.done():
            self._to_client(chunk(data) if self.to_client_chunked else data)

    def on_message_complete(self) -> None:
        if self.status < 200 or self.done.done():
            return
        if self.to_client_chunked:
            self._to_client(LAST_CHUNK)
        keep = self.parser.should_keep_alive() and not self.until_close
        self._finish(REUSABLE if keep and self.sent_all else SPENT)

    # -- ends --------------------------------------------------------------------------------

    def _finish(self, outcome: str) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def _switched(self, rest: bytes) -> None:
        tokens = upgrade_tokens(field_values(self.fields, b"upgrade"))
        if self.status == 101 and self.request.websocket and tokens == [WEBSOCKET]:
            fields = forwarded_fields(self.fields)
            extra = [b"Connection: Upgrade", b"Upgrade: websocket"]
            self.plane.write(
                response_head(101, self.reason or b"Switching Protocols", fields, extra)
            )
            self.started = True
            self.plane.switch(self, rest)
            self._finish(SWITCHED)
            return
        asked = ", ".join(tokens) or "nothing named"
        self._fail(
            Refused(
                403,
                Reason.UPGRADE_REFUSED,
                f"the upstream switched protocols to {shown(asked)!r} unasked",
            ),
            stage=Stage.REQUEST,
        )

    def _fail(self, refused: Refused, stage: Stage = Stage.UPSTREAM) -> None:
        """The exchange cannot go on: its refusal line; the client's answer when nothing of the
        response went out yet, else the client is cut off (a truncated body must not look
        whole)."""
        if self.done.done():
            return
        if self.started:
            self.out.clear()  # the client is cut off: nothing more of this response goes out
        else:
            self._flush()  # an interim 100 Continue, which came before the failure
        self.done.set_result(FAILED)
        self.transport.abort()
        self.plane.failed_exchange(self.request, refused, stage=stage, answered=self.started)
