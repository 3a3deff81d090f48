"""What `inspection.mode: all` costs: proxy CPU per tunnel and per request, intercepted against
passthrough, on loopback, with a bounded load.

    .venv/bin/python benchmarks/interception.py [--tunnels 300] [--requests 2000] [--rounds 3]

For each round and each mode (`prefixes`: a host allowed whole is passed through; `all`: every
TLS connection is intercepted), one `egress-proxy run` process (audit lines on, to a file) in
front of a keep-alive HTTPS upstream of this script's own (its own process), and a client:

- tunnels: `--tunnels` CONNECT tunnels, 4 at a time, each a TLS handshake (the client verifying
  the certificate it is given: the upstream's, or the proxy's CA's), one GET, its answer, close;
- requests: one tunnel carrying `--requests` GETs one after the other (keep-alive), HTTP/1.1;
- requests_h2: the same over HTTP/2 (ALPN `h2`, one stream after another on one connection);
  the upstream speaks both, so an intercepted h2 client is h2 on both sides.

The figure of record is the proxy's CPU (utime + stime of its process, all threads, from
/proc/PID/stat) divided by the work; the client and the upstream share the machine's cores, so
rates understate the proxy and are printed beside it. Names resolve through the test DNS server
(tests/support/dns_server.py); nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.dns_server import running_dns_server  # noqa: E402

BODY = b"x" * 512
LISTENING = re.compile(r"listening on (\S+):(\d+) ")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


# -- the upstream (its own process) ------------------------------------------------------------


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The upstream's HTTP/2: every request answered with BODY on its stream."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    while data := await reader.read(65536):
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                fields = [(":status", "200"), ("content-length", str(len(BODY)))]
                conn.send_headers(event.stream_id, fields)
                conn.send_data(event.stream_id, BODY, end_stream=True)
        writer.write(conn.data_to_send())
        await writer.drain()


def upstream_main(cert: str, key: str, port_pipe: Any) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        try:
            if writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2":
                await serve_h2(reader, writer)
                return
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, h2.exceptions.H2Error):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2", "http/1.1"])
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context, backlog=256)
        port_pipe.send(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(serve())


# -- the proxy -----------------------------------------------------------------------------------


def start_proxy(work: Path, dns_port: int, mode: str, upstream_ca: Path) -> tuple[Any, int]:
    (work / "agent.yaml").write_text("network:\n  egress: [up.test]\n")
    (work / "config.yaml").write_text(
        f"dns:\n  nameservers: ['127.0.0.1:{dns_port}']\n  timeout: 2s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n"
        f"inspection:\n  ca_dir: {work / 'ca'}\n  upstream_ca: {upstream_ca}\n  mode: {mode}\n"
    )
    stderr = open(work / "stderr.txt", "wb")  # noqa: SIM115 - the child keeps it
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", str(work / "agent.yaml"),
         "--config", str(work / "config.yaml"), "--listen", "127.0.0.1:0",
         "--admin", "127.0.0.1:0", "--audit-log", str(work / "audit.jsonl")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proxy.poll() is None:
        found = LISTENING.search((work / "stderr.txt").read_text())
        if found:
            return proxy, int(found.group(2))
        time.sleep(0.05)
    proxy.kill()
    raise SystemExit(f"the proxy did not start: {(work / 'stderr.txt').read_text()}")


# -- the client ----------------------------------------------------------------------------------


def tunnel(proxy_port: int, upstream_port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    authority = f"up.test:{upstream_port}"
    raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return context.wrap_socket(raw, server_hostname="up.test")


def get(conn: ssl.SSLSocket, upstream_port: int) -> None:
    conn.sendall(f"GET / HTTP/1.1\r\nHost: up.test:{upstream_port}\r\n\r\n".encode())
    data = b""
    while not data.endswith(BODY):
        chunk = conn.recv(65536)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


class H2Client:
    """Sequential GETs, one stream after another, on one HTTP/2 connection in a tunnel."""

    def __init__(self, conn: ssl.SSLSocket, authority: str) -> None:
        assert conn.selected_alpn_protocol() == "h2", conn.selected_alpn_protocol()
        self.conn, self.authority = conn, authority
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        conn.sendall(self.h2.data_to_send())

    def get(self) -> None:
        stream = self.h2.get_next_available_stream_id()
        fields = [(":method", "GET"), (":scheme", "https"), (":authority", self.authority),
                  (":path", "/")]  # fmt: skip
        self.h2.send_headers(stream, fields, end_stream=True)
        self.conn.sendall(self.h2.data_to_send())
        received, ended = 0, False
        while not ended:
            data = self.conn.recv(65536)
            assert data, "the connection closed"
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream:
                    ended = True
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream reset: {event}")
            if out := self.h2.data_to_send():
                self.conn.sendall(out)
        assert received == len(BODY), received


def measure(pid: int, work: Any) -> dict[str, float]:
    before, started = cpu_seconds(pid), time.monotonic()
    count = work()
    elapsed, used = time.monotonic() - started, cpu_seconds(pid) - before
    return {"count": count, "cpu_us": used / count * 1e6, "rate": count / elapsed}


def tunnels_phase(pid: int, proxy_port: int, upstream_port: int, ca: str, n: int) -> dict:
    context = ssl.create_default_context(cafile=ca)

    def one(_: int) -> None:
        with tunnel(proxy_port, upstream_port, context) as conn:
            get(conn, upstream_port)

    def work() -> int:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(n)))
        return n

    return measure(pid, work)


def requests_phase(pid: int, proxy_port: int, upstream_port: int, ca: str, n: int) -> dict:
    conn = tunnel(proxy_port, upstream_port, ssl.create_default_context(cafile=ca))
    get(conn, upstream_port)  # the tunnel and the upstream connection are set up before

    def work() -> int:
        for _ in range(n):
            get(conn, upstream_port)
        return n

    try:
        return measure(pid, work)
    finally:
        conn.close()


def requests_h2_phase(pid: int, proxy_port: int, upstream_port: int, ca: str, n: int) -> dict:
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    conn = tunnel(proxy_port, upstream_port, context)
    client = H2Client(conn, f"up.test:{upstream_port}")
    client.get()  # the tunnel and the upstream connection are set up before

    def work() -> int:
        for _ in range(n):
            client.get()
        return n

    try:
        return measure(pid, work)
    finally:
        conn.close()


# -- rounds ----------------------------------------------------------------------------------


def one_round(args: argparse.Namespace, mode: str, dns_port: int, upstream: tuple) -> dict:
    upstream_port, upstream_ca = upstream
    with tempfile.TemporaryDirectory(prefix="egress-bench-") as tmp:
        work = Path(tmp)
        proxy, port = start_proxy(work, dns_port, mode, upstream_ca)
        try:
            ca = str(work / "ca" / "mitmproxy-ca-cert.pem") if mode == "all" else str(upstream_ca)
            tunnels_phase(proxy.pid, port, upstream_port, ca, 20)  # warm-up: imports, caches
            result = {
                "tunnels": tunnels_phase(proxy.pid, port, upstream_port, ca, args.tunnels),
                "requests": requests_phase(proxy.pid, port, upstream_port, ca, args.requests),
                "requests_h2": requests_h2_phase(proxy.pid, port, upstream_port, ca, args.requests),
            }
            result["rss_kib"] = rss_kib(proxy.pid)
            return result
        finally:
            proxy.terminate()
            proxy.wait(timeout=15)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def certificate(directory: Path) -> tuple[Path, Path, Path]:
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("up.test")
    paths = (directory / "ca.pem", directory / "leaf.pem", directory / "key.pem")
    ca.cert_pem.write_to_path(str(paths[0]))
    leaf.cert_chain_pems[0].write_to_path(str(paths[1]))
    leaf.private_key_pem.write_to_path(str(paths[2]))
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tunnels", type=int, default=300)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write every sample here too")
    args = parser.parse_args()
    if not (0 < args.tunnels <= 10_000 and 0 < args.requests <= 100_000 and 0 < args.rounds <= 9):
        parser.error("bounded load: tunnels 1..10000, requests 1..100000, rounds 1..9")
    samples: dict[str, list[dict]] = {"prefixes": [], "all": []}
    with tempfile.TemporaryDirectory(prefix="egress-bench-ca-") as tmp, running_dns_server() as dns:
        dns.set("up.test", a=["127.0.0.1"])
        ca, cert, key = certificate(Path(tmp))
        receive, send = multiprocessing.Pipe(duplex=False)
        server = multiprocessing.Process(target=upstream_main, args=(str(cert), str(key), send))
        server.daemon = True
        server.start()
        upstream = (receive.recv(), ca)
        try:
            for n in range(args.rounds):  # interleaved, so drift hits both modes alike
                for mode in samples:
                    sample = one_round(args, mode, dns.address[1], upstream)
                    samples[mode].append(sample)
                    print(f"round {n + 1} {mode}: {json.dumps(sample)}", flush=True)
        finally:
            server.terminate()
    report(samples)
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=2))
    return 0


def report(samples: dict[str, list[dict]]) -> None:
    def median(mode: str, phase: str, key: str) -> float:
        return statistics.median(x[phase][key] for x in samples[mode])

    print("\nmedians (proxy CPU per unit of work; rates: client and upstream share the cores)")
    phases = (("tunnels", "tunnel"), ("requests", "request"), ("requests_h2", "HTTP/2 request"))
    for phase, unit in phases:
        passed, seen = median("prefixes", phase, "cpu_us"), median("all", phase, "cpu_us")
        passed_rate, seen_rate = median("prefixes", phase, "rate"), median("all", phase, "rate")
        print(
            f"  per {unit}: passthrough {passed:,.0f} µs ({passed_rate:,.0f}/s), "
            f"mode all {seen:,.0f} µs ({seen_rate:,.0f}/s): "
            f"+{seen - passed:,.0f} µs, {seen / passed:.1f}x"
        )
    for mode in samples:
        rss = statistics.median(x["rss_kib"] for x in samples[mode]) / 1024
        print(f"  RSS after the load, {mode}: {rss:.1f} MB")


if __name__ == "__main__":
    sys.exit(main())
