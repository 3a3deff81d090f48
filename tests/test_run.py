"""`egress-proxy run` as a real process: start-up, serving through curl, audit and metrics, SIGHUP
reload (good and broken), SIGTERM drain, and the fail-closed start-up exits."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from support.dns_server import DNSServer
from support.real_servers import free_port
from support.running import (
    CURL as CURL_BIN,
)
from support.running import (
    HELLO,
    HTTPUpstream,
    RunningProxy,
    curl,
    http_get,
    http_upstream,
    listening,
    make_config,
    wait_for,
)

from proxy.app.inputs import compile_inputs, read_inputs
from proxy.app.runtime import Runtime

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [up.test, other.test]\n"
CEILING = "tenant: test\negress: [up.test, other.test]\n"
NARROWED = "tenant: test\negress: [other.test]\n"
# URL-prefix rules: the policy can need inspection, so the engine and its CA load at start.
# (agent.toml's schema, written in YAML: the harness names the file agent.yaml.)
PATHS = "schema_version: 1\nnetwork_access:\n  allowed: ['https://up.test/api/']\n"


@pytest.fixture
def upstream() -> Iterator[HTTPUpstream]:
    with http_upstream() as server:
        yield server


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    dns.set("up.test", a=["127.0.0.1"])
    dns.set("other.test", a=["127.0.0.1"])
    return dns


def test_run_serves_reloads_and_drains(
    tmp_path: Path, dns: DNSServer, upstream: HTTPUpstream
) -> None:
    up = upstream.port
    with RunningProxy(tmp_path, MANIFEST, ceiling=CEILING, dns=dns, session_id="s-1") as proxy:
        port, admin = proxy.port, proxy.admin_port
        stderr = proxy.stderr()
        assert f"curl -x http://127.0.0.1:{port} " in stderr
        assert http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200

        # Allowed upstream, through the pinned checked address.
        result = curl(port, f"http://up.test:{up}/x")
        assert (result.status, result.body) == (200, "hello from upstream\n")
        # A name outside the policy: 403 with the reason, and no DNS query for it.
        result = curl(port, "http://denied.test/")
        assert result.status == 403 and result.headers["x-egress-denied"] == "not_allowed"
        assert dns.count("denied.test") == 0

        lines = proxy.audit()
        reasons = {(line.get("host"), line.get("reason")) for line in lines if "decision" in line}
        assert ("denied.test", "not_allowed") in reasons, lines
        assert all(line["session"] == "s-1" for line in lines)
        metrics = http_get(f"http://127.0.0.1:{admin}/metrics")[1]
        assert re.search(r'egress_decisions_total\{.*reason="not_allowed".*\} 1\.0', metrics)
        assert "egress_build_info{" in metrics

        # A broken ceiling on SIGHUP: the old policy stays, the proxy serves on.
        proxy.files.ceiling.write_text("egress: [\n")
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in proxy.stderr())
        # One line says why: the loader's reason code, the file and the place in it.
        failed = next(line for line in proxy.stderr().splitlines() if "reload failed" in line)
        assert failed.startswith(
            "egress-proxy: reload failed (yaml_syntax), keeping the previous policy: "
            f"{proxy.files.ceiling}:2:1: YAML syntax error"
        ), failed
        assert curl(port, f"http://up.test:{up}/y").status == 200
        metrics = http_get(f"http://127.0.0.1:{admin}/metrics")[1]
        assert re.search(r'egress_reloads_total\{result="failure"\} 1\.0', metrics), metrics

        # A narrowed ceiling on SIGHUP: the next request to up.test is denied, and a live
        # keep-alive connection to up.test is closed, while one to other.test stays open.
        def keep_alive(host: str) -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port), timeout=3)
            conn.sendall(b"GET http://%s:%d/ HTTP/1.1\r\nHost: %s:%d\r\n\r\n"
                         % (host.encode(), up, host.encode(), up))  # fmt: skip
            got = b""
            while not got.endswith(b"hello from upstream\n"):
                chunk = conn.recv(4096)
                assert chunk, got
                got += chunk
            assert b"200 OK" in got
            return conn

        narrowed_conn, kept_conn = keep_alive("up.test"), keep_alive("other.test")
        proxy.files.ceiling.write_text(NARROWED)
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in proxy.stderr())
        assert "1 live connection(s) closed" in proxy.stderr()
        with narrowed_conn, kept_conn:
            assert narrowed_conn.recv(4096) == b""
            kept_conn.sendall(b"GET http://other.test:%d/again HTTP/1.1\r\nHost: other.test:%d"
                              b"\r\n\r\n" % (up, up))  # fmt: skip
            assert b"200 OK" in kept_conn.recv(4096)
        wait_for(lambda: "policy_reload" in proxy.files.audit.read_text())
        result = curl(port, f"http://up.test:{up}/z")
        assert result.status == 403 and "x-egress-denied" in result.headers
        assert curl(port, f"http://other.test:{up}/").status == 200

        # SIGTERM with a live (idle) connection: not ready at once and no longer accepting,
        # while the admin endpoints still answer; the drain ends within its bound; exit 0.
        with socket.create_connection(("127.0.0.1", port), timeout=2) as live:
            live.sendall(b"GET http://other.test:%d/ HTTP/1.1\r\nHost: other.test:%d\r\n\r\n"
                         % (up, up))  # fmt: skip
            assert b"200 OK" in live.recv(4096)
            started = time.monotonic()
            proxy.send_signal(signal.SIGTERM)
            wait_for(lambda: http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 503, timeout=3)
            wait_for(lambda: not listening(port), timeout=3)
            assert proxy.wait_exit(timeout=10) == 0
            assert time.monotonic() - started < 8
        assert "draining 1 live connection(s)" in proxy.stderr()
        assert not listening(admin)


@pytest.mark.parametrize(
    ("name", "text", "code"),
    [
        ("config", "dns:\n  nameserverz: []\n", 2),  # unknown key
        ("manifest", "network:\n  egress: ['*.github.com']\n", 1),  # does not compile
        ("ceiling", "egress: [\n", 2),  # unparsable
    ],
)
def test_run_bad_input_exits_before_listening(
    tmp_path: Path, dns: DNSServer, name: str, text: str, code: int
) -> None:
    inputs = {"manifest": MANIFEST, "ceiling": CEILING, "config": make_config(dns)}
    inputs[name] = text
    port, admin = free_port(), free_port()
    proxy = RunningProxy(
        tmp_path,
        inputs["manifest"],
        ceiling=inputs["ceiling"],
        config=inputs["config"],
        listen=f"127.0.0.1:{port}",
        admin=f"127.0.0.1:{admin}",
        wait=False,
    )
    with proxy:
        assert proxy.wait_exit(timeout=10) == code
    assert not listening(port) and not listening(admin)
    assert "egress-proxy: " in proxy.stderr()


@pytest.mark.parametrize("which", ["--listen", "--admin"])
def test_run_port_in_use_exits_2(tmp_path: Path, dns: DNSServer, which: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = free_port()
        ports = {"--listen": other, "--admin": other, which: taken}
        proxy = RunningProxy(
            tmp_path,
            MANIFEST,
            dns=dns,
            listen=f"127.0.0.1:{ports['--listen']}",
            admin=f"127.0.0.1:{ports['--admin']}",
            wait=False,
        )
        with proxy:
            assert proxy.wait_exit(timeout=10) == 2
        assert f"127.0.0.1:{taken}" in proxy.stderr()
        assert not listening(other)


def test_run_sigint_exits_0(tmp_path: Path, dns: DNSServer) -> None:
    with RunningProxy(tmp_path, MANIFEST, dns=dns) as proxy:
        assert "listening on" in proxy.stderr()
        proxy.send_signal(signal.SIGINT)
        assert proxy.wait_exit(timeout=8) == 0


def test_a_failing_hook_is_reported_on_stderr(tmp_path: Path) -> None:
    """mitmproxy routes the root logger into its own event log; a hook that failed (and denied)
    must still reach the operator, escaped for the terminal."""
    manifest = tmp_path / "agent.yaml"
    manifest.write_text("network:\n  egress: [up.test]\n")
    inputs = read_inputs(str(manifest))
    err = io.StringIO()
    runtime = Runtime(inputs, compile_inputs(inputs), listen=[], admin=("127.0.0.1", 0), err=err)
    handler = runtime._log_to_stderr()
    try:
        try:
            raise RuntimeError("boom \x1b[31m")
        except RuntimeError:
            logging.getLogger("proxy.l7.engine").exception("egress: http_connect failed")
    finally:
        logging.getLogger("proxy").removeHandler(handler)
    text = err.getvalue()
    assert "egress-proxy: ERROR proxy.l7.engine: egress: http_connect failed" in text
    assert "RuntimeError: boom \\x1b[31m" in text
    assert "\x1b" not in text


def test_run_creates_the_inspection_ca_and_says_how_to_trust_it(
    tmp_path: Path, dns: DNSServer
) -> None:
    ca_dir = tmp_path / "ca"
    extra = f"inspection:\n  ca_dir: {ca_dir}\n"
    with RunningProxy(tmp_path / "one", PATHS, dns=dns, config_extra=extra) as proxy:
        cert = ca_dir / "mitmproxy-ca-cert.pem"
        assert f"TLS inspection CA {cert} (created now" in proxy.stderr()
        # How a client trusts it: the bundle (system roots + the CA) and the CA alone for Node,
        # by the variables the common tools read.
        bundle, alone = ca_dir / "trust-bundle.pem", ca_dir / "session-ca.pem"
        assert f"trust bundle {bundle} (" in proxy.stderr()
        assert f"SSL_CERT_FILE={bundle} " in proxy.stderr()
        assert f"PIP_CERT={bundle} " in proxy.stderr()
        assert f"NODE_EXTRA_CA_CERTS={alone} " in proxy.stderr()
        assert alone.read_bytes() == cert.read_bytes()
        first = cert.read_bytes()
    # The next start uses the same CA.
    with RunningProxy(tmp_path / "two", PATHS, dns=dns, config_extra=extra) as proxy:
        assert f"TLS inspection CA {cert} (existing" in proxy.stderr()
        assert cert.read_bytes() == first


def test_run_ca_problem_exits_2_before_listening(tmp_path: Path, dns: DNSServer) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    port, admin = free_port(), free_port()
    proxy = RunningProxy(
        tmp_path / "run",
        PATHS,
        dns=dns,
        config_extra=f"inspection:\n  ca_dir: {blocker / 'ca'}\n",
        listen=f"127.0.0.1:{port}",
        admin=f"127.0.0.1:{admin}",
        wait=False,
    )
    with proxy:
        assert proxy.wait_exit(timeout=20) == 2
    assert not listening(port) and not listening(admin)
    assert "inspection CA in" in proxy.stderr() and "cannot create the directory" in proxy.stderr()


def test_run_serves_socks5_beside_http(tmp_path: Path, dns: DNSServer) -> None:
    socks = free_port()
    proxy = RunningProxy(
        tmp_path, MANIFEST, dns=dns, args=("--listen", f"socks5://127.0.0.1:{socks}")
    )
    with proxy:
        assert f"and socks5://127.0.0.1:{socks} (admin" in proxy.stderr()
        result = subprocess.run(
            [CURL_BIN, "-sS", "--max-time", "5", "--socks5-hostname", f"127.0.0.1:{socks}",
             "https://denied.test/"],
            capture_output=True, timeout=15,
        )  # fmt: skip
        assert result.returncode == 97  # the SOCKS5 proxy refused (reply 2)
        assert dns.count("denied.test") == 0
        assert any(
            x["protocol"] == "socks5" and x["reason"] == "not_allowed" for x in proxy.decisions()
        )


@contextlib.contextmanager
def tls_keep_alive_upstream(directory: Path) -> Iterator[tuple[HTTPUpstream, Path]]:
    """running.http_upstream (keep-alive, answers HELLO) over TLS for tls.test; with the file
    of the CA that signed it."""
    ca = trustme.CA()
    bundle = directory / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("tls.test").configure_cert(context)
    with http_upstream() as upstream:
        upstream.server.socket = context.wrap_socket(upstream.server.socket, server_side=True)
        yield upstream, bundle


def intercepted_keep_alive(port: int, host: str, target: int, ca: Path) -> ssl.SSLSocket:
    """A CONNECT through the proxy, TLS inside it trusting the proxy's CA, and one request
    answered: an intercepted connection kept alive."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    raw.sendall(f"CONNECT {host}:{target} HTTP/1.1\r\nHost: {host}:{target}\r\n\r\n".encode())
    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
    conn = ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname=host)
    assert answered(conn, f"GET /api/x HTTP/1.1\r\nHost: {host}:{target}\r\n\r\n")
    return conn


def answered(conn: ssl.SSLSocket, request: str) -> bool:
    """Sends `request`; whether a whole 200 with the upstream's body came back."""
    conn.sendall(request.encode())
    got = b""
    while not got.endswith(HELLO):
        chunk = conn.recv(4096)
        if not chunk:
            break
        got += chunk
    return got.startswith(b"HTTP/1.1 200") and got.endswith(HELLO)


def test_reload_closes_intercepted_connections_and_refuses_a_new_inspection_mode(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    with tls_keep_alive_upstream(tmp_path) as (upstream, bundle):
        manifest = (
            "schema_version: 1\nnetwork_access:\n"
            f"  allowed: ['https://tls.test:{upstream.port}/api/', 'up.test']\n"
        )
        ca = tmp_path / "ca"
        extra = f"inspection:\n  ca_dir: {ca}\n  upstream_ca: {bundle}\n"
        ceiling = "tenant: test\negress: [tls.test, up.test]\n"
        with RunningProxy(
            tmp_path / "run", manifest, ceiling=ceiling, dns=dns, config_extra=extra
        ) as proxy:
            cert = ca / "mitmproxy-ca-cert.pem"
            conn = intercepted_keep_alive(proxy.port, "tls.test", upstream.port, cert)
            again = f"GET /api/y HTTP/1.1\r\nHost: tls.test:{upstream.port}\r\n\r\n"
            # inspection.mode cannot change while running: refused, the old policy stays.
            proxy.files.config.write_text(make_config(dns, extra=extra + "  mode: all\n"))
            proxy.send_signal(signal.SIGHUP)
            wait_for(lambda: "reload failed" in proxy.stderr())
            assert "inspection.mode changed from 'prefixes' to 'all'" in proxy.stderr()
            assert "needs a restart" in proxy.stderr()
            assert answered(conn, again)
            # A ceiling without tls.test: the intercepted connection is closed.
            proxy.files.config.write_text(make_config(dns, extra=extra))
            proxy.files.ceiling.write_text("tenant: test\negress: [up.test]\n")
            proxy.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded" in proxy.stderr())
            assert "1 live connection(s) closed" in proxy.stderr()
            with conn:
                assert conn.recv(4096) == b""
            wait_for(lambda: any(x["reason"] == "policy_reload" for x in proxy.closes()))
            close = next(x for x in proxy.closes() if x["reason"] == "policy_reload")
            assert (close["plane"], close["host"]) == ("l7", "tls.test")
    assert upstream.requests == ["/api/x", "/api/y"]
