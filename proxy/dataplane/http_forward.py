"""Forwarding one plain-HTTP request, once the client's parser has it whole in the head: decided
(proxy/dataplane/http_requests.py, then the name stage, DNS once, the address stage and the loop
guard), then sent over an idle pooled connection to one of its checked addresses or a fresh dial
of them, with the request's one allow line; its exchange (proxy/dataplane/http_upstream.py)
does the rest. A pooled connection the server had closed is retried once on a fresh one, for a
request without a body of a method that may be sent twice.

    keep = await serve(plane, request)    # False: the client connection ends after it
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Final, Protocol

from policy.dimensions import Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, upstream_refusal
from proxy.dataplane import tunnel
from proxy.dataplane.http_messages import RequestHead, forwarded_fields, request_head
from proxy.dataplane.http_requests import Rejected, Request, destination
from proxy.dataplane.http_upstream import FAILED, REUSABLE, STALE, SWITCHED, Client, Exchange
from proxy.decide.events import Details
from proxy.decide.injection import counted, inject
from proxy.net.dialing import UpstreamError, connect_upstream, dial_checked
from proxy.net.flow import Hold

if TYPE_CHECKING:
    from proxy.dataplane.connection import Connection, Door

# Methods a stale pooled connection may be retried for (nothing of them was sent or read).
_RETRIABLE: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class Plane(Client, Protocol):
    """What forwarding needs of the client's side (proxy/dataplane/http.py's HttpPlane)."""

    door: Door
    transparent: bool
    tunnel_hosts: tuple[str, ...] | None
    exchange: Exchange | None

    def refusal(
        self,
        refused: Refused,
        host: str | None,
        port: int | None,
        stage: Stage,
        details: Details,
    ) -> Refused: ...

    def answer_refusal(
        self, request: Request, refused: Refused, host: str | None, port: int | None
    ) -> bool: ...


async def serve(plane: Plane, request: Request) -> bool:
    """One request, decided and forwarded (or refused); False when the connection ends."""
    head = request.head
    conn = plane.conn
    host: str | None = None
    port = conn.port if plane.transparent else None
    try:
        if request.refused is not None:
            details = _details(conn, head, head.target)
            raise plane.refusal(request.refused, None, port, Stage.REQUEST, details)
        host, port, path = destination(request, port, plane.tunnel_hosts)
        # From here on, the lines name the path as an origin reads it.
        details = _details(conn, head, path)
        url = f"http://{authority(host, port)}{path}"
        vetted = await tunnel.vet(conn, url, port, conn.door.vetter.decide(url), details=details)
        name = vetted.decision.host
        # Allowed: a credential of this host that may go over plain HTTP goes in, here where
        # the head is rebuilt for the one upstream it is sent to (a checked address of `name`).
        fields, applied = inject(
            conn.door.config.credentials, name, forwarded_fields(head.fields), plain_http=True
        )
        request.upstream_head = request_head(
            head.method,
            path,
            fields,
            chunked=request.chunked,
            upgrade=request.websocket,
        )
        for attempt in range(2):
            exchange = await _connect(plane, request, name, port, details, fresh=attempt > 0)
            if attempt == 0:
                # A credential put in is named on the request's one allow line alone.
                credential = counted(conn.door.metrics, applied)
                line = details if credential is None else replace(details, credential=credential)
                conn.door.vetter.allowed(
                    conn.peer, conn.protocol, stage=Stage.ADDRESS, vetted=vetted, port=port,
                    details=line,
                )  # fmt: skip
            outcome = await _exchange(plane, exchange)
            if outcome != STALE:
                break
    except Rejected as rejected:
        path = rejected.path if rejected.path is not None else head.target
        refused = plane.refusal(
            rejected.refused, rejected.host, rejected.port, rejected.stage,
            _details(conn, head, path),
        )  # fmt: skip
        return plane.answer_refusal(request, refused, rejected.host, rejected.port)
    except Refused as refused:
        return plane.answer_refusal(request, refused, host, port)
    if outcome == SWITCHED:
        return True  # the relay has both transports now
    if outcome == FAILED:
        return False
    if outcome == REUSABLE:
        address = exchange.transport.get_extra_info("peername")[0]
        plane.door.http_pool().put(name, port, address, exchange.reading)
    else:
        exchange.transport.close()
    # A body still arriving goes to the finished exchange, which drops it; the next request
    # is parsed after it.
    return not (request.websocket or plane.closing)


def _details(conn: Connection, head: RequestHead, path: str) -> Details:
    """What a request's lines say of it: its method and `path`, and how its host was known."""
    return Details(
        method=head.method, path=path, attribution=conn.attribution, attributed=conn.attributed
    )


async def _connect(
    plane: Plane, request: Request, name: str, port: int, details: Details, *, fresh: bool
) -> Exchange:
    """An idle pooled connection to a checked address (not for a body that cannot be sent
    twice), else a dial of the checked addresses; Refused (502/504) after its line."""
    conn, door = plane.conn, plane.conn.door
    pinned = conn.pinned
    if not fresh and not request.has_body and request.head.method in _RETRIABLE:
        taken = door.http_pool().take(name, port, pinned)
        if taken is not None:
            reading, address = taken
            conn.upstream = authority(address, port)
            return Exchange(plane, request, reading, reused=True)
    try:
        transport, upstream = await dial_checked(
            name, pinned, port, connect_upstream,
            timeout=door.config.limits.connect_timeout, metrics=door.metrics,
        )  # fmt: skip
    except UpstreamError as exc:
        refused = upstream_refusal(exc.reason, exc.message)
        raise plane.refusal(refused, name, port, Stage.UPSTREAM, details) from None
    address = transport.get_extra_info("peername")
    conn.upstream = authority(address[0], address[1])
    exchange = Exchange(plane, request, upstream.reading, reused=False)
    early = upstream.take_early()
    if upstream.lost or upstream.eof or early:
        transport.abort()
        message = "the upstream spoke or closed before the request"
        raise plane.refusal(
            Refused(502, Reason.UPSTREAM_ERROR, message, error=True),
            name,
            port,
            Stage.UPSTREAM,
            details,
        )
    return exchange


async def _exchange(plane: Plane, exchange: Exchange) -> str:
    plane.exchange = exchange
    try:
        exchange.send()
        outcome = await exchange.done
    finally:
        plane.exchange = None
    if outcome != SWITCHED:  # a relay has the client now, and its own reasons
        # Its upstream takes no more of the client's bytes: its full buffer holds none back.
        plane.reading.resume(Hold.UPSTREAM_SLOW)
    return outcome
