"""What both planes (the L4 fast path and the L7 engine) answer when they refuse: the `Refused`
exception that carries a reason code (a `Reason`, policy/reasons.py: the one catalog) through a
decision, and the one-line HTTP answer (DESIGN 3.6) in bytes. No mitmproxy here: the fast path
must not import it.

    raise Refused(403, Reason.SNI_MISMATCH, "SNI 'a.test' is not the CONNECT host 'b.test'")
    writer.write(refusal_response(refused, "b.test", 443))
"""

from __future__ import annotations

from policy.reasons import Reason

__all__ = [
    "DENIED_HEADER",
    "ERROR_HEADER",
    "Reason",
    "Refused",
    "authority",
    "refusal_parts",
    "refusal_response",
    "shown",
]

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


# TLS alert descriptions (RFC 8446 6.2): what a refused client's TLS stack reports.
_ACCESS_DENIED = 49
_INTERNAL_ERROR = 80


def refusal_alert(refused: Refused) -> bytes:
    """A refusal where only TLS was spoken (a transparent listener, after the ClientHello): one
    fatal TLS alert record, `access_denied` for a denial and `internal_error` for an upstream or
    DNS failure, so the client says "alert access denied" rather than reporting a reset. Sent
    in the clear, before any ServerHello, as a server that refuses a handshake does."""
    description = _INTERNAL_ERROR if refused.error else _ACCESS_DENIED
    return bytes((0x15, 0x03, 0x03, 0x00, 0x02, 0x02, description))
