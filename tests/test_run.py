"""`egress-proxy run` as a real process: start-up, serving through curl, audit and metrics, SIGHUP
reload (good and broken), SIGTERM drain, and the fail-closed start-up exits."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from dns_server import DNSServer, running_dns_server

CURL = "/usr/bin/curl"
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "network:\n  egress: [up.test, other.test]\n"
CEILING = "tenant: test\negress: [up.test, other.test]\n"
NARROWED = "tenant: test\negress: [other.test]\n"
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) \(admin http://127\.0\.0\.1:(\d+)/")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client connection stays open for the drain

    def do_GET(self) -> None:
        body = b"hello from upstream\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dns() -> Iterator[DNSServer]:
    with running_dns_server() as server:
        server.set("up.test", a=["127.0.0.1"])
        server.set("other.test", a=["127.0.0.1"])
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def write_inputs(tmp_path: Path, dns: DNSServer) -> dict[str, Path]:
    files = {
        "manifest": tmp_path / "agent.yaml",
        "ceiling": tmp_path / "ceiling.yaml",
        "config": tmp_path / "config.yaml",
        "audit": tmp_path / "audit.jsonl",
        "stderr": tmp_path / "stderr.txt",
    }
    files["manifest"].write_text(MANIFEST)
    files["ceiling"].write_text(CEILING)
    files["config"].write_text(
        f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n"
    )
    return files


def start(files: dict[str, Path], *extra: str) -> subprocess.Popen[bytes]:
    with open(files["stderr"], "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", "run", str(files["manifest"]), *extra],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def curl(proxy_port: int, url: str) -> tuple[int, dict[str, str], str]:
    result = subprocess.run(
        [CURL, "-s", "-i", "--max-time", "5", "-x", f"http://127.0.0.1:{proxy_port}", url],
        capture_output=True,
        timeout=10,
    )
    head, _, body = result.stdout.decode("latin-1").partition("\r\n\r\n")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


@contextlib.contextmanager
def killed(process: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_run_serves_reloads_and_drains(tmp_path: Path, dns: DNSServer, upstream: int) -> None:
    files = write_inputs(tmp_path, dns)
    args = ["--ceiling", str(files["ceiling"]), "--config", str(files["config"])]
    args += ["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--session-id", "s-1"]
    args += ["--audit-log", str(files["audit"])]
    with killed(start(files, *args)) as process:
        wait_for(
            lambda: LISTENING.search(files["stderr"].read_text()) or process.poll() is not None
        )
        stderr = files["stderr"].read_text()
        match = LISTENING.search(stderr)
        assert match, stderr
        port, admin = int(match[1]), int(match[2])
        assert f"curl -x http://127.0.0.1:{port} " in stderr
        assert get(f"http://127.0.0.1:{admin}/readyz")[0] == 200

        # Allowed upstream, through the pinned checked address.
        status, _, body = curl(port, f"http://up.test:{upstream}/x")
        assert (status, body) == (200, "hello from upstream\n")
        # A name outside the policy: 403 with the reason, and no DNS query for it.
        status, headers, _ = curl(port, "http://denied.test/")
        assert status == 403 and headers["x-egress-denied"] == "not_allowed"
        assert dns.count("denied.test") == 0

        lines = [json.loads(line) for line in files["audit"].read_text().splitlines()]
        reasons = {(line.get("host"), line.get("reason")) for line in lines if "decision" in line}
        assert ("denied.test", "not_allowed") in reasons, lines
        assert all(line["session"] == "s-1" for line in lines)
        metrics = get(f"http://127.0.0.1:{admin}/metrics")[1]
        assert re.search(r'egress_decisions_total\{.*reason="not_allowed".*\} 1\.0', metrics)
        assert "egress_build_info{" in metrics

        # A broken ceiling on SIGHUP: the old policy stays, the proxy serves on.
        files["ceiling"].write_text("egress: [\n")
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in files["stderr"].read_text())
        assert curl(port, f"http://up.test:{upstream}/y")[0] == 200
        metrics = get(f"http://127.0.0.1:{admin}/metrics")[1]
        assert re.search(r'egress_reloads_total\{result="failure"\} 1\.0', metrics), metrics

        # A narrowed ceiling on SIGHUP: the next request to up.test is denied, and a live
        # keep-alive connection to up.test is closed, while one to other.test stays open.
        def keep_alive(host: str) -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port), timeout=3)
            conn.sendall(b"GET http://%s:%d/ HTTP/1.1\r\nHost: %s:%d\r\n\r\n"
                         % (host.encode(), upstream, host.encode(), upstream))  # fmt: skip
            got = b""
            while not got.endswith(b"hello from upstream\n"):
                chunk = conn.recv(4096)
                assert chunk, got
                got += chunk
            assert b"200 OK" in got
            return conn

        narrowed_conn, kept_conn = keep_alive("up.test"), keep_alive("other.test")
        files["ceiling"].write_text(NARROWED)
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in files["stderr"].read_text())
        assert "1 live connection(s) closed" in files["stderr"].read_text()
        with narrowed_conn, kept_conn:
            assert narrowed_conn.recv(4096) == b""
            kept_conn.sendall(b"GET http://other.test:%d/again HTTP/1.1\r\nHost: other.test:%d"
                              b"\r\n\r\n" % (upstream, upstream))  # fmt: skip
            assert b"200 OK" in kept_conn.recv(4096)
        wait_for(lambda: "policy_reload" in files["audit"].read_text())
        status, headers, _ = curl(port, f"http://up.test:{upstream}/z")
        assert status == 403 and "x-egress-denied" in headers
        assert curl(port, f"http://other.test:{upstream}/")[0] == 200

        # SIGTERM with a live (idle) connection: not ready at once and no longer accepting,
        # while the admin endpoints still answer; the drain ends within its bound; exit 0.
        with socket.create_connection(("127.0.0.1", port), timeout=2) as live:
            live.sendall(b"GET http://other.test:%d/ HTTP/1.1\r\nHost: other.test:%d\r\n\r\n"
                         % (upstream, upstream))  # fmt: skip
            assert b"200 OK" in live.recv(4096)
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: get(f"http://127.0.0.1:{admin}/readyz")[0] == 503, timeout=3)
            wait_for(lambda: not listening(port), timeout=3)
            assert process.wait(timeout=10) == 0
            assert time.monotonic() - started < 8
        assert "draining 1 live connection(s)" in files["stderr"].read_text()
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
    files = write_inputs(tmp_path, dns)
    files[name].write_text(text)
    port, admin = free_port(), free_port()
    args = ["--ceiling", str(files["ceiling"]), "--config", str(files["config"])]
    args += ["--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"]
    with killed(start(files, *args)) as process:
        assert process.wait(timeout=10) == code
    assert not listening(port) and not listening(admin)
    assert "egress-proxy: " in files["stderr"].read_text()


@pytest.mark.parametrize("which", ["--listen", "--admin"])
def test_run_port_in_use_exits_2(tmp_path: Path, dns: DNSServer, which: str) -> None:
    files = write_inputs(tmp_path, dns)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = free_port()
        ports = {"--listen": other, "--admin": other, which: taken}
        args = ["--config", str(files["config"])]
        args += ["--listen", f"127.0.0.1:{ports['--listen']}"]
        args += ["--admin", f"127.0.0.1:{ports['--admin']}"]
        with killed(start(files, *args)) as process:
            assert process.wait(timeout=10) == 2
        assert f"127.0.0.1:{taken}" in files["stderr"].read_text()
        assert not listening(other)


def test_run_sigint_exits_0(tmp_path: Path, dns: DNSServer) -> None:
    files = write_inputs(tmp_path, dns)
    args = ["--config", str(files["config"]), "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
    with killed(start(files, *args)) as process:
        wait_for(lambda: "listening on" in files["stderr"].read_text())
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=8) == 0
