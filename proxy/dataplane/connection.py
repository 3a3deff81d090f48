"""One accepted client connection of the front door, as an `asyncio.Protocol`: its bytes, its
timers, its answer and its close line; and the `Door`, what all of them share (the decision
code, the config, the sinks, the live connections, the door's own addresses). The kinds of
listener (explicit proxy, SOCKS5, transparent) subclass Connection; a tunnel or an HTTP exchange
takes its transport over from it.

Every connection gets exactly one close line, whoever ends it: the relay of its tunnel, its own
refusal, the client going away, or the engine it was handed to (which then writes it itself).

Where a connection is in its life is one explicit state (proxy/dataplane/lifecycle.py), which
only the connection changes, as planes ask it to: `spawn`, `classifying`, `setting_up`, `held`
and `released`, `take_over`, `detach_socket`, `mark_answered`, `lost`, `refuse`, `close`,
`finish`. Its client transport's reading is paused and resumed through one `Reading`
(proxy/net/flow.py), for named reasons, by whoever holds the transport.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from policy.dimensions import Plane, Protocol, Stage
from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.refusals import Refused, refusal_response, refusal_ssh, too_slow
from proxy.dataplane.lifecycle import NOTHING_TO_END, SETTING_UP, Lifecycle, Mark, Phase
from proxy.decide.asks import HELD_CLIENT
from proxy.decide.closes import close_line
from proxy.decide.events import NO_DETAILS, CloseEvent, Details
from proxy.decide.interception import Destination
from proxy.decide.vetting import Peer, next_connection_id
from proxy.net.bytecount import Counter
from proxy.net.flow import Hold, Reading
from proxy.net.pool import Pool
from proxy.net.relay import Relay

if TYPE_CHECKING:
    from proxy.common.listeners import Listener
    from proxy.common.settings import Config
    from proxy.decide.attribution import Attribution
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.decide.interception import Interceptor
    from proxy.decide.vetting import Vetted, Vetter

logger = logging.getLogger(__name__)

# What a connection may hold of its client's bytes before it has decided what they are: a
# CONNECT head, a SOCKS5 request or a ClientHello are far smaller.
MAX_PENDING = 64 << 10


class Quiesces(typing.Protocol):
    """What the drain needs of a plane that owns a connection (proxy/dataplane/http.py)."""

    def quiesce(self) -> None: ...


class Connection(asyncio.Protocol):
    """A client connection while the front door still owns it. Subclasses implement `begin`
    (called once the transport is there) and `received` (bytes while nothing else owns them)."""

    protocol = Protocol.HTTP  # the audit lines' `protocol` until the subclass knows better

    def __init__(self, door: Door, listener: Listener) -> None:
        self.door = door
        self.listener = listener
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.reading: Reading = None  # type: ignore[assignment]  # the transport's read side
        self.life = Lifecycle()
        self.peer = Peer(None, "")
        self.opened = 0.0
        self.buffer = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.reason: str = Reason.CLIENT_CLOSED  # for a close line nobody else wrote
        self.task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # What is known of the destination, as it is learned: for reloads and the close line.
        self.target: str | None = None  # the decided authority
        self.host: str | None = None
        self.port: int | None = None
        self.sni: str | None = None
        self.ech = False  # its ClientHello carried ECH or ESNI (the SNI gate says so)
        self.pinned: tuple[str, ...] = ()
        self.upstream: str | None = None  # the pinned address connected to
        self.relay: Relay | None = None
        self.vetted: Vetted | None = None  # what vetting found, once it has run
        self.counter = Counter()
        self.http: Quiesces | None = None  # the HTTP plane, once the bytes were plain HTTP
        # How `host` was known (events.ATTRIBUTIONS), and every name DNS answered its address
        # for when that was several.
        self.attribution: str | None = None
        self.attributed: tuple[str, ...] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        self.reading = Reading(self.transport)
        self.opened = time.monotonic()
        try:
            address = transport.get_extra_info("peername")
            client = (str(address[0]), int(address[1])) if isinstance(address, tuple) else None
            self.peer = Peer(client, next_connection_id())
            if self.door.admit(self):
                self.begin()
        except Exception as exc:
            self.failed(exc)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > MAX_PENDING:
            self.reading.pause(Hold.PENDING_FULL)  # whoever reads next decides what is too much
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
            return
        if self.task is not None and not self.task.done():
            return  # the setup task reads what it needs when it gets to it
        try:
            self.received()
        except Exception as exc:
            self.failed(exc)

    def eof_received(self) -> bool:
        self.reading.end()
        if self.waiter is not None:
            self._wake()
        elif self.task is None or self.task.done():
            # Gone before asking anything whole: nothing to answer.
            self.close()
        return True  # half-open: a tunnel setup still running decides what the EOF means

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost()
        self._wake()
        self.cancel_timer()
        if self.life.phase in NOTHING_TO_END:
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()  # its setup cannot go on without the client
        try:
            self.finish(self.reason)
        except Exception:
            logger.exception("egress: writing a close line failed")

    # -- for subclasses ------------------------------------------------------------------------

    def begin(self) -> None:
        """The transport is there (and admitted): start reading."""

    def received(self) -> None:
        """Bytes arrived (in `buffer`) while no task waits for them."""

    def spawn(self, work: Any) -> None:
        """Runs the coroutine `work` as this connection's setup task; a failure in it is a
        denial (fail closed), never a crash."""
        self.life.to(Phase.SETUP)
        # The task tells this connection when it waits for a person, and learns from it whether
        # its client has gone meanwhile (proxy/decide/asks.py); a task copies the context it is
        # created in.
        token = HELD_CLIENT.set(self)
        try:
            self.task = asyncio.get_running_loop().create_task(work)
        finally:
            HELD_CLIENT.reset(token)
        self.task.add_done_callback(self._task_done)

    # -- the phases of the setup task (proxy/dataplane/lifecycle.py) ---------------------------

    def classifying(self) -> None:
        """The setup task reads what the client sends first."""
        self.life.to(Phase.CLASSIFYING)

    def setting_up(self) -> None:
        """The setup task vets or dials (again, after the client's first bytes)."""
        if self.life.phase is not Phase.SETUP:
            self.life.to(Phase.SETUP)

    def held(self) -> None:
        """The setup task waits for a person's answer (asks.HeldClient). A request of the HTTP
        plane inherits the task's context, and may be held too: its connection stays SERVED."""
        if self.life.phase is Phase.SETUP:
            self.life.to(Phase.HELD)

    def released(self) -> None:
        """The wait for a person is over (answered, timed out, or the client went away)."""
        if self.life.phase is Phase.HELD:
            self.life.to(Phase.SETUP)

    def abandoned(self) -> bool:
        """While its setup waits for a person's answer: whether the client went away (closed,
        reset, or ended its side, which no client waiting for a CONNECT or SOCKS5 reply does).
        Such a connection is ended here, which cancels the waiting task."""
        lost = self.life.lost
        if not (lost or self.reading.ended):
            return False
        if not lost:
            self.transport.abort()
        return True

    def take_over(self, owner: Relay | Quiesces) -> None:
        """`owner` has the client transport from now on: a relay (both transports; its end
        writes the close line) or the HTTP plane."""
        self.cancel_timer()
        if isinstance(owner, Relay):
            self.life.to(Phase.RELAYED)
            self.relay = owner
        else:
            self.life.to(Phase.SERVED)
            self.http = owner

    def mark_answered(self) -> None:
        """Something went to the client in answer: its listener's protocol gets no other."""
        self.life.mark(Mark.ANSWERED)

    def lost(self) -> None:
        """The client's transport is closed (whichever protocol it had then)."""
        self.life.mark(Mark.LOST)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failed(exc)

    async def more(self) -> bool:
        """Waits for more bytes in `buffer`; False when the client ended or went away first."""
        reading, life = self.reading, self.life
        if reading.ended or life.lost:
            return False
        size = len(self.buffer)
        reading.resume(Hold.PENDING_FULL)  # the reader decides how much is enough
        while len(self.buffer) == size:
            if reading.ended or life.lost:
                return False
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return True

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def arm_timer(self, seconds: float, refused: Refused | None = None) -> None:
        """A deadline for what the client must send next (a head, a hello): past it, `refused`
        is answered (or, None, the connection is closed as timed out)."""
        self.cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._timed_out, refused)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, refused: Refused | None) -> None:
        self._timer = None
        if self.life.phase not in SETTING_UP:
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()
        refused = refused or too_slow("request head")
        self.refuse(refused, None, None, stage=Stage.ACCEPT)

    # -- answers and ends ----------------------------------------------------------------------

    def refuse(
        self,
        refused: Refused,
        host: str | None,
        port: int | None,
        *,
        stage: Stage | None = None,
        record: bool = True,
        details: Details = NO_DETAILS,
    ) -> None:
        """A connection refused before any tunnel: its decision line at `stage` (unless the
        vetting wrote it already: `record` False, and no stage), its answer in the client's
        protocol (unless one went out), its close."""
        if host is not None:
            self.host = host
        if port is not None:
            self.port = port
        if record:
            assert stage is not None, "a refusal's line names its stage"
            self.door.vetter.refusal(
                refused, self.peer, host, port, self.protocol, stage=stage, details=details
            )
        life = self.life
        if life.phase is Phase.CLOSED:
            return  # the client went first: its close line is written, its reason with it
        life.to(Phase.REFUSED)
        if not life.answered and not life.lost:
            life.mark(Mark.ANSWERED)
            self.answer_refusal(refused, host, port)
        self.reason = refused.reason
        self.close()

    def answer_refusal(self, refused: Refused, host: str | None, port: int | None) -> None:
        """The refusal in this listener's protocol: HTTP's 403 (or 4xx/5xx) by default."""
        self.transport.write(refusal_response(refused, host or "proxy", port))

    def refuse_stream(
        self, refused: Refused, kind: str, *, record: bool = True, vetted: Vetted | None = None
    ) -> None:
        """A connection refused once its first bytes said what it is (`kind`, a FirstFlight),
        after any answer of the listener's own protocol: its decision line (unless written),
        then the refusal in the stream's protocol: SSH gets our identification string and a
        disconnect naming the reason and remedy, TLS what the listener sends for it
        (`answer_tls_refusal`), anything else a reset, so nothing is left hanging."""
        host, port = self.host, self.port
        if record:
            self.door.vetter.refusal(
                refused, self.peer, host, port, self.protocol, stage=Stage.STREAM,
                vetted=vetted, details=self.attribution_details(),
            )  # fmt: skip
        self.reason = refused.reason
        self.cancel_timer()
        life = self.life
        if life.phase is Phase.CLOSED:
            return
        life.to(Phase.REFUSED)
        if life.lost:
            return
        if kind == "ssh":
            self.transport.write(refusal_ssh(refused, host, port))
        elif kind == "tls":
            self.answer_tls_refusal(refused)
        else:
            self.transport.abort()
            return
        self.transport.close()

    def answer_tls_refusal(self, refused: Refused) -> None:
        """What a refused TLS client reads after its ClientHello: nothing by default (a tunnel
        whose 200 or SOCKS5 reply went out is closed)."""

    def attribution_details(self, details: Details = NO_DETAILS) -> Details:
        """`details` with how the host was known, for a decision line (made anew only when
        they do not say so already)."""
        how, names = self.attribution, self.attributed
        if how is None or (details.attribution == how and details.attributed == names):
            return details
        return replace(details, attribution=how, attributed=names)

    def close(self) -> None:
        """Closes the client (what is buffered for it is written first); the close line follows
        from connection_lost, or from the owner that has the transport by then."""
        self.cancel_timer()
        life = self.life
        if life.phase in SETTING_UP:
            life.to(Phase.CLOSING)
        if not life.lost:
            self.transport.close()

    def failed(self, exc: BaseException) -> None:
        """Fail closed: whatever went wrong, the connection is denied here."""
        if isinstance(exc, OSError):
            logger.debug("egress: client connection ended: %s", exc)
            self.reason = Reason.RESET
            self.close()
            return
        logger.error("egress: the front door failed on a connection", exc_info=exc)
        refused = Refused(403, Reason.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        try:
            if self.life.phase in NOTHING_TO_END:
                vetter = self.door.vetter
                vetter.refusal(refused, self.peer, None, None, self.protocol, stage=Stage.ENGINE)
                return
            self.refuse(refused, None, None, stage=Stage.ENGINE)
        except Exception:
            # Even the refusal failed: the connection goes, unanswered.
            logger.exception("egress: refusing a failed connection failed too")
            if not self.life.lost:
                self.transport.abort()

    def count_open(self) -> None:
        """The connection in the metrics, under the protocol it turned out to speak: a tunnel
        counts when it starts, anything else when it closes (a connection handed to the engine
        is the engine's to count)."""
        if not self.life.has(Mark.COUNTED) and self.door.metrics is not None:
            self.life.mark(Mark.COUNTED)
            self.door.metrics.connection_opened(Plane.L4, self.protocol)

    def still_allowed(self) -> bool:
        """After a reload: whether what this connection was decided for is still allowed
        (nothing decided yet: it will be decided on the new policy)."""
        if self.target is None:
            return True
        return self.door.vetter.still_allowed(self.target, self.pinned, False)

    def quiesce(self) -> None:
        """The drain began: a plain-HTTP connection takes no further request (an idle one
        closes now). Anything else is left to finish within the drain's time."""
        if self.http is not None:
            self.http.quiesce()

    def end(self, reason: str) -> None:
        """Ends the connection from outside (a reload, the drain), whatever stage it is at."""
        self.reason = reason
        if self.relay is not None:
            self.relay.close(reason)
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.cancel_timer()
        if not self.life.lost:
            self.transport.abort()

    def finish(self, reason: str) -> None:
        """The close line (and the metrics of the close), once per connection, with what is
        known of its destination by then."""
        if self.life.phase is Phase.CLOSED:
            return
        self.life.to(Phase.CLOSED)
        door = self.door
        door.forget(self)
        self.count_open()
        counter = self.counter
        event = CloseEvent(
            host=self.host, port=self.port, plane=Plane.L4, protocol=self.protocol,
            client=self.peer.client, connection=self.peer.connection, sni=self.sni,
            ech=self.ech, upstream=self.upstream, bytes_up=counter.up, bytes_down=counter.down,
            duration=time.monotonic() - self.opened, reason=reason, pinned=self.pinned or None,
            attribution=self.attribution, attributed=self.attributed,
        )  # fmt: skip
        close_line(door.metrics, door.audit, event)

    # -- the socket itself ------------------------------------------------------------------------

    def raw_socket(self) -> Any:
        """The transport's socket, for socket options (SO_ORIGINAL_DST)."""
        return self.transport.get_extra_info("socket")

    def detach_socket(self) -> socket.socket:
        """The client's socket, duplicated and blocking-free, its transport dropped: for the
        engine, which serves it on a transport of its own. Whatever was read stays in
        `buffer`."""
        self.reading.pause(Hold.HANDOFF)
        fd = os.dup(self.raw_socket().fileno())
        self.life.to(Phase.HANDED)
        self.transport.abort()
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        return sock


class Door:
    """The state the front door's connections share."""

    def __init__(
        self,
        vetter: Vetter,
        config: Config,
        metrics: MetricsSink | None,
        audit: AuditSink | None,
        engine: Callable[[], Awaitable[Interceptor]],
        attribution: Attribution | None = None,
    ) -> None:
        self.vetter = vetter
        # The session DNS responder's answers, for connections that carry no name.
        self.attribution = attribution
        self.config = config
        self.metrics = metrics
        self.audit = audit
        self.engine = engine
        self.connections: set[Connection] = set()
        self.handoffs: set[asyncio.Task[None]] = set()
        self._pool: Pool | None = None

    def http_pool(self) -> Pool:
        """The idle upstream connections of plain HTTP (made with the first one)."""
        if self._pool is None:
            self._pool = Pool(asyncio.get_running_loop())
        return self._pool

    def close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()

    @property
    def live(self) -> int:
        """Connections accepted and not yet closed (those handed to the engine included)."""
        return len(self.connections) + len(self.handoffs)

    def admit(self, connection: Connection) -> bool:
        """Counts a new connection in, or refuses it (503) when `limits.max_connections` are
        live already: only the connections over the limit are refused, and those do not count."""
        if self.live >= self.config.limits.max_connections:
            refused = Refused(503, Reason.OVERLOAD, "too many connections", error=True)
            connection.refuse(refused, None, None, stage=Stage.ACCEPT)
            return False
        self.connections.add(connection)
        return True

    def forget(self, connection: Connection) -> None:
        self.connections.discard(connection)

    def is_own(self, address: str, port: int) -> bool:
        """Whether address:port reaches one of our listeners (the vetter's loop guard)."""
        return self.vetter.own.is_own(address, port)

    async def intercept(self, connection: Connection) -> None:
        """Gives a TLS connection to the interception engine (loaded now if it is not yet): its
        destination decided and vetted (`connection.host`, `port`, `target`, `pinned`), its
        ClientHello through the SNI gate (`connection.sni`; the hello itself in `buffer`), any
        answer of its own protocol already sent (a CONNECT's 200, a SOCKS5 reply). The engine
        serves it on the same socket and writes its close line; until then it counts as live
        (limits.max_connections, the drain)."""
        assert connection.host is not None and connection.port is not None
        assert connection.sni is not None and connection.target is not None
        try:
            engine = await self.engine()
        except ProxyError as exc:
            # The engine could not be loaded (its CA, say): nothing can serve this connection.
            refused = Refused(403, exc.reason, exc.message)
            connection.refuse(refused, connection.host, connection.port, stage=Stage.ENGINE)
            return
        destination = Destination(
            host=connection.host,
            port=connection.port,
            sni=connection.sni,
            target=connection.target,
            pinned=connection.pinned,
            peer=connection.peer,
            protocol=connection.protocol,
            ech=connection.ech,
        )
        connection.cancel_timer()
        hello = bytes(connection.buffer)
        connection.buffer.clear()
        sock = connection.detach_socket()
        self.connections.discard(connection)
        task = asyncio.current_task()
        assert task is not None
        self.handoffs.add(task)
        try:
            await engine.intercept(sock, hello, destination)
        finally:
            self.handoffs.discard(task)
