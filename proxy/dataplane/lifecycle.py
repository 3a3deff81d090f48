"""The life of one front-door connection (proxy/dataplane/connection.py) as one explicit state,
kept by the connection itself: a `Phase` (who has the connection and what it is doing) and a
few `Mark`s (facts orthogonal to the phase). Planes ask the connection to change
(`Connection.spawn`, `take_over`, `mark_answered`, `lost`, `refuse`, `close`, `finish`, ...);
nothing else sets them.

The phases, and the only moves between them (`MOVES`, which tests/test_lifecycle.py holds to
this table):

    ACCEPTED    -> SETUP SERVED REFUSED CLOSING CLOSED
    SETUP       -> HELD CLASSIFYING RELAYED HANDED REFUSED CLOSING CLOSED
    HELD        -> SETUP REFUSED CLOSING CLOSED
    CLASSIFYING -> SETUP SERVED RELAYED HANDED REFUSED CLOSING CLOSED
    SERVED      -> RELAYED CLOSED
    RELAYED     -> CLOSED
    HANDED      -> (final)
    REFUSED     -> REFUSED CLOSED
    CLOSING     -> CLOSING REFUSED CLOSED
    CLOSED      -> (final)

- ACCEPTED: the listener reads its request (a CONNECT head, a SOCKS5 greeting and request); a
  transparent connection starts its setup at once.
- SETUP: the setup task runs: vetting, DNS, dialling, the listener's answer.
- HELD: the setup task waits for a person's answer (proxy/decide/asks.py); back to SETUP when
  it has one. A request of the HTTP plane held for a person leaves its connection SERVED.
- CLASSIFYING: the setup task reads what the client sends first (proxy/decide/first_flight.py:
  a ClientHello, an HTTP head, an opaque stream) and, for TLS, the whole ClientHello; back to
  SETUP for a vetting or a dial that only its first bytes could start.
- SERVED: the HTTP plane (proxy/dataplane/http.py) owns the transport; it writes the close line
  through the connection when the client goes.
- RELAYED: a Relay (proxy/net/relay.py) owns both transports; its end writes the close line.
- HANDED: the interception engine has the socket, and writes the close line itself. Final here.
- REFUSED: refused before any owner took it; the refusal went out where the client's protocol
  has one (and nothing else had been answered). Its transport is closing.
- CLOSING: ended without a refusal (the client ended first, its stream ended it); the
  transport is closing.
- CLOSED: the close line is written. Final.

Rules the moves keep:
1. Nothing leaves HANDED or CLOSED: a connection has at most one close line, and one writer of
   it (the connection, or the engine it was handed to).
2. Once an owner (SERVED, RELAYED) has the transport, the setup's moves are over: it cannot be
   refused, set up or handed any more; the HTTP plane gives it up only to a relay (WebSocket).
3. REFUSED and CLOSING are ends: they lead only to CLOSED (a refusal may still follow a close:
   its line is written, and it is REFUSED); asking for them again changes nothing.
4. Any other move is a bug, and `Lifecycle.to` raises ProxyError (`internal_error`), which the
   fail-closed paths of the front door turn into a denial.

Marks, each set once and never cleared:
- LOST: the client's transport is closed (connection_lost); nothing more can be written to it.
- ANSWERED: something went to the client in answer (a 200, a SOCKS5 reply, an HTTP response, a
  refusal): the listener's protocol gets no second answer.
- COUNTED: `connection_opened` went to the metrics (a tunnel at its start, else at its close).

The client's EOF is not a mark: it belongs to the client transport's read side
(proxy/net/flow.py `Reading.ended`), orthogonal to every phase and read by the relay too.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from policy.reasons import Reason
from proxy.common.errors import ProxyError

__all__ = [
    "ENDED",
    "MOVES",
    "NOTHING_TO_END",
    "OWNED",
    "SETTING_UP",
    "Lifecycle",
    "Mark",
    "Phase",
]


class Phase(enum.IntEnum):
    # Ints, not strings: a plain enum hashes in Python, and every move looks its phase up.
    ACCEPTED = 0
    SETUP = 1
    HELD = 2
    CLASSIFYING = 3
    SERVED = 4
    RELAYED = 5
    HANDED = 6
    REFUSED = 7
    CLOSING = 8
    CLOSED = 9


class Mark(enum.IntEnum):
    LOST = 1
    ANSWERED = 2
    COUNTED = 4


# The phases before any owner: the front door's own, which it may refuse or close.
SETTING_UP: Final = frozenset({Phase.ACCEPTED, Phase.SETUP, Phase.HELD, Phase.CLASSIFYING})
# Someone else has the transport (and writes, or has the connection write, the close line).
OWNED: Final = frozenset({Phase.SERVED, Phase.RELAYED, Phase.HANDED})
# Ending or ended: its transport is closing or closed.
ENDED: Final = frozenset({Phase.REFUSED, Phase.CLOSING, Phase.CLOSED})
# Nothing for the front door to end: an owner has the transport, or the close line is written.
NOTHING_TO_END: Final = OWNED | {Phase.CLOSED}

MOVES: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.ACCEPTED: ENDED | {Phase.SETUP, Phase.SERVED},
    Phase.SETUP: ENDED | {Phase.HELD, Phase.CLASSIFYING, Phase.RELAYED, Phase.HANDED},
    Phase.HELD: ENDED | {Phase.SETUP},
    Phase.CLASSIFYING: ENDED | {Phase.SETUP, Phase.SERVED, Phase.RELAYED, Phase.HANDED},
    Phase.SERVED: frozenset({Phase.RELAYED, Phase.CLOSED}),
    Phase.RELAYED: frozenset({Phase.CLOSED}),
    Phase.HANDED: frozenset(),
    Phase.REFUSED: frozenset({Phase.REFUSED, Phase.CLOSED}),
    Phase.CLOSING: frozenset({Phase.CLOSING, Phase.REFUSED, Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}


class Lifecycle:
    """One connection's phase and marks; see the module docstring. Made per connection: slots,
    one enum and one int."""

    __slots__ = ("_marks", "phase")

    def __init__(self) -> None:
        self.phase = Phase.ACCEPTED
        self._marks = 0

    def to(self, phase: Phase) -> None:
        """Moves to `phase`, or raises ProxyError when `MOVES` has no such move."""
        if phase not in MOVES[self.phase]:
            raise ProxyError(
                Reason.INTERNAL_ERROR,
                f"a connection {self.phase.name.lower()} cannot become {phase.name.lower()}",
            )
        self.phase = phase

    def mark(self, mark: Mark) -> None:
        self._marks |= mark

    def has(self, mark: Mark) -> bool:
        return bool(self._marks & mark)

    @property
    def lost(self) -> bool:
        return bool(self._marks & Mark.LOST)

    @property
    def answered(self) -> bool:
        return bool(self._marks & Mark.ANSWERED)

    def __repr__(self) -> str:
        marks = ",".join(mark.name for mark in Mark if self._marks & mark)
        return f"<Lifecycle {self.phase.name.lower()}{' ' + marks if marks else ''}>"
