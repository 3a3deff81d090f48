"""A harness for the real `egress-proxy run` process, shared by the tests that run it.

    with running_dns_server() as dns, http_upstream() as upstream:
        dns.set("up.test", a=["127.0.0.1"])
        with RunningProxy(tmp_path, "network:\\n  egress: [up.test]\\n", dns=dns) as proxy:
            result = curl(proxy.port, f"http://up.test:{upstream.port}/")
            assert result.status == 200
            assert proxy.audit()[0]["reason"] == "allowed"

`RunningProxy` writes the manifest, ceiling and operator config into a directory, starts
`python -m proxy run` with `--listen 127.0.0.1:0 --admin 127.0.0.1:0` (or the addresses given),
waits for the "listening on" line on stderr, and in the end stops the process (SIGTERM, then
SIGKILL if it does not exit in time). The audit log goes to a file the test reads as JSON.

Everything here talks to loopback only, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import re
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.dns_server import DNSServer

ROOT = Path(__file__).resolve().parents[2]  # the repository (this is tests/support/)
CURL = "/usr/bin/curl"
OPENSSL = "/usr/bin/openssl"
LOOPBACK = "127.0.0.1"
# The first listener's port (a bare HTTP proxy in these tests), then any others, then admin;
# each on any address (`0.0.0.0`, `[::]` too).
_HOST = r"(?:[0-9.]+|\[[0-9a-f:.]+\])"
LISTENING = re.compile(rf"listening on {_HOST}:(\d+)(?: and \S+)* \(admin http://{_HOST}:(\d+)/")
# Start-up imports mitmproxy, which takes a few seconds on a slow shared machine.
READY_TIMEOUT = 30.0
# SIGTERM drains live connections for at most 5 s; this leaves room on a loaded machine.
STOP_TIMEOUT = 15.0


# -- small helpers -----------------------------------------------------------------------------


@contextlib.contextmanager
def tcp_server(handle: Callable[[socket.socket], None], host: str = LOOPBACK) -> Iterator[int]:
    """A TCP server on `host` (IPv4 or IPv6) that runs `handle(connection)` for every
    connection, each in a thread of its own, and closes the connection after it; yields the
    port. A handler's OSError (a client gone) ends that connection only."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with contextlib.suppress(OSError):
                handle(self.request)

    class Server(socketserver.ThreadingTCPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET  # `::1` too

    server = Server((host, 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def full_listener() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A loopback listener whose accept queue is full (Linux drops SYNs to it, so connects hang
    until a place frees up) and the connection filling it. Nothing leaves loopback."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.socket()
    filler.connect(listener.getsockname())
    try:
        yield listener, filler
    finally:
        filler.close()
        listener.close()


def listening(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def recv_head(sock: socket.socket, limit: int = 65536, size: int = 4096) -> bytes:
    """What `sock` sends (`size` bytes a read) until a blank line ends a head, or it closes, or
    `limit` bytes came; the socket's own timeout bounds each read."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < limit:
        chunk = sock.recv(size)
        if not chunk:
            break
        data += chunk
    return data


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until it is true; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting{' for ' + what if what else ''}")


async def eventually(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = ""
) -> None:
    """`wait_for` inside a test's event loop: the loop runs between the polls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout:g}s waiting{' for ' + what if what else ''}")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """A direct GET (no proxy) of a loopback URL: (status, body)."""
    # An empty ProxyHandler: urllib would otherwise honour http_proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def make_config(
    dns: DNSServer | None = None,
    *,
    allow: Sequence[str] = ("127.0.0.0/8",),
    extra: str = "",
    dns_timeout: str = "1s",
) -> str:
    """Operator config text: the test DNS server as the only nameserver, `allow` as
    `addresses.allow` (how tests reach loopback upstreams), then `extra` verbatim (more
    top-level keys, e.g. "limits:\\n  connect_timeout: 2s\\n")."""
    text = ""
    if dns is not None:
        text += f"dns:\n  nameservers: ['{dns.address[0]}:{dns.address[1]}']\n"
        text += f"  timeout: {dns_timeout}\n"
    text += "addresses:\n  allow: [" + ", ".join(allow) + "]\n"
    return text + extra


# -- curl --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Head:
    """One response head as curl saw it: a CONNECT response or the response itself."""

    status: int
    reason: str
    headers: dict[str, str]  # names lowercase


@dataclass(frozen=True)
class CurlResult:
    returncode: int  # curl's exit code: 0, 56 (CONNECT refused), 60 (verification failed), ...
    status: int  # %{http_code}: the response's status; 0 when there was none
    connect_status: int  # %{http_connect}: the proxy's answer to CONNECT; 0 without CONNECT
    heads: list[Head]  # every head written, CONNECT responses first
    body: str
    stderr: str  # curl's error message (-S), if any

    @property
    def headers(self) -> dict[str, str]:
        """The headers of the last head (the CONNECT response when the tunnel was refused)."""
        return self.heads[-1].headers if self.heads else {}


_WRITE_OUT = "%{stderr}\n@@curl %{http_code} %{http_connect}\n"


def _parse_heads(text: str) -> list[Head]:
    heads: list[Head] = []
    for block in text.split("\r\n\r\n"):
        lines = [line for line in block.split("\r\n") if line]
        if not lines or not lines[0].startswith("HTTP/"):
            continue
        parts = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        heads.append(Head(int(parts[1]), parts[2] if len(parts) > 2 else "", headers))
    return heads


def curl(
    proxy_port: int | None, url: str, *args: str, timeout: float = 10.0, proxy_host: str = LOOPBACK
) -> CurlResult:
    """Run /usr/bin/curl through the proxy on 127.0.0.1:`proxy_port` (or directly when None).
    Every head (with -p or https: the CONNECT response first) is parsed from `-D`."""
    with tempfile.TemporaryDirectory() as tmp:
        head_file, body_file = Path(tmp) / "head", Path(tmp) / "body"
        command = [CURL, "-sS", "--max-time", str(timeout), "-D", str(head_file)]
        command += ["-o", str(body_file), "-w", _WRITE_OUT]
        if proxy_port is not None:
            command += ["-x", f"http://{proxy_host}:{proxy_port}"]
        command += [*args, url]
        result = subprocess.run(
            command,
            capture_output=True,
            timeout=timeout + 5,
            env={"PATH": "/usr/bin:/bin", "HOME": tmp},  # no *_proxy variables, no ~/.curlrc
        )
        stderr = result.stderr.decode("latin-1")
        message, _, written = stderr.rpartition("\n@@curl ")
        code, connect = written.split()[:2]
        heads = _parse_heads(head_file.read_bytes().decode("latin-1")) if head_file.exists() else []
        body = body_file.read_bytes().decode("latin-1") if body_file.exists() else ""
    return CurlResult(result.returncode, int(code), int(connect), heads, body, message.strip())


def exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send `request` on a fresh connection to the proxy and read until it closes (or the
    head of a tunnel's answer arrived and nothing follows)."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as conn:
        conn.sendall(request)
        got = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
        return got


# -- upstreams ---------------------------------------------------------------------------------


HELLO = b"hello from upstream\n"


class _HelloHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(HELLO)))
        self.end_headers()
        self.wfile.write(HELLO)

    def log_message(self, *args: object) -> None:
        pass


class _CountingHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.connections = 0
        self.requests: list[str] = []
        super().__init__(address, _HelloHandler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1
        return True


@dataclass
class HTTPUpstream:
    """A keep-alive HTTP/1.1 server on loopback answering every GET with HELLO."""

    server: _CountingHTTPServer
    host: str
    port: int

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        return self.server.connections

    @property
    def requests(self) -> list[str]:
        """Paths of the GET requests served so far."""
        return self.server.requests


@contextlib.contextmanager
def http_upstream(host: str = LOOPBACK) -> Iterator[HTTPUpstream]:
    server = _CountingHTTPServer((host, 0))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield HTTPUpstream(server, host, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# -- the proxy process -------------------------------------------------------------------------


@dataclass
class ProxyFiles:
    """The files of one run: inputs written by the test, outputs written by the process."""

    directory: Path
    manifest: Path
    ceiling: Path
    config: Path
    audit: Path
    stdout: Path
    stderr: Path

    @classmethod
    def in_directory(cls, directory: Path) -> ProxyFiles:
        directory.mkdir(parents=True, exist_ok=True)
        return cls(
            directory,
            manifest=directory / "agent.yaml",
            ceiling=directory / "ceiling.yaml",
            config=directory / "config.yaml",
            audit=directory / "audit.jsonl",
            stdout=directory / "stdout.txt",
            stderr=directory / "stderr.txt",
        )


@dataclass
class RunningProxy:
    """`egress-proxy run` as a child process. As a context manager: started (and, with
    `wait=True`, listening) on enter, stopped on exit, whatever happened in between.

    `ceiling=None` passes no `--ceiling`. `config=None` writes `make_config(dns, allow=allow,
    extra=config_extra)`; a string is written as is. `listen` / `admin` default to port 0
    (a free port, read back from the "listening on" line). `audit=False` leaves the audit
    lines on stdout (`files.stdout`) instead of `--audit-log`. `python_flags` go to the
    interpreter, before `-m proxy` (`("-X", "importtime")` lists every import on stderr:
    `imported_modules`)."""

    directory: Path
    manifest: str
    ceiling: str | None = None
    config: str | None = None
    dns: DNSServer | None = None
    allow: Sequence[str] = ("127.0.0.0/8",)
    config_extra: str = ""
    session_id: str | None = "test-session"
    listen: str = f"{LOOPBACK}:0"
    admin: str = f"{LOOPBACK}:0"
    audit_to_file: bool = True
    args: Sequence[str] = ()
    python_flags: Sequence[str] = ()
    wait: bool = True
    ready_timeout: float = READY_TIMEOUT

    files: ProxyFiles = field(init=False)
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)
    port: int = field(init=False, default=0)
    admin_port: int = field(init=False, default=0)
    returncode: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.files = ProxyFiles.in_directory(Path(self.directory))
        self.files.manifest.write_text(self.manifest)
        if self.ceiling is not None:
            self.files.ceiling.write_text(self.ceiling)
        config = self.config
        if config is None:
            config = make_config(self.dns, allow=self.allow, extra=self.config_extra)
        self.files.config.write_text(config)

    # -- life cycle ------------------------------------------------------------------------------

    def command(self) -> list[str]:
        command = [sys.executable, *self.python_flags, "-m", "proxy"]
        command += ["run", str(self.files.manifest)]
        if self.ceiling is not None:
            command += ["--ceiling", str(self.files.ceiling)]
        command += ["--config", str(self.files.config)]
        command += ["--listen", self.listen, "--admin", self.admin]
        if self.session_id is not None:
            command += ["--session-id", self.session_id]
        if self.audit_to_file:
            command += ["--audit-log", str(self.files.audit)]
        return command + list(self.args)

    def start(self) -> RunningProxy:
        with open(self.files.stdout, "wb") as out, open(self.files.stderr, "wb") as err:
            self.process = subprocess.Popen(
                self.command(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err
            )
        if self.wait:
            self.wait_listening()
        return self

    def wait_listening(self) -> tuple[int, int]:
        """Wait for the "listening on" line; sets and returns (port, admin_port)."""
        process = self._process()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            match = LISTENING.search(self.stderr())
            if match:
                self.port, self.admin_port = int(match[1]), int(match[2])
                return self.port, self.admin_port
            if process.poll() is not None:
                raise AssertionError(
                    f"egress-proxy run exited {process.returncode} before listening:\n"
                    + self.stderr()
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"egress-proxy run not listening after {self.ready_timeout:g}s:\n"
                    + self.stderr()
                )
            time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        self._process().send_signal(sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the process to exit by itself; its exit code."""
        self.returncode = self._process().wait(timeout=timeout)
        return self.returncode

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; the exit code (negative: killed)."""
        process = self.process
        if process is None:
            return 0
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        self.returncode = process.wait(timeout=10)
        return self.returncode

    def __enter__(self) -> RunningProxy:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _process(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("the proxy was not started")
        return self.process

    @property
    def pid(self) -> int:
        return self._process().pid

    @property
    def url(self) -> str:
        """The proxy URL for clients (`curl -x`)."""
        return f"http://{LOOPBACK}:{self.port}"

    # -- what it wrote ---------------------------------------------------------------------------

    def stderr(self) -> str:
        return self.files.stderr.read_text(errors="replace")

    def audit(self) -> list[dict[str, Any]]:
        """Every complete audit line so far, parsed (a line being written is left out)."""
        path = self.files.audit if self.audit_to_file else self.files.stdout
        if not path.exists():
            return []
        text = path.read_text()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line]

    def audit_count(self) -> int:
        """How many complete audit lines there are so far (cheap: nothing is parsed)."""
        path = self.files.audit if self.audit_to_file else self.files.stdout
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def decisions(self) -> list[dict[str, Any]]:
        return [line for line in self.audit() if line.get("event") == "decision"]

    def closes(self) -> list[dict[str, Any]]:
        return [line for line in self.audit() if line.get("event") == "close"]

    def admin_get(self, path: str) -> tuple[int, str]:
        return http_get(f"http://{LOOPBACK}:{self.admin_port}{path}")

    def metrics(self) -> str:
        status, body = self.admin_get("/metrics")
        assert status == 200, (status, body)
        return body

    def rss_kib(self) -> int:
        """VmRSS of the process, in KiB (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"no VmRSS in /proc/{self.pid}/status")


_IMPORT_TIME = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", re.MULTILINE)


def imported_modules(stderr: str) -> list[str]:
    """The modules a process started with `-X importtime` imported, in the order their imports
    finished, from what it wrote on stderr so far."""
    return _IMPORT_TIME.findall(stderr)


def metric_value(metrics: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels include `labels` (exposition text), summed
    over every matching series; None when no series matches."""
    total: float | None = None
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if match is None or match[1] != name:
            continue
        found = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match[2] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(match[3])
    return total
