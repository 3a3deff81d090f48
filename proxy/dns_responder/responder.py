"""What the DNS responder (`egress-proxy run --dns-listen HOST:PORT`) answers: the server
(proxy/dns_responder/server.py, messages in proxy/dns_responder/wire.py) only translates its
messages to and from these values.

    responder = DnsResponder(vetter, metrics)
    answer = await responder.answer(DnsQuery(QUERY, (DnsQuestion("pypi.org", A, IN),)), peer)
    answer.rcode, answer.addresses      # NOERROR and the checked IPv4 addresses

A question is decided as the name stage of a connection is, with the same Policy: a DNS query
names no port, so the name is decided for any port (as `egress-proxy explain HOST` does: a name
the proxy would let through on some port is answered). Nothing in here ever forwards a query,
and a name is resolved only after the policy allowed it, with the proxy's own resolver, so the
addresses a client is given are the very ones the proxy checks when it connects:

- a name outside the policy (or no hostname at all: an IP literal, a name with a port, a
  control character, ...): REFUSED, reason from the policy. REFUSED rather than NXDOMAIN: the
  name may well exist, this server only will not say, and a stub resolver must not cache it as
  nonexistent after a reload that widens the policy;
- an allowed name, A or AAAA: our resolver's answer (A and AAAA together, cached), every address
  through the address stage (`Policy.check_addresses`); the addresses of the asked family are
  returned (none: NOERROR without records). A refused answer (private, mixed, blocked, CNAME
  through an internal name) is REFUSED with its reason; NXDOMAIN stays NXDOMAIN, a name with no
  address is NOERROR without records, any other DNS failure (timeout, SERVFAIL upstream) is
  SERVFAIL;
- an allowed name, any other type (TXT, MX, HTTPS, SVCB, ANY, ...): NOERROR without records
  (reason `dns_qtype_not_served`: nothing is resolved or forwarded). For HTTPS and SVCB this
  also means an agent inside our boundary learns no ECH configuration from our DNS (clients
  fall back to A/AAAA and a ClientHello whose SNI is the real name);
- another opcode (NOTIFY, UPDATE, ...): NOTIMP; another class (CH, HS, ...): REFUSED; no or
  several questions: FORMERR; an exception anywhere: SERVFAIL (reason `internal_error`).

Every answer has its audit line(s) and metrics through the shared Vetter (protocol `dns`, the
query type in the line's `method` field; the name stage line, then for A/AAAA the DNS failure
or address stage line) plus `egress_dns_queries_total{qtype, rcode}`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype

from policy import PolicyError
from policy.dimensions import Protocol, Stage
from policy.hostnames import normalize_host
from policy.reasons import Reason
from proxy.common.refusals import Refused, shown
from proxy.decide.events import Details

if TYPE_CHECKING:
    from proxy.decide.attribution import Attribution
    from proxy.decide.events import MetricsSink
    from proxy.decide.vetting import Peer, Vetter

logger = logging.getLogger(__name__)

QUERY = dns.opcode.QUERY
IN = dns.rdataclass.IN
A = dns.rdatatype.A
AAAA = dns.rdatatype.AAAA
NOERROR = dns.rcode.NOERROR
FORMERR = dns.rcode.FORMERR
SERVFAIL = dns.rcode.SERVFAIL
NXDOMAIN = dns.rcode.NXDOMAIN
NOTIMP = dns.rcode.NOTIMP
REFUSED = dns.rcode.REFUSED

# Reason codes of the DNS responder (audit lines and metrics; the policy's and the resolver's
# own codes are used as they are).

# Clients may keep an answer this long (seconds). Short, so that a reload that narrows the
# policy reaches their caches soon; the proxy decides and resolves again on every connection
# anyway, so a client's cached address never decides where a connection goes.
ANSWER_TTL = 30
# A UDP answer larger than this is sent truncated (TC, no records), and the client asks again
# over TCP: the classic limit, for a query without an EDNS record (one with it offers its own
# payload size, which proxy/dns_responder/wire.py caps).
UDP_ANSWER_LIMIT = 512

_FAMILY: dict[int, int] = {A: 4, AAAA: 6}
# DNS failures of the resolver that have an answer of their own (every other one is SERVFAIL).
_DNS_FAILURE_RCODES: dict[str, dns.rcode.Rcode] = {Reason.DNS_NXDOMAIN: NXDOMAIN}


@dataclass(frozen=True, slots=True)
class DnsQuestion:
    name: str  # as the client sent it (decoded by the transport), not yet normalised
    qtype: int
    qclass: int


@dataclass(frozen=True, slots=True)
class DnsQuery:
    opcode: int
    questions: tuple[DnsQuestion, ...]


@dataclass(frozen=True, slots=True)
class DnsAnswer:
    """The answer to one query: its rcode, the reason code that decided it, and for A/AAAA the
    checked addresses of the asked family (records for the question's name, `ttl` seconds)."""

    rcode: int
    reason: str
    addresses: tuple[str, ...] = ()
    ttl: int = ANSWER_TTL


def qtype_text(qtype: int) -> str:
    """`A`, `AAAA`, `TXT`, ... or `TYPE65280` for an unknown number (bounded: a 16-bit type)."""
    try:
        return dns.rdatatype.to_text(dns.rdatatype.RdataType.make(qtype))
    except Exception:
        return "invalid"


def rcode_text(rcode: int) -> str:
    try:
        return dns.rcode.to_text(dns.rcode.Rcode.make(rcode))
    except Exception:
        return "invalid"


def is_answerable(qtype: int) -> bool:
    """Whether a question of this type is answered with records (A and AAAA only)."""
    return qtype in _FAMILY


class DnsResponder:
    """Decides DNS queries with a Vetter (its policy and resolver are the ones a reload swaps)."""

    def __init__(
        self,
        vetter: Vetter,
        metrics: MetricsSink | None = None,
        attribution: Attribution | None = None,
    ) -> None:
        self.vetter = vetter
        self.metrics = metrics
        # Every answered name and its checked addresses (both families: the client may ask
        # for the other one next), so a connection to one of them can be attributed.
        self.attribution = attribution

    async def answer(self, query: DnsQuery, peer: Peer) -> DnsAnswer:
        """The answer to `query`; never raises (an exception is SERVFAIL, `internal_error`)."""
        qtype = qtype_text(query.questions[0].qtype) if len(query.questions) == 1 else "none"
        try:
            answer = await self._answer(query, peer, qtype)
        except Exception as exc:
            logger.exception("egress: deciding a DNS query failed")
            answer = DnsAnswer(SERVFAIL, Reason.INTERNAL_ERROR)
            with contextlib.suppress(Exception):
                name = query.questions[0].name if query.questions else None
                refused = Refused(
                    403, Reason.INTERNAL_ERROR, f"internal error: {type(exc).__name__}"
                )
                self._refusal(refused, peer, name, qtype, stage=Stage.DNS)
        self.count(qtype, rcode_text(answer.rcode))
        return answer

    async def _answer(self, query: DnsQuery, peer: Peer, qtype: str) -> DnsAnswer:
        if query.opcode != QUERY:
            return self._refuse(
                NOTIMP,
                Reason.DNS_OPCODE_NOT_SERVED,
                f"DNS opcode {_opcode_text(query.opcode)} is not served (only QUERY)",
                peer,
                None,
                qtype,
            )
        if len(query.questions) != 1:
            return self._refuse(
                FORMERR,
                Reason.DNS_MALFORMED,
                f"a query has exactly one question, not {len(query.questions)}",
                peer,
                None,
                qtype,
            )
        question = query.questions[0]
        if question.qclass != IN:
            return self._refuse(
                REFUSED,
                Reason.DNS_CLASS_NOT_SERVED,
                f"DNS class {_class_text(question.qclass)} is not served (only IN)",
                peer,
                question.name,
                qtype,
            )
        try:
            host = normalize_host(question.name)
        except PolicyError as exc:
            return self._refuse(REFUSED, exc.reason, exc.message, peer, question.name, qtype)
        vetter = self.vetter
        # Through the Vetter: a learning session answers (and audits as would_deny) names it
        # would refuse, with the same address checks, as its connections are let through.
        decision = vetter.decide(host)
        details = Details(method=qtype)  # a query's lines name its type as a request's method
        if not is_answerable(question.qtype):
            if not decision.allowed:
                vetter.record(decision, peer, Protocol.DNS, details)
                return DnsAnswer(REFUSED, decision.reason)
            message = f"{host}: {qtype} records are not served (only A and AAAA); no records"
            refused = Refused(403, Reason.DNS_QTYPE_NOT_SERVED, message)
            self._refusal(refused, peer, host, qtype, stage=Stage.REQUEST, rule=decision.rule)
            return DnsAnswer(NOERROR, Reason.DNS_QTYPE_NOT_SERVED)
        try:
            # A path-rule host is answered too: the proxy lets it through (inspected) on some
            # port, and the name stage of the connection decides that again.
            vetted = await vetter.vet(
                host, None, peer, Protocol.DNS, inspecting=True, decision=decision, details=details
            )
        except Refused as refused:
            if refused.error:  # a DNS failure of our resolver
                return DnsAnswer(_DNS_FAILURE_RCODES.get(refused.reason, SERVFAIL), refused.reason)
            if refused.reason == Reason.NO_ADDRESSES:  # the name has no address: say just that
                return DnsAnswer(NOERROR, refused.reason)
            return DnsAnswer(REFUSED, refused.reason)
        if self.attribution is not None:
            self.attribution.remember(vetted.decision.host, vetted.pinned, ANSWER_TTL)
        family = _FAMILY[question.qtype]
        addresses = tuple(a for a in vetted.pinned if ipaddress.ip_address(a).version == family)
        return DnsAnswer(NOERROR, vetted.decision.reason, addresses)

    # -- refusals of the responder's own ----------------------------------------------------

    def refuse_message(self, peer: Peer, reason: str, message: str, *, rcode: int | None) -> None:
        """A message the transport could not hand over as a query (unparsable, or not a query
        at all): its audit line and metrics. `rcode`: what the transport answers (FORMERR where
        the header could be read), None when it drops the message."""
        with contextlib.suppress(Exception):
            self._refusal(Refused(403, reason, message), peer, None, None, stage=Stage.REQUEST)
            self.count("none", rcode_text(rcode) if rcode is not None else "dropped")

    def _refuse(
        self, rcode: int, reason: str, message: str, peer: Peer, name: str | None, qtype: str
    ) -> DnsAnswer:
        stage = Stage.NAME if reason not in _REQUEST_REASONS else Stage.REQUEST
        self._refusal(Refused(403, reason, message), peer, name, qtype, stage=stage)
        return DnsAnswer(rcode, reason)

    def _refusal(
        self,
        refused: Refused,
        peer: Peer,
        name: str | None,
        qtype: str | None,
        *,
        stage: Stage,
        rule: str | None = None,
    ) -> None:
        host = shown(name) if name is not None else None
        self.vetter.refusal(refused, peer, host, None, Protocol.DNS, stage=stage,
                            details=Details(method=qtype, rule=rule))  # fmt: skip

    def count(self, qtype: str, rcode: str) -> None:
        if self.metrics is not None:
            self.metrics.dns_query(qtype, rcode)


_REQUEST_REASONS = frozenset(
    {
        Reason.DNS_OPCODE_NOT_SERVED,
        Reason.DNS_CLASS_NOT_SERVED,
        Reason.DNS_MALFORMED,
        Reason.DNS_NOT_A_QUERY,
    }
)


def _opcode_text(opcode: int) -> str:
    try:
        return dns.opcode.to_text(dns.opcode.Opcode.make(opcode))
    except Exception:
        return str(opcode)


def _class_text(qclass: int) -> str:
    try:
        return dns.rdataclass.to_text(dns.rdataclass.RdataClass.make(qclass))
    except Exception:
        return str(qclass)
