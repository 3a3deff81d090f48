"""One plain-HTTP request as the HTTP plane holds it, and where it asks to go: the checks a
request passes before its destination is decided (HTTP/1.0 or 1.1, not CONNECT, its target,
the upgrade rule, exactly one Host naming the target). Pure: a failed check raises `Rejected`
with the stage it failed at; the plane writes its line and answers.

    host, port, path = destination(request, original_port)   # or raises Rejected
"""

from __future__ import annotations

from typing import Protocol

from policy.dimensions import Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, shown
from proxy.dataplane.http_messages import RequestHead, absolute_target, has_field
from proxy.decide.http_checks import check_host, check_upgrade, parse_host_field
from proxy.decide.vetting import canonical_host


class BodySink(Protocol):
    """Where a request's body goes once its exchange began (proxy/dataplane/http_upstream.py)."""

    def body(self, data: bytes) -> None: ...

    def body_end(self) -> None: ...


class Request:
    """One request as the client's parser gave it: its head, and its body as it arrives (held
    in `pending` until an exchange takes it as `sink`)."""

    __slots__ = (
        "body_started",
        "chunked",
        "ended",
        "has_body",
        "head",
        "pending",
        "refused",
        "sink",
        "upstream_head",
        "websocket",
    )

    def __init__(self, head: RequestHead, has_body: bool, chunked: bool) -> None:
        self.head = head
        self.has_body = has_body
        self.chunked = chunked
        self.pending = bytearray()
        self.ended = False  # the whole body (or none) was received
        self.body_started = False  # some of the body went upstream
        self.sink: BodySink | None = None
        self.upstream_head = b""
        self.websocket = False
        self.refused: Refused | None = None  # its framing, refused as it was read


class Rejected(Exception):
    """A request refused before its destination was decided, and the stage that refused it
    (`path`: the path as an origin reads it, once that was known)."""

    def __init__(
        self,
        refused: Refused,
        stage: Stage,
        host: str | None,
        port: int | None,
        path: str | None = None,
    ) -> None:
        super().__init__(refused.message)
        self.refused = refused
        self.stage = stage
        self.host = host
        self.port = port
        self.path = path


def destination(
    request: Request,
    original_port: int | None,
    tunnel_hosts: tuple[str, ...] | None = None,
) -> tuple[str, int, str]:
    """Host (as written), port and path (as sent) of a request: from its absolute-form target
    on an explicit listener (`original_port` None), from its Host field and the port the client
    dialled on a transparent one or inside a tunnel, whose host it must name (`tunnel_hosts`,
    canonical). The path is as an origin reads it. Raises Rejected (with that path, once
    known)."""
    head = request.head
    port = original_port
    if head.version not in ("1.0", "1.1"):
        raise Rejected(
            Refused(400, Reason.INVALID_REQUEST, f"HTTP/{shown(head.version)}"),
            Stage.REQUEST,
            None,
            port,
        )
    if head.method == "CONNECT":
        message = "CONNECT after another request on one connection"
        raise Rejected(Refused(400, Reason.INVALID_REQUEST, message), Stage.REQUEST, None, port)
    hosts = head.values(b"host")
    if original_port is not None:
        named = parse_host_field(hosts[0], 80) if len(hosts) == 1 else None
        if not head.target.startswith("/") or named is None or named[0].startswith("\0"):
            refused = Refused(
                403,
                Reason.HOST_MISMATCH,
                "a redirected request needs an origin-form target and one valid Host header",
            )
            raise Rejected(refused, Stage.HOST, None, port)
        host, path = named[0], head.target
        port = original_port
        if tunnel_hosts is not None and canonical_host(host) not in tunnel_hosts:
            refused = Refused(
                403,
                Reason.HOST_MISMATCH,
                f"Host {shown(host)!r} is not the tunnel's host {tunnel_hosts[0]!r}",
            )
            raise Rejected(refused, Stage.HOST, host, port)
    else:
        target = absolute_target(head.target)
        if isinstance(target, Refused):
            raise Rejected(target, Stage.REQUEST, None, None)
        host, port, path = target
    upgrade = check_upgrade(head.values(b"upgrade"), has_field(head.fields, b"http2-settings"))
    if upgrade is None and head.values(b"upgrade") and not request.websocket:
        upgrade = Refused(403, Reason.UPGRADE_REFUSED, "an Upgrade without Connection: upgrade")
    if upgrade is not None:
        raise Rejected(upgrade, Stage.REQUEST, host, port, path)
    where = authority(host, port)
    mismatch = check_host(hosts, host, port, default_port=80, where=where)
    if mismatch is not None:
        raise Rejected(mismatch, Stage.HOST, host, port, path)
    return host, port, path
