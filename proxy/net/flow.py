"""Read-side flow control of one transport: the one place that pauses and resumes its reading,
and that knows why it is paused. Each reason is a `Hold`; the transport reads only while no
reason holds it, so one reason can never resume what another paused.

    reading = Reading(transport)
    reading.pause(Hold.PIPELINED)      # a request waits behind the one being served
    reading.pause(Hold.BODY_HELD)      # and a body beyond the limit waits for its upstream
    reading.resume(Hold.PIPELINED)     # still paused: the body is still held
    reading.resume(Hold.BODY_HELD)     # the set is empty: the transport reads again
    reading.clear()                    # a new holder (a relay, the pool): reads, holds nothing
    reading.end()                      # the peer ended its sending: nothing more to read

Rules:
- `pause(why)` and `resume(why)` are idempotent: pausing twice for one reason needs one resume,
  resuming a reason that does not hold is nothing.
- The transport's `pause_reading` is called when the first reason arrives, `resume_reading`
  when the last one goes; never otherwise.
- `clear()` drops every reason and reads: for a new holder of the transport (the reasons of the
  one before are void with it: it took what they were holding), or a holder that only drains
  what comes now. It resumes even when no reason held, since a transport may come paused from
  code that did not use its Reading (the relay's own tests hand it paused transports).
- After `end()` (an EOF was read) the transport is never paused or resumed again: reading an
  ended stream again would deliver its EOF twice. Reasons are still recorded.

The write side is the transport's protocol's (pause_writing / resume_writing): a full write
buffer on one transport is a reason on the other transport's Reading (CLIENT_SLOW, UPSTREAM_SLOW).
Made per transport, so it keeps to slots and one int.
"""

from __future__ import annotations

import asyncio
import enum

__all__ = ["Hold", "Reading"]


class Hold(enum.IntEnum):
    """Why a transport is not read; each a bit of `Reading`'s set."""

    # The front door holds MAX_PENDING of the client's bytes that nothing has taken yet
    # (proxy/dataplane/connection.py): whoever reads next lifts it.
    PENDING_FULL = 1
    # A plain-HTTP request waits behind the one being served (proxy/dataplane/http.py).
    PIPELINED = 2
    # A request body beyond MAX_HELD waits for its upstream connection (proxy/dataplane/http.py).
    BODY_HELD = 4
    # Bytes after a WebSocket upgrade beyond MAX_HELD wait for the upstream to switch.
    UPGRADE_HELD = 8
    # An upstream that spoke first holds EARLY_LIMIT unread by anyone (proxy/net/dialing.py).
    EARLY_FULL = 16
    # The client's write buffer is full: the upstream is not read until it drains.
    CLIENT_SLOW = 32
    # The upstream's write buffer is full: the client is not read until it drains.
    UPSTREAM_SLOW = 64
    # The socket is being taken off the transport (to the engine, to splice).
    HANDOFF = 128


class Reading:
    """The read side of one transport; see the module docstring."""

    __slots__ = ("_ended", "_held", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._held = 0  # a set of Hold, as bits: the transport is paused while it is not 0
        self._ended = False

    def pause(self, why: Hold) -> None:
        held = self._held
        if not held and not self._ended:
            self.transport.pause_reading()
        self._held = held | why

    def resume(self, why: Hold) -> None:
        held = self._held
        if held & why:
            held = self._held = held & ~why
            if not held and not self._ended:
                self.transport.resume_reading()

    def clear(self) -> None:
        self._held = 0
        if not self._ended:
            self.transport.resume_reading()

    def end(self) -> None:
        self._ended = True

    @property
    def ended(self) -> bool:
        """The peer ended its sending (an EOF was read)."""
        return self._ended

    @property
    def paused(self) -> bool:
        return bool(self._held)

    def holds(self, why: Hold) -> bool:
        return bool(self._held & why)

    @property
    def reasons(self) -> frozenset[Hold]:
        """What holds the transport now."""
        return frozenset(hold for hold in Hold if self._held & hold)

    def __repr__(self) -> str:
        names = ",".join(sorted(hold.name for hold in self.reasons)) or "-"
        return f"<Reading held={names}{' ended' if self._ended else ''}>"
