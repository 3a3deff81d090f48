"""mitmproxy is loaded only when the session can need TLS interception (issues 4 and 12), proved
on the real `egress-proxy run` process: started under `python -X importtime`, whose stderr lists
every module as its import finishes, so what the process imported so far can be read at any
moment.

- A plain agent.yaml session serves CONNECT tunnels (allowed and denied) on the front door
  without importing any mitmproxy module (`egress_engine_loaded 0`), nor making a CA.
- A manifest with URL-prefix rules loads the engine (and its CA) at start, before any connection;
  with inspection disabled it never does (such hosts are refused instead).
- `inspection.mode: all` loads it at start without any URL-prefix rule, and every allowed TLS
  connection is then intercepted (plane l7).
- A session with a SOCKS5 listener serves SOCKS5 tunnels (allowed and denied) in the front
  door too: mitmproxy is never imported.
- The sidecar's shape (`--dns-listen`, explicit, SOCKS5 and transparent listeners in one
  process): after answering DNS over UDP and TCP and serving plain HTTP, CONNECT and SOCKS5, it
  has never imported mitmproxy.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from dns import message as dnsmessage
from dns import query as dnsquery
from support.dns_server import DNSServer
from support.running import (
    CURL,
    HELLO,
    LOOPBACK,
    RunningProxy,
    curl,
    http_upstream,
    imported_modules,
    metric_value,
    wait_for,
)
from support.upstreams import TLS_BODY, TLSUpstream, tls_upstream

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [tls.test, up.test]\n"
# agent.toml's schema written in YAML (the harness names the file agent.yaml): a URL prefix.
PATHS = "schema_version: 1\nnetwork_access:\n  allowed: ['https://up.test/api/', 'tls.test']\n"
IMPORTTIME = ("-X", "importtime")


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("tls.test", "up.test", "denied.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[TLSUpstream]:
    with tls_upstream(tmp_path) as server:
        yield server


def mitmproxy_modules(proxy: RunningProxy) -> list[str]:
    return [m for m in imported_modules(proxy.stderr()) if m.split(".")[0] == "mitmproxy"]


def engine_loaded(proxy: RunningProxy) -> float | None:
    return metric_value(proxy.metrics(), "egress_engine_loaded")


def allowed_and_denied_tunnels(proxy: RunningProxy, upstream: TLSUpstream) -> None:
    """An allowed tunnel (the client verifies the upstream's own certificate) and a denied one,
    then their two close lines."""
    before = len(proxy.closes())
    url = f"https://tls.test:{upstream.port}/"
    allowed = curl(proxy.port, url, "--cacert", str(upstream.ca_file))
    assert (allowed.connect_status, allowed.status) == (200, 200), allowed.stderr
    assert allowed.body == TLS_BODY.decode()
    denied = curl(proxy.port, "https://denied.test/")
    assert denied.connect_status == 403
    assert denied.headers["x-egress-denied"] == "not_allowed"
    wait_for(lambda: len(proxy.closes()) == before + 2, what="two more close lines")


def test_a_passthrough_session_never_imports_mitmproxy(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    with RunningProxy(
        tmp_path / "run",
        MANIFEST,
        dns=dns,
        python_flags=IMPORTTIME,
        config_extra=f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n",
    ) as proxy:
        assert "proxy.dataplane.frontdoor" in imported_modules(
            proxy.stderr()
        )  # the flag took effect
        allowed_and_denied_tunnels(proxy, upstream)
        assert mitmproxy_modules(proxy) == []
        assert engine_loaded(proxy) == 0
        assert not (tmp_path / "ca").exists()  # nor was the inspection CA made
        assert {(x["plane"], x["host"]) for x in proxy.closes()} == {
            ("l4", "tls.test"),
            ("l4", "denied.test"),
        }
    assert proxy.returncode == 0


def test_a_socks5_session_never_imports_mitmproxy(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    with RunningProxy(
        tmp_path / "run",
        MANIFEST,
        dns=dns,
        python_flags=IMPORTTIME,
        config_extra=f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n",
        args=("--listen", "socks5://127.0.0.1:0"),
    ) as proxy:
        match = re.search(r" and socks5://127\.0\.0\.1:(\d+)", proxy.stderr())
        assert match, proxy.stderr()
        socks = f"127.0.0.1:{match[1]}"

        def through_socks(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
            command = [CURL, "-q", "-sS", "--max-time", "5", "--socks5-hostname", socks]
            return subprocess.run([*command, *args, url], capture_output=True, timeout=15)

        url = f"https://tls.test:{upstream.port}/"
        allowed = through_socks(url, "--cacert", str(upstream.ca_file))
        assert allowed.returncode == 0, allowed.stderr
        assert allowed.stdout == TLS_BODY  # the upstream's own certificate, verified
        denied = through_socks("https://denied.test/")
        assert denied.returncode == 97  # the SOCKS5 proxy refused (reply 2)
        wait_for(lambda: len(proxy.closes()) == 2, what="two close lines")
        assert mitmproxy_modules(proxy) == []
        assert engine_loaded(proxy) == 0
        assert not (tmp_path / "ca").exists()
        assert {(x["plane"], x["protocol"], x["host"]) for x in proxy.closes()} == {
            ("l4", "socks5", "tls.test"),
            ("l4", "socks5", "denied.test"),
        }
    assert proxy.returncode == 0


def test_url_prefix_rules_load_the_engine_at_start(tmp_path: Path, dns: DNSServer) -> None:
    with RunningProxy(
        tmp_path / "run",
        PATHS,
        dns=dns,
        python_flags=IMPORTTIME,
        config_extra=f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n",
    ) as proxy:
        # Before any connection: the engine, its imports and its CA are there.
        assert engine_loaded(proxy) == 1
        assert "mitmproxy.master" in mitmproxy_modules(proxy)
        assert (tmp_path / "ca" / "mitmproxy-ca-cert.pem").exists()
        assert proxy.audit() == []
    assert proxy.returncode == 0


def test_url_prefix_rules_with_inspection_disabled_never_load_it(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    config = f"inspection:\n  enabled: false\n  ca_dir: {tmp_path / 'ca'}\n"
    with RunningProxy(
        tmp_path / "run", PATHS, dns=dns, python_flags=IMPORTTIME, config_extra=config
    ) as proxy:
        refused = curl(proxy.port, "https://up.test/api/")
        assert refused.connect_status == 403
        assert refused.headers["x-egress-denied"] == "inspection_disabled"
        url = f"https://tls.test:{upstream.port}/"
        passed = curl(proxy.port, url, "--cacert", str(upstream.ca_file))
        assert passed.status == 200, passed.stderr
        assert mitmproxy_modules(proxy) == []
        assert engine_loaded(proxy) == 0
        assert not (tmp_path / "ca").exists()
    assert proxy.returncode == 0


def test_inspection_mode_all_loads_the_engine_and_intercepts_every_tunnel(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    ca = tmp_path / "ca"
    config = f"inspection:\n  ca_dir: {ca}\n  upstream_ca: {upstream.ca_file}\n  mode: all\n"
    with RunningProxy(tmp_path / "run", MANIFEST, dns=dns, config_extra=config) as proxy:
        assert engine_loaded(proxy) == 1
        url = f"https://tls.test:{upstream.port}/"
        # The upstream's own certificate no longer reaches the client: the proxy's does.
        own = curl(proxy.port, url, "--cacert", str(upstream.ca_file))
        assert own.connect_status == 200 and own.status == 0
        intercepted = curl(proxy.port, url, "--cacert", str(ca / "mitmproxy-ca-cert.pem"))
        assert (intercepted.status, intercepted.body) == (200, TLS_BODY.decode())
        wait_for(lambda: len(proxy.closes()) == 2, what="two close lines")
        assert {(x["plane"], x["protocol"]) for x in proxy.closes()} == {("l7", "connect")}
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_connections_total", plane="l7") == 2
    assert proxy.returncode == 0


def test_a_sidecar_session_never_imports_mitmproxy(
    tmp_path: Path, dns: DNSServer, upstream: TLSUpstream
) -> None:
    # The shape the sandbox and the Kubernetes sidecar run: DNS, explicit, SOCKS5 and
    # transparent listeners in one process; it serves DNS, plain HTTP, CONNECT and SOCKS5.
    args = (
        *("--dns-listen", f"{LOOPBACK}:0", "--dns-listen", "[::1]:0"),
        *("--listen", f"http://{LOOPBACK}:0", "--listen", f"socks5://{LOOPBACK}:0"),
        *("--listen", f"transparent://{LOOPBACK}:0"),
    )
    with (
        http_upstream() as plain,
        RunningProxy(
            tmp_path / "run", MANIFEST, dns=dns, python_flags=IMPORTTIME, args=args
        ) as proxy,
    ):
        assert re.search(r" and transparent://127\.0\.0\.1:\d+", proxy.stderr())
        socks = re.search(r" and socks5://127\.0\.0\.1:(\d+)", proxy.stderr())
        assert socks, proxy.stderr()
        served = curl(proxy.port, f"http://up.test:{plain.port}/plain")
        assert (served.status, served.body) == (200, HELLO.decode()), served
        refused = curl(proxy.port, f"http://denied.test:{plain.port}/plain")
        assert refused.headers["x-egress-denied"] == "not_allowed", refused
        assert plain.requests == ["/plain"]
        through = subprocess.run(
            [CURL, "-q", "-sS", "--max-time", "5", "--socks5-hostname", f"127.0.0.1:{socks[1]}",
             "--cacert", str(upstream.ca_file), f"https://tls.test:{upstream.port}/"],
            capture_output=True, timeout=15,
        )  # fmt: skip
        assert through.stdout == TLS_BODY, through.stderr
        wait_for(lambda: len(proxy.closes()) == 3, what="three close lines")
        assert "proxy.dns_responder.server" in imported_modules(
            proxy.stderr()
        )  # the flag took effect
        port = int(proxy.stderr().split(f"dns://{LOOPBACK}:")[1].split()[0])
        port6 = int(proxy.stderr().split("dns://[::1]:")[1].split()[0])
        for name, rdtype in (("tls.test", "A"), ("denied.test", "A"), ("tls.test", "HTTPS")):
            query = dnsmessage.make_query(name, rdtype)
            udp = dnsquery.udp(query, LOOPBACK, port=port, timeout=5)
            tcp = dnsquery.tcp(query, "::1", port=port6, timeout=5)
            assert udp.rcode() == tcp.rcode() and udp.answer == tcp.answer
        assert [str(r) for rrset in udp.answer for r in rrset] == []  # HTTPS: no records
        allowed_and_denied_tunnels(proxy, upstream)
        # One line per query and transport: tls.test's A allowed at its last stage (the
        # address), denied.test refused at its name, the HTTPS type refused as a request.
        queries = [
            (x["host"], x["method"], x["stage"], x["reason"])
            for x in proxy.decisions()
            if x["protocol"] == "dns"
        ]
        assert sorted(queries) == sorted(
            [
                ("tls.test", "A", "address", "allowed"),
                ("denied.test", "A", "name", "not_allowed"),
                ("tls.test", "HTTPS", "request", "dns_qtype_not_served"),
            ]
            * 2
        )
        assert mitmproxy_modules(proxy) == []
        assert engine_loaded(proxy) == 0
    assert proxy.returncode == 0
