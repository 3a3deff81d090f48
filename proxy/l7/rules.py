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
from mitmproxy.net.http import url

from proxy.decide.vetting import canonical_host
from proxy.reasons import (
    HOST_MISMATCH,
    UPGRADE_REFUSED,
    Refused,
    authority,
    refusal_parts,
    shown,
)

if TYPE_CHECKING:
    from proxy.decide.interception import Destination

# An upgraded connection's bytes are relayed after the 101; only a WebSocket's were decided.
WEBSOCKET = "websocket"


def upgrade_tokens(headers: http.Headers) -> list[str]:
    """The protocols an Upgrade header asks for, lowercase, in order (all fields joined)."""
    return [
        token.strip().lower()
        for value in headers.get_all("upgrade")
        for token in value.split(",")
        if token.strip()
    ]


def is_websocket(request: http.Request) -> bool:
    """Whether the request asks to upgrade to WebSocket, and to nothing else."""
    return upgrade_tokens(request.headers) == [WEBSOCKET]


def check_upgrade(request: http.Request) -> Refused | None:
    """Every upgrade but WebSocket is refused; so is an h2c upgrade's HTTP2-Settings alone."""
    tokens = upgrade_tokens(request.headers)
    if tokens and tokens != [WEBSOCKET]:
        return Refused(
            403,
            UPGRADE_REFUSED,
            f"upgrade to {shown(', '.join(tokens))!r} refused: only WebSocket is decided per "
            "request",
        )
    if "http2-settings" in request.headers:
        return Refused(403, UPGRADE_REFUSED, "HTTP2-Settings (an h2c upgrade) refused")
    if request.headers.get_all("upgrade") and not tokens:
        return Refused(403, UPGRADE_REFUSED, "an empty Upgrade header refused")
    return None


def _names(value: str, destination: Destination) -> bool:
    """Whether an authority (`host[:port]`, the port 443 when absent) names the destination."""
    try:
        host, port = url.parse_authority(value, check=True)
    except ValueError:
        return False
    return canonical_host(host) == destination.host and (port or 443) == destination.port


def check_host(request: http.Request, destination: Destination) -> Refused | None:
    """Exactly one Host header, and it (and an absolute-form target's authority) names the
    connection's host and port."""
    where = authority(destination.host, destination.port)
    hosts = request.headers.get_all("host")
    if len(hosts) != 1:
        return Refused(
            403, HOST_MISMATCH, f"{len(hosts)} Host headers inside the tunnel to {where}"
        )
    if not _names(hosts[0], destination):
        return Refused(
            403, HOST_MISMATCH, f"Host header {shown(hosts[0])!r} inside the tunnel to {where}"
        )
    target = request.authority
    if target and not _names(target, destination):
        return Refused(
            403, HOST_MISMATCH, f"request for {shown(target)!r} inside the tunnel to {where}"
        )
    return None


def check_request(request: http.Request, destination: Destination) -> Refused | None:
    """The rules above, upgrade first; None when the request may be decided on its path."""
    return check_upgrade(request) or check_host(request, destination)


def denial(refused: Refused, host: str, port: int | None) -> http.Response:
    """The 403 (or 4xx/5xx) + X-Egress-Denied (X-Egress-Error for upstream errors) answer with
    its one-line body. A denial leaves the client's keep-alive connection usable; an upstream
    error closes it, as the upstream connection is gone."""
    headers, body = refusal_parts(refused.status, host, port, refused.reason, error=refused.error)
    if refused.error:
        headers["Connection"] = "close"
    return http.Response.make(refused.status, body, headers)
