"""Interception on a transparent listener (issue 13): in a network namespace the test creates
(root only), nftables redirects TLS for 127.0.0.5 to `egress-proxy run --mode transparent`;
clients that know nothing of a proxy (Python's ssl, curl) reach a host whose rules are URL
prefixes, and get it intercepted exactly as through CONNECT: the SNI decides the name, our CA
signs, every request is decided on its path, h2c is refused. Under `inspection.mode: all` a host
allowed whole is intercepted too, and a request inside for another host (domain fronting) is
refused. Skips with the reason when not root or without `ip` / `nft`."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from support.netns import IP, NFT, needs_namespaces, run
from support.real_servers import free_port

TESTS = Path(__file__).resolve().parent
pytestmark = [pytest.mark.integration, *needs_namespaces]


def scenario(tmp_path: Path, mode: str) -> dict:
    namespace = f"egress-ti-{uuid.uuid4().hex[:8]}"
    proxy_port, tls_port = 15002, free_port()
    run(str(IP), "netns", "add", namespace)
    try:
        run(str(IP), "link", "set", "lo", "up", namespace=namespace)
        rules = f"""
table inet egress_test {{
  chain out {{
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.5 tcp dport {tls_port} redirect to :{proxy_port}
  }}
}}
"""
        run(str(NFT), "-f", "-", namespace=namespace, input=rules)
        out = run(
            sys.executable, "-m", "support.transparent_interception_scenario",
            str(proxy_port), str(tls_port), str(tmp_path), mode,
            namespace=namespace, cwd=str(TESTS),  # where `support` is a package
        )  # fmt: skip
    finally:
        run(str(IP), "netns", "delete", namespace)
    results = json.loads(out.strip().splitlines()[-1])
    assert "start" not in results, results.get("start")
    results["tls_port"] = tls_port
    return results


@pytest.mark.parametrize("mode", ["prefixes", "all"])
def test_transparent_tls_is_intercepted_like_connect(tmp_path: Path, mode: str) -> None:
    results = scenario(tmp_path, mode)
    diagnostics = results["stderr"]
    port = results["tls_port"]
    # A host whose rules decide paths: intercepted, each request decided on its own.
    assert results["api"] == {"ok": True, "status": "200", "denied": []}, diagnostics
    assert results["admin"] == {"ok": True, "status": "403", "denied": ["path_not_allowed"]}
    assert results["h2c"] == {"ok": True, "status": "403", "denied": ["upgrade_refused"]}
    assert results["curl"]["status"] == "200", results["curl"]
    assert results["curl"]["version"] == "2", results["curl"]  # ALPN h2 here too
    # A host allowed whole: passthrough (its own certificate) unless every TLS connection is
    # intercepted; then ours, and a request inside for another host is refused.
    if mode == "prefixes":
        assert results["whole_own_ca"]["status"] == "200", diagnostics
        assert results["whole_proxy_ca"] == {"ok": False, "error": "SSLCertVerificationError"}
    else:
        assert results["whole_own_ca"] == {"ok": False, "error": "SSLCertVerificationError"}
        assert results["whole_proxy_ca"]["status"] == "200", diagnostics
        assert results["whole_fronted"] == {
            "ok": True, "status": "403", "denied": ["host_mismatch"]
        }  # fmt: skip
    # Only allowed requests reached the upstream, each naming its own host.
    expected = [f"paths.test:{port}"] * 2 + [f"whole.test:{port}"]
    assert sorted(results["upstream_hosts"]) == expected
    audit = results["audit"]
    gates = [x for x in audit if x.get("stage") == "sni" and x["event"] == "decision"]
    assert {(x["plane"], x["protocol"], x["decision"]) for x in gates} == {("l4", "tls", "allow")}
    # One line per request: an allow at its last stage (the address), a denial at the stage
    # that denied it (the name, on its path).
    requests = {(x["path"], x["stage"], x["reason"]) for x in audit
                if x.get("protocol") == "https" and x["event"] == "decision"}  # fmt: skip
    assert ("/api/x", "address", "allowed") in requests
    assert ("/admin", "name", "path_not_allowed") in requests
    intercepted = {x["host"] for x in audit if x["event"] == "close" and x["plane"] == "l7"}
    assert intercepted == ({"paths.test"} if mode == "prefixes" else {"paths.test", "whole.test"})
    assert not any(x["reason"] == "inspection_unsupported" for x in audit)
