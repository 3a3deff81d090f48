"""What a tunnel is, told by the client's first bytes (proxy/decide/first_flight.py) once its
listener answered (a CONNECT's 200, a SOCKS5 success): a TLS ClientHello goes through the SNI gate
on every port; an HTTP/1.x head is plain HTTP for the HTTP plane (one implementation), every
request's Host naming the tunnel's host; anything else is an opaque stream (`ssh` or `tcp`),
decided as `ssh://host:port` / `tcp://host:port` with the operator's `opaque_ports`, and relayed
to the pinned address.

    dialled = await tunnel.dial(connection, target, port, decision)
    ... the listener's answer ...
    await carry(connection, dialled.vetted, port, dialled, what="CONNECT host")

Where an opaque stream would pass, what the upstream sends reaches the client at once
(server-first protocols: SMTP, MySQL, FTP); only the client's bytes wait for the decision, and
nothing the client sends leaves before it. Elsewhere (ports 80 and 443 by default) the upstream
is held back, so that a refusal after the first bytes is the first thing the client reads (an
SSH client reads our identification string and disconnect, not the server's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from typing import TYPE_CHECKING, cast

from policy.dimensions import Protocol, Stage
from policy.hostnames import parse_ip_literal
from policy.learning import LEARNABLE as LIFTED_BY_ENTRY
from proxy.common.refusals import Refused, authority, too_slow
from proxy.dataplane import tunnel
from proxy.dataplane.http import HttpPlane
from proxy.dataplane.tunnel import Dialled, dial_vetted, gate, relay
from proxy.decide.events import NO_DETAILS, Details
from proxy.decide.first_flight import FirstFlight, classify
from proxy.decide.interception import intercepted

if TYPE_CHECKING:
    from policy import Decision
    from proxy.dataplane.connection import Connection
    from proxy.decide.vetting import Vetted


def stream_decision(connection: Connection, kind: str, name: str, port: int) -> Decision:
    """The name stage for an opaque stream of `kind` (`ssh`, `tcp`) to `name`:`port`, with the
    operator's `opaque_ports` (learning, the session's grants and the policy of the moment
    included)."""
    return connection.door.vetter.decide(f"{kind}://{authority(name, port)}")


def tunnel_stream(connection: Connection, kind: str, vetted: Vetted, port: int) -> Decision:
    """The decision on an opaque stream of `kind` inside a tunnel vetted as `vetted`: the
    stream's own name stage, except that a host the tunnel was let through for by a person's
    answer (allow once) keeps that answer; the operator's `opaque_ports` hold either way."""
    decision = stream_decision(connection, kind, vetted.decision.host, port)
    tunnel = vetted.decision
    if decision.allowed or not tunnel.allowed or decision.reason not in LIFTED_BY_ENTRY:
        return decision
    return connection.door.vetter.policy.opaque(tunnel, kind)


async def first_flight(connection: Connection, *, patient: bool) -> FirstFlight | Refused | None:
    """What the client's first bytes say the tunnel is (waiting for enough of them), a refusal
    when none came in time, or None when the client ended first with nothing sent. The header
    timeout bounds the wait; `patient` (the upstream may speak first, and was let to): once it
    has spoken, the client may well be waiting for more of it, and the idle timeout does."""
    connection.classifying()
    limits = connection.door.config.limits
    kind = classify(connection.buffer)
    timeout = limits.header_timeout
    while kind is None:
        try:
            async with asyncio.timeout(timeout):
                while kind is None:
                    if not await connection.more():
                        return _final(connection.buffer)
                    kind = classify(connection.buffer)
        except TimeoutError:
            if patient and connection.counter.down and timeout != limits.idle_timeout:
                timeout = limits.idle_timeout
                continue
            if connection.buffer:
                return _final(connection.buffer)
            return too_slow("first bytes (a ClientHello, a request or a stream)")
    return kind


def _final(data: bytearray) -> FirstFlight | None:
    """What a first flight that will not grow is: a few bytes that could still have become
    a method or an SSH identification are an opaque stream."""
    if not data:
        return None
    return classify(data) or FirstFlight.TCP


async def carry(
    connection: Connection,
    vetted: Vetted,
    port: int,
    dialled: Dialled | None,
    *,
    what: str,
    intercept: bool = False,
) -> None:
    """A tunnel whose listener answered (a 200, a SOCKS5 success), decided by what the client
    sends first: the SNI gate and the relay (or, `intercept`, the engine), the HTTP plane, or an
    opaque stream. `dialled`: the upstream connected before the answer (None when the engine
    dials, or nothing was dialled yet); it is closed when it is not needed. `what` names the
    tunnel's host in a refusal (`CONNECT host`, `SOCKS5 host`)."""
    name = vetted.decision.host
    patient = False
    if dialled is not None and tunnel_stream(connection, "tcp", vetted, port).allowed:
        # An opaque stream would pass here: the server may speak first.
        dialled.upstream.forward_to(connection.transport, connection.counter)
        patient = True
    try:
        kind = await first_flight(connection, patient=patient)
        if kind is None or isinstance(kind, Refused):
            drop(dialled)
            if kind is not None:
                connection.door.vetter.refusal(
                    kind, connection.peer, name, port, connection.protocol, stage=Stage.STREAM,
                    vetted=vetted, details=connection.attribution_details(),
                )  # fmt: skip
                connection.reason = kind.reason
            connection.close()
            return
        if kind == FirstFlight.HTTP and connection.counter.down:
            kind = FirstFlight.TCP  # the server spoke first: no HTTP exchange begins like that
        if kind == FirstFlight.TLS:
            if not await gate(connection, name, port, vetted, what=what):
                drop(dialled)
                return
            if intercept:
                drop(dialled)
                await connection.door.intercept(connection)
                return
            if dialled is None:
                dialled = await _late_dial(connection, vetted, port, FirstFlight.TLS)
                if dialled is None:
                    return
            relay(connection, dialled)
            return
        if kind == FirstFlight.HTTP:
            drop(dialled)
            connection.protocol = Protocol.HTTP
            hosts = connection.attributed or (name,)
            HttpPlane(connection, transparent=True, tunnel_hosts=hosts).start()
            return
        await opaque(connection, kind, vetted, port, dialled)
    except BaseException:
        if dialled is not None and connection.relay is None:
            dialled.transport.abort()
        raise


async def opaque(
    connection: Connection, kind: FirstFlight, vetted: Vetted, port: int, dialled: Dialled | None
) -> None:
    """An opaque stream (`ssh`, `tcp`) on a vetted destination: decided with `opaque_ports`,
    then relayed to `dialled` (or a dial of the checked addresses now), or refused in the
    stream's own terms."""
    name = vetted.decision.host
    connection.protocol = Protocol(kind)  # the stream's kind names its protocol
    connection.target = f"{kind}://{authority(name, port)}"  # what a reload decides again
    decision = tunnel_stream(connection, kind, vetted, port)
    if not decision.allowed:
        drop(dialled)
        policy = connection.door.vetter.policy
        refused = Refused(
            403,
            decision.reason,
            decision.message,
            remedy=policy.remedy(decision, connection.target),
        )
        # The line names the stream's own rule, with the tunnel's ceiling and addresses.
        named = dataclasses.replace(vetted.decision, rule=decision.rule)
        connection.refuse_stream(refused, kind, vetted=dataclasses.replace(vetted, decision=named))
        return
    if dialled is None:
        dialled = await _late_dial(connection, vetted, port, kind)
        if dialled is None:
            return
    connection.door.vetter.allowed(
        connection.peer, connection.protocol, stage=Stage.STREAM, vetted=vetted, port=port,
        details=connection.attribution_details(),
    )  # fmt: skip
    relay(connection, dialled)


async def _late_dial(
    connection: Connection, vetted: Vetted, port: int, kind: FirstFlight
) -> Dialled | None:
    """The dial of a tunnel whose first bytes came before anything was dialled; None when it
    failed (refused in the stream's terms, its line written)."""
    connection.setting_up()
    try:
        return await dial_vetted(connection, vetted, port)
    except Refused as refused:
        connection.refuse_stream(refused, kind, record=False)
        return None


def drop(dialled: Dialled | None) -> None:
    """Closes an upstream the stream turned out not to need (the client's connection stays:
    an upstream that was speaking to it speaks no more)."""
    if dialled is not None:
        dialled.upstream.sink = None
        dialled.transport.close()


# -- a tunnel from its request to its stream, for the listeners that answer one (CONNECT, SOCKS5)


class Answers(typing.Protocol):
    """What a listener that answers a tunnel request gives `open_tunnel`."""

    def answer_success(self, bound: tuple[str, int] | None) -> bool:
        """The listener's success answer (a 200, a SOCKS5 reply naming `bound`); False when
        the connection was refused instead (its lines written)."""
        ...


async def open_tunnel(
    connection: Connection,
    target: str,
    host: str,
    port: int,
    *,
    what: str,
    details: Details = NO_DETAILS,
) -> None:
    """A tunnel request for `target`: the name stage (and, when the host is no name but an
    address the session's DNS answered for allowed names, those names), DNS once, the address
    stage, the dial (the engine's own, for an intercepted host), the listener's answer, then
    the stream. A refusal before the answer is answered in the listener's protocol."""
    door = connection.door
    answers = cast(Answers, connection)
    address = parse_ip_literal(host)
    names = tunnel.attributed_names(connection, str(address)) if address is not None else ()
    try:
        if names:
            vetted = await tunnel.vet_by_address(
                connection, names, str(address), port, details=details
            )
            inspecting = intercepted(vetted.decision, door.config)
        else:
            decision = door.vetter.decide(target)
            inspecting = intercepted(decision, door.config)
            vetted = await tunnel.vet(
                connection, target, port, decision, inspecting=inspecting, details=details
            )
        dialled = None
        if not inspecting:
            dialled = await tunnel.dial_vetted(connection, vetted, port, details)
    except Refused as refused:
        connection.refuse(refused, host, port, record=False)
        return
    try:
        bound = dialled.transport.get_extra_info("sockname") if dialled is not None else None
        if not answers.answer_success(bound):
            drop(dialled)
            return
    except BaseException:
        if dialled is not None:
            dialled.transport.abort()
        raise
    await carry(connection, vetted, port, dialled, what=what, intercept=dialled is None)
