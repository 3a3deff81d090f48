"""The steps every tunnel takes, whichever listener accepted it (CONNECT, SOCKS5, transparent):
DNS once and the address stage on a name already decided, the loop guard, the dial of the
checked addresses, the SNI gate on a ClientHello, and the relay with its close line. What the
client's first bytes say a tunnel is, and so which of these it takes, is
proxy/dataplane/streams.py's.

    dialled = await dial(connection, target, port, decision)     # raises Refused
    ... the listener's own answer (200, a SOCKS5 reply), then proxy/dataplane/streams.py ...
    if await gate(connection, dialled.name, port, dialled.vetted, what="CONNECT host"):
        relay(connection, dialled)                # the hello and all after it, first

A destination may also be known by its address alone (`vet_by_address`): the names the
session's DNS answered it for (proxy/decide/attribution.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.dimensions import Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, too_slow, upstream_refusal
from proxy.decide.attribution import canonical_address
from proxy.decide.events import NO_DETAILS, Details
from proxy.decide.first_flight import FirstFlight
from proxy.decide.sni_gate import GateOutcome, check_hello
from proxy.net.dialing import Upstream, UpstreamError, connect_upstream, dial_checked
from proxy.net.relay import Relay

if TYPE_CHECKING:
    from policy import Decision
    from proxy.dataplane.connection import Connection
    from proxy.decide.vetting import Vetted


@dataclass(slots=True)
class Dialled:
    transport: asyncio.Transport
    upstream: Upstream
    vetted: Vetted
    address: str  # the checked address connected to

    @property
    def name(self) -> str:
        """The host as the policy decided it."""
        return self.vetted.decision.host


async def vet(
    connection: Connection,
    target: str,
    port: int,
    decision: Decision,
    *,
    inspecting: bool = False,
    details: Details = NO_DETAILS,
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
        details=connection.attribution_details(details),
    )
    _vetted(connection, vetted, port)
    return vetted


async def vet_by_address(
    connection: Connection,
    names: tuple[str, ...],
    address: str,
    port: int,
    *,
    scheme: str | None = None,
    details: Details = NO_DETAILS,
) -> Vetted:
    """A tunnel to an address the session's DNS answered for `names` (`attributed_names`: a
    SOCKS5 request of type 1 or 4, a CONNECT to an address, a redirected stream): the names
    decided (the first allowed one is the tunnel's host), the address stage on that address
    alone, and the loop guard. Raises Refused after its line. `scheme`: the names are decided
    for a stream of that kind (`ssh`, `tcp`)."""
    door = connection.door
    vetted = await door.vetter.vet_attributed(
        names, address, port, connection.peer, connection.protocol, scheme=scheme,
        details=connection.attribution_details(details),
    )  # fmt: skip
    where = authority(vetted.decision.host, port)
    connection.target = f"{scheme}://{where}" if scheme else where
    _vetted(connection, vetted, port)
    return vetted


def attributed_names(connection: Connection, address: str) -> tuple[str, ...]:
    """The names the session's DNS answered `address` for (the most recent first), noted on the
    connection (`attribution: dns`, every name in `attributed` when there are several)."""
    table = connection.door.attribution
    names = table.names(address) if table is not None else ()
    if names:
        connection.attribution = "dns"
        connection.attributed = names if len(names) > 1 else None
    return names


def unattributed(address: str, port: int) -> Refused:
    return Refused(
        403,
        Reason.UNATTRIBUTED,
        f"{authority(address, port)}: the session's DNS never answered with this address, so it "
        "names no host",
    )


def _vetted(connection: Connection, vetted: Vetted, port: int) -> None:
    """The destination vetted this far (the loop guard passed: `Vetter`), on the connection."""
    connection.host, connection.port, connection.pinned = vetted.decision.host, port, vetted.pinned
    connection.vetted = vetted


async def dial(
    connection: Connection,
    target: str,
    port: int,
    decision: Decision,
    details: Details = NO_DETAILS,
) -> Dialled:
    """`vet`, then the dial of the checked addresses. Raises Refused after its audit line is
    written."""
    vetted = await vet(connection, target, port, decision, details=details)
    return await dial_vetted(connection, vetted, port, details)


async def dial_vetted(
    connection: Connection, vetted: Vetted, port: int, details: Details = NO_DETAILS
) -> Dialled:
    """The dial of a vetted destination's checked addresses. Raises Refused after its line."""
    door = connection.door
    name = vetted.decision.host
    try:
        transport, upstream = await dial_checked(
            name,
            vetted.pinned,
            port,
            connect_upstream,
            timeout=door.config.limits.connect_timeout,
            metrics=door.metrics,
        )
    except UpstreamError as exc:
        refused = upstream_refusal(exc.reason, exc.message)
        door.vetter.refusal(
            refused, connection.peer, name, port, connection.protocol, stage=Stage.UPSTREAM,
            vetted=vetted, details=connection.attribution_details(details),
        )  # fmt: skip
        raise refused from None
    address = transport.get_extra_info("peername")
    connection.upstream = authority(address[0], address[1])
    # The peer is one of the checked addresses, in the resolver's canonical spelling, except
    # where the socket spells it otherwise (an IPv4-mapped IPv6 peer): only then is it parsed.
    dialled = address[0]
    if dialled not in vetted.pinned:
        dialled = canonical_address(dialled) or dialled
    return Dialled(transport, upstream, vetted, dialled)


async def gate(connection: Connection, name: str, port: int, vetted: Vetted, *, what: str) -> bool:
    """The SNI gate on the ClientHello the client sends first: True when it passed (its allow
    line written), False when the connection is closed (refused, or the client went first)."""
    outcome = await client_hello(connection, name, what=what)
    if outcome is None:
        connection.close()
        return False
    connection.sni = outcome.sni
    refused = outcome.refused
    if refused is not None and refused.reason == Reason.SNI_MISMATCH:
        refused = _another_attributed(connection, outcome, port)
    vetter = connection.door.vetter
    # One value for the gate's one line, whichever it is.
    details = Details(
        sni=connection.sni,
        ech=outcome.ech,
        attribution=connection.attribution,
        attributed=connection.attributed,
    )
    if refused is not None:
        vetter.refusal(
            refused, connection.peer, name, port, connection.protocol, stage=Stage.SNI,
            vetted=vetted, details=details,
        )  # fmt: skip
        connection.refuse_stream(refused, FirstFlight.TLS, record=False)
        return False
    vetter.allowed(
        connection.peer, connection.protocol, stage=Stage.SNI, vetted=vetted, port=port,
        details=details,
    )  # fmt: skip
    return True


def _another_attributed(connection: Connection, outcome: GateOutcome, port: int) -> Refused | None:
    """An SNI that is not the tunnel's host, passed when the tunnel's address was answered for
    several names and the SNI is another of them, allowed itself (on the same address)."""
    names = connection.attributed
    host = outcome.host
    if not names or host is None or host not in names:
        return outcome.refused
    decision = connection.door.vetter.decide(authority(host, port))
    if not decision.allowed or decision.needs_inspection:
        return outcome.refused
    connection.host = host
    return None


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
    ech = connection.door.config.tls_ech
    return await whole_hello(connection, lambda data: check_hello(data, host, what=what, ech=ech))


async def whole_hello(
    connection: Connection, gate: Callable[[bytearray], GateOutcome | None]
) -> GateOutcome | None:
    """`gate` (the SNI gate, with or without a host to compare) on the client's bytes once they
    hold a whole ClientHello, read within the header timeout: its outcome (a `header_timeout`
    refusal when the time ran out), or None when the client ended first."""
    buffer = connection.buffer
    outcome = gate(buffer) if buffer else None
    if outcome is not None:
        return outcome
    try:
        async with asyncio.timeout(connection.door.config.limits.header_timeout):
            while outcome is None:
                if not await connection.more():
                    return None
                outcome = gate(connection.buffer)
    except TimeoutError:
        refused = too_slow("ClientHello")
        return GateOutcome(None, refused)
    return outcome


def relay(connection: Connection, dialled: Dialled) -> None:
    """Hands both transports to a relay, starting with what the client sent so far (the
    ClientHello the gate passed); the relay's end writes the connection's close line."""
    connection.count_open()
    upstream = dialled.upstream
    early = upstream.take_early()
    if upstream.lost:
        # The upstream was gone before the relay could start: what it sent is passed on,
        # and the client is closed the way the upstream closed.
        if early:
            connection.transport.write(early)
            connection.counter.down += len(early)
        connection.reason = Reason.RESET if upstream.lost_error is not None else Reason.CLOSED
        connection.close()
        connection.finish(connection.reason)
        return
    limits = connection.door.config.limits
    relayed = Relay(
        asyncio.get_running_loop(),
        connection.reading,
        upstream.reading,
        connection.counter,
        limits.idle_timeout,
        connection.finish,
    )
    connection.take_over(relayed)
    data = bytes(connection.buffer)
    connection.buffer.clear()
    relayed.start(
        to_upstream=data,
        to_client=early,
        client_eof=connection.reading.ended,
        upstream_eof=upstream.eof,
    )
