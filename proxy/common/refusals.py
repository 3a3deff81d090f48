"""What both planes (the L4 fast path and the L7 engine) answer when they refuse: the `Refused`
exception that carries a reason code (a `Reason`, policy/reasons.py: the one catalog) through a
decision, and the one-line HTTP answer (docs/commands.md) in bytes. No mitmproxy here: the fast path
must not import it.

    raise Refused(403, Reason.SNI_MISMATCH, "SNI 'a.test' is not the CONNECT host 'b.test'")
    writer.write(refusal_response(refused, "b.test", 443))
"""

from __future__ import annotations

from policy.reasons import Reason
from policy.remedies import client_remedy

__all__ = [
    "DENIED_HEADER",
    "ERROR_HEADER",
    "STATUS_PHRASES",
    "Reason",
    "Refused",
    "authority",
    "refusal_parts",
    "refusal_response",
    "refusal_ssh",
    "shown",
    "too_slow",
    "upstream_refusal",
]

DENIED_HEADER = "X-Egress-Denied"
ERROR_HEADER = "X-Egress-Error"

_MAX_SHOWN = 200
# A remedy names a host (up to 253 characters) and a few words around it: room for the longest
# valid name, while a hostile one is still cut (the whole line stays under 1 KiB).
_MAX_REMEDY = 400
# The reason phrase of every status the proxy's own answers use (refusals and the admin
# listener), written out: Python's HTTPStatus renamed some between the versions we support.
STATUS_PHRASES = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


class Refused(Exception):
    """A denial (or an upstream error, `error=True`) on its way to the client: the status, the
    reason code, a message for the audit line and the remedy its body ends with (the change
    that would allow it, policy/remedies.py). `remedy` None: the client's own fix for the
    reason, if it has one; the vetting step passes the policy's, which names manifest entries.
    An upstream or DNS error has none: nothing the client or a manifest changes fixes it."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        error: bool = False,
        remedy: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.error = error
        self.remedy = None if error else remedy if remedy is not None else client_remedy(reason)


def upstream_refusal(reason: str, message: str) -> Refused:
    """An upstream that could not be reached (`upstream_timeout`, `upstream_refused`): 504 for a
    connect that timed out, 502 otherwise; an error, so no remedy."""
    status = 504 if reason == Reason.UPSTREAM_TIMEOUT else 502
    return Refused(status, reason, message, error=True)


def shown(text: object, limit: int = _MAX_SHOWN) -> str:
    """Client-controlled text for a one-line body or message: printable ASCII, capped."""
    value = "".join(c if " " <= c <= "~" else "?" for c in str(text))
    return value if len(value) <= limit else value[: limit - 3] + "..."


def authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def too_slow(what: str, seconds: float | None = None) -> Refused:
    """The refusal of a client that did not send `what` (a request head, a ClientHello, ...)
    within its time limit (`seconds`, when the message names it): 408, `header_timeout`, for
    every listener and plane."""
    limit = "the time limit" if seconds is None else f"{seconds:g}s"
    return Refused(408, Reason.HEADER_TIMEOUT, f"no {what} within {limit}")


def refusal_parts(
    status: int,
    host: str,
    port: int | None,
    reason: str,
    *,
    error: bool = False,
    remedy: str | None = None,
) -> tuple[dict[str, str], bytes]:
    """The headers and body of a refusal: `X-Egress-Denied` (or `X-Egress-Error` for upstream
    and DNS errors) with the bare reason code, and one line naming host and reason and, when
    there is one, the change that would allow it (policy/remedies.py), for an agent to act on:
    `egress-proxy: denied.test:443 denied: not_allowed: add 'denied.test' to network.egress`.
    Never 407."""
    where = shown(host if port is None else authority(host, port))
    verb = "failed" if error else "denied"
    # The remedy names what clients sent (a host, a path): one printable line, capped.
    tail = f": {shown(remedy, _MAX_REMEDY)}" if remedy and not error else ""
    body = f"egress-proxy: {where} {verb}: {reason}{tail}\n".encode("ascii", "replace")
    headers = {
        ERROR_HEADER if error else DENIED_HEADER: reason,
        "Content-Type": "text/plain; charset=us-ascii",
    }
    return headers, body


def refusal_response(refused: Refused, host: str, port: int | None, *, close: bool = True) -> bytes:
    """The whole HTTP/1.1 response for a refusal, as bytes (the fast path writes it itself)."""
    headers, body = refusal_parts(
        refused.status, host, port, refused.reason, error=refused.error, remedy=refused.remedy
    )
    phrase = STATUS_PHRASES.get(refused.status, "Error")
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


# What an SSH client reads first from the server (RFC 4253 4.2); the software version names us,
# so a refusal is not mistaken for the server's.
SSH_IDENTIFICATION = b"SSH-2.0-egress_proxy\r\n"
_SSH_MSG_DISCONNECT = 1
# RFC 4253 11.1: SSH_DISCONNECT_HOST_NOT_ALLOWED_TO_CONNECT; SSH_DISCONNECT_CONNECTION_LOST
# for an upstream or DNS failure (nothing the client may not do, a path that is not there).
_SSH_NOT_ALLOWED = 1
_SSH_CONNECTION_LOST = 10


def refusal_ssh(refused: Refused, host: str | None, port: int | None) -> bytes:
    """A refusal in SSH's own terms, for a client that sent its identification string: ours,
    then an SSH_MSG_DISCONNECT (in the clear, as every packet before the key exchange is) whose
    description is the one-line refusal, so that OpenSSH and git print the reason and its
    remedy ("Received disconnect from ...: egress-proxy: git.test:2222 denied: ...")."""
    _, body = refusal_parts(
        refused.status,
        host or "proxy",
        port,
        refused.reason,
        error=refused.error,
        remedy=refused.remedy,
    )
    description = body.rstrip(b"\n")
    code = _SSH_CONNECTION_LOST if refused.error else _SSH_NOT_ALLOWED
    payload = (
        bytes((_SSH_MSG_DISCONNECT,))
        + code.to_bytes(4, "big")
        + len(description).to_bytes(4, "big")
        + description
        + (0).to_bytes(4, "big")  # language tag: none
    )
    # Binary packet (RFC 4253 6): length, padding length, payload, at least 4 bytes of padding,
    # the whole a multiple of 8 (the block size before any cipher), no MAC yet.
    padding = 8 - (5 + len(payload)) % 8
    if padding < 4:
        padding += 8
    packet = (1 + len(payload) + padding).to_bytes(4, "big") + bytes((padding,)) + payload
    return SSH_IDENTIFICATION + packet + bytes(padding)
