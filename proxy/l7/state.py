"""What the engine knows of each intercepted connection, and the dials its hooks allowed.

    connection = Intercepted(destination, transport)     # Engine.intercept makes it
    ledger.add("mitmproxy client id", connection)        # modes.InterceptInstance.serve
    ledger.allow_dial(server.id, Dial(...))               # the server_connect hook
    ledger.take_dial(server.id)                           # the dial itself (patches.py)
    server.error = ledger.fail(client.id, refused)        # why it was not connected
    ledger.fail(client.id, refused, text)                 # or why its TLS handshake failed

mitmproxy hands a server connection's failure on only as text (`Server.error`, then the flow's
error), and to a request's flow through a server connection of its own: the refusal is kept
here as a value, by client and that text, for the hooks that answer it (the text is a key, never
read back).

mitmproxy names client and server connections by ids (`Client.id`, `Server.id`); every hook
finds our state by them. A hook for a connection not in the ledger is not ours: it is denied.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policy.dimensions import Protocol
from policy.reasons import Reason
from proxy.common.refusals import Refused

if TYPE_CHECKING:
    from proxy.decide.events import MetricsSink
    from proxy.decide.interception import Destination


@dataclass(slots=True)
class Bytes:
    """Bytes of one client connection as the client sent and received them (TLS records)."""

    up: int = 0  # read from the client
    down: int = 0  # written to the client


@dataclass(frozen=True, slots=True)
class Dial:
    """What `server_connect` allowed one upstream connection to dial: checked addresses only,
    in answer order, each with the connect timeout, falling back to the next on failure."""

    name: str  # the host as decided, for messages
    addresses: tuple[str, ...]
    port: int
    timeout: float
    metrics: MetricsSink | None


@dataclass(slots=True, eq=False)  # one per connection, kept in sets: identity, not value
class Intercepted:
    """One client connection the front door handed over, from hand-over to close line."""

    destination: Destination
    transport: asyncio.Transport  # the client's: closing it ends the connection, whatever stage
    opened: float = field(default_factory=time.monotonic)
    counted: Bytes = field(default_factory=Bytes)
    client_id: str = ""  # mitmproxy's Client.id, once its handler exists
    # The audit label: the destination's, `wss` once upgraded.
    protocol: Protocol = field(init=False)
    # (host, port) as mitmproxy dials it -> the checked addresses of the last request there.
    vetted: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    pinned: tuple[str, ...] = ()  # of the last decided request
    upstream: str | None = None  # the address last connected to
    upgraded: str | None = None  # the URL whose request opened a WebSocket, for reloads
    close_reason: str = Reason.CLOSED
    head_timer: asyncio.TimerHandle | None = None  # until the first request head arrives

    def __post_init__(self) -> None:
        self.protocol = self.destination.protocol
        self.pinned = self.pinned or self.destination.pinned

    def end(self, reason: str) -> None:
        """Closes the client connection (a reload, the drain, a timeout, a failed hook);
        mitmproxy winds its handler down on the loss, and the close line says `reason`."""
        if self.close_reason == Reason.CLOSED:
            self.close_reason = reason
        self.cancel_head_timer()
        self.transport.abort()

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None


# An upstream connection no server_connect hook allowed: nothing is dialled (fail closed).
NOT_VETTED = Refused(403, Reason.NOT_VETTED, "server connection not vetted by policy")
# Failed upstream connections remembered at once (each is answered within its request).
MAX_FAILURES = 1024


class Ledger:
    """The engine's live connections by mitmproxy client id, and the dials allowed by server id."""

    def __init__(self) -> None:
        self.connections: dict[str, Intercepted] = {}
        self._dials: dict[str, Dial] = {}
        self._failures: dict[tuple[str, str], Refused] = {}  # in the order they failed

    def add(self, client_id: str, connection: Intercepted) -> None:
        connection.client_id = client_id
        self.connections[client_id] = connection

    def remove(self, connection: Intercepted) -> None:
        self.connections.pop(connection.client_id, None)

    def get(self, client_id: str) -> Intercepted | None:
        return self.connections.get(client_id)

    def allow_dial(self, server_id: str, dial: Dial) -> None:
        self._dials[server_id] = dial

    def take_dial(self, server_id: str) -> Dial | None:
        """The dial allowed for this upstream connection, once; None: it was never allowed."""
        return self._dials.pop(server_id, None)

    def forget_dial(self, server_id: str) -> None:
        self._dials.pop(server_id, None)

    def fail(self, client_id: str, refused: Refused, text: str | None = None) -> str:
        """Why an upstream connection of client `client_id` was not connected (refused before
        its dial, the dial failed, or its TLS handshake did); returns the text mitmproxy
        carries (`text`, or one made of the refusal). Bounded: the oldest are forgotten first."""
        if text is None:
            text = f"egress-proxy: {refused.reason}: {refused.message}"
        failures = self._failures
        key = (client_id, text)
        failures.pop(key, None)
        failures[key] = refused
        while len(failures) > MAX_FAILURES:
            del failures[next(iter(failures))]
        return text

    def failure(self, client_id: str, text: str) -> Refused | None:
        return self._failures.get((client_id, text))

    def forget_failure(self, client_id: str, text: str) -> Refused | None:
        return self._failures.pop((client_id, text), None)
