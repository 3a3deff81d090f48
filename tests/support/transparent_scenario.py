"""Transparent mode, end to end, run *inside* a network namespace that tests/test_transparent.py
created (with nftables rules redirecting 127.0.0.5 and fd00:5::5 to the proxy). Everything here
lives in that namespace: the DNS server, the upstreams, `egress-proxy run` and the clients.
Prints one JSON object with what each client saw, for the test to assert on.

    cd tests && ip netns exec NS python -m support.transparent_scenario \
        PROXY_PORT TLS_PORT HTTP_PORT DIR [mixed]

The proxy is `run --mode transparent --listen 127.0.0.1:PORT --listen [::1]:PORT`; with `mixed`
the same process is `run --listen transparent://127.0.0.1:PORT --listen transparent://[::1]:PORT
--listen http://127.0.0.1:EXPLICIT --dns-listen 127.0.0.1:DNS`, and the clients also use the
explicit listener (a CONNECT through the fast path, a plain HTTP request) and the DNS listener.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trustme

from support.dns_server import running_dns_server
from support.real_servers import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository (this is tests/support/)
ORIGINAL_V4 = "127.0.0.5"  # redirected by the namespace's nftables rules; nothing is served here
ORIGINAL_V6 = "fd00:5::5"


class Upstream:
    """A TLS or plain-HTTP server on one address that counts connections and answers once."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.tls = tls
        self.connections = 0
        self.hosts: list[str] = []
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            conn.settimeout(5)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"host:"):
                    self.hosts.append(line[5:].strip().decode("latin-1"))
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\nhello\n"
            )
        conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def tls_get_on(
    raw: socket.socket, context: ssl.SSLContext, sni: str | None, host: str
) -> dict[str, Any]:
    """A TLS GET for `host` on the connected socket `raw`; the status line's code."""
    with context.wrap_socket(raw, server_hostname=sni) as conn:
        conn.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
    return {"ok": True, "status": data.split(b" ", 2)[1].decode() if data else None}


def tls_get(address: str, port: int, sni: str | None, ca: str) -> dict[str, Any]:
    """A verified TLS GET to address:port with `sni` (None: no SNI, no verification)."""
    context = ssl.create_default_context(cafile=ca)
    if sni is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect((address, port))
            return tls_get_on(raw, context, sni, sni or address)
    except (OSError, ssl.SSLError) as exc:
        return {"ok": False, "error": type(exc).__name__, "detail": str(exc)[:300]}


def curl_refused(address: str, port: int, name: str, ca: str) -> dict[str, Any]:
    """curl to https://name:port/ at `address` (no proxy variables: the redirect takes it): its
    exit code and what it said."""
    done = subprocess.run(
        ["curl", "-sS", "--noproxy", "*", "--max-time", "5", "--cacert", ca,
         "--resolve", f"{name}:{port}:{address}", f"https://{name}:{port}/"],
        capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    return {"code": done.returncode, "stderr": done.stderr[-300:]}


def http_get(address: str, port: int, head: str) -> dict[str, Any]:
    try:
        with socket.create_connection((address, port), timeout=5) as conn:
            conn.sendall(head.encode())
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
        first = data.split(b"\r\n", 1)[0].decode("latin-1")
        denied = [
            line.split(b":", 1)[1].strip().decode()
            for line in data.split(b"\r\n")
            if line.lower().startswith(b"x-egress-denied:")
        ]
        return {"ok": True, "status": first.split(" ")[1] if first else None, "denied": denied}
    except OSError as exc:
        return {"ok": False, "error": type(exc).__name__}


def connect_get(proxy_port: int, host: str, port: int, ca: str) -> dict[str, Any]:
    """CONNECT host:port through the explicit listener, then a verified TLS GET inside."""
    try:
        with socket.create_connection(("127.0.0.1", proxy_port), timeout=5) as raw:
            raw.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = raw.recv(4096)
                if not chunk:
                    break
                head += chunk
            status = head.split(b" ", 2)[1].decode() if head else None
            if status != "200":
                return {"ok": False, "connect": status}
            return tls_get_on(raw, ssl.create_default_context(cafile=ca), host, host)
    except (OSError, ssl.SSLError) as exc:
        return {"ok": False, "error": type(exc).__name__}


def dns_answer(port: int, name: str) -> dict[str, Any]:
    import dns.message
    import dns.query
    import dns.rcode

    try:
        query = dns.message.make_query(name, "A")
        response = dns.query.udp(query, "127.0.0.1", port=port, timeout=5)
    except Exception as exc:
        return {"rcode": None, "error": type(exc).__name__}
    found = sorted(r.address for rrset in response.answer for r in rrset)
    return {"rcode": dns.rcode.to_text(response.rcode()), "addresses": found}


def wait_listening(proxy: subprocess.Popen[bytes], stderr: Path) -> str | None:
    """Waits (30 s at most) for the proxy's "listening on" line; None once it is there, else
    what the proxy said on stderr before it exited or the time ran out."""
    deadline = time.monotonic() + 30
    while b"listening on" not in stderr.read_bytes():
        if proxy.poll() is not None or time.monotonic() > deadline:
            return stderr.read_text()
        time.sleep(0.05)
    return None


def stop(proxy: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a drain), then SIGKILL if it has not exited within 15 s."""
    proxy.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proxy.wait(timeout=15)
    if proxy.poll() is None:
        proxy.kill()


def main() -> int:
    proxy_port, tls_port, http_port = (int(x) for x in sys.argv[1:4])
    work = Path(sys.argv[4])
    mixed = sys.argv[5:] == ["mixed"]
    explicit_port, dns_port = free_port(), free_port()
    ca = trustme.CA()
    ca_file = work / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("tls.test").configure_cert(server_tls)
    results: dict[str, Any] = {}
    with running_dns_server() as dns:
        dns.set("tls.test", a=["127.0.0.1"])
        dns.set("web.test", a=["127.0.0.1"])
        upstreams = {
            "tls": Upstream("127.0.0.1", tls_port, server_tls),
            "tls6": Upstream("::1", tls_port, server_tls),
            "http": Upstream("127.0.0.1", http_port, None),
        }
        (work / "agent.yaml").write_text("network:\n  egress: [tls.test, web.test]\n")
        (work / "config.yaml").write_text(
            f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
            "addresses:\n  allow: [127.0.0.1/32]\n"
            f"inspection:\n  ca_dir: {work / 'proxy-ca'}\n"
            "limits:\n  header_timeout: 2s\n"
        )
        audit = work / "audit.jsonl"
        stderr = open(work / "stderr.txt", "wb")  # noqa: SIM115 - closed below
        if mixed:
            listeners = [
                "--listen", f"transparent://127.0.0.1:{proxy_port}",
                "--listen", f"transparent://[::1]:{proxy_port}",
                "--listen", f"http://127.0.0.1:{explicit_port}",
                "--dns-listen", f"127.0.0.1:{dns_port}",
            ]  # fmt: skip
        else:
            listeners = ["--mode", "transparent", "--listen", f"127.0.0.1:{proxy_port}",
                         "--listen", f"[::1]:{proxy_port}"]  # fmt: skip
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy", "run", str(work / "agent.yaml"),
             "--config", str(work / "config.yaml"), *listeners,
             "--admin", "127.0.0.1:0", "--audit-log", str(audit)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
        try:
            failed = wait_listening(proxy, work / "stderr.txt")
            if failed is not None:
                results["start"] = failed
                print(json.dumps(results))
                return 1
            ca_path = str(ca_file)
            results["tls_v4"] = tls_get(ORIGINAL_V4, tls_port, "tls.test", ca_path)
            results["tls_v6"] = tls_get(ORIGINAL_V6, tls_port, "tls.test", ca_path)
            results["tls_denied"] = tls_get(ORIGINAL_V4, tls_port, "denied.test", ca_path)
            results["tls_no_sni"] = tls_get(ORIGINAL_V4, tls_port, None, ca_path)
            results["curl_denied"] = curl_refused(ORIGINAL_V4, tls_port, "denied.test", ca_path)
            results["http_allowed"] = http_get(
                ORIGINAL_V4, http_port, f"GET / HTTP/1.1\r\nHost: web.test:{http_port}\r\n"
                "Connection: close\r\n\r\n",
            )  # fmt: skip
            results["http_denied"] = http_get(
                ORIGINAL_V4, http_port, f"GET / HTTP/1.1\r\nHost: denied.test:{http_port}\r\n"
                "Connection: close\r\n\r\n",
            )  # fmt: skip
            results["http_no_host"] = http_get(ORIGINAL_V4, http_port, "GET / HTTP/1.0\r\n\r\n")
            # Straight to the proxy's port, not redirected: no original destination.
            results["not_redirected"] = tls_get("127.0.0.1", proxy_port, "tls.test", ca_path)
            if mixed:
                # The same process, as an explicit proxy and as the namespace's DNS.
                results["explicit_tls"] = connect_get(explicit_port, "tls.test", tls_port, ca_path)
                results["explicit_denied"] = connect_get(
                    explicit_port, "denied.test", tls_port, ca_path
                )
                results["explicit_http"] = http_get(
                    "127.0.0.1", explicit_port,
                    f"GET http://web.test:{http_port}/x HTTP/1.1\r\nHost: web.test:{http_port}\r\n"
                    "Connection: close\r\n\r\n",
                )  # fmt: skip
                results["dns_allowed"] = dns_answer(dns_port, "tls.test")
                results["dns_denied"] = dns_answer(dns_port, "denied.test")
            time.sleep(0.3)
            results["upstream_connections"] = {k: u.connections for k, u in upstreams.items()}
            results["upstream_hosts"] = {k: u.hosts for k, u in upstreams.items()}
            results["dns_denied_queries"] = dns.count("denied.test")
        finally:
            stop(proxy)
            stderr.close()
            for upstream in upstreams.values():
                upstream.close()
        results["audit"] = [json.loads(line) for line in audit.read_text().splitlines()]
        results["stderr"] = (work / "stderr.txt").read_text()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
