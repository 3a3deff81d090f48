"""A sidecar-shaped session (`--dns-listen` v4 and v6, as deploy/kubernetes/sidecar/pod.yaml runs
it) costs about what a session without DNS listeners does, also after serving DNS: with
mitmproxy's DNS mode it took about 45 MB more. The real `egress-proxy run` process, asked with
dnspython over UDP and TCP on loopback; every loop bounded in count."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dns import message as dnsmessage
from dns import query as dnsquery
from support.dns_server import DNSServer
from support.running import LOOPBACK, RunningProxy, metric_value

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MANIFEST = "network:\n  egress: [ok.test]\n"
ALLOW = ("192.0.2.0/24", "2001:db8::/32")
NAMES = 300  # each asked A, AAAA and HTTPS over UDP and A over TCP: 1,200 queries
MAX_EXTRA_KIB = 5 * 1024


def test_a_dns_responder_session_stays_near_a_session_without_one(
    tmp_path: Path, dns: DNSServer
) -> None:
    for n in range(NAMES):
        dns.set(f"n{n}.ok.test", a=["192.0.2.1"], aaaa=["2001:db8::1"])
    with RunningProxy(tmp_path / "plain", MANIFEST, dns=dns, allow=ALLOW) as plain:
        baseline = plain.rss_kib()
    args = ("--dns-listen", f"{LOOPBACK}:0", "--dns-listen", "[::1]:0")
    with RunningProxy(tmp_path / "dns", MANIFEST, dns=dns, allow=ALLOW, args=args) as proxy:
        match = re.search(rf"dns://{re.escape(LOOPBACK)}:(\d+)", proxy.stderr())
        assert match, proxy.stderr()
        port = int(match[1])
        for n in range(NAMES):
            name = f"n{n}.ok.test"
            for rdtype in ("A", "AAAA", "HTTPS"):
                query = dnsmessage.make_query(name, rdtype)
                assert dnsquery.udp(query, LOOPBACK, port=port, timeout=5).rcode() == 0
            query = dnsmessage.make_query(name, "A")
            assert len(dnsquery.tcp(query, LOOPBACK, port=port, timeout=5).answer) == 1
        served = proxy.rss_kib()
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_dns_queries_total") == 4 * NAMES
        assert metric_value(metrics, "egress_engine_loaded") == 0
    assert served - baseline < MAX_EXTRA_KIB, (baseline, served)
