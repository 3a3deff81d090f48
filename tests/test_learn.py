"""Learning mode (`egress-proxy run --learn`): what only a manifest entry would allow is let
through and audited as `would_deny`; everything else holds in full. The policy core's part
(`Policy.learn`) directly, then the real `egress-proxy run` process (tests/support/running.py)
with the tests' own DNS server, real clients (curl, urllib, dnspython, a TLS client) on loopback
only.
"""

from __future__ import annotations

import ipaddress
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trustme
from dns import message as dnsmessage
from dns import query as dnsquery
from dns import rcode as dnsrcode
from support.dns_server import DNSServer
from support.running import (
    LOOPBACK,
    ROOT,
    RunningProxy,
    curl,
    http_upstream,
    make_config,
    metric_value,
    wait_for,
)
from support.tls import tls_context
from support.upstreams import TLS_BODY, TLSUpstream, recording_upstream, tls_upstream

from policy import OperatorRules, Reason, compile_policy, load_ceiling, load_manifest
from policy.learning import LEARNABLE
from proxy.boundary.sandbox import preflight
from proxy.boundary.sandbox.net import AddressPlan, SessionNames
from proxy.boundary.sandbox.session_proxy import proxy_command
from proxy.cli import build_parser, main
from proxy.cli.sandbox import options_from

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

# 127.0.0.2 is loopback the operator denies, inside the loopback it otherwise allows.
CONFIG_EXTRA = "  deny: [127.0.0.2/32]\n"


def toml(port: int = 443, scheme: str = "https") -> str:
    """An agent.toml (written as YAML) with a host, a URL prefix on `port` and blocks."""
    return (
        f"network_access:\n  allowed: [up.test, '{scheme}://paths.test:{port}/api/']\n"
        "  blocked: [blocked.test, 'https://paths.test/api/admin/', 'https://open.test/secret/']\n"
    )


TOML = toml()


def learning_proxy(
    directory: Path, manifest: str, dns: DNSServer, *args: str, extra: str = ""
) -> RunningProxy:
    config = make_config(dns, allow=("127.0.0.0/8",)) + CONFIG_EXTRA + extra
    return RunningProxy(directory, manifest, config=config, dns=dns, args=("--learn", *args))


@pytest.fixture
def names(dns: DNSServer) -> DNSServer:
    for name in ("up.test", "new.test", "paths.test", "blocked.test", "open.test", "tls.test"):
        dns.set(name, a=["127.0.0.1"])
    dns.set("denied-address.test", a=["127.0.0.2"])
    return dns


def would_deny_lines(proxy: RunningProxy, host: str) -> list[dict]:
    return [
        line
        for line in proxy.decisions()
        if line["host"] == host and line["decision"] == "would_deny"
    ]


# -- the policy core -----------------------------------------------------------------------


def test_only_manifest_refusals_are_learnable() -> None:
    assert {Reason.NOT_ALLOWED, Reason.OUTSIDE_CEILING, Reason.PATH_NOT_ALLOWED} == LEARNABLE
    policy = compile_policy(load_manifest(TOML, source="agent.yaml"))
    for target in ("new.test:443", "https://paths.test/other"):
        refused = policy.decide(target)
        learned = policy.learn(refused, target)
        assert not refused.allowed and learned.allowed and learned.would_deny, target
        assert learned.reason == refused.reason
    # A refusal no manifest entry lifts stays one.
    for target in ("blocked.test:443", "127.0.0.1:80", "localhost:80", "printer.local:443"):
        refused = policy.decide(target)
        assert policy.learn(refused, target) == refused, target
    # An allow is untouched.
    allowed = policy.decide("up.test:443")
    assert policy.learn(allowed, "up.test:443") is allowed


def test_a_learned_host_with_blocked_paths_is_inspected_so_the_blocks_still_hold() -> None:
    policy = compile_policy(load_manifest(TOML, source="agent.yaml"))
    tunnel = policy.learn(policy.decide("open.test:443"), "open.test:443")
    assert tunnel.allowed and tunnel.needs_inspection
    inside = "https://open.test:443/secret/x"
    assert policy.learn(policy.decide(inside), inside).reason == Reason.BLOCKED
    plain = policy.learn(policy.decide("http://new.test/x"), "http://new.test/x")
    assert plain.allowed and not plain.needs_inspection
    # Without inspection such a host cannot be let through at all.
    off = compile_policy(
        load_manifest(TOML, source="agent.yaml"), operator=OperatorRules(inspection_enabled=False)
    )
    refused = off.learn(off.decide("open.test:443"), "open.test:443")
    assert not refused.allowed and refused.reason == Reason.INSPECTION_DISABLED


def test_outside_the_ceiling_is_learned_with_its_reason() -> None:
    manifest = load_manifest("network:\n  egress: [up.test, out.test]\n")
    policy = compile_policy(manifest, load_ceiling("egress: [up.test]\n"))
    refused = policy.decide("out.test:443")
    learned = policy.learn(refused, "out.test:443")
    assert learned.allowed and learned.reason == Reason.OUTSIDE_CEILING and learned.would_deny


# -- the running proxy -----------------------------------------------------------------------


def test_learn_lets_a_new_name_through_and_refuses_what_no_entry_lifts(
    tmp_path: Path, names: DNSServer
) -> None:
    with (
        http_upstream() as upstream,
        tls_upstream(tmp_path) as tls,
    ):
        proxy = learning_proxy(tmp_path / "p", toml(upstream.port, "http"), names)
        with proxy:
            learn_and_refuse(proxy, upstream.port, tls)


def learn_and_refuse(proxy: RunningProxy, port: int, tls: TLSUpstream) -> None:
    """What test_learn_lets_a_new_name_through_... checks, against a running learning proxy
    whose HTTP upstream listens on `port`."""
    # curl, plain HTTP: a declared name, and one the manifest does not allow.
    for host in ("up.test", "new.test"):
        result = curl(proxy.port, f"http://{host}:{port}/{host}")
        assert (result.status, result.body) == (200, "hello from upstream\n"), result
    # urllib through the proxy: the path rules' host, on a path outside its prefixes.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
    with opener.open(f"http://paths.test:{port}/other/x", timeout=10) as response:
        assert response.status == 200
    # A TLS tunnel (CONNECT, SNI gate, passthrough): the upstream's own certificate.
    result = curl(proxy.port, f"https://tls.test:{tls.port}/", "--cacert", str(tls.ca_file))
    assert (result.connect_status, result.body) == (200, TLS_BODY.decode()), result
    # Plain HTTP inside a tunnel still names the tunnel's host and port in its Host.
    with socket.create_connection((LOOPBACK, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT new.test:{port} HTTP/1.1\r\nHost: new.test:{port}\r\n\r\n".encode())
        assert b" 200 " in sock.recv(4096)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: new.test\r\n\r\n")
        assert b"X-Egress-Denied: host_mismatch" in sock.recv(4096)

    # Everything a manifest entry cannot lift is still refused.
    refused = {
        "denied-address.test": "operator_deny",  # the operator's deny list, in loopback
        "blocked.test": "blocked",
        "localhost": "loopback_name",
    }
    for host, reason in refused.items():
        result = curl(proxy.port, f"http://{host}:{port}/")
        assert result.status == 403, (host, result)
        assert result.headers["x-egress-denied"] == reason
    result = curl(proxy.port, f"http://127.0.0.1:{port}/")
    assert result.headers["x-egress-denied"] == "ip_literal"
    result = curl(proxy.port, f"http://paths.test:{port}/api/admin/x")
    assert result.headers["x-egress-denied"] == "blocked"

    lines = proxy.decisions()
    assert [line["decision"] for line in lines if line["host"] == "up.test"] == ["allow"]
    (new,) = would_deny_lines(proxy, "new.test")
    assert new["reason"] == "not_allowed" and new["path"] == "/new.test"
    assert new["port"] == port and new["pinned"] == ["127.0.0.1"]
    assert "learning: let through" in new["message"]
    (path,) = would_deny_lines(proxy, "paths.test")
    assert path["reason"] == "path_not_allowed" and path["path"] == "/other/x"
    (tunnel,) = would_deny_lines(proxy, "tls.test")
    assert tunnel["stage"] == "sni" and tunnel["sni"] == "tls.test"
    denied = {line["host"]: line["reason"] for line in lines if line["decision"] == "deny"}
    assert denied["denied-address.test"] == "operator_deny"
    assert denied["blocked.test"] == "blocked"
    assert denied["new.test"] == "host_mismatch"
    # The refused addresses were never dialled: only 127.0.0.1 served the tunnel.
    assert tls.snapshot()[0] == 1

    # Loud: stderr at start, /readyz, and the metrics.
    assert "LEARNING MODE" in proxy.stderr()
    assert proxy.admin_get("/readyz") == (200, "ready\nlearn: true\n")
    metrics = proxy.metrics()
    assert metric_value(metrics, "egress_learn_mode") == 1
    assert metric_value(metrics, "egress_would_deny_total", reason="not_allowed") == 2
    assert metric_value(metrics, "egress_would_deny_total", reason="path_not_allowed") == 1
    assert metric_value(metrics, "egress_decisions_total", decision="would_deny") == 3
    # The denial feed carries denials only.
    assert '"would_deny"' not in proxy.admin_get("/denials")[1]


def test_the_dns_responder_answers_what_it_would_refuse_with_the_same_address_checks(
    tmp_path: Path, names: DNSServer
) -> None:
    args = ("--dns-listen", f"{LOOPBACK}:0")
    with learning_proxy(tmp_path, "network:\n  egress: [up.test]\n", names, *args) as proxy:
        found = re.search(r"dns://127\.0\.0\.1:(\d+)", proxy.stderr())
        assert found is not None, proxy.stderr()
        port = int(found[1])

        def ask(name: str) -> dnsmessage.Message:
            query = dnsmessage.make_query(name, "A")
            return dnsquery.udp(query, LOOPBACK, port=port, timeout=5)

        answer = ask("new.test")
        assert dnsrcode.to_text(answer.rcode()) == "NOERROR"
        assert [r.address for rrset in answer.answer for r in rrset] == ["127.0.0.1"]
        assert dnsrcode.to_text(ask("denied-address.test").rcode()) == "REFUSED"
        assert dnsrcode.to_text(ask("printer.local").rcode()) == "REFUSED"
        (line,) = would_deny_lines(proxy, "new.test")
        assert (line["protocol"], line["method"], line["reason"]) == ("dns", "A", "not_allowed")
        # A name refused before DNS is never looked up.
        assert names.count("printer.local") == 0


def test_without_learn_nothing_is_let_through_and_nothing_says_learning(
    tmp_path: Path, names: DNSServer
) -> None:
    config = make_config(names) + CONFIG_EXTRA
    with (
        http_upstream() as upstream,
        RunningProxy(tmp_path, "network:\n  egress: [up.test]\n", config=config) as proxy,
    ):
        result = curl(proxy.port, f"http://new.test:{upstream.port}/")
        assert result.headers["x-egress-denied"] == "not_allowed"
        assert proxy.admin_get("/readyz") == (200, "ready\n")
        assert metric_value(proxy.metrics(), "egress_learn_mode") == 0
        assert "LEARNING" not in proxy.stderr()


def test_learn_forbid_refuses_to_start_naming_the_key(tmp_path: Path, names: DNSServer) -> None:
    proxy = learning_proxy(
        tmp_path, "network:\n  egress: [up.test]\n", names, extra="learn: forbid\n"
    )
    proxy.wait = False
    with proxy:
        code = proxy.wait_exit()
    assert code == 2
    stderr = proxy.stderr()
    assert "learn" in stderr and "forbid" in stderr and str(proxy.files.config) in stderr
    assert "listening on" not in stderr
    # The same config without --learn starts as usual; a bad value is a config error.
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(proxy.files.manifest), "--config",
         str(proxy.files.config)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("learn: maybe\n")
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(proxy.files.manifest), "--config", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "learn" in result.stderr, result.stderr


def _get_keep_alive(sock: socket.socket, host: str, port: int) -> bytes:
    sock.sendall(f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    data = b""
    deadline = time.monotonic() + 10
    while not data.endswith(b"hello from upstream\n") and time.monotonic() < deadline:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_reload_to_learn_forbid_stops_learning_and_closes_what_it_let_in(
    tmp_path: Path, names: DNSServer
) -> None:
    with (
        http_upstream() as upstream,
        learning_proxy(tmp_path, "network:\n  egress: [up.test]\n", names) as proxy,
    ):
        learned = socket.create_connection((LOOPBACK, proxy.port), timeout=10)
        declared = socket.create_connection((LOOPBACK, proxy.port), timeout=10)
        with learned, declared:
            assert b" 200 " in _get_keep_alive(learned, "new.test", upstream.port)
            assert b" 200 " in _get_keep_alive(declared, "up.test", upstream.port)
            proxy.files.config.write_text(proxy.files.config.read_text() + "learn: forbid\n")
            proxy.send_signal(signal.SIGHUP)
            wait_for(lambda: "LEARNING STOPPED" in proxy.stderr(), what="learning to stop")
            # The connection only learning let in is closed; the declared one still works.
            learned.settimeout(10)
            assert learned.recv(4096) == b""
            assert b" 200 " in _get_keep_alive(declared, "up.test", upstream.port)
        result = curl(proxy.port, f"http://new.test:{upstream.port}/")
        assert (result.status, result.headers["x-egress-denied"]) == (403, "not_allowed")
        assert proxy.admin_get("/readyz") == (200, "ready\n")
        assert metric_value(proxy.metrics(), "egress_learn_mode") == 0
        closes = [c for c in proxy.closes() if c["host"] == "new.test"]
        assert [c["reason"] for c in closes] == ["policy_reload"]
        # A later `learn: allow` does not turn it back on.
        proxy.files.config.write_text(proxy.files.config.read_text().replace("forbid", "allow"))
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: proxy.stderr().count("reloaded:") >= 2, what="the second reload")
        result = curl(proxy.port, f"http://new.test:{upstream.port}/")
        assert result.headers["x-egress-denied"] == "not_allowed"


# -- the sandbox passes it on ----------------------------------------------------------------


def test_sandbox_learn_reaches_its_proxy_and_learn_forbid_stops_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "agent.yaml"
    manifest.write_text("network:\n  egress: [up.test]\n")
    args = build_parser().parse_args(["sandbox", str(manifest), "--learn", "--", "true"])
    options = options_from(args, {})
    assert options.learn
    plan = AddressPlan(
        ipaddress.ip_network("169.254.240.0/30"), ipaddress.ip_network("fd00:1::/64")
    )
    command = proxy_command(options, plan, (1, 2, 3), SessionNames("ab12"), ("127.0.0.1", 9))
    assert command[-1] == "--learn" and command[3] == "run"
    quiet = options_from(build_parser().parse_args(["sandbox", str(manifest), "--", "true"]), {})
    assert "--learn" not in proxy_command(quiet, plan, (1, 2, 3), SessionNames("ab12"), ("h", 9))

    # With `learn: forbid`, refused before the privileges are even looked at.
    config = tmp_path / "config.yaml"
    config.write_text("learn: forbid\n")
    monkeypatch.setattr(preflight, "missing_capabilities", lambda: ["CAP_NET_ADMIN"])
    code = main(["sandbox", str(manifest), "--config", str(config), "--learn", "--", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "learn" in err and "forbid" in err and "CAP_NET_ADMIN" not in err


def test_inside_interception_a_path_outside_the_prefixes_is_learned_and_blocks_still_hold(
    tmp_path: Path, names: DNSServer
) -> None:
    """HTTPS through the interception engine: each request inside is decided (and learned) on
    its own path; a blocked prefix under the same host is still refused."""
    ca = trustme.CA()
    upstream_ca = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(upstream_ca))
    with recording_upstream(tls_context(ca, "paths.test")) as (port, seen):
        extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {upstream_ca}\n"
        with learning_proxy(tmp_path / "p", toml(port), names, extra=extra) as proxy:
            trust = tmp_path / "client.pem"  # what the session trusts: our CA
            trust.write_bytes((tmp_path / "ca" / "session-ca.pem").read_bytes())
            inside = curl(proxy.port, f"https://paths.test:{port}/other/x", "--cacert", str(trust))
            assert inside.status == 200, inside
            allowed = curl(proxy.port, f"https://paths.test:{port}/api/x", "--cacert", str(trust))
            assert allowed.status == 200, allowed
            admin = curl(
                proxy.port, f"https://paths.test:{port}/api/admin/x", "--cacert", str(trust)
            )
            assert admin.status == 403 and admin.headers["x-egress-denied"] == "blocked"
            wait_for(lambda: len(would_deny_lines(proxy, "paths.test")) >= 1, what="the line")
            (learned,) = would_deny_lines(proxy, "paths.test")
            assert learned["plane"] == "l7" and learned["protocol"] == "https"
            assert (learned["reason"], learned["path"]) == ("path_not_allowed", "/other/x")
    # Only the two requests the session let through reached the upstream.
    assert [line.split()[1] for line, _ in seen.heads] == ["/other/x", "/api/x"]
