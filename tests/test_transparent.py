"""`egress-proxy run --mode transparent` in a network namespace the test creates (root only):
nftables redirects the namespace's TCP to 127.0.0.5 and fd00:5::5 (addresses of that namespace)
to the proxy, which decides TLS on the SNI and plain HTTP on the Host header, reads the original
destination (SO_ORIGINAL_DST, v4 and v6) only for its port, and connects to the addresses it
checked for the name. Spelled twice: `--mode transparent` with bare listeners, and
`--listen transparent://...` beside an explicit `http://` listener and a `--dns-listen` in the
same process, each of which is used too. Skips with the reason when not root or without `ip` /
`nft`."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.netns import IP, NFT, needs_namespaces, run
from support.real_servers import free_port

TESTS = Path(__file__).resolve().parent

pytestmark = [pytest.mark.integration, *needs_namespaces]


@pytest.mark.parametrize("spelling", ["mode", "mixed"])
def test_transparent_mode_decides_on_sni_and_host(tmp_path: Path, spelling: str) -> None:
    namespace = f"egress-t-{uuid.uuid4().hex[:8]}"
    proxy_port, tls_port, http_port = 15001, free_port(), free_port()
    run(str(IP), "netns", "add", namespace)
    try:
        run(str(IP), "link", "set", "lo", "up", namespace=namespace)
        run(str(IP), "-6", "addr", "add", "fd00:5::5/128", "dev", "lo", namespace=namespace)
        rules = f"""
table inet egress_test {{
  chain out {{
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.5 tcp dport {{ {tls_port}, {http_port} }} redirect to :{proxy_port}
    ip6 daddr fd00:5::5 tcp dport {{ {tls_port}, {http_port} }} redirect to :{proxy_port}
  }}
}}
"""
        run(str(NFT), "-f", "-", namespace=namespace, input=rules)
        out = run(
            sys.executable,
            "-m",
            "support.transparent_scenario",
            str(proxy_port),
            str(tls_port),
            str(http_port),
            str(tmp_path),
            *(["mixed"] if spelling == "mixed" else []),
            namespace=namespace,
            cwd=str(TESTS),  # where `support` is a package
        )
    finally:
        subprocess.run([str(IP), "netns", "delete", namespace], capture_output=True, timeout=30)
    results = json.loads(out.strip().splitlines()[-1])
    assert "start" not in results, results.get("start")
    diagnostics = results["stderr"]

    # TLS: decided on the SNI, relayed to the checked address of the name (127.0.0.1 or ::1),
    # over IPv4 and IPv6 originals alike; the client verified the real certificate.
    assert results["tls_v4"] == {"ok": True, "status": "200"}, diagnostics
    assert results["tls_v6"] == {"ok": True, "status": "200"}, diagnostics
    explicit = 1 if spelling == "mixed" else 0  # the explicit CONNECT goes to tls.test too
    tls_connections = (
        results["upstream_connections"]["tls"] + results["upstream_connections"]["tls6"]
    )
    assert tls_connections == 2 + explicit
    # A name outside the policy, and a ClientHello without SNI: closed, never resolved.
    # Refused in the client's own protocol: a TLS alert, which TLS stacks name, not a reset.
    assert results["tls_denied"]["ok"] is False
    assert "ALERT_ACCESS_DENIED" in results["tls_denied"]["detail"], results["tls_denied"]
    assert results["tls_no_sni"]["ok"] is False
    assert "ALERT_ACCESS_DENIED" in results["tls_no_sni"]["detail"], results["tls_no_sni"]
    assert results["curl_denied"]["code"] == 35, results["curl_denied"]  # a TLS handshake error
    assert "access denied" in results["curl_denied"]["stderr"], results["curl_denied"]
    assert results["dns_denied_queries"] == 0
    # Plain HTTP: decided on the Host header by the front door's HTTP plane (plane l4), connected
    # to the name's checked address.
    assert results["http_allowed"]["status"] == "200", diagnostics
    assert results["upstream_hosts"]["http"] == [f"web.test:{http_port}"] * (1 + explicit)
    assert results["http_denied"]["status"] == "403"
    assert results["http_denied"]["denied"] == ["not_allowed"]
    assert results["http_no_host"]["status"] == "403"
    assert results["http_no_host"]["denied"] == ["host_mismatch"]
    # Not redirected at all: no original destination, closed.
    assert results["not_redirected"]["ok"] is False

    decisions = [x for x in results["audit"] if x["event"] == "decision"]
    reasons = {(x["plane"], x["protocol"], x["decision"], x["reason"]) for x in decisions}
    assert ("l4", "tls", "allow", "allowed") in reasons
    assert ("l4", "tls", "deny", "not_allowed") in reasons
    assert ("l4", "tls", "deny", "sni_missing") in reasons
    assert ("l4", "tls", "deny", "no_original_destination") in reasons
    assert ("l4", "http", "deny", "not_allowed") in reasons
    assert ("l4", "http", "allow", "allowed") in reasons
    assert not any(x["plane"] == "l7" for x in decisions)  # no TLS here needs interception
    # A tunnel's one allow line is its SNI gate's, naming the host its SNI gave.
    allowed = [x for x in decisions if x["protocol"] == "tls" and x["decision"] == "allow"]
    assert allowed and {(x["stage"], x["host"]) for x in allowed} == {("sni", "tls.test")}
    if spelling == "mixed":
        # One process: the explicit listener (CONNECT and plain HTTP) and the DNS listener.
        assert results["explicit_tls"] == {"ok": True, "status": "200"}, diagnostics
        assert results["explicit_denied"] == {"ok": False, "connect": "403"}
        assert results["explicit_http"]["status"] == "200", diagnostics
        assert results["dns_allowed"] == {"rcode": "NOERROR", "addresses": ["127.0.0.1"]}
        assert results["dns_denied"] == {"rcode": "REFUSED", "addresses": []}
        assert results["dns_denied_queries"] == 0
        assert ("l4", "connect", "allow", "allowed") in reasons
        assert ("l4", "dns", "deny", "not_allowed") in reasons
