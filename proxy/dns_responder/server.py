"""The DNS responder's server (`egress-proxy run --dns-listen HOST:PORT`): UDP and TCP on one port
per listener, on asyncio transports and protocols (any event loop), messages read and written
with dnspython (proxy/dns_responder/wire.py), every query decided by DnsResponder
(proxy/dns_responder/responder.py).

    server = DnsServer(responder, ServerLimits(header_timeout=10, idle_timeout=600))
    bound = await server.start([Listener("dns", "127.0.0.1", 0)])   # all or none
    server.configure(Update(policy=policy, resolver=resolver))     # a reload
    await server.stop()

Bounds, each a refusal with an audit line when reached (reason, and how it shows):
- `max_in_flight` queries being decided at once over all listeners (each is one task, started
  eagerly: an answer that needs no lookup is sent before the datagram callback returns). A UDP
  query beyond it is dropped (`overload`); a TCP connection stops being read until one ends.
- `max_tcp_clients` TCP connections at once. At the cap a new connection first takes the place
  of the one idle the longest (then of the one stuck the longest in a message), so idle clients
  cannot starve the others; when every connection has a query in flight it is refused
  (`overload`).
- TCP (proxy/dns_responder/tcp_listener.py): up to `max_pipelined` queries in flight per connection,
  answered as each is decided (their ids tell them apart); a message must arrive whole within
  `header_timeout` of its first byte (`header_timeout`); a connection with nothing in flight is
  closed after `idle_timeout`; a length prefix over MAX_QUERY, a message shorter than a header, or a
  response closes it.
- UDP: nothing is kept per client, so a client that reuses its socket is always answered. A
  datagram from one of this server's own addresses (every address of a wildcard bind) is never
  answered (`proxy_loop`): an answer sent there would be a message to ourselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import dns.message

from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener, OwnListeners
from proxy.decide.vetting import Peer, next_connection_id
from proxy.dns_responder.responder import FORMERR, DnsQuery, DnsResponder
from proxy.dns_responder.tcp_listener import TcpConnection
from proxy.dns_responder.wire import Unanswerable, read_query, render, udp_limit

if TYPE_CHECKING:
    from proxy.decide.planes import Update

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 1024
MAX_TCP_CLIENTS = 512
MAX_PIPELINED = 32
_BACKLOG = 128
# With port 0 a free UDP port is taken first and TCP asked for the same one, which another
# process may hold: a few tries before giving up.
_BIND_TRIES = 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    header_timeout: float
    idle_timeout: float
    max_in_flight: int = MAX_IN_FLIGHT
    max_tcp_clients: int = MAX_TCP_CLIENTS
    max_pipelined: int = MAX_PIPELINED


class DnsServer:
    """See the module docstring."""

    def __init__(self, responder: DnsResponder, limits: ServerLimits) -> None:
        self.responder = responder
        self.limits = limits
        self.listeners: tuple[Listener, ...] = ()
        self.own = OwnListeners()  # its own listeners: a message from one is never answered
        self._udp: list[asyncio.DatagramTransport] = []
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self.tcp: dict[TcpConnection, None] = {}  # insertion-ordered: oldest first
        self._waiting: dict[TcpConnection, None] = {}
        self._wake_scheduled = False
        self._stopping = False

    # -- life cycle --------------------------------------------------------------------------

    async def start(self, listeners: Sequence[Listener]) -> tuple[Listener, ...]:
        """Bind UDP and TCP of every listener (all or none) and serve; returns them as bound.
        Raises ProxyError('listen_failed') naming the listener."""
        loop = asyncio.get_running_loop()
        pairs: list[tuple[socket.socket, socket.socket]] = []
        unowned: list[socket.socket] = []  # bound, not yet handed to a transport
        try:
            for listener in listeners:
                try:
                    pair = _bind_pair(listener)
                except OSError as exc:
                    raise ProxyError(
                        "listen_failed", f"cannot listen on {listener}: {exc.strerror or exc}"
                    ) from None
                pairs.append(pair)
                unowned += pair
            self.listeners = tuple(
                Listener("dns", listener.host, udp.getsockname()[1])
                for listener, (udp, _) in zip(listeners, pairs, strict=True)
            )
            self.own = OwnListeners(self.listeners)
            for udp, tcp in pairs:
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self), sock=udp
                )
                unowned.remove(udp)
                self._udp.append(transport)
                server = await loop.create_server(
                    lambda: TcpConnection(self), sock=tcp, backlog=_BACKLOG
                )
                unowned.remove(tcp)
                self._servers.append(server)
        except BaseException:
            for sock in unowned:
                sock.close()
            await self.stop()
            raise
        return self.listeners

    async def stop(self) -> None:
        """Stop listening, close every TCP connection, cancel the queries in flight."""
        self._stopping = True
        for transport in self._udp:
            transport.close()
        for server in self._servers:
            server.close()
        for connection in list(self.tcp):
            connection.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)
        self._udp.clear()
        self._servers.clear()

    def configure(self, update: Update) -> list[str]:
        """A reload, as every plane takes it (proxy/decide/planes.py): later queries are decided
        with what changed. A DNS answer is over once sent: nothing live to close."""
        self.responder.vetter.configure(update)
        return []

    # -- queries -----------------------------------------------------------------------------

    def read(self, data: bytes, peer: Peer) -> tuple[dns.message.Message, DnsQuery] | bytes | None:
        """A message as the transports see it: the query to decide, or (after its audit line)
        the bytes to answer at once (FORMERR), or None: send nothing."""
        try:
            return read_query(data)
        except Unanswerable as refused:
            rcode = FORMERR if refused.reply is not None else None
            self.responder.refuse_message(peer, refused.reason, refused.message, rcode=rcode)
            return refused.reply

    def admit(self) -> bool:
        """Whether one more query may be decided now (the caller then `spawn`s it)."""
        if self._stopping or self._in_flight >= self.limits.max_in_flight:
            return False
        self._in_flight += 1
        return True

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run an admitted query: one task, started at once. Returns it while it runs, None
        when it ended right here (an answer that needed no lookup)."""
        task = asyncio.Task(_guarded(work), loop=asyncio.get_running_loop(), eager_start=True)
        if task.done():
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def release(self) -> None:
        """An admitted query has ended: connections that waited for room are read again."""
        self._in_flight -= 1
        if self._waiting and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake)

    def wait_for_room(self, connection: TcpConnection) -> None:
        self._waiting[connection] = None

    def _wake(self) -> None:
        self._wake_scheduled = False
        while self._waiting and self._in_flight < self.limits.max_in_flight:
            connection = next(iter(self._waiting))
            del self._waiting[connection]
            connection.resume()

    async def answer(
        self, message: dns.message.Message, query: DnsQuery, peer: Peer, limit: int
    ) -> bytes:
        """The response to an admitted query, `limit` bytes at most."""
        answer = await self.responder.answer(query, peer)
        return render(message, answer, limit)

    # -- TCP connections ---------------------------------------------------------------------

    def tcp_opened(self, connection: TcpConnection) -> bool:
        """Whether `connection` may stay: at the cap, the longest idle (or stuck) connection
        makes room for it; with none to close, it is refused (its audit line written)."""
        if len(self.tcp) >= self.limits.max_tcp_clients:
            victim = _evictable(self.tcp)
            if victim is None:
                self.responder.refuse_message(
                    connection.peer, Reason.OVERLOAD, "too many DNS connections at once", rcode=None
                )
                return False
            victim.close_for_room()
        self.tcp[connection] = None
        return True

    def tcp_closed(self, connection: TcpConnection) -> None:
        self.tcp.pop(connection, None)
        self._waiting.pop(connection, None)

    def is_own(self, address: str, port: int) -> bool:
        return self.own.is_own(address, port)


async def _guarded(work: Coroutine[Any, Any, None]) -> None:
    # The work sends its own answer; an exception here is a bug, logged, never a crash of the
    # server (and never an answer: the client asks again).
    try:
        await work
    except Exception:
        logger.exception("egress: answering a DNS query failed")


def _evictable(connections: dict[TcpConnection, None]) -> TcpConnection | None:
    """The idle connection quiet the longest, else the one stuck the longest in a message;
    never one with a query in flight."""
    idle = [c for c in connections if c.idle_since is not None]
    if idle:
        return min(idle, key=lambda c: c.idle_since or 0.0)
    partial = [c for c in connections if c.message_since is not None and not c.in_flight]
    if partial:
        return min(partial, key=lambda c: c.message_since or 0.0)
    return None


class _UdpProtocol(asyncio.DatagramProtocol):
    """One UDP listener: each datagram is a query of its own, nothing is kept per client."""

    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio's classes: no isinstance check.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._received(data, addr)
        except Exception:
            logger.exception("egress: a DNS datagram could not be handled")

    def _received(self, data: bytes, addr: Any) -> None:
        """`addr` as the socket gave it (an IPv6 one with its flow and scope), for the answer."""
        server, responder = self.server, self.server.responder
        client = (str(addr[0]), int(addr[1]))
        peer = Peer(client, next_connection_id())
        if server.is_own(*client):
            message = "a DNS message from this server's own address: never answered"
            responder.refuse_message(peer, Reason.PROXY_LOOP, message, rcode=None)
            return
        read = server.read(data, peer)
        if read is None or isinstance(read, bytes):
            if read is not None:
                self._send(read, addr)
            return
        if not server.admit():
            message = "too many DNS queries in flight: dropped"
            responder.refuse_message(peer, Reason.OVERLOAD, message, rcode=None)
            return
        server.spawn(self._answer(*read, peer, addr))

    async def _answer(
        self, message: dns.message.Message, query: DnsQuery, peer: Peer, addr: Any
    ) -> None:
        try:
            self._send(await self.server.answer(message, query, peer, udp_limit(message)), addr)
        finally:
            self.server.release()

    def _send(self, wire: bytes, addr: Any) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.sendto(wire, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error about a client that went away: nothing to do


def _bind_pair(listener: Listener) -> tuple[socket.socket, socket.socket]:
    """UDP and TCP sockets bound to one port of `listener`'s address (for port 0, a free port
    both have); IPv6 sockets take IPv6 only, so `[::]` and `0.0.0.0` can be listeners side by
    side."""
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    for attempt in range(_BIND_TRIES if listener.port == 0 else 1):
        udp = _socket(family, socket.SOCK_DGRAM)
        try:
            udp.bind((listener.host, listener.port))
            port = udp.getsockname()[1]
            tcp = _socket(family, socket.SOCK_STREAM)
        except BaseException:
            udp.close()
            raise
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((listener.host, port))
            tcp.listen(_BACKLOG)
            return udp, tcp
        except OSError as exc:
            udp.close()
            tcp.close()
            if listener.port != 0 or exc.errno != errno.EADDRINUSE or attempt == _BIND_TRIES - 1:
                raise
        except BaseException:
            udp.close()
            tcp.close()
            raise
    raise AssertionError("unreachable")


def _socket(family: socket.AddressFamily, kind: socket.SocketKind) -> socket.socket:
    sock = socket.socket(family, kind)
    try:
        sock.setblocking(False)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    except BaseException:
        sock.close()
        raise
    return sock
