"""The DNS responder's decisions (proxy/dns_answers.py), without mitmproxy: a real Policy, our
real resolver asking the tests' DNS server on loopback, a real audit log and metrics. Every
case also checks what the DNS server was asked: a name outside the policy, and every type but
A/AAAA, must never reach it."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from support.dns_server import DNSServer
from support.in_process import ExplodingPolicy
from support.running import metric_value

from policy import Policy, compile_policy, load_manifest
from policy.reasons import Reason
from proxy.app.config import load_config
from proxy.decide.vetting import Peer, Vetter
from proxy.dns_responder.responder import (
    FORMERR,
    NOERROR,
    NOTIMP,
    NXDOMAIN,
    REFUSED,
    SERVFAIL,
    DnsAnswer,
    DnsQuery,
    DnsQuestion,
    DnsResponder,
    qtype_text,
    rcode_text,
)
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [ok.test, priv.test, mixed.test, gone.test, empty.test, bad.test]\n"
CONFIG = """\
addresses:
  allow: [192.0.2.0/24, 2001:db8::/32]
platform_destinations:
  - host: gateway.platform.svc.cluster.local
    ports: [443]
    cidrs: [10.96.0.0/12]
"""
PEER = Peer(("127.0.0.1", 40000), "c1")
A, AAAA, TXT, MX, HTTPS, ANY = 1, 28, 16, 15, 65, 255
IN, CH = 1, 3
QUERY, NOTIFY, UPDATE = 0, 4, 5


def compiled(manifest: str = MANIFEST) -> Policy:
    config = load_config(CONFIG)
    return compile_policy(load_manifest(manifest), None, config.operator)


class Responder:
    """A DnsResponder with its audit lines and metrics at hand."""

    def __init__(self, dns: DNSServer, policy: Policy) -> None:
        self.stream = io.StringIO()
        self.metrics = Metrics()
        resolver = Resolver([dns.address], timeout=1.0)
        self.audit = audit = AuditLog(stream=self.stream)
        self.vetter = Vetter(policy, resolver, self.metrics, audit, plane="l7")
        self.responder = DnsResponder(self.vetter, self.metrics)

    async def ask(
        self, name: str, qtype: int = A, *, qclass: int = IN, opcode: int = QUERY
    ) -> DnsAnswer:
        query = DnsQuery(opcode, (DnsQuestion(name, qtype, qclass),))
        return await self.responder.answer(query, PEER)

    def lines(self) -> list[dict[str, Any]]:
        self.audit.flush()  # what this loop iteration gathered is written when it ends
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def count(self, qtype: str, rcode: str) -> float:
        text = self.metrics.render()[0].decode()
        return metric_value(text, "egress_dns_queries_total", qtype=qtype, rcode=rcode) or 0.0


@pytest.fixture
def responder(dns: DNSServer) -> Responder:
    dns.set("ok.test", a=["192.0.2.10", "192.0.2.11"], aaaa=["2001:db8::10"])
    dns.set("priv.test", a=["10.0.0.1"])
    dns.set("mixed.test", a=["192.0.2.10", "127.0.0.1"])
    dns.nxdomain("gone.test")
    dns.set("empty.test")  # exists, no address
    dns.servfail("bad.test")
    dns.set("gateway.platform.svc.cluster.local", a=["10.96.0.10"])
    return Responder(dns, compiled())


@pytest.mark.asyncio
async def test_allowed_a_and_aaaa_are_answered_with_the_checked_addresses_of_their_family(
    responder: Responder, dns: DNSServer
) -> None:
    answer = await responder.ask("ok.test", A)
    assert answer.rcode == NOERROR and sorted(answer.addresses) == ["192.0.2.10", "192.0.2.11"]
    answer = await responder.ask("OK.Test.", AAAA)  # normalised as the proxy does
    assert answer.rcode == NOERROR and answer.addresses == ("2001:db8::10",)
    # One lookup of A and AAAA with our resolver (the answer the proxy checks), then its cache.
    assert dns.count("ok.test", "A") == 1 and dns.count("ok.test", "AAAA") == 1
    lines = responder.lines()
    # One line per decision: the allow, at the address stage, with the rule and the addresses.
    assert [(x["protocol"], x["stage"], x["decision"], x["method"]) for x in lines] == [
        ("dns", "address", "allow", "A"),
        ("dns", "address", "allow", "AAAA"),
    ]
    assert lines[0]["host"] == "ok.test" and lines[0]["rule"] == "network.egress[0]"
    assert sorted(lines[0]["pinned"]) == ["192.0.2.10", "192.0.2.11", "2001:db8::10"]
    assert responder.count("A", "NOERROR") == 1 and responder.count("AAAA", "NOERROR") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("qtype", [A, AAAA, TXT, MX, HTTPS, ANY])
async def test_a_name_outside_the_policy_is_refused_and_never_asked(
    responder: Responder, dns: DNSServer, qtype: int
) -> None:
    answer = await responder.ask("denied.test", qtype)
    assert answer == DnsAnswer(REFUSED, "not_allowed")
    assert dns.queries == []
    [line] = responder.lines()
    assert line["decision"] == "deny" and line["reason"] == "not_allowed"
    assert line["host"] == "denied.test" and line["method"] == qtype_text(qtype)
    assert responder.count(qtype_text(qtype), "REFUSED") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("127.0.0.1", "ip_literal"),
        ("2130706433", "ip_literal"),
        ("localhost", "loopback_name"),
        ("ok.test:443", "invalid_host"),
        ("ok.test/x", "invalid_host"),
        ("a\x00b.ok.test", "invalid_host"),
        ("", "invalid_host"),
        ("pypi.org.svc.cluster.local", "internal_name"),
        ("wpad", "single_label"),
    ],
)
async def test_what_is_not_an_allowed_hostname_is_refused(
    responder: Responder, dns: DNSServer, name: str, reason: str
) -> None:
    answer = await responder.ask(name)
    assert answer.rcode == REFUSED and answer.reason == reason
    assert dns.queries == []
    [line] = responder.lines()
    assert line["decision"] == "deny" and line["reason"] == reason


@pytest.mark.asyncio
@pytest.mark.parametrize("qtype", [TXT, MX, HTTPS, ANY, 65280])
async def test_other_types_of_an_allowed_name_get_no_records_and_are_never_forwarded(
    responder: Responder, dns: DNSServer, qtype: int
) -> None:
    answer = await responder.ask("ok.test", qtype)
    assert answer == DnsAnswer(NOERROR, Reason.DNS_QTYPE_NOT_SERVED)
    assert dns.queries == []
    [line] = responder.lines()
    assert (line["decision"], line["reason"], line["host"]) == (
        "deny",
        Reason.DNS_QTYPE_NOT_SERVED,
        "ok.test",
    )
    assert line["rule"] == "network.egress[0]"
    label = qtype_text(qtype) if qtype != 65280 else "other"
    assert responder.count(label, "NOERROR") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "rcode", "reason"),
    [
        ("priv.test", REFUSED, "private"),
        ("mixed.test", REFUSED, "mixed_answer"),
        ("gone.test", NXDOMAIN, "dns_nxdomain"),
        ("empty.test", NOERROR, "no_addresses"),
        ("bad.test", SERVFAIL, "dns_error"),
    ],
)
async def test_answers_that_fail_their_checks(
    responder: Responder, name: str, rcode: int, reason: str
) -> None:
    answer = await responder.ask(name)
    assert (answer.rcode, answer.reason, answer.addresses) == (rcode, reason, ())
    last = responder.lines()[-1]
    assert last["decision"] == "deny" and last["reason"] == reason
    assert responder.count("A", rcode_text(rcode)) == 1


@pytest.mark.asyncio
async def test_a_dns_timeout_is_servfail(dns: DNSServer) -> None:
    dns.blackhole("slow.test")
    responder = Responder(dns, compiled("network:\n  egress: [slow.test]\n"))
    answer = await responder.ask("slow.test")
    assert answer == DnsAnswer(SERVFAIL, "dns_timeout")


@pytest.mark.asyncio
async def test_a_family_without_addresses_is_noerror_without_records(
    responder: Responder, dns: DNSServer
) -> None:
    dns.set("ok.test", a=["192.0.2.10"])  # no AAAA
    answer = await responder.ask("ok.test", AAAA)
    assert answer.rcode == NOERROR and answer.addresses == ()


@pytest.mark.asyncio
async def test_platform_destinations_and_path_rule_hosts_are_answered(dns: DNSServer) -> None:
    manifest = '[network_access]\nallowed = ["https://api.ok.test/v1/"]\n'
    config = load_config(CONFIG)
    manifest_doc = load_manifest(manifest, source="agent.toml")
    responder = Responder(dns, compile_policy(manifest_doc, None, config.operator))
    dns.set("api.ok.test", a=["192.0.2.20"])
    dns.set("gateway.platform.svc.cluster.local", a=["10.96.0.10"])
    answer = await responder.ask("api.ok.test")
    assert answer.rcode == NOERROR and answer.addresses == ("192.0.2.20",)
    answer = await responder.ask("gateway.platform.svc.cluster.local")
    assert answer.rcode == NOERROR and answer.addresses == ("10.96.0.10",)
    assert (await responder.ask("other.ok.test")).rcode == REFUSED


@pytest.mark.asyncio
async def test_request_shapes_that_are_not_served(responder: Responder, dns: DNSServer) -> None:
    assert await responder.ask("ok.test", opcode=NOTIFY) == DnsAnswer(
        NOTIMP, Reason.DNS_OPCODE_NOT_SERVED
    )
    assert await responder.ask("ok.test", opcode=UPDATE) == DnsAnswer(
        NOTIMP, Reason.DNS_OPCODE_NOT_SERVED
    )
    assert await responder.ask("version.bind", TXT, qclass=CH) == DnsAnswer(
        REFUSED, Reason.DNS_CLASS_NOT_SERVED
    )
    two = DnsQuery(QUERY, (DnsQuestion("ok.test", A, IN), DnsQuestion("ok.test", AAAA, IN)))
    assert await responder.responder.answer(two, PEER) == DnsAnswer(FORMERR, Reason.DNS_MALFORMED)
    none = DnsQuery(QUERY, ())
    assert await responder.responder.answer(none, PEER) == DnsAnswer(FORMERR, Reason.DNS_MALFORMED)
    assert dns.queries == []
    reasons = [(x["reason"], x["stage"]) for x in responder.lines()]
    assert reasons == [
        (Reason.DNS_OPCODE_NOT_SERVED, "request"),
        (Reason.DNS_OPCODE_NOT_SERVED, "request"),
        (Reason.DNS_CLASS_NOT_SERVED, "request"),
        (Reason.DNS_MALFORMED, "request"),
        (Reason.DNS_MALFORMED, "request"),
    ]
    assert responder.count("none", "FORMERR") == 2


@pytest.mark.asyncio
async def test_an_exception_is_servfail_never_an_answer(
    responder: Responder, dns: DNSServer
) -> None:
    responder.vetter.policy = ExplodingPolicy()  # type: ignore[assignment]
    answer = await responder.ask("ok.test")
    assert answer == DnsAnswer(SERVFAIL, "internal_error")
    assert dns.queries == []
    [line] = responder.lines()
    assert line["decision"] == "deny" and line["reason"] == "internal_error"
    assert responder.count("A", "SERVFAIL") == 1


@pytest.mark.asyncio
async def test_a_new_policy_changes_the_answers(responder: Responder, dns: DNSServer) -> None:
    assert (await responder.ask("ok.test")).rcode == NOERROR
    responder.vetter.policy = compiled("network:\n  egress: [priv.test]\n")  # a reload's swap
    assert await responder.ask("ok.test") == DnsAnswer(REFUSED, "not_allowed")


@pytest.mark.asyncio
async def test_messages_refused_by_the_transport_are_audited(responder: Responder) -> None:
    responder.responder.refuse_message(
        PEER, Reason.DNS_MALFORMED, "not a DNS message", rcode=FORMERR
    )
    responder.responder.refuse_message(PEER, "dns_not_a_query", "a response", rcode=None)
    lines = responder.lines()
    assert [(x["reason"], x["protocol"], x["host"]) for x in lines] == [
        (Reason.DNS_MALFORMED, "dns", None),
        ("dns_not_a_query", "dns", None),
    ]
    assert responder.count("none", "FORMERR") == 1 and responder.count("none", "dropped") == 1
