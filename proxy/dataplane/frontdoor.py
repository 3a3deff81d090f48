"""The front door of `egress-proxy run`: our own asyncio listener, and the L4 fast path.

    door = FrontDoor(vetter, config, metrics, audit, engine=lazy_engine)
    bound = await door.start([Listener("http", "127.0.0.1", 3128)])
    door.set_policy(policy)       # reload: live tunnels the new policy denies are closed
    await door.drain(5.0)

Every connection is accepted here. A CONNECT whose host needs no inspection stays here (the
fast path, DESIGN 1): the head is read with `limits.header_timeout` and a size limit and parsed
by h11; then the name stage, DNS once and the address stage (proxy/vetting.py, the engine's
code too); an eager dial of the checked addresses (proxy/dialing.py), so a failure is a 502 or
504 with its reason rather than a silent close; `200`; the ClientHello, bounded and timed, through
the SNI gate (proxy/sni_gate.py); then the bytes are relayed by proxy/relay.py (`os.splice`,
driven by the event loop) with the idle timeout, and counted for the close line.

Everything else (plain HTTP, a CONNECT that needs inspection, SOCKS5 listeners) is handed to the
L7 engine on the same socket, with the bytes read so far, so the client cannot tell: same
address, same policy, same audit lines and metrics. The engine (and so mitmproxy) is loaded
only when the first such connection arrives, unless the runtime loaded it at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import h11

from policy import PolicyError
from policy.urls import split_authority
from proxy.decide.clienthello import ClientHelloError, parse_client_hello, starts_like_tls
from proxy.decide.events import CloseEvent
from proxy.decide.sni_gate import GateOutcome, check_hello
from proxy.decide.vetting import Peer, Vetter, canonical_host
from proxy.errors import ProxyError
from proxy.net.dialing import UpstreamError, connect_socket, dial_checked
from proxy.net.relay import Counter, relay
from proxy.netaddr import Listener
from proxy.reasons import (
    HEADER_TIMEOUT,
    INSPECTION_UNSUPPORTED,
    INTERNAL_ERROR,
    INVALID_CLIENT_HELLO,
    INVALID_REQUEST,
    NO_ORIGINAL_DESTINATION,
    OVERLOAD,
    POLICY_RELOAD,
    PROXY_LOOP,
    SNI_MISMATCH,
    SNI_MISSING,
    UPSTREAM_TIMEOUT,
    Refused,
    authority,
    refusal_response,
    shown,
)

if TYPE_CHECKING:
    from policy import Policy
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.settings import Config

logger = logging.getLogger(__name__)

# A CONNECT head is a line and a few headers; anything near this is not a CONNECT we want.
MAX_CONNECT_HEAD = 16 * 1024
_CONNECT = b"CONNECT "
_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
_READ = 65536
_BACKLOG = 1024


class Handoff(Protocol):
    """What the front door needs of the engine: serve one accepted connection as if mitmproxy
    had accepted it, starting with the bytes already read from it."""

    async def handoff(self, sock: socket.socket, prefix: bytes, scheme: str) -> None: ...


@dataclass(slots=True)
class _Tunnel:
    """A live fast-path tunnel, for reloads and the drain."""

    task: asyncio.Task[Any]
    target: str
    pinned: tuple[str, ...]
    close_reason: str | None = None


@dataclass(slots=True)
class _Accepted:
    peer: Peer
    opened: float = field(default_factory=time.monotonic)
    answered: bool = False  # a status line went out: nothing more may be answered
    closed: bool = False  # its close line is written
    handed: bool = False  # the engine's now, close line and all
    reason: str = "client_closed"  # for a close line nobody else wrote
    protocol: str = "http"


class FrontDoor:
    """Our listener(s): the fast path for passthrough CONNECT, hand-off for the rest."""

    def __init__(
        self,
        vetter: Vetter,
        config: Config,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
        *,
        engine: Callable[[], Awaitable[Handoff]],
    ) -> None:
        self.vetter = vetter
        self.config = config
        self.metrics = metrics
        self.audit = audit
        self._engine = engine
        self._servers: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()  # one per accepted connection
        self._tunnels: dict[str, _Tunnel] = {}
        self.listeners: tuple[Listener, ...] = ()

    # -- life cycle --------------------------------------------------------------------------

    async def start(self, listeners: Sequence[Listener]) -> tuple[Listener, ...]:
        """Bind every listener (all or none) and start accepting; returns them as bound."""
        bound: list[Listener] = []
        try:
            for listener in listeners:
                sock = _listening_socket(listener)
                self._servers.append(sock)
                host, port = sock.getsockname()[:2]
                bound.append(Listener(listener.scheme, host, port))
        except OSError as exc:
            self._close_servers()
            raise ProxyError(
                "listen_failed",
                f"cannot listen on {listener}: {exc.strerror or exc}",
            ) from None
        loop = asyncio.get_running_loop()
        for sock, listener in zip(self._servers, bound, strict=True):
            self._accepting.append(loop.create_task(self._accept(sock, listener)))
        self.listeners = tuple(bound)
        return self.listeners

    def stop_accepting(self) -> None:
        for task in self._accepting:
            task.cancel()
        self._accepting.clear()
        self._close_servers()

    @property
    def live(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float) -> None:
        """Stop accepting; give live connections up to `timeout` to end, then close them."""
        self.stop_accepting()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)

    def set_policy(self, policy: Policy) -> list[str]:
        """Every later decision uses `policy`; live tunnels it denies are closed. Returns the
        connection ids closed. (The engine's connections are the engine's to re-decide.)"""
        self.vetter.policy = policy
        closed: list[str] = []
        for connection, tunnel in list(self._tunnels.items()):
            try:
                allowed = self.vetter.still_allowed(tunnel.target, tunnel.pinned, False)
            except Exception:
                logger.exception("egress: re-deciding a live tunnel failed")
                allowed = False  # fail closed
            if not allowed:
                tunnel.close_reason = POLICY_RELOAD
                tunnel.task.cancel()
                closed.append(connection)
        return closed

    def _is_own(self, address: str, port: int) -> bool:
        """Whether address:port is one of our listeners (a wildcard one on any address)."""
        return any(
            listener.port == port and listener.host in (address, "0.0.0.0", "::")
            for listener in self.listeners
        )

    def _close_servers(self) -> None:
        loop = None
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
        for sock in self._servers:
            with contextlib.suppress(OSError, ValueError):
                # A pending sock_accept watches this fd: unwatch it before the number is freed
                # (and perhaps reused by the next socket opened).
                if loop is not None:
                    loop.remove_reader(sock.fileno())
                sock.close()
        self._servers.clear()

    # -- accepting ---------------------------------------------------------------------------

    async def _accept(self, server: socket.socket, listener: Listener) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(server)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                # EMFILE and friends: back off instead of spinning; the listener stays.
                logger.warning("egress: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(sock, address, listener))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket, address: Any, listener: Listener) -> None:
        accepted = _Accepted(Peer(_peername(address), uuid.uuid4().hex))
        try:
            if sock.gettimeout() != 0.0:  # loop.sock_accept made it so already
                sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.live > self.config.limits.max_connections:
                await self._refuse(
                    sock,
                    accepted,
                    Refused(503, OVERLOAD, "too many connections", error=True),
                    None,
                    None,
                    stage="accept",
                )
                return
            if listener.scheme == "socks5":
                await self._hand_off(sock, accepted, b"", "socks5")
                return
            if listener.scheme == "transparent":
                await self._serve_transparent(sock, accepted)
                return
            await self._serve_http(sock, accepted)
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            # The client reset or vanished: ordinary, not a failure of ours.
            logger.debug("egress: client connection ended: %s", exc)
        except Exception as exc:
            # Fail closed (DESIGN 3.7): whatever went wrong, the connection is denied here.
            logger.exception("egress: the front door failed on a connection")
            refused = Refused(403, INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            with contextlib.suppress(Exception):
                if accepted.closed or accepted.handed:  # answered or the engine's: say only
                    self.vetter.refusal(refused, accepted.peer, None, None, "http", stage="engine")
                else:
                    await self._refuse(sock, accepted, refused, None, None, stage="engine")
        finally:
            if not accepted.closed and not accepted.handed:
                # Ended before any tunnel or answer (gone, or refused unanswered): still one
                # close line per connection.
                if self.metrics is not None:
                    self.metrics.connection_opened("l4", accepted.protocol)
                self._closed(
                    accepted, None, None, None, None, Counter(), accepted.reason, (),
                    accepted.protocol,
                )  # fmt: skip
            with contextlib.suppress(OSError):
                sock.close()

    async def _hand_off(
        self, sock: socket.socket, accepted: _Accepted, prefix: bytes, scheme: str
    ) -> None:
        engine = await self._engine()
        accepted.handed = True
        # The engine owns the socket from here (a duplicate: ours is closed when we return).
        await engine.handoff(sock.dup(), prefix, scheme)

    # -- the fast path -----------------------------------------------------------------------

    async def _serve_http(self, sock: socket.socket, accepted: _Accepted) -> None:
        loop = asyncio.get_running_loop()
        # Most clients send the head with the connection: when it is all there already, no
        # timer is armed for it.
        try:
            data = sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            data = None
        if data == b"":
            return  # gone before asking anything
        if data is None or not _head_read(data):
            data = data or b""
            try:
                async with asyncio.timeout(self.config.limits.header_timeout):
                    while True:
                        chunk = await loop.sock_recv(sock, _READ)
                        if not chunk:
                            return  # gone before asking anything
                        data += chunk
                        if _head_read(data):
                            break
            except TimeoutError:
                # Nothing, or a CONNECT head that never ended (any other request was handed
                # on).
                refused = Refused(408, HEADER_TIMEOUT, "no request head within the time limit")
                await self._refuse(sock, accepted, refused, None, None, stage="accept")
                return
        if not data.startswith(_CONNECT):
            await self._hand_off(sock, accepted, data, "http")
            return
        request = _parse_connect(data)
        if isinstance(request, Refused):
            await self._refuse(sock, accepted, request, None, None, stage="request")
            return
        host, port, rest = request
        target = authority(host, port)
        decision = self.vetter.decide(target)
        if decision.allowed and decision.needs_inspection:
            await self._hand_off(sock, accepted, data, "http")  # interception is the engine's
            return
        await self._tunnel(sock, accepted, target, host, port, rest, decision)

    def _refused_quietly(
        self,
        accepted: _Accepted,
        refused: Refused,
        host: str | None,
        port: int | None,
        *,
        stage: str,
        sni: str | None = None,
    ) -> None:
        """A redirected connection refused before any tunnel: nothing can be answered (the
        client asked nothing of a proxy); the decision line now, the close line when it ends."""
        extra = {"sni": sni} if sni is not None else {}
        self.vetter.refusal(refused, accepted.peer, host, port, "tls", stage=stage, **extra)
        accepted.reason = refused.reason

    async def _serve_transparent(self, sock: socket.socket, accepted: _Accepted) -> None:
        """A connection redirected to us (netfilter REDIRECT/DNAT; `--mode transparent`): TLS is
        decided on its SNI and relayed to a checked address of that name, never to the original
        destination, which is read only for its port; anything else goes to the engine, which
        decides plain HTTP on its Host header. No SNI and no Host: refused."""
        accepted.protocol = "tls"
        try:
            original = original_destination(sock)
            if original == sock.getsockname()[:2]:
                # conntrack knows every connection, redirected or not: one that reached our
                # port directly names the port itself, and dialling that would loop.
                raise OSError("the connection was not redirected")
            _, port = original
        except OSError as exc:
            refused = Refused(
                403,
                NO_ORIGINAL_DESTINATION,
                f"no original destination (not a redirected connection?): {exc.strerror or exc}",
            )
            self._refused_quietly(accepted, refused, None, None, stage="accept")
            return
        loop = asyncio.get_running_loop()
        data = b""
        hello = None
        refused = None
        try:
            async with asyncio.timeout(self.config.limits.header_timeout):
                while hello is None:
                    chunk = await loop.sock_recv(sock, _READ)
                    if not chunk:
                        return
                    data += chunk
                    if not starts_like_tls(data[:3]):
                        break
                    try:
                        hello = parse_client_hello(data)
                    except ClientHelloError as exc:
                        refused = Refused(
                            403, INVALID_CLIENT_HELLO, f"invalid TLS ClientHello: {exc.message}"
                        )
                        break
        except TimeoutError:
            refused = Refused(408, HEADER_TIMEOUT, "no request head within the time limit")
        if refused is None and hello is None:
            await self._hand_off(sock, accepted, data, "transparent")  # plain HTTP: the engine's
            return
        if refused is None and hello is not None and not hello.sni:
            refused = Refused(403, SNI_MISSING, "the ClientHello has no SNI")
        if refused is not None or hello is None or not hello.sni:
            assert refused is not None
            self._refused_quietly(accepted, refused, None, port, stage="sni")
            return
        host = canonical_host(hello.sni)
        if host.startswith("\0"):
            refused = Refused(403, SNI_MISMATCH, f"SNI {shown(hello.sni)!r} is not a host name")
            self._refused_quietly(accepted, refused, None, port, stage="sni", sni=hello.sni)
            return
        target = authority(host, port)
        decision = self.vetter.decide(target)
        if decision.allowed and decision.needs_inspection:
            refused = Refused(
                403,
                INSPECTION_UNSUPPORTED,
                "this host's rules need TLS inspection, which transparent mode does not do; "
                "use the explicit proxy",
            )
            self._refused_quietly(accepted, refused, host, port, stage="name", sni=hello.sni)
            return
        await self._tunnel(
            sock, accepted, target, host, port, b"", decision, hello=data, sni=hello.sni
        )

    async def _tunnel(
        self,
        sock: socket.socket,
        accepted: _Accepted,
        target: str,
        host: str,
        port: int,
        rest: bytes,
        decision: Any,
        *,
        hello: bytes | None = None,
        sni: str | None = None,
    ) -> None:
        """The fast path for one tunnel. Explicit (`hello` None): answer the CONNECT, then the
        SNI gate on the ClientHello read after the 200. Transparent: `hello` was already read
        and decided on, and nothing is answered."""
        peer = accepted.peer
        protocol = "connect" if hello is None else "tls"
        if self.metrics is not None:
            self.metrics.connection_opened("l4", protocol)
        upstream: socket.socket | None = None
        counter = Counter()
        reason = "closed"
        pinned: tuple[str, ...] = ()
        name = decision.host or host
        upstream_address: str | None = None
        tunnel: _Tunnel | None = None
        try:
            try:
                context: dict[str, Any] = {"method": "CONNECT"} if hello is None else {"sni": sni}
                vetted = await self.vetter.vet(
                    target, port, peer, protocol, inspecting=False, decision=decision, **context
                )
                pinned = vetted.pinned
                name = vetted.decision.host
                if any(self._is_own(address, port) for address in pinned):
                    refused = Refused(
                        403, PROXY_LOOP, f"{authority(name, port)} is this proxy's own listener"
                    )
                    self.vetter.refusal(refused, peer, name, port, protocol, stage="address")
                    raise refused
                try:
                    upstream = await dial_checked(
                        name,
                        pinned,
                        port,
                        connect_socket,
                        timeout=self.config.limits.connect_timeout,
                        metrics=self.metrics,
                    )
                    address = upstream.getpeername()
                    upstream_address = authority(address[0], address[1])
                except UpstreamError as exc:
                    status = 504 if exc.reason == UPSTREAM_TIMEOUT else 502
                    refused = Refused(status, exc.reason, exc.message, error=True)
                    self.vetter.refusal(refused, peer, name, port, protocol, stage="upstream")
                    raise refused from None
            except Refused as refused:
                reason = refused.reason
                if hello is None:  # a transparent client asked nothing it could be answered
                    accepted.answered = True
                    with contextlib.suppress(OSError, TimeoutError):
                        await _send(sock, refusal_response(refused, host, port))
                return
            # Live from here: a reload re-decides it, also while it waits for its ClientHello.
            task = asyncio.current_task()
            assert task is not None
            tunnel = _Tunnel(task, target, pinned)
            self._tunnels[peer.connection] = tunnel
            if hello is None:
                accepted.answered = True
                await _send(sock, _ESTABLISHED)
                hello, gate = await self._client_hello(sock, name, rest)
                sni = gate.sni
                if gate.refused is not None:
                    reason = gate.refused.reason
                    self.vetter.refusal(
                        gate.refused, peer, name, port, protocol, stage="sni", sni=sni
                    )
                    return
                if isinstance(gate, _Gone):
                    reason = gate.reason
                    return
            self.vetter.allowed(peer, protocol, stage="sni", host=name, port=port, sni=sni)
            result = await relay(
                sock,
                upstream,
                idle_timeout=self.config.limits.idle_timeout,
                counter=counter,
                initial_up=hello,
            )
            reason = result.reason
        except asyncio.CancelledError:
            reason = (tunnel.close_reason if tunnel is not None else None) or "cancelled"
            if tunnel is None or tunnel.close_reason is None:
                raise
        except OSError:
            reason = "reset"  # the client went away mid-way: ordinary, and no answer is owed
        finally:
            self._tunnels.pop(peer.connection, None)
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()
            self._closed(
                accepted, name, port, sni, upstream_address, counter, reason, pinned, protocol
            )

    async def _client_hello(
        self, sock: socket.socket, host: str, data: bytes
    ) -> tuple[bytes, GateOutcome | _Gone]:
        """The ClientHello (bounded by the parser, timed by the header timeout) and the gate's
        outcome on it; _Gone when the client ended or timed out first."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.limits.header_timeout):
                while True:
                    if data:
                        outcome = check_hello(data, host)
                        if outcome is not None:
                            return data, outcome
                    try:
                        chunk = await loop.sock_recv(sock, _READ)
                    except OSError:
                        return data, _Gone(reason="reset")
                    if not chunk:
                        return data, _Gone()
                    data += chunk
        except TimeoutError:
            refused = Refused(408, HEADER_TIMEOUT, "no ClientHello within the time limit")
            return data, _Gone(refused, reason=HEADER_TIMEOUT)

    # -- answers -----------------------------------------------------------------------------

    async def _refuse(
        self,
        sock: socket.socket,
        accepted: _Accepted,
        refused: Refused,
        host: str | None,
        port: int | None,
        *,
        stage: str,
    ) -> None:
        """A connection refused before any tunnel: its decision line, its answer (unless one
        went out already), and its close line, so every connection has one."""
        self.vetter.refusal(refused, accepted.peer, host, port, "http", stage=stage)
        if not accepted.answered:
            accepted.answered = True
            with contextlib.suppress(OSError, TimeoutError):
                await _send(sock, refusal_response(refused, host or "proxy", port))
        if self.metrics is not None:
            self.metrics.connection_opened("l4", "http")
        self._closed(accepted, host, port, None, None, Counter(), refused.reason, (), "http")

    def _closed(
        self,
        accepted: _Accepted,
        host: str | None,
        port: int | None,
        sni: str | None,
        upstream: str | None,
        counter: Counter,
        reason: str,
        pinned: tuple[str, ...],
        protocol: str,
    ) -> None:
        accepted.closed = True
        duration = time.monotonic() - accepted.opened
        if self.metrics is not None:
            self.metrics.connection_closed("l4", counter.up, counter.down, duration)
        if self.audit is not None:
            self.audit.closed(
                CloseEvent(
                    host=host,
                    port=port,
                    plane="l4",
                    protocol=protocol,
                    client=accepted.peer.client,
                    connection=accepted.peer.connection,
                    sni=sni,
                    upstream=upstream,
                    bytes_up=counter.up,
                    bytes_down=counter.down,
                    duration=duration,
                    reason=reason,
                    pinned=pinned or None,
                )
            )


@dataclass(frozen=True, slots=True)
class _Gone:
    """The client ended (or timed out) before its ClientHello was complete."""

    refused: Refused | None = None
    sni: str | None = None
    reason: str = "client_closed"


# The CONNECT heads that h11 is certain to accept as they are, with the same target and the same
# trailing bytes: CRLF line ends only, a request line and header lines within h11's own grammar
# (h11/_abnf.py: token, vchar; obs-text, obs-fold and bare CR or LF left out), no framing header
# for h11 to check (Content-Length, Transfer-Encoding), and the Host header count h11 requires.
# Every other head, valid or not, goes to h11, whose answer (or error text) is then the one.
# Linear regexes: a 16 KiB head of hostile bytes costs one pass.
_FAST_REQUEST_LINE = re.compile(rb"CONNECT ([\x21-\x7e]+) HTTP/1\.([01])")
_FAST_HEADER_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t\x21-\x7e]*")
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


def _plain_connect(data: bytes) -> tuple[bytes, bytes] | None:
    """(request target, bytes after the head) of a head h11 parses the same way; else None."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    request = _FAST_REQUEST_LINE.fullmatch(lines[0])
    if request is None:
        return None
    hosts = 0
    for line in lines[1:]:
        header = _FAST_HEADER_LINE.fullmatch(line)
        if header is None:
            return None
        name = header[1].lower()
        if name == b"host":
            hosts += 1
        elif name in _FRAMING:
            return None
    if hosts > 1 or (hosts == 0 and request[2] == b"1"):
        return None
    return request[1], data[end + 4 :]


def _head_read(data: bytes) -> bool:
    """Whether the front door has read enough of a connection's first bytes: a whole CONNECT
    head, too much for one, or enough to tell it is not a CONNECT (the engine's then)."""
    if not _CONNECT.startswith(data[: len(_CONNECT)]):
        return True
    return b"\r\n\r\n" in data or len(data) > MAX_CONNECT_HEAD


def _parse_connect(data: bytes) -> tuple[str, int, bytes] | Refused:
    """(host, port, bytes after the head) of a CONNECT head, or the refusal to answer with."""
    if len(data) > MAX_CONNECT_HEAD and b"\r\n\r\n" not in data[:MAX_CONNECT_HEAD]:
        return Refused(431, INVALID_REQUEST, "the CONNECT head is too large")
    plain = _plain_connect(data)
    if plain is not None:
        target, rest = plain
    else:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_CONNECT_HEAD)
        try:
            connection.receive_data(data)
            event = connection.next_event()
        except h11.RemoteProtocolError as exc:
            return Refused(400, INVALID_REQUEST, f"invalid CONNECT request: {exc}")
        if not isinstance(event, h11.Request) or event.method != b"CONNECT":
            return Refused(400, INVALID_REQUEST, "invalid CONNECT request")
        target, rest = event.target, bytes(connection.trailing_data[0])
    try:
        host, port = split_authority(target.decode("ascii"))
    except (PolicyError, UnicodeDecodeError) as exc:
        return Refused(400, INVALID_REQUEST, f"invalid CONNECT target: {exc}")
    if port is None or not host:
        return Refused(400, INVALID_REQUEST, "a CONNECT target is HOST:PORT")
    return host, port, rest


SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same number


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (netfilter's conntrack), v4 or v6. Raises
    OSError for a connection that was not redirected."""
    if sock.family == socket.AF_INET6:
        raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)  # sockaddr_in6
        port = int.from_bytes(raw[2:4], "big")
        address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        return address, port
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # sockaddr_in
    return socket.inet_ntop(socket.AF_INET, raw[4:8]), int.from_bytes(raw[2:4], "big")


def _listening_socket(listener: Listener) -> socket.socket:
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((listener.host, listener.port))
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _peername(address: Any) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


async def _send(sock: socket.socket, data: bytes) -> None:
    # An answer fits the socket buffer of a fresh connection: sent at once, without a timer.
    try:
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    if sent == len(data):
        return
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        await loop.sock_sendall(sock, data[sent:])
