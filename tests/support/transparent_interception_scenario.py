"""Interception on a transparent listener, end to end, run *inside* a network namespace that
tests/test_transparent_interception.py created (nftables redirecting 127.0.0.5 to the proxy).
Everything lives in that namespace: the DNS server, a TLS upstream, `egress-proxy run --mode
transparent` and the clients (Python's ssl and curl, which know nothing of a proxy). Prints one
JSON object with what each client saw.

    cd tests && ip netns exec NS python -m support.transparent_interception_scenario \
        PROXY_PORT TLS_PORT DIR MODE

MODE is the operator's `inspection.mode` (prefixes or all). The manifest allows
`https://paths.test:TLS_PORT/api/` (path rules: intercepted in both modes) and `whole.test`
(intercepted only under `all`).
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trustme

from support.dns_server import running_dns_server
from support.transparent_scenario import ORIGINAL_V4, ROOT, Upstream, stop, wait_listening

CURL = "/usr/bin/curl"
H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__")


def tls_request(port: int, sni: str, ca: str, head: str) -> dict[str, Any]:
    """One request over TLS to the redirected address, verified against `ca`: the status and
    the X-Egress-Denied reasons of the answer, or the error."""
    context = ssl.create_default_context(cafile=ca)
    try:
        with (
            socket.create_connection((ORIGINAL_V4, port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=sni) as conn,
        ):
            conn.sendall(head.encode())
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
                if b"\r\n\r\n" in data and b"Connection: close" not in data:
                    break  # keep-alive answer: its head is enough here
    except (OSError, ssl.SSLError) as exc:
        return {"ok": False, "error": type(exc).__name__}
    lines = data.split(b"\r\n")
    denied = [
        line.split(b":", 1)[1].strip().decode()
        for line in lines
        if line.lower().startswith(b"x-egress-denied:")
    ]
    status = lines[0].split(b" ")[1].decode() if data else None
    return {"ok": True, "status": status, "denied": denied}


def get(host: str, path: str, *headers: str) -> str:
    return "\r\n".join(
        [f"GET {path} HTTP/1.1", f"Host: {host}", *headers, "Connection: close", "", ""]
    )


def curl(port: int, url: str, ca: str) -> dict[str, Any]:
    """curl with no proxy at all, its name resolved to the redirected address: the status and
    the HTTP version it spoke (it offers h2)."""
    host = url.split("/")[2].split(":")[0]
    done = subprocess.run(
        [CURL, "-sS", "--max-time", "5", "--resolve", f"{host}:{port}:{ORIGINAL_V4}",
         "--cacert", ca, "-o", "/dev/null", "-w", "%{http_code} %{http_version}", url],
        capture_output=True, timeout=15, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    status, _, version = done.stdout.decode().partition(" ")
    return {
        "code": done.returncode,
        "status": status,
        "version": version,
        "error": done.stderr.decode(),
    }


def start_proxy(work: Path, proxy_port: int) -> subprocess.Popen[bytes]:
    stderr = open(work / "stderr.txt", "wb")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", str(work / "agent.toml"),
         "--config", str(work / "config.yaml"), "--mode", "transparent",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin", "127.0.0.1:0",
         "--audit-log", str(work / "audit.jsonl")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
    )  # fmt: skip


def clients(tls_port: int, proxy_ca: str, upstream_ca: str) -> dict[str, Any]:
    paths, whole = f"paths.test:{tls_port}", f"whole.test:{tls_port}"
    return {
        "api": tls_request(tls_port, "paths.test", proxy_ca, get(paths, "/api/x")),
        "admin": tls_request(tls_port, "paths.test", proxy_ca, get(paths, "/admin")),
        "h2c": tls_request(tls_port, "paths.test", proxy_ca, get(paths, "/api/x", *H2C)),
        "curl": curl(tls_port, f"https://{paths}/api/y", proxy_ca),
        # A host allowed whole: its own certificate (passthrough), or ours under mode all.
        "whole_own_ca": tls_request(tls_port, "whole.test", upstream_ca, get(whole, "/")),
        "whole_proxy_ca": tls_request(tls_port, "whole.test", proxy_ca, get(whole, "/")),
        "whole_fronted": tls_request(tls_port, "whole.test", proxy_ca, get(paths, "/api/x")),
    }


def main() -> int:
    proxy_port, tls_port = int(sys.argv[1]), int(sys.argv[2])
    work, mode = Path(sys.argv[3]), sys.argv[4]
    ca = trustme.CA()
    bundle = work / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("paths.test", "whole.test").configure_cert(server_tls)
    results: dict[str, Any] = {}
    with running_dns_server() as dns:
        dns.set("paths.test", a=["127.0.0.1"])
        dns.set("whole.test", a=["127.0.0.1"])
        upstream = Upstream("127.0.0.1", tls_port, server_tls)
        (work / "agent.toml").write_text(
            "schema_version = 1\n[network_access]\n"
            f'allowed = ["https://paths.test:{tls_port}/api/", "whole.test"]\n'
        )
        (work / "config.yaml").write_text(
            f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
            "addresses:\n  allow: [127.0.0.1/32]\n"
            f"inspection:\n  ca_dir: {work / 'proxy-ca'}\n  upstream_ca: {bundle}\n"
            f"  mode: {mode}\n"
        )
        proxy = start_proxy(work, proxy_port)
        try:
            failed = wait_listening(proxy, work / "stderr.txt")
            if failed is not None:
                results["start"] = failed
                print(json.dumps(results))
                return 1
            proxy_ca = str(work / "proxy-ca" / "mitmproxy-ca-cert.pem")
            results.update(clients(tls_port, proxy_ca, str(bundle)))
            time.sleep(0.3)
            results["upstream_hosts"] = upstream.hosts
        finally:
            stop(proxy)
            upstream.close()
        audit = (work / "audit.jsonl").read_text().splitlines()
        results["audit"] = [json.loads(line) for line in audit]
        results["stderr"] = (work / "stderr.txt").read_text()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
