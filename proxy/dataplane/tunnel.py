"""The steps every tunnel takes, whichever listener accepted it (CONNECT, SOCKS5, transparent):
DNS once and the address stage on a name already decided, the loop guard, the dial of the
checked addresses, the SNI gate on the ClientHello, and the relay with its close line.

    dialled = await dial(connection, target, port, decision)         # raises Refused
    outcome = await client_hello(connection, dialled.name)            # the SNI gate
    relay(connection, dialled)                # the hello and all after it, first
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from policy.reasons import Reason
from proxy.decide.sni_gate import GateOutcome, check_hello
from proxy.net.dialing import Upstream, UpstreamError, connect_upstream, dial_checked
from proxy.net.relay import Relay
from proxy.reasons import Refused, authority

if TYPE_CHECKING:
    from policy import Decision
    from proxy.dataplane.connection import Connection
    from proxy.decide.vetting import Vetted


@dataclass(slots=True)
class Dialled:
    name: str  # the host as the policy decided it
    transport: asyncio.Transport
    upstream: Upstream
    vetted: Vetted


async def vet(
    connection: Connection,
    target: str,
    port: int,
    decision: Decision,
    *,
    inspecting: bool = False,
    **context: Any,
) -> Vetted:
    """DNS once, address stage and loop guard for a name stage already taken (`decision`):
    returns what vetting found (also kept in `connection.vetted`, the checked addresses in
    `connection.pinned`); the allow line is the caller's last stage's (the SNI gate). Raises Refused
    after its audit line is written; the connection learns the destination as it goes (for
    reloads and its close line). `inspecting`: the connection goes to the interception engine."""
    door = connection.door
    vetter = door.vetter
    peer, protocol = connection.peer, connection.protocol
    connection.target = target
    vetted = await vetter.vet(
        target,
        port,
        peer,
        protocol,
        inspecting=inspecting,
        decision=decision,
        final=False,
        **context,
    )
    name = vetted.decision.host
    connection.host, connection.port, connection.pinned = name, port, vetted.pinned
    connection.vetted = vetted
    if any(door.is_own(address, port) for address in vetted.pinned):
        refused = Refused(
            403, Reason.PROXY_LOOP, f"{authority(name, port)} is this proxy's own listener"
        )
        vetter.refusal(
            refused, peer, name, port, protocol, stage="address", vetted=vetted, **context
        )
        raise refused
    return vetted


async def dial(
    connection: Connection,
    target: str,
    port: int,
    decision: Decision,
    **context: Any,
) -> Dialled:
    """`vet`, then the dial of the checked addresses. Raises Refused after its audit line is
    written."""
    door = connection.door
    vetter = door.vetter
    peer, protocol = connection.peer, connection.protocol
    vetted = await vet(connection, target, port, decision, **context)
    name = vetted.decision.host
    try:
        transport, upstream = await dial_checked(
            name,
            connection.pinned,
            port,
            connect_upstream,
            timeout=door.config.limits.connect_timeout,
            metrics=door.metrics,
        )
    except UpstreamError as exc:
        status = 504 if exc.reason == Reason.UPSTREAM_TIMEOUT else 502
        refused = Refused(status, exc.reason, exc.message, error=True)
        vetter.refusal(
            refused, peer, name, port, protocol, stage="upstream", vetted=vetted, **context
        )
        raise refused from None
    address = transport.get_extra_info("peername")
    connection.upstream = authority(address[0], address[1])
    return Dialled(name, transport, upstream, vetted)


async def client_hello(
    connection: Connection, host: str, *, what: str = "CONNECT host"
) -> GateOutcome | None:
    """The SNI gate on the ClientHello (bounded by the parser, timed by the header timeout):
    its GateOutcome, or None when the client ended first (its close line says why). The
    operator's `tls.ech` is read as the gate runs, so a reload applies to later tunnels.
    `connection.ech` learns whether the hello carries ECH or ESNI (for its close line)."""
    outcome = await _client_hello(connection, host, what)
    if outcome is not None and outcome.ech:
        connection.ech = True
    return outcome


async def _client_hello(connection: Connection, host: str, what: str) -> GateOutcome | None:
    buffer = connection.buffer
    ech = connection.door.config.tls_ech
    outcome = check_hello(buffer, host, what=what, ech=ech) if buffer else None
    if outcome is not None:
        return outcome
    try:
        async with asyncio.timeout(connection.door.config.limits.header_timeout):
            while outcome is None:
                if not await connection.more():
                    return None
                outcome = check_hello(connection.buffer, host, what=what, ech=ech)
    except TimeoutError:
        refused = Refused(408, Reason.HEADER_TIMEOUT, "no ClientHello within the time limit")
        return GateOutcome(None, refused)
    return outcome


def relay(connection: Connection, dialled: Dialled) -> None:
    """Hands both transports to a relay, starting with what the client sent so far (the
    ClientHello the gate passed); the relay's end writes the connection's close line."""
    connection.cancel_timer()
    connection.count_open()
    upstream = dialled.upstream
    early = upstream.take_early()
    connection.owned = True
    if upstream.lost:
        # The upstream was gone before the relay could start: what it sent is passed on,
        # and the client is closed the way the upstream closed.
        if early:
            connection.transport.write(early)
            connection.counter.down += len(early)
        connection.reason = Reason.RESET if upstream.lost_error is not None else Reason.CLOSED
        connection.transport.close()
        connection.finish(connection.reason)
        return
    limits = connection.door.config.limits
    relayed = Relay(
        asyncio.get_running_loop(),
        connection.transport,
        dialled.transport,
        connection.counter,
        limits.idle_timeout,
        connection.finish,
    )
    connection.relay = relayed
    data = bytes(connection.buffer)
    connection.buffer.clear()
    relayed.start(
        to_upstream=data,
        to_client=early,
        client_eof=connection.client_eof,
        upstream_eof=upstream.eof,
    )
