"""What a request inside an intercepted connection must be before it is decided, and the answers
the engine gives. Pure functions of mitmproxy's parsed request; no I/O.

    refused = check_request(request, destination)   # None, or the Refused to answer with
    flow.response = denial(refused, host, port)

A request may only go where its connection was decided to go: its Host header (and the authority
of an absolute-form target, which an origin must prefer to Host) names the connection's host and
port, which is the name its SNI gave (the gate checked that), so with `inspection.mode: all`
neither ECH nor domain fronting can send a request elsewhere. In HTTP/2 the authority is
`:authority` and a Host header is optional; each one sent must name the same. The only upgrade
is WebSocket over HTTP/1.1, decided as the request that opens it; any other (h2c among them, with
its HTTP2-Settings) and a CONNECT inside (HTTP/2's extended CONNECT of RFC 8441 included) would
take the connection out of per-request decisions and are refused, never forwarded.

A refusal is a valid response in the request's own HTTP version, and a gRPC client's refusal
also carries `grpc-status` and `grpc-message`, so the client shows the reason, not "HTTP 403".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import http

from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, refusal_parts, shown
from proxy.decide.http_checks import WEBSOCKET, parse_host_field
from proxy.decide.http_checks import check_host as check_host_fields
from proxy.decide.http_checks import check_upgrade as check_upgrade_fields
from proxy.decide.http_checks import upgrade_tokens as tokens_of

if TYPE_CHECKING:
    from proxy.decide.interception import Destination

__all__ = ["WEBSOCKET", "check_request", "denial", "is_grpc", "is_websocket", "upgrade_tokens"]

# The pseudo-header of RFC 8441's extended CONNECT, kept among a CONNECT request's fields by
# patches.EgressHttp2Server (mitmproxy's request has no place for it) so the refusal can name it.
PROTOCOL_PSEUDO = ":protocol"
_H2_AUTHORITY_REMEDY = "name the host this connection was opened for in :authority (and Host)"
_CONNECT_REMEDY = (
    "send CONNECT to the proxy itself, not inside a tunnel; for WebSocket use HTTP/1.1 Upgrade"
)
# gRPC status codes (grpc/doc/statuscodes.md): a policy denial, and an upstream we cannot reach.
GRPC_PERMISSION_DENIED = 7
GRPC_UNAVAILABLE = 14


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


def check_method(request: http.Request) -> Refused | None:
    """A CONNECT inside interception (HTTP/1.1, HTTP/2, or HTTP/2's extended CONNECT) would open
    a tunnel of its own, which no request decision covers."""
    if request.method.upper() != "CONNECT":
        return None
    protocol = request.headers.get(PROTOCOL_PSEUDO)
    what = (
        f"extended CONNECT (RFC 8441) for {shown(protocol)!r}"
        if protocol is not None
        else "CONNECT"
    )
    return Refused(
        403,
        Reason.CONNECT_REFUSED,
        f"{what} to {shown(request.authority or '')!r} inside an intercepted connection refused",
        remedy=_CONNECT_REMEDY,
    )


def check_host(request: http.Request, destination: Destination) -> Refused | None:
    """HTTP/1.1: exactly one Host header, and it (and an absolute-form target's authority) names
    the connection's host and port (443 when a field names none). HTTP/2: `:authority` or a
    Host header or both, never two Host headers, each naming them."""
    where = f"the tunnel to {authority(destination.host, destination.port)}"
    host, port = destination.host, destination.port
    fields = request.headers.get_all("host")
    target = request.authority
    refused = None
    if request.is_http2 and not fields:
        # A Host header is optional in HTTP/2 (RFC 9113 8.3.1); :authority then names the host.
        if not target:
            refused = Refused(
                403,
                Reason.HOST_MISMATCH,
                f"neither :authority nor Host in a request inside {where}",
            )
    else:
        refused = check_host_fields(fields, host, port, default_port=443, where=where)
    if refused is None and target and parse_host_field(target, 443) != (host, port):
        refused = Refused(
            403, Reason.HOST_MISMATCH, f"request for {shown(target)!r} inside {where}"
        )
    if refused is not None and request.is_http2:
        refused.remedy = _H2_AUTHORITY_REMEDY
    return refused


def check_request(request: http.Request, destination: Destination) -> Refused | None:
    """The rules above, CONNECT and upgrade first; None when the request may be decided on its
    path."""
    return check_method(request) or check_upgrade(request) or check_host(request, destination)


def is_grpc(request: http.Request) -> bool:
    """Whether a request is gRPC (`application/grpc`, `application/grpc+proto`, ...)."""
    kind = str(request.headers.get("content-type", "")).split(";", 1)[0].strip().lower()
    return kind == "application/grpc" or kind.startswith("application/grpc+")


def grpc_message(text: str) -> str:
    """`grpc-message` as the gRPC spec encodes it (PROTOCOL-HTTP2.md, Percent-Encoded): bytes
    outside space..~, and `%` itself, as %XX of their UTF-8."""
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in text.encode()
    )


def denial(
    refused: Refused, host: str, port: int | None, request: http.Request | None = None
) -> http.Response:
    """The 403 (or 4xx/5xx) + X-Egress-Denied (X-Egress-Error for upstream errors) answer with
    its one-line body, in `request`'s HTTP version. HTTP/1.1: a denial leaves the client's
    keep-alive connection usable; an upstream error closes it, as the upstream connection is
    gone. HTTP/2 has no Connection header (RFC 9113 8.2.2): the answer ends its stream only.
    A gRPC request's answer is gRPC's Trailers-Only response (PROTOCOL-HTTP2.md): headers that
    end the stream, the one line in `grpc-message` with `grpc-status`, and no body, which a gRPC
    client would read as length-prefixed messages (grpcio then reports a garbled call)."""
    headers, body = refusal_parts(
        refused.status, host, port, refused.reason, error=refused.error, remedy=refused.remedy
    )
    http2 = request is not None and request.is_http2
    if refused.error and not http2:
        headers["Connection"] = "close"
    if request is not None and is_grpc(request):
        code = GRPC_UNAVAILABLE if refused.error else GRPC_PERMISSION_DENIED
        headers["Content-Type"] = "application/grpc"
        headers["grpc-status"] = str(code)
        headers["grpc-message"] = grpc_message(body.decode("ascii").strip())
        body = b""
    if http2:
        headers = {name.lower(): value for name, value in headers.items()}
    response = http.Response.make(refused.status, body, headers)
    if http2:
        response.http_version = "HTTP/2.0"
    return response
