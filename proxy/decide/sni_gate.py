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

ECH (`encrypted_client_hello`, 0xfe0d) and draft ESNI (0xffce) encrypt the real server name, so
the SNI checked may not be the name served. Either one sets `ech` on the outcome (whatever the
outcome: the planes mark the tunnel's audit lines with it). With `ech=ECH_REFUSE` (the operator's
`tls.ech: refuse`) a hello that passed every SNI check is refused as `ech_refused`; the SNI
checks come first, so a hello that fails one keeps that reason. GREASE ECH cannot be told from
real ECH, hence the default ECH_ALLOW.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.reasons import Reason
from proxy.common.refusals import Refused, shown
from proxy.common.settings import ECH_ALLOW, ECH_REFUSE
from proxy.decide.clienthello import ENCRYPTED_CLIENT_HELLO, ClientHelloError, parse_client_hello
from proxy.decide.vetting import canonical_host


@dataclass(frozen=True, slots=True)
class GateOutcome:
    sni: str | None
    refused: Refused | None  # None: the tunnel may carry these bytes on
    host: str | None = None  # the SNI in the policy's spelling, once it is a host name
    ech: bool = False  # the hello carries ECH or ESNI: the name served may not be `sni`
    hidden: int | None = None  # which of the two came first (its extension type)


def read_hello(
    data: bytes | bytearray, expected: str | None = None, *, ech: str = ECH_ALLOW
) -> GateOutcome | None:
    """The ClientHello in the bytes received so far, its SNI present and a host name; None while
    it is incomplete. Nothing is compared: `host` of a passing outcome is the SNI's host
    (`expected`, a canonical host, only spares normalising an SNI sent exactly so). `ech`: the
    operator's `tls.ech` (ECH_REFUSE refuses a passing hello that carries ECH or ESNI)."""
    outcome = _read(data, expected)
    if outcome is None or outcome.refused is not None:
        return outcome
    return _ech_gate(outcome, ech)


def _read(data: bytes | bytearray, expected: str | None) -> GateOutcome | None:
    """`read_hello` before `tls.ech` is applied."""
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
    hidden = hello.hidden_name
    ech = hidden is not None
    sni = hello.sni
    if not sni:
        refused = Refused(403, Reason.SNI_MISSING, "the ClientHello has no SNI")
        return GateOutcome(None, refused, ech=ech, hidden=hidden)
    host = sni if sni == expected else canonical_host(sni)  # most clients send it as decided
    if host.startswith("\0"):  # canonical_host's mark for what is no host name
        refused = Refused(403, Reason.SNI_INVALID, f"SNI {shown(sni)!r} is not a host name")
        return GateOutcome(sni, refused, ech=ech, hidden=hidden)
    return GateOutcome(sni, None, host, ech=ech, hidden=hidden)


def _ech_gate(outcome: GateOutcome, ech: str) -> GateOutcome:
    """A passing `outcome`, refused when its hello carries ECH or ESNI and `ech` refuses them."""
    if not outcome.ech or ech != ECH_REFUSE:
        return outcome
    name = "ECH" if outcome.hidden == ENCRYPTED_CLIENT_HELLO else "ESNI"
    message = (
        f"the ClientHello for {shown(outcome.sni)!r} carries {name} "
        f"({outcome.hidden or 0:#06x}), which may hide the name served; tls.ech: refuse"
    )
    refused = Refused(403, Reason.ECH_REFUSED, message)
    return GateOutcome(outcome.sni, refused, outcome.host, ech=True, hidden=outcome.hidden)


def check_hello(
    data: bytes | bytearray, host: str, *, what: str = "CONNECT host", ech: str = ECH_ALLOW
) -> GateOutcome | None:
    """The gate on the bytes received so far; None while the ClientHello is incomplete.
    `host` is the tunnel's host as the policy decided it (canonical spelling); `ech` the
    operator's `tls.ech`."""
    outcome = _read(data, host)
    if outcome is None or outcome.refused is not None:
        return outcome
    if outcome.host != host:
        sni = outcome.sni
        return GateOutcome(
            sni,
            Refused(403, Reason.SNI_MISMATCH, f"SNI {shown(sni)!r} is not the {what} {host!r}"),
            outcome.host,
            ech=outcome.ech,
            hidden=outcome.hidden,
        )
    return _ech_gate(outcome, ech)
