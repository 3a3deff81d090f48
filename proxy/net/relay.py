"""The byte relay of a tunnel: two connected transports (the client's and the upstream's), bytes
both ways until both directions have ended. Each transport gets a small protocol of ours that
writes what it receives to the other transport; a tunnel that has moved `splice_after` bytes is a
bulk transfer and moves to `os.splice` (proxy/net/splice.py), where bytes no longer enter user
space.

    relay = Relay(loop, client_reading, upstream_reading, counter, idle_timeout, on_end)
    relay.start(to_upstream=hello)      # the bytes the caller already read, first
    relay.close("policy_reload")        # from outside: both sides closed, on_end called

Semantics, the same in both modes:
- Half-close: an EOF from one side is passed on as `write_eof` (`shutdown(SHUT_WR)`) of the
  other, after everything read before it has been written; the other direction carries on until
  it ends too. Both EOFs end the relay with `closed`.
- A reset (or any error) on either side ends both; the other side is then reset as well
  (`SO_LINGER` 0), so a peer never mistakes a truncated stream for a complete one.
- Idle timeout: when no byte has moved either way for `idle_timeout` seconds, both sides are
  closed (`idle_timeout`). One timer per relay, re-armed only when it fires
  (proxy/net/idle.py).
- Flow control: when one transport's write buffer is full, the other stops reading until it
  has drained, so a slow reader holds the sender back and the relay holds at most one buffer's
  worth per direction. Each transport is paused and resumed through its `Reading`
  (proxy/net/flow.py), the reason named (CLIENT_SLOW, UPSTREAM_SLOW, HANDOFF); the relay takes
  the Readings its caller used (or makes them for bare transports) and clears what they held.
- `on_end(reason)` is called exactly once, after both transports (or sockets) are closed; the
  counter holds the bytes moved, live while the relay runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Final

from policy.reasons import Reason
from proxy.net.bytecount import Counter
from proxy.net.flow import Hold, Reading
from proxy.net.idle import IdleTimer
from proxy.net.splice import LINGER_RESET, SpliceRelay, splice_available

logger = logging.getLogger(__name__)

# How a relay's transports are shut: what is buffered for them written first (both ended
# cleanly), dropped (closed from outside, idle), or dropped with a reset (a reset or an error).
_FLUSH, _DROP, _RESET = "flush", "drop", "reset"

# Bytes after which a tunnel moves to splice. Below it a chunk costs a read and a write through
# the loop; splice costs two pipes and twice the system calls per chunk, and pays for that only
# once chunks are large and many (benchmarks/relay_bulk.py measures both).
SPLICE_AFTER: Final = 1 << 20
# A transport's write buffer beyond which the other side stops reading. Resumed only once empty,
# so a tunnel that wants to move to splice finds both buffers empty at a resume.
WRITE_HIGH: Final = 256 << 10


class Relay:
    """One tunnel's relay between two transports; see the module docstring."""

    __slots__ = (
        "_down",
        "_ended",
        "_idle",
        "_on_end",
        "_splice",
        "_splice_after",
        "_up",
        "_wants_splice",
        "counter",
        "idle_timeout",
        "loop",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: asyncio.Transport | Reading,
        upstream: asyncio.Transport | Reading,
        counter: Counter,
        idle_timeout: float | None,
        on_end: Callable[[str], None],
        *,
        splice_after: int | None = SPLICE_AFTER,
    ) -> None:
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be positive or None, not {idle_timeout!r}")
        self.loop = loop
        self.counter = counter
        self.idle_timeout = idle_timeout
        self._idle = IdleTimer(loop, idle_timeout, self._idled)
        self._on_end = on_end
        self._splice_after = splice_after if splice_available() else None
        self._up = _Side(self, _reading(client), is_up=True)  # reads the client, writes upstream
        self._down = _Side(self, _reading(upstream), is_up=False)
        self._up.peer, self._down.peer = self._down, self._up
        self._splice: SpliceRelay | None = None
        self._wants_splice = False
        self._ended = False

    # -- life cycle ----------------------------------------------------------------------------

    def start(
        self,
        *,
        to_upstream: bytes = b"",
        to_client: bytes = b"",
        client_eof: bool = False,
        upstream_eof: bool = False,
    ) -> None:
        """Takes both transports over. `to_upstream` / `to_client`: bytes the caller read before
        (the ClientHello it checked; what the upstream sent early), written first and counted;
        `client_eof` / `upstream_eof`: that side had already ended its sending."""
        for side in (self._up, self._down):
            side.transport.set_protocol(side)
            side.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
        if to_upstream:
            self._up.forward(to_upstream)
        if to_client:
            self._down.forward(to_client)
        self._idle.start()
        for side, ended in ((self._up, client_eof), (self._down, upstream_eof)):
            if ended:
                side.ended_sending()
            elif not self._ended:
                side.reading.clear()  # what the caller held it for is the relay's now
        if not self._ended and self._splice_after == 0:
            self._to_splice()

    def close(self, reason: str) -> None:
        """Ends the relay from outside (a reload, the drain): both sides closed at once, what
        is still buffered for them dropped."""
        if self._splice is not None:
            self._splice.close(reason)
        else:
            self._end(reason, _DROP)

    @property
    def ended(self) -> bool:
        return self._ended

    def _end(self, reason: str, how: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._idle.stop()
        for side in (self._up, self._down):
            side.shut(how)
        self._on_end(reason)

    def _idled(self) -> None:
        self._end(Reason.IDLE_TIMEOUT, _DROP)

    # -- events of the sides ---------------------------------------------------------------------

    def moved(self) -> None:
        self._idle.moved()
        limit = self._splice_after
        if limit is not None and self.counter.up + self.counter.down >= limit:
            self._wants_splice = True
            self._to_splice()

    def side_ended(self) -> None:
        if self._up.sent_eof and self._down.sent_eof:
            self._end(Reason.CLOSED, _FLUSH)

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        # A transport closed under us: a reset, or a close we did not ask for.
        self._end(Reason.RESET if exc is not None or not side.sent_eof else Reason.CLOSED, _RESET)

    def side_failed(self) -> None:
        logger.exception("egress: the relay failed")
        self._end(Reason.ERROR, _RESET)

    def drained(self) -> None:
        if self._wants_splice:
            self._to_splice()

    # -- bulk: on to splice ------------------------------------------------------------------

    def _to_splice(self) -> None:
        """Moves the tunnel to splice once neither transport holds unwritten bytes (a resume at
        an empty buffer tries again). The sockets are duplicated and the transports dropped, so
        the kernel connections go on under the splice relay's own descriptors. When no pipe or
        descriptor can be had, the transports simply carry on."""
        if self._ended or self._splice is not None:
            return
        if any(side.transport.get_write_buffer_size() for side in (self._up, self._down)):
            return
        self._wants_splice = False
        client = self._up.detach()
        upstream = self._down.detach() if client is not None else None
        splice = None
        if client is not None and upstream is not None:
            splice = SpliceRelay(
                self.loop, client, upstream, self.counter, self.idle_timeout, self._spliced_end
            )
            if not splice.open_pipes(up_done=self._up.sent_eof, down_done=self._down.sent_eof):
                splice = None
        if splice is None:
            for sock in (client, upstream):
                if sock is not None:
                    sock.close()
            self._splice_after = None  # stay on the transports for good
            self._up.reattach()
            self._down.reattach()
            return
        self._idle.stop()
        splice.idle.last_moved = self._idle.last_moved
        self._splice = splice
        for side in (self._up, self._down):
            side.drop_transport()
        splice.start()

    def _spliced_end(self, reason: str) -> None:
        self._ended = True
        self._on_end(reason)


def _reading(transport: asyncio.Transport | Reading) -> Reading:
    return transport if isinstance(transport, Reading) else Reading(transport)


class _Side(asyncio.Protocol):
    """One transport of the relay: what it receives is written to the peer's transport."""

    __slots__ = ("detached", "is_up", "peer", "reading", "relay", "sent_eof", "slow", "transport")

    def __init__(self, relay: Relay, reading: Reading, *, is_up: bool) -> None:
        self.relay = relay
        self.reading = reading
        self.transport = reading.transport  # read per chunk: one lookup, not two
        self.is_up = is_up
        self.peer: _Side = self
        self.sent_eof = False  # this side's sender has ended (its EOF passed on to the peer)
        # Why the peer is not read while this side's transport cannot take more.
        self.slow = Hold.CLIENT_SLOW if is_up else Hold.UPSTREAM_SLOW
        self.detached = False

    def forward(self, data: bytes) -> None:
        """Writes bytes read from this side to the peer, counted."""
        self.peer.transport.write(data)
        if self.is_up:
            self.relay.counter.up += len(data)
        else:
            self.relay.counter.down += len(data)

    def data_received(self, data: bytes) -> None:
        try:
            self.forward(data)
            self.relay.moved()
        except Exception:
            self.relay.side_failed()

    def eof_received(self) -> bool:
        try:
            self.ended_sending()
        except Exception:
            self.relay.side_failed()
        return True  # keep the transport open: the other direction may go on

    def ended_sending(self) -> None:
        self.sent_eof = True
        self.reading.end()
        peer = self.peer.transport
        if peer.can_write_eof():
            peer.write_eof()  # after whatever is still buffered for it
        self.relay.side_ended()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.detached or self.relay.ended:
            return
        self.relay.side_lost(self, exc)

    def pause_writing(self) -> None:
        # This side's transport is full: its peer stops reading until it has drained (a peer
        # that has ended is not read anyway: its Reading knows).
        if not self.detached:
            self.peer.reading.pause(self.slow)

    def resume_writing(self) -> None:
        if not self.detached:
            self.peer.reading.resume(self.slow)
        self.relay.drained()

    def shut(self, how: str) -> None:
        if self.detached:
            return
        transport = self.transport
        if how == _FLUSH:
            transport.close()
            return
        if how == _RESET:
            _set_linger_reset(transport)
        transport.abort()

    def detach(self) -> socket.socket | None:
        """A duplicate of the transport's socket, non-blocking, with reading paused; None when
        the socket cannot be had (the transport keeps it then)."""
        transport = self.transport
        self.reading.pause(Hold.HANDOFF)
        raw = transport.get_extra_info("socket")
        try:
            fd = os.dup(raw.fileno())
        except (OSError, AttributeError):
            return None
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        return sock

    def reattach(self) -> None:
        self.reading.resume(Hold.HANDOFF)

    def drop_transport(self) -> None:
        # The splice relay has its own descriptor of the socket: the transport's goes, and its
        # connection_lost is ignored.
        self.detached = True
        self.transport.abort()


def _set_linger_reset(transport: asyncio.BaseTransport) -> None:
    raw: Any = transport.get_extra_info("socket")
    if raw is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)


__all__ = ["SPLICE_AFTER", "Counter", "Relay"]
