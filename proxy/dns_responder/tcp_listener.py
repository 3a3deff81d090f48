"""One TCP connection to the DNS responder (RFC 7766): messages with a 2-byte length prefix,
several per connection, pipelined (each query is decided as it comes, up to the server's
`max_pipelined` at once, and answered when decided; the ids tell the answers apart).

The connection's state decides its one timer:
- a message begun and not yet whole (the client owes us bytes): it must be whole within
  `header_timeout` of its first byte, however slowly its bytes trickle in, or the connection
  is closed (`header_timeout`);
- nothing begun and nothing in flight (idle): closed after `idle_timeout`, quietly;
- otherwise (queries in flight, or whole messages waiting for room): no timer, the resolver's
  own timeout bounds each query.
Reading pauses while the connection has `max_pipelined` queries in flight, while the server has
no room for another, or while the client does not read its answers (the transport's write
buffer is full), so a client can make the server hold at most a message's worth of its bytes
beyond what is being decided. A length prefix below a header or above MAX_QUERY, or a response
sent to us, closes the connection (with its audit line); a message that does not parse is
answered FORMERR and the connection goes on (its framing still holds).
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any, Protocol, cast

from policy.reasons import Reason
from proxy.decide.vetting import Peer, next_connection_id
from proxy.dns_responder.wire import HEADER, MAX_QUERY, TCP_ANSWER_LIMIT

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import dns.message

    from proxy.dns_responder.responder import DnsQuery, DnsResponder

_LENGTH = struct.Struct("!H")
# Answers a client has not read yet, beyond which we stop reading its queries.
WRITE_HIGH = 64 * 1024
# Queries received and not yet started (reading pauses long before a client that plays by the
# rules gets here: this bounds what one read may bring in besides).
MAX_BUFFERED = 64 * 1024


class Limits(Protocol):
    @property
    def header_timeout(self) -> float: ...

    @property
    def idle_timeout(self) -> float: ...

    @property
    def max_pipelined(self) -> int: ...


class Server(Protocol):
    """What a connection needs of its server (proxy.dns_responder.server.DnsServer)."""

    @property
    def limits(self) -> Limits: ...

    @property
    def responder(self) -> DnsResponder: ...

    def read(
        self, data: bytes, peer: Peer
    ) -> tuple[dns.message.Message, DnsQuery] | bytes | None: ...

    def admit(self) -> bool: ...

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None: ...

    def release(self) -> None: ...

    def wait_for_room(self, connection: TcpConnection) -> None: ...

    async def answer(
        self, message: dns.message.Message, query: DnsQuery, peer: Peer, limit: int
    ) -> bytes: ...

    def tcp_opened(self, connection: TcpConnection) -> bool: ...

    def tcp_closed(self, connection: TcpConnection) -> None: ...


class TcpConnection(asyncio.Protocol):
    """See the module docstring."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.peer = Peer(None, next_connection_id())
        self.buffer = bytearray()
        self.in_flight = 0
        self.idle_since: float | None = None  # loop time it became idle, if it is
        self.message_since: float | None = None  # loop time the unfinished message began
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._writable = True
        self._waiting = False  # for room in the server
        self._eof = False
        self._closed = False
        self._pumping = False

    # -- asyncio's callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio's classes: no isinstance check.
        self.transport = stream = cast(asyncio.Transport, transport)
        self.peer = Peer(_client(stream.get_extra_info("peername")), self.peer.connection)
        if not self.server.tcp_opened(self):
            self._closed = True
            stream.abort()
            return
        stream.set_write_buffer_limits(high=WRITE_HIGH)
        self._update()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self.buffer += data
        if len(self.buffer) > MAX_BUFFERED:
            self._refuse(
                Reason.OVERLOAD, f"more than {MAX_BUFFERED} bytes of DNS queries unanswered"
            )
            self._close()
            return
        self._pump()

    def eof_received(self) -> bool:
        self._eof = True
        self._update()  # closes now, or once the queries it sent are answered
        return True  # we close; the answers in flight may still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._disarm()
        self.server.tcp_closed(self)
        for task in list(self._tasks):
            task.cancel()

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._pump()

    # -- used by the server ------------------------------------------------------------------

    def resume(self) -> None:
        """The server has room again (this connection waited for it)."""
        self._waiting = False
        self._pump()

    def close_for_room(self) -> None:
        """Closed to make room for a new connection (the server is at its cap)."""
        if self.message_since is not None:
            self._refuse(
                Reason.OVERLOAD, "an unfinished DNS message closed to make room for a client"
            )
        self._close()

    def abort(self) -> None:
        self._closed = True
        self.server.tcp_closed(self)
        if self.transport is not None:
            self.transport.abort()

    # -- messages ----------------------------------------------------------------------------

    def _pump(self) -> None:
        """Start every whole message there is room for, then set the timer and reading."""
        if self._pumping:
            return  # a query that ended within this very loop: it goes on from there
        self._pumping = True
        try:
            while not self._closed and self._next():
                pass
        finally:
            self._pumping = False
        self._update()

    def _next(self) -> bool:
        """Start the next whole message; whether to look for another one."""
        if len(self.buffer) < _LENGTH.size:
            return False
        (length,) = _LENGTH.unpack_from(self.buffer)
        if not HEADER.size <= length <= MAX_QUERY:
            self._refuse(Reason.DNS_MALFORMED, f"a DNS message of {length} bytes over TCP")
            self._close()
            return False
        if len(self.buffer) < _LENGTH.size + length or self._waiting:
            return False
        if not self._writable or self.in_flight >= self.limits.max_pipelined:
            return False
        if not self.server.admit():
            self._waiting = True
            self.server.wait_for_room(self)
            return False
        data = bytes(self.buffer[_LENGTH.size : _LENGTH.size + length])
        del self.buffer[: _LENGTH.size + length]
        self.message_since = None  # what follows in the buffer is the next message
        read = self.server.read(data, self.peer)
        if read is None or isinstance(read, bytes):
            self.server.release()
            if read is None:  # a response sent to us (audited): not a client to serve
                self._close()
                return False
            self._write(read)
            return True
        self.in_flight += 1
        task = self.server.spawn(self._answer(*read))
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def _answer(self, message: dns.message.Message, query: DnsQuery) -> None:
        try:
            self._write(await self.server.answer(message, query, self.peer, TCP_ANSWER_LIMIT))
        finally:
            self.server.release()
            self.in_flight -= 1
            if not self._closed:
                self._pump()

    def _write(self, wire: bytes) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(_LENGTH.pack(len(wire)) + wire)

    # -- state, timer, reading ---------------------------------------------------------------

    def _update(self) -> None:
        if self._closed:
            return
        whole = self._whole_message()
        if self._eof and not whole:
            if self.buffer:
                self._refuse(
                    Reason.DNS_MALFORMED, "connection closed in the middle of a DNS message"
                )
                self.buffer.clear()
            if not self.in_flight:
                self._close()
                return
        loop = asyncio.get_running_loop()
        if self.buffer and not whole:  # the client owes us the rest of a message
            self.idle_since = None
            if self.message_since is None:
                self.message_since = loop.time()
                self._arm(self.limits.header_timeout, self._header_timed_out)
        elif not self.buffer and not self.in_flight:
            self.message_since = None
            if self.idle_since is None:
                self.idle_since = loop.time()
                self._arm(self.limits.idle_timeout, self._close)
        else:
            self.idle_since = self.message_since = None
            self._disarm()
        # Read more only when there is room for what comes: no whole message left waiting.
        pause = whole or self._waiting or not self._writable
        if pause != self._paused and self.transport is not None:
            self._paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _whole_message(self) -> bool:
        if len(self.buffer) < _LENGTH.size:
            return False
        length: int = _LENGTH.unpack_from(self.buffer)[0]
        return len(self.buffer) >= _LENGTH.size + length

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timed_out(self) -> None:
        self._timer = None
        waited = f"{self.limits.header_timeout:g}s"
        self._refuse(
            Reason.HEADER_TIMEOUT, f"no whole DNS message within {waited} of its first byte"
        )
        self._close()

    def _refuse(self, reason: str, message: str) -> None:
        self.server.responder.refuse_message(self.peer, reason, message, rcode=None)

    def _close(self) -> None:
        self._disarm()
        self.server.tcp_closed(self)  # at once: its place is free for the next client
        if not self._closed and self.transport is not None:
            self._closed = True
            self.transport.close()  # answers already written still go out


def _client(peername: Any) -> tuple[str, int] | None:
    if isinstance(peername, tuple) and len(peername) >= 2:
        return (str(peername[0]), int(peername[1]))
    return None
