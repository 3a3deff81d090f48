"""Real clients (curl, openssl s_client) against the real `egress-proxy run` process.

A TLS upstream of the test's own (a trustme certificate for tls.test) listens on 127.0.0.1; the
test DNS server answers for the names. What is checked is what a user sees: the CONNECT status
and its `X-Egress-Denied` header, whether the client verified the upstream's own certificate
(the proxy passes TLS through, it does not intercept), the audit lines and the metrics.

Answers that must be refused include non-loopback addresses (link-local, metadata, NAT64,
private). For those the client sends no TLS after its CONNECT: even a proxy that wrongly
answered 200 would then close the tunnel at its SNI gate (not TLS) before dialling, so no test
here can make anything dial beyond loopback.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dns_server import DNSServer, running_dns_server
from support.running import OPENSSL, RunningProxy, curl, metric_value, wait_for
from support.upstreams import TLS_BODY, TLSUpstream, tls_upstream

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [tls.test, other.test, refused.test]\n"
# 127.0.0.1 only: 127.0.0.2 stays a refused loopback address.
ALLOW = ("127.0.0.1/32",)


# -- a TLS upstream ----------------------------------------------------------------------------


# -- fixtures: one proxy for the module ----------------------------------------------------------


@pytest.fixture(scope="module")
def dns() -> Iterator[DNSServer]:
    with running_dns_server() as server:
        server.set("tls.test", a=["127.0.0.1"])
        server.set("other.test", a=["127.0.0.1"])
        yield server


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSUpstream]:
    with tls_upstream(tmp_path_factory.mktemp("tls")) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, dns: DNSServer) -> Iterator[RunningProxy]:
    directory = tmp_path_factory.mktemp("proxy")
    with RunningProxy(directory, MANIFEST, dns=dns, allow=ALLOW) as running:
        yield running


def s_client(proxy_port: int, target: str, *args: str) -> tuple[int, str]:
    """openssl s_client through the proxy; stdin is empty, so it ends after the handshake."""
    result = subprocess.run(
        [OPENSSL, "s_client", "-proxy", f"127.0.0.1:{proxy_port}", "-connect", target, *args],
        input=b"",
        capture_output=True,
        timeout=20,
    )
    return result.returncode, (result.stdout + result.stderr).decode("latin-1")


def decisions_for(proxy: RunningProxy, host: str) -> list[dict]:
    return [line for line in proxy.decisions() if line["host"] == host]


# -- 1. an allowed tunnel, end to end ------------------------------------------------------------


def test_allowed_tunnel_reaches_the_real_upstream(
    proxy: RunningProxy, upstream: TLSUpstream
) -> None:
    url = f"https://tls.test:{upstream.port}/"
    before_lines = len(proxy.audit())
    connections, received = upstream.snapshot()
    result = curl(proxy.port, url, "--cacert", str(upstream.ca_file))
    assert result.returncode == 0, result
    assert result.connect_status == 200
    assert (result.status, result.body) == (200, TLS_BODY.decode())

    # Without the test CA the client refuses the certificate it got: it is the upstream's own
    # (signed by the test CA), not one the proxy minted.
    result = curl(proxy.port, url)
    assert result.connect_status == 200
    assert result.returncode == 60, result  # CURLE_PEER_FAILED_VERIFICATION
    assert result.status == 0 and result.body == ""

    # The very certificate the upstream holds, verified by the client against the test CA.
    code, out = s_client(
        proxy.port,
        f"tls.test:{upstream.port}",
        "-servername",
        "tls.test",
        "-CAfile",
        str(upstream.ca_file),
        "-verify_return_error",
    )
    assert code == 0, out
    assert "Verify return code: 0 (ok)" in out
    presented = re.search(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----\n", out, re.S)
    assert presented is not None and presented[0] == upstream.leaf_pem

    # Three tunnels reached the upstream, each opened by a ClientHello.
    after = upstream.snapshot()
    assert after[0] == connections + 3 and after[1] > received, (after, connections, received)

    lines = [line for line in proxy.audit()[before_lines:] if line["event"] == "decision"]
    assert all(line["host"] == "tls.test" and line["decision"] == "allow" for line in lines)
    assert [line["stage"] for line in lines] == ["sni"] * 3, lines  # one line per decision
    assert {line["reason"] for line in lines} == {"allowed"}
    assert lines[0]["pinned"] == ["127.0.0.1"] and lines[0]["sni"] == "tls.test"


# -- 2. a denied name ------------------------------------------------------------------------


def test_denied_name_is_403_and_never_resolved(
    proxy: RunningProxy, dns: DNSServer, upstream: TLSUpstream
) -> None:
    before = upstream.snapshot()
    result = curl(
        proxy.port, f"https://denied.test:{upstream.port}/", "--cacert", str(upstream.ca_file)
    )
    assert result.connect_status == 403
    assert result.returncode == 56, result  # CURLE_RECV_ERROR: CONNECT tunnel failed
    assert result.headers["x-egress-denied"] == "not_allowed"
    assert result.status == 0 and result.body == ""
    assert dns.count("denied.test") == 0
    assert upstream.snapshot() == before
    (line,) = decisions_for(proxy, "denied.test")
    assert (line["decision"], line["reason"], line["stage"]) == ("deny", "not_allowed", "name")
    assert line["method"] == "CONNECT" and line["resolved"] is None


# -- 3. answers that are refused whole ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "a", "aaaa", "reason"),
    [
        ("loopback", ["127.0.0.2"], [], "loopback"),
        ("mapped", [], ["::ffff:127.0.0.1"], "ipv4_mapped"),
        ("linklocal", ["169.254.7.7"], [], "link_local"),
        ("nat64", [], ["64:ff9b::a00:1"], "nat64"),
        ("metadata", ["169.254.169.254"], [], "metadata"),
        ("metadata6", [], ["fd00:ec2::254"], "metadata"),
        ("mixed", ["127.0.0.1", "10.0.0.1"], [], "mixed_answer"),
    ],
)
def test_refused_answer_is_403_and_nothing_is_dialled(
    proxy: RunningProxy,
    dns: DNSServer,
    upstream: TLSUpstream,
    name: str,
    a: list[str],
    aaaa: list[str],
    reason: str,
) -> None:
    host = f"{name}.refused.test"
    dns.set(host, a=a, aaaa=aaaa)
    loopback_only = all(
        addr.startswith("127.") or addr.startswith("::ffff:127.") for addr in a + aaaa
    )
    before = upstream.snapshot()
    if loopback_only:
        # A real TLS client: a proxy that let this through would dial our upstream.
        result = curl(
            proxy.port, f"https://{host}:{upstream.port}/", "--cacert", str(upstream.ca_file)
        )
    else:
        # No TLS after CONNECT (see the module docstring): nothing can dial beyond loopback.
        result = curl(proxy.port, f"http://{host}:{upstream.port}/", "-p")
    assert result.connect_status == 403, result
    assert result.headers["x-egress-denied"] == reason
    assert result.status == 0 and result.body == ""
    assert dns.count(host) >= 1  # the name was allowed, so it was resolved

    if loopback_only:
        # Plain HTTP is decided per request the same way.
        plain = curl(proxy.port, f"http://{host}:{upstream.port}/plain")
        assert plain.status == 403 and plain.headers["x-egress-denied"] == reason
    assert upstream.snapshot() == before  # no connection, no byte

    # Per request one line: the answer refused, with the rule that admitted the name and every
    # address the answer held.
    lines = decisions_for(proxy, host)
    requests = 2 if loopback_only else 1
    stages = [(line["stage"], line["decision"]) for line in lines]
    assert stages == [("address", "deny")] * requests, lines
    for line in lines:
        assert line["rule"] is not None
        assert line["reason"] == reason
        assert sorted(line["resolved"]) == sorted(a + aaaa) and line["pinned"] == []


# -- 4. the SNI gate -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "reason", "sni"),
    [
        (["-servername", "other.test"], "sni_mismatch", "other.test"),
        (["-noservername"], "sni_missing", None),
    ],
)
def test_sni_gate_closes_the_tunnel_before_any_dial(
    proxy: RunningProxy, upstream: TLSUpstream, args: list[str], reason: str, sni: str | None
) -> None:
    before_lines = len(proxy.audit())
    before = upstream.snapshot()
    code, out = s_client(proxy.port, f"tls.test:{upstream.port}", *args)
    assert code != 0, out
    # The tunnel closed before any server byte: no certificate, no cipher.
    assert "no peer certificate available" in out, out
    assert "BEGIN CERTIFICATE" not in out and "Cipher is (NONE)" in out, out
    # The fast path dials before its 200 (so a dial failure is a 502 with a reason), so the
    # upstream may see the connection; it never sees a byte of the refused ClientHello.
    connections, received = upstream.snapshot()
    assert received == before[1] and connections in (before[0], before[0] + 1)

    def sni_denials() -> list[dict]:
        new = proxy.audit()[before_lines:]
        return [line for line in new if line["event"] == "decision" and line["stage"] == "sni"]

    wait_for(sni_denials, timeout=5, what="the SNI decision line")
    (line,) = sni_denials()
    assert (line["decision"], line["reason"], line["host"]) == ("deny", reason, "tls.test")
    assert line["sni"] == sni and line["port"] == upstream.port


# -- 5. metrics and audit after a mix of requests ----------------------------------------------


def test_metrics_and_audit_account_for_every_decision(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    dns.set("loopback.refused.test", a=["127.0.0.2"])
    cacert = ("--cacert", str(upstream.ca_file))
    with RunningProxy(tmp_path, MANIFEST, dns=dns, allow=ALLOW, session_id="mix") as proxy:
        port, up = proxy.port, upstream.port
        for _ in range(2):
            assert curl(port, f"https://tls.test:{up}/", *cacert).status == 200
        assert (
            curl(port, f"https://other.test:{up}/", *cacert).returncode == 60
        )  # cert for tls.test
        assert curl(port, f"https://nope.test:{up}/", *cacert).connect_status == 403
        result = curl(port, f"https://loopback.refused.test:{up}/", *cacert)
        assert result.headers["x-egress-denied"] == "loopback"
        assert s_client(port, f"tls.test:{up}", "-servername", "other.test")[0] != 0
        assert s_client(port, f"tls.test:{up}", "-noservername")[0] != 0
        connections = 7

        wait_for(lambda: len(proxy.closes()) == connections, timeout=10, what="7 close lines")
        decisions, closes = proxy.decisions(), proxy.closes()
        metrics = proxy.metrics()

    counted: dict[tuple[str, str, str], int] = {}
    for line in decisions:
        key = (line["decision"], line["reason"], line["stage"])
        counted[key] = counted.get(key, 0) + 1
    assert counted == {
        # One line per decision: tls.test twice and other.test once (the client refused its
        # certificate after the gate) allowed at the SNI gate; the rest denied where they were.
        ("allow", "allowed", "sni"): 3,
        ("deny", "not_allowed", "name"): 1,
        ("deny", "loopback", "address"): 1,
        ("deny", "sni_mismatch", "sni"): 1,
        ("deny", "sni_missing", "sni"): 1,
    }
    # One decision line per decision: each counter equals its audit lines.
    for (decision, reason, stage), count in counted.items():
        value = metric_value(
            metrics,
            "egress_decisions_total",
            decision=decision,
            reason=reason,
            stage=stage,
            plane="l4",  # CONNECT tunnels are the fast path's
        )
        assert value == count, (decision, reason, stage, value, count)
    assert metric_value(metrics, "egress_decisions_total") == len(decisions)
    assert all(line["session"] == "mix" for line in decisions + closes)

    # One close line per client connection, with the bytes of allowed tunnels.
    assert len({line["connection"] for line in decisions}) == connections
    assert {line["connection"] for line in closes} == {line["connection"] for line in decisions}
    # Tunnels that carried bytes: tls.test twice, other.test. (The SNI-refused ones were
    # dialled before their 200, so they name an upstream too, but moved nothing.)
    tunnels = [line for line in closes if line["bytes_up"] > 0]
    assert len(tunnels) == 3
    for line in tunnels:
        assert line["upstream"] == f"127.0.0.1:{up}" and line["protocol"] == "connect"
        assert line["bytes_up"] > 200 and line["bytes_down"] > 500, line  # hello; certificate
    served = [line for line in tunnels if line["host"] == "tls.test"]
    assert len(served) == 2 and all(line["sni"] == "tls.test" for line in served)
    for line in closes:
        if line not in tunnels:
            assert (line["bytes_up"], line["bytes_down"]) == (0, 0), line
    assert metric_value(metrics, "egress_bytes_total", direction="up") == sum(
        line["bytes_up"] for line in closes
    )
    assert metric_value(metrics, "egress_bytes_total", direction="down") == sum(
        line["bytes_down"] for line in closes
    )
    assert metric_value(metrics, "egress_connections_total") == connections
