"""Proxy CPU per new tunnel: SOCKS5 against CONNECT, through one `egress-proxy run` process that
has both listeners (the same policy, audit log and metrics for both), on loopback.

    .venv/bin/python benchmarks/socks5_cost.py                       # 5 rounds of 2,000 each
    .venv/bin/python benchmarks/socks5_cost.py --rounds 3 --count 1000 --concurrency 8

A tunnel is what a client does for one HTTPS request through the proxy, minus TLS itself:
connect, ask (a CONNECT head and its `200`, or the SOCKS5 greeting, request and reply), send a
real ClientHello (Python's ssl, SNI bench.test), read the one byte the upstream answers once it
has read that record, close. The proxy decides bench.test (name stage, a cached DNS answer,
address stage), dials, answers, checks the SNI and relays, writing three decision lines and a
close line per tunnel.

The proxy's CPU (user + system, /proc/PID/stat) is read before and after each phase and divided
by the tunnels it served; rounds alternate the two modes (the order rotating), and the table
shows medians. The client and the upstream are subprocesses of this script (uvloop when
importable), so their CPU is not the proxy's; on 2 shared cores they compete with it for time,
so rates understate it and the CPU per tunnel is the figure of record.

Every phase is bounded by its count and a deadline, every subprocess is killed past its limit;
everything talks to 127.0.0.1 only, and the proxy asks this script's own DNS server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
HOST = "bench.test"
MODES = ("connect", "socks5")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) and socks5://127\.0\.0\.1:(\d+)")


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# -- the upstream: reads one TLS record, answers one byte, waits for the close ----------------


async def upstream_main() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            header = await reader.readexactly(5)
            await reader.readexactly(int.from_bytes(header[3:5], "big"))
            writer.write(b"R")
            while await reader.read(65536):
                pass
        writer.close()

    server = await asyncio.start_server(serve, LOOPBACK, 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent goes


# -- the client ------------------------------------------------------------------------------


def client_hello() -> bytes:
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=HOST)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def one_tunnel(mode: str, proxy_port: int, upstream: int, hello: bytes) -> None:
    reader, writer = await asyncio.open_connection(LOOPBACK, proxy_port)
    try:
        if mode == "connect":
            authority = f"{HOST}:{upstream}"
            writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"CONNECT answered {head[:40]!r}")
        else:
            writer.write(b"\x05\x01\x00")
            if await reader.readexactly(2) != b"\x05\x00":
                raise RuntimeError("SOCKS5 method refused")
            name = HOST.encode()
            writer.write(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + upstream.to_bytes(2))
            reply = await reader.readexactly(10)  # an IPv4 bound address: a loopback upstream
            if reply[1] != 0:
                raise RuntimeError(f"SOCKS5 reply {reply[1]}")
        writer.write(hello)
        if await reader.readexactly(1) != b"R":
            raise RuntimeError("the upstream's answer was not relayed")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def client_main(args: argparse.Namespace) -> None:
    hello = client_hello()
    deadline = time.monotonic() + args.seconds
    done = errors = 0
    first_error = ""
    remaining = args.count

    async def worker() -> None:
        nonlocal done, errors, first_error, remaining
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            try:
                await asyncio.wait_for(
                    one_tunnel(args.mode, args.proxy_port, args.upstream, hello), 10
                )
                done += 1
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.monotonic() - started
    print(json.dumps({"done": done, "errors": errors, "error": first_error, "wall": wall}))


# -- the driver ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def script(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


@contextlib.contextmanager
def upstream_process() -> Iterator[int]:
    process = subprocess.Popen(
        script("--role", "upstream"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        process.kill()
        process.wait(10)


@contextlib.contextmanager
def proxy_process(directory: Path, dns_port: int) -> Iterator[tuple[int, int, int]]:
    """`egress-proxy run` with an HTTP and a SOCKS5 listener: (pid, http port, socks port)."""
    (directory / "agent.yaml").write_text(f"network:\n  egress: [{HOST}]\n")
    (directory / "config.yaml").write_text(
        f"dns:\n  nameservers: ['{LOOPBACK}:{dns_port}']\n  timeout: 2s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n"
    )
    stderr = directory / "stderr.txt"
    command = [sys.executable, "-m", "proxy", "run", str(directory / "agent.yaml")]
    command += ["--config", str(directory / "config.yaml"), "--listen", f"{LOOPBACK}:0"]
    command += ["--listen", f"socks5://{LOOPBACK}:0", "--admin", f"{LOOPBACK}:0"]
    command += ["--audit-log", str(directory / "audit.jsonl"), "--session-id", "bench"]
    with open(stderr, "wb") as err:
        process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while not (match := LISTENING.search(stderr.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the proxy did not start:\n{stderr.read_text()}")
            time.sleep(0.05)
        yield process.pid, int(match[1]), int(match[2])
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()


def phase(mode: str, pid: int, proxy_port: int, upstream: int, args: argparse.Namespace) -> dict:
    command = script("--role", "client", "--mode", mode, "--proxy-port", str(proxy_port))
    command += ["--upstream", str(upstream), "--count", str(args.count)]
    command += ["--concurrency", str(args.concurrency), "--seconds", str(args.seconds)]
    before = cpu_seconds(pid)
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.seconds + 30)
    time.sleep(0.2)  # the last close lines
    cpu = cpu_seconds(pid) - before
    outcome = json.loads(result.stdout)
    if outcome["errors"] or not outcome["done"]:
        raise SystemExit(f"{mode}: {outcome['errors']} tunnels failed: {outcome['error']}")
    return {"cpu_us": cpu / outcome["done"] * 1e6, "rate": outcome["done"] / outcome["wall"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("driver", "upstream", "client"), default="driver")
    parser.add_argument("--mode", choices=MODES, default="connect")
    parser.add_argument("--proxy-port", type=int, default=0)
    parser.add_argument("--upstream", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    if not (1 <= args.count <= 100_000 and 1 <= args.rounds <= 50 and args.concurrency >= 1):
        parser.error("--count is 1..100000, --rounds 1..50, --concurrency at least 1")
    if args.role == "upstream":
        new_loop().run_until_complete(upstream_main())
        return
    if args.role == "client":
        new_loop().run_until_complete(client_main(args))
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from support.dns_server import running_dns_server

    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="socks5-cost-") as tmp,
        running_dns_server() as dns,
        upstream_process() as upstream,
        proxy_process(Path(tmp), dns.address[1]) as (pid, http_port, socks_port),
    ):
        dns.set(HOST, a=[LOOPBACK])
        ports = {"connect": http_port, "socks5": socks_port}
        for mode in MODES:  # warm-up: imports, caches, the DNS answer
            phase(
                mode, pid, ports[mode], upstream, argparse.Namespace(**{**vars(args), "count": 200})
            )
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                sample = phase(mode, pid, ports[mode], upstream, args)
                samples[mode].append(sample)
                print(f"round {round_ + 1} {mode}: {sample['cpu_us']:.0f} µs, "
                      f"{sample['rate']:.0f}/s", file=sys.stderr)  # fmt: skip
    print(f"{args.rounds} rounds of {args.count} tunnels, {args.concurrency} concurrent; medians")
    print("| mode | proxy CPU per tunnel | tunnels/s |")
    print("|---|---|---|")
    medians = {}
    for mode in MODES:
        cpu = statistics.median(s["cpu_us"] for s in samples[mode])
        rate = statistics.median(s["rate"] for s in samples[mode])
        medians[mode] = cpu
        print(f"| {mode} | {cpu:.0f} µs | {rate:.0f} |")
    print(f"SOCKS5 / CONNECT CPU per tunnel: {medians['socks5'] / medians['connect']:.2f}")


if __name__ == "__main__":
    main()
