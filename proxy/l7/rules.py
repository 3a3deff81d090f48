"""What a request inside an intercepted connection must be before it is decided, and the answers
the engine gives. Pure functions of mitmproxy's parsed request; no I/O.

    refused = check_request(request, destination)   # None, or the Refused to answer with
    flow.response = denial(refused, host, port)

A request may only go where its connection was decided to go: its Host header (and the authority
of an absolute-form target, which an origin must prefer to Host) names the connection's host and
port, which is the name its SNI gave (the gate checked that), so with `inspection.mode: all`
neither ECH nor domain fronting can send a request elsewhere. The only upgrade is WebSocket,
decided as the request that opens it; any other (h2c among them, with its HTTP2-Settings) would
take the connection out of per-request decisions and is refused, never forwarded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import http

from policy.reasons import Reason
from proxy.decide.http_checks import WEBSOCKET, parse_host_field
from proxy.decide.http_checks import check_host as check_host_fields
from proxy.decide.http_checks import check_upgrade as check_upgrade_fields
from proxy.decide.http_checks import upgrade_tokens as tokens_of
from proxy.reasons import Refused, authority, refusal_parts, shown

if TYPE_CHECKING:
    from proxy.decide.interception import Destination

__all__ = ["WEBSOCKET", "check_request", "denial", "is_websocket", "upgrade_tokens"]


def upgrade_tokens(headers: http.Headers) -> list[str]:
    """The protocols an Upgrade header asks for, lowercase, in order (all fields joined)."""
    return tokens_of(headers.get_all("upgrade"))


def is_websocket(request: http.Request) -> bool:
    """Whether the request asks to upgrade to WebSocket, and to nothing else."""
    return upgrade_tokens(request.headers) == [WEBSOCKET]


def check_upgrade(request: http.Request) -> Refused | None:
    return check_upgrade_fields(
        request.headers.get_all("upgrade"), "http2-settings" in request.headers
    )


def check_host(request: http.Request, destination: Destination) -> Refused | None:
    """Exactly one Host header, and it (and an absolute-form target's authority) names the
    connection's host and port (443 when a field names none)."""
    where = f"the tunnel to {authority(destination.host, destination.port)}"
    host, port = destination.host, destination.port
    refused = check_host_fields(
        request.headers.get_all("host"), host, port, default_port=443, where=where
    )
    if refused is not None:
        return refused
    target = request.authority
    if target and parse_host_field(target, 443) != (host, port):
        return Refused(403, Reason.HOST_MISMATCH, f"request for {shown(target)!r} inside {where}")
    return None


def check_request(request: http.Request, destination: Destination) -> Refused | None:
    """The rules above, upgrade first; None when the request may be decided on its path."""
    return check_upgrade(request) or check_host(request, destination)


def denial(refused: Refused, host: str, port: int | None) -> http.Response:
    """The 403 (or 4xx/5xx) + X-Egress-Denied (X-Egress-Error for upstream errors) answer with
    its one-line body. A denial leaves the client's keep-alive connection usable; an upstream
    error closes it, as the upstream connection is gone."""
    headers, body = refusal_parts(
        refused.status, host, port, refused.reason, error=refused.error, remedy=refused.remedy
    )
    if refused.error:
        headers["Connection"] = "close"
    return http.Response.make(refused.status, body, headers)
