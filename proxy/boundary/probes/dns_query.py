"""The DNS probe: a query for a name outside the policy must be refused, wherever it is sent."""

from __future__ import annotations

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype

# dnspython loads a record type's module when an answer first holds one. Load the ones a probe
# can meet now: after --as-user drops privileges the interpreter's files may be out of reach.
import dns.rdtypes.ANY.CNAME
import dns.rdtypes.ANY.SOA
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA

from proxy.boundary.probes.result import ProbeResult, endpoint, oserror
from proxy.common.refusals import shown


def dns_refused(
    name: str, server: str, port: int, qname: str, *, timeout: float = 2.0
) -> ProbeResult:
    """Ask `server` for A `qname` over UDP: passed iff the answer is REFUSED or NXDOMAIN, or the
    query is refused locally; addresses in the answer, or no answer at all, fail."""
    where = endpoint(server, port)
    try:
        query = dns.message.make_query(dns.name.from_text(qname), dns.rdatatype.A)
    except dns.exception.DNSException as exc:
        return ProbeResult(name, False, f"cannot ask for {shown(qname)!r}: {exc}")
    try:
        answer = dns.query.udp(query, server, port=port, timeout=timeout)
    except PermissionError as exc:
        return ProbeResult(name, True, f"DNS query to {where} refused locally ({oserror(exc)})")
    except dns.exception.Timeout:
        return ProbeResult(
            name,
            False,
            f"no DNS answer from {where} within {timeout:g}s: DNS is not redirected to the proxy "
            "or the proxy's DNS is down",
        )
    except (OSError, dns.exception.DNSException) as exc:
        detail = oserror(exc) if isinstance(exc, OSError) else str(exc)
        return ProbeResult(name, False, f"DNS query to {where} failed: {shown(detail)}")
    rcode = answer.rcode()
    text = dns.rcode.to_text(rcode)
    if rcode in (dns.rcode.REFUSED, dns.rcode.NXDOMAIN):
        return ProbeResult(name, True, f"{shown(qname)} A from {where}: {text}")
    addresses = [
        item.to_text()
        for rrset in answer.answer
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
        for item in rrset
    ]
    if addresses:
        listed = ", ".join(addresses[:4])
        return ProbeResult(
            name, False, f"{shown(qname)} A from {where} was answered with {listed}: a leak"
        )
    return ProbeResult(
        name, False, f"{shown(qname)} A from {where}: {text} without addresses, not REFUSED"
    )
