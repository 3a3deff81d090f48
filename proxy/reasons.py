"""What both planes (the L4 fast path and the L7 engine) answer when they refuse: the runtime's
reason codes, the `Refused` exception that carries one through a decision, and the one-line
HTTP answer (DESIGN 3.6) in bytes. No mitmproxy here: the fast path must not import it.

    raise Refused(403, SNI_MISMATCH, "SNI 'a.test' is not the CONNECT host 'b.test'")
    writer.write(refusal_response(refused, "b.test", 443))
"""

from __future__ import annotations

from policy import decisions as d

# Reason codes of the runtime (the policy core's are in policy/decisions.py). Audit lines and
# metrics carry the same strings.
HOST_MISMATCH = "host_mismatch"
NOT_VETTED = "not_vetted"
SNI_MISSING = "sni_missing"
SNI_MISMATCH = "sni_mismatch"
NOT_TLS = "not_tls"
INVALID_CLIENT_HELLO = "invalid_client_hello"
INVALID_REQUEST = "invalid_request"
INSPECTION_UNSUPPORTED = "inspection_unsupported"
UNSUPPORTED_SCHEME = "unsupported_scheme"
UPSTREAM_REFUSED = "upstream_refused"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_ERROR = "upstream_error"  # the upstream closed before its response ended, or sent garbage
UPSTREAM_TLS = "upstream_tls"  # an inspected upstream's certificate failed verification
OVERLOAD = "overload"
HEADER_TIMEOUT = "header_timeout"
POLICY_RELOAD = "policy_reload"
NO_ORIGINAL_DESTINATION = "no_original_destination"
PROXY_LOOP = "proxy_loop"  # a destination that is one of the proxy's own listeners
# SOCKS5 (RFC 1928): what arrived on a SOCKS5 listener was not SOCKS5 at all (SOCKS4, HTTP,
# TLS, ...); the client offered no method we serve (only 0x00, no authentication); a command
# other than CONNECT (BIND, UDP ASSOCIATE); an address type other than IPv4, name, IPv6.
NOT_SOCKS5 = "not_socks5"
SOCKS_NO_METHOD = "socks_no_acceptable_method"
SOCKS_COMMAND = "socks_command_unsupported"
SOCKS_ADDRESS_TYPE = "socks_address_type_unsupported"
# An upgrade to anything but WebSocket (h2c, TLS/1.0, ...), which would take the connection out
# of per-request decisions (plain HTTP and inside interception alike).
UPGRADE_REFUSED = "upgrade_refused"
INTERNAL_ERROR = d.INTERNAL_ERROR

DENIED_HEADER = "X-Egress-Denied"
ERROR_HEADER = "X-Egress-Error"

_MAX_SHOWN = 200
_REASON_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class Refused(Exception):
    """A denial (or an upstream error, `error=True`) on its way to the client: the status, the
    reason code and a message for the audit line."""

    def __init__(self, status: int, reason: str, message: str, *, error: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.error = error


def shown(text: object) -> str:
    """Client-controlled text for a one-line body or message: printable ASCII, capped."""
    value = "".join(c if " " <= c <= "~" else "?" for c in str(text))
    return value if len(value) <= _MAX_SHOWN else value[: _MAX_SHOWN - 3] + "..."


def authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refusal_parts(
    status: int, host: str, port: int | None, reason: str, *, error: bool = False
) -> tuple[dict[str, str], bytes]:
    """The headers and body of a refusal: `X-Egress-Denied` (or `X-Egress-Error` for upstream
    and DNS errors) with the reason code, and one line naming host and reason. Never 407."""
    where = shown(host if port is None else authority(host, port))
    verb = "failed" if error else "denied"
    body = f"egress-proxy: {where} {verb}: {reason}\n".encode("ascii", "replace")
    headers = {
        ERROR_HEADER if error else DENIED_HEADER: reason,
        "Content-Type": "text/plain; charset=us-ascii",
    }
    return headers, body


def refusal_response(refused: Refused, host: str, port: int | None, *, close: bool = True) -> bytes:
    """The whole HTTP/1.1 response for a refusal, as bytes (the fast path writes it itself)."""
    headers, body = refusal_parts(refused.status, host, port, refused.reason, error=refused.error)
    phrase = _REASON_PHRASES.get(refused.status, "Error")
    lines = [f"HTTP/1.1 {refused.status} {phrase}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body
