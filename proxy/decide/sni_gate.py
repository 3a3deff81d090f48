"""The SNI gate of a tunnel, shared by both planes: the first bytes a client sends through an
allowed CONNECT (or SOCKS5, or transparent) tunnel must be a TLS ClientHello whose SNI is the
host that was decided. Nothing is dialled (engine) or relayed (fast path) before it passes.

    outcome = check_hello(data, "pypi.org")
    if outcome is None: ...            # a ClientHello split across reads: read more
    elif outcome.refused: ...          # closed; outcome.refused.reason is the audit reason
    else: ...                          # relay, starting with `data`
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.decide.clienthello import NOT_TLS as HELLO_NOT_TLS
from proxy.decide.clienthello import ClientHelloError, parse_client_hello
from proxy.decide.vetting import canonical_host
from proxy.reasons import (
    INVALID_CLIENT_HELLO,
    NOT_TLS,
    SNI_MISMATCH,
    SNI_MISSING,
    Refused,
    shown,
)


@dataclass(frozen=True, slots=True)
class GateOutcome:
    sni: str | None
    refused: Refused | None  # None: the tunnel may carry these bytes on


def check_hello(
    data: bytes | bytearray, host: str, *, what: str = "CONNECT host"
) -> GateOutcome | None:
    """The gate on the bytes received so far; None while the ClientHello is incomplete.
    `host` is the tunnel's host as the policy decided it (canonical spelling)."""
    try:
        hello = parse_client_hello(data)
    except ClientHelloError as exc:
        if exc.reason == HELLO_NOT_TLS:
            return GateOutcome(
                None, Refused(403, NOT_TLS, "the tunnel did not start with a TLS ClientHello")
            )
        return GateOutcome(
            None, Refused(403, INVALID_CLIENT_HELLO, f"invalid TLS ClientHello: {exc.message}")
        )
    if hello is None:
        return None
    sni = hello.sni
    if not sni:
        return GateOutcome(None, Refused(403, SNI_MISSING, "the ClientHello has no SNI"))
    if sni != host and canonical_host(sni) != host:  # most clients send it as decided
        return GateOutcome(
            sni,
            Refused(403, SNI_MISMATCH, f"SNI {shown(sni)!r} is not the {what} {host!r}"),
        )
    return GateOutcome(sni, None)
