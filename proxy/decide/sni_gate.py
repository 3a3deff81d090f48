"""The SNI gate, shared by every plane that reads a ClientHello: the first bytes a client sends
through an allowed CONNECT (or SOCKS5) tunnel must be a TLS ClientHello whose SNI is the host
that was decided; on a transparent listener the ClientHello's SNI names the host to decide.
Nothing is dialled (engine) or relayed (fast path) before it passes.

    outcome = check_hello(data, "pypi.org")
    if outcome is None: ...            # a ClientHello split across reads: read more
    elif outcome.refused: ...          # closed; outcome.refused.reason is the audit reason
    else: ...                          # relay, starting with `data`

`read_hello` is the same gate without a host to compare with (the transparent listener): the
ClientHello parsed, its SNI present and a host name, and that host in the policy's spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.reasons import Reason
from proxy.decide.clienthello import ClientHelloError, parse_client_hello
from proxy.decide.vetting import canonical_host
from proxy.reasons import Refused, shown


@dataclass(frozen=True, slots=True)
class GateOutcome:
    sni: str | None
    refused: Refused | None  # None: the tunnel may carry these bytes on
    host: str | None = None  # the SNI in the policy's spelling, once it is a host name


def read_hello(data: bytes | bytearray, expected: str | None = None) -> GateOutcome | None:
    """The ClientHello in the bytes received so far, its SNI present and a host name; None while
    it is incomplete. Nothing is compared: `host` of a passing outcome is the SNI's host
    (`expected`, a canonical host, only spares normalising an SNI sent exactly so)."""
    try:
        hello = parse_client_hello(data)
    except ClientHelloError as exc:
        if exc.reason == Reason.NOT_TLS:
            return GateOutcome(
                None,
                Refused(403, Reason.NOT_TLS, "the tunnel did not start with a TLS ClientHello"),
            )
        message = f"invalid TLS ClientHello: {exc.message}"
        return GateOutcome(None, Refused(403, Reason.INVALID_CLIENT_HELLO, message))
    if hello is None:
        return None
    sni = hello.sni
    if not sni:
        return GateOutcome(None, Refused(403, Reason.SNI_MISSING, "the ClientHello has no SNI"))
    host = sni if sni == expected else canonical_host(sni)  # most clients send it as decided
    if host.startswith("\0"):  # canonical_host's mark for what is no host name
        return GateOutcome(
            sni, Refused(403, Reason.SNI_INVALID, f"SNI {shown(sni)!r} is not a host name")
        )
    return GateOutcome(sni, None, host)


def check_hello(
    data: bytes | bytearray, host: str, *, what: str = "CONNECT host"
) -> GateOutcome | None:
    """The gate on the bytes received so far; None while the ClientHello is incomplete.
    `host` is the tunnel's host as the policy decided it (canonical spelling)."""
    outcome = read_hello(data, host)
    if outcome is None or outcome.refused is not None:
        return outcome
    if outcome.host != host:
        sni = outcome.sni
        return GateOutcome(
            sni,
            Refused(403, Reason.SNI_MISMATCH, f"SNI {shown(sni)!r} is not the {what} {host!r}"),
            outcome.host,
        )
    return outcome
