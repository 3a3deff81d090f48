"""Tunnel benchmark of `egress-proxy run`: new CONNECT tunnels (latency, rate, proxy CPU), bulk
through one tunnel, memory and start-up, side by side on loopback against no proxy at all.

    .venv/bin/python benchmarks/tunnels.py                   # full run: 3 rounds, 1 GiB bulk
    .venv/bin/python benchmarks/tunnels.py --quick           # under 2 minutes
    .venv/bin/python benchmarks/tunnels.py --json benchmarks/results/tunnels.json
    .venv/bin/python benchmarks/tunnels.py --configs direct,fast --rounds 5 --bulk-mib 256

Other options: `--bulk up|down|none` (default both), `--client-procs N` (client processes of the
rate phase, default 2), `--loop auto|uvloop|asyncio` (the load generator's own event loop),
`--baseline-tree PATH` (adds `fast-baseline`: the fast path run from another checkout, such as
`git worktree add /tmp/ep-baseline HEAD`, for an A/B of a change within the same rounds).

Configurations, interleaved round by round (A B C A B C ...), so a noisy moment of a shared
machine hits every one alike:

- `direct`: the client talks to the upstream itself (no proxy): the ceiling of the load
  generator, and the denominator of every ratio.
- `fast`: `egress-proxy run` as shipped (the front door: CONNECT decided, dialled, SNI-gated and
  relayed with splice, mitmproxy never imported for this passthrough-only policy).
- `engine`: `egress-proxy run --engine-only` (every connection through mitmproxy).
- `fast-uvloop` (only when uvloop is importable): `fast` with uvloop's event loop policy set by
  a two-line launcher before the CLI runs (the proxy itself has no switch for it).
- `bare`: a reference, not egress-proxy: this script's own minimal CONNECT relay
  (`--role bare`), doing only the fast path's socket work: `loop.sock_accept`, read the head
  until CRLFCRLF, `sock_connect` to the address on its command line (at the port the CONNECT
  names: the upstream has a tunnel port and a bulk port), `200`, read the ClientHello record,
  then `proxy.relay.relay(..., initial_up=hello)`. No DNS, policy, audit, metrics or timeouts:
  the floor of Python asyncio for that work on this machine. `bare-uvloop` (only when uvloop is
  importable): the same on uvloop's loop.
- `fast-baseline` (only with `--baseline-tree PATH`): `fast`, but the `proxy` and `policy`
  packages imported from PATH (its working directory and PYTHONPATH), the same Python and
  dependencies.

Each proxy is a fresh process per round, with a manifest `network: egress: [bench.test]`, a DNS
server of this script's own on 127.0.0.1 (tests/dns_server.py) answering bench.test with
127.0.0.1, `addresses.allow: [127.0.0.0/8]`, and the audit log in a file. The upstream and the
client are separate processes of this script (uvloop when importable, else asyncio): the
upstream reads the TLS ClientHello record and answers one byte (tunnels), or after it sinks or
sources raw bytes (bulk). The client sends a real ClientHello (Python's ssl, SNI bench.test)
because the proxy relays nothing before its SNI gate has seen one. The table goes to stdout,
progress to stderr; the exit code is 1 when a tunnel or transfer failed, or when the wrong plane
served a configuration (checked on the proxy's /metrics).

Every loop is bounded in count and in time (a phase stops starting tunnels at its deadline;
every client process is killed past its limit, every proxy past its stop timeout, and the
upstream process ends with its parent); everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import select
import shlex
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench_stats import dig, latency_summary, median, ratios_by_round

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
HOST = "bench.test"
MANIFEST = f"network:\n  egress: [{HOST}]\n"
# The first listener's port, then the admin port, from the proxy's "listening on" line.
LISTENING = re.compile(
    r"listening on 127\.0\.0\.1:(\d+)(?: and \S+)* \(admin http://127\.0\.0\.1:(\d+)/"
)
# The bare relay's line on stderr once it listens.
BARE_LISTENING = re.compile(r"bare relay listening on 127\.0\.0\.1:(\d+)")
CONFIGS = ("direct", "fast", "engine", "fast-uvloop", "bare", "bare-uvloop", "fast-baseline")
UVLOOP_CONFIGS = ("fast-uvloop", "bare-uvloop")
# Runs the CLI with uvloop's loop: asyncio.run() in proxy/runtime.py asks the policy for its loop.
UVLOOP_LAUNCHER = (
    "import asyncio, sys, uvloop; asyncio.set_event_loop_policy(uvloop.EventLoopPolicy()); "
    "from proxy.cli import main; sys.exit(main())"
)
MB = 1_000_000  # decimal: MB/s and RSS MB
MIB = 1 << 20
GIB = 1 << 30
CHUNK = MIB  # bulk writes and reads
BULK_WARMUP = 64 * MIB  # moved through a tunnel of its own before each bulk measurement
CLIENTS = 16
READY_TIMEOUT = 30.0  # start-up: until listening and /readyz 200
STOP_TIMEOUT = 15.0  # SIGTERM drains for at most 5 s
SETTLE_S = 0.5  # idle RSS is read this long after /readyz is 200
SOCKET_TIMEOUT = 30.0
UPSTREAM_LIFETIME = 3600.0  # the upstream process exits by itself after this, whatever happens
READY = b"R"  # the upstream's answer to a ClientHello: the "first upstream byte"

# Targets of issue 4, measured as ratios within the same run.
TARGET_BULK_RATIO = 0.5  # fast bulk MB/s >= 0.5x direct
TARGET_RATE_RATIO = 0.4  # fast tunnels/s at 16 clients >= 0.4x direct
TARGET_CPU_RATIO = 0.1  # fast proxy CPU per tunnel <= 0.1x the engine's ...
TARGET_CPU_US = 250.0  # ... and <= 250 µs
TARGET_IDLE_RSS_MB = 30.0  # idle RSS of a passthrough-only session
TARGET_READY_S = 0.5  # listening and /readyz 200 within this of process start


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: int  # sequential tunnels before anything is measured, per round
    latency_count: int  # sequential tunnels for latency, at most ...
    latency_s: float  # ... or this long
    rate_count: int  # tunnels at CLIENTS concurrent clients, at most ...
    rate_s: float  # ... or this long
    bulk_bytes: int  # through one tunnel, each direction
    bulk_s: float  # a bulk transfer taking longer than this is abandoned


FULL = Settings(3, 30, 1000, 8.0, 8000, 6.0, GIB, 60.0)
QUICK = Settings(2, 20, 300, 3.0, 2500, 2.5, 256 * MIB, 30.0)


# --------------------------------------------------------------------------------------------
# Shared helpers (all processes)


def pick_loop(name: str) -> str:
    """'uvloop' when asked for (or 'auto') and importable, else 'asyncio'."""
    if name in ("uvloop", "auto"):
        try:
            import uvloop  # noqa: F401
        except ImportError:
            if name == "uvloop":
                raise SystemExit("uvloop is not importable") from None
            return "asyncio"
        return "uvloop"
    return "asyncio"


def run_loop(main: Callable[[], Coroutine[Any, Any, None]], loop_name: str) -> None:
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15)


def proc_memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of `pid` in MB (decimal)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024 / MB
    return out


def client_hello(sni: str, context: ssl.SSLContext | None = None) -> bytes:
    """The first flight of a real TLS client (Python's ssl) for `sni`. Pass one `context` for
    many names: a new default context loads the system's CA store (about 30 ms here)."""
    context = context or ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


# --------------------------------------------------------------------------------------------
# The upstream process: `tunnels.py --role upstream`
#
# Tunnel port (asyncio protocol): read one TLS record (the ClientHello), answer READY, close on
# the client's EOF. Bulk port (a thread per connection, blocking sockets): read the record,
# answer READY, then read a 9-byte command: b"U" + size: sink that many bytes and answer the
# count (8 bytes); b"D" + size: send that many bytes. Then wait for the client to close. No
# half-close: the engine (mitmproxy) closes a passthrough tunnel whole on the first EOF.


class _HelloAnswer(asyncio.Protocol):
    __slots__ = ("answered", "buffer", "transport")

    def __init__(self) -> None:
        self.buffer = b""
        self.answered = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.buffer += data
        if len(self.buffer) >= 5 and len(self.buffer) >= 5 + int.from_bytes(self.buffer[3:5]):
            self.answered = True
            self.buffer = b""
            assert self.transport is not None
            self.transport.write(READY)
        elif len(self.buffer) > 65536 and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close


def _read_record(sock: socket.socket) -> None:
    header = recv_exact(sock, 5)
    recv_exact(sock, int.from_bytes(header[3:5]))


def _bulk_connection(sock: socket.socket) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    try:
        sock.settimeout(SOCKET_TIMEOUT)
        _read_record(sock)
        sock.sendall(READY)
        command = recv_exact(sock, 9)
        size = struct.unpack("!Q", command[1:])[0]
        # Blocking without a timeout from here (a timeout adds a poll() to every call); the
        # client's deadline and this process's lifetime bound the transfer.
        sock.settimeout(None)
        if command[:1] == b"U":
            total = 0
            while total < size and (n := sock.recv_into(buffer)):
                total += n
            sock.sendall(struct.pack("!Q", total))
        elif command[:1] == b"D":
            left = size
            while left:
                n = min(left, CHUNK)
                sock.sendall(view[:n])
                left -= n
        while sock.recv(4096):  # until the client closes
            pass
    except OSError:
        pass
    finally:
        sock.close()


def _bulk_server(server: socket.socket, stop: threading.Event) -> None:
    server.settimeout(0.5)
    while not stop.is_set():
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=_bulk_connection, args=(sock,), daemon=True).start()


def upstream_main(loop_name: str) -> int:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def wait_stdin() -> None:
            # The parent holds our stdin: its end (or our lifetime) ends this process.
            with contextlib.suppress(OSError):
                sys.stdin.buffer.read()
            loop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(None))

        server = await loop.create_server(_HelloAnswer, LOOPBACK, 0, backlog=4096)
        bulk = socket.create_server((LOOPBACK, 0), backlog=64)
        stop = threading.Event()
        threading.Thread(target=_bulk_server, args=(bulk, stop), daemon=True).start()
        threading.Thread(target=wait_stdin, daemon=True).start()
        ports = {
            "pid": os.getpid(),
            "tunnel": server.sockets[0].getsockname()[1],
            "bulk": bulk.getsockname()[1],
            "loop": loop_name,
        }
        print(json.dumps(ports), flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped, UPSTREAM_LIFETIME)
        stop.set()
        server.close()
        bulk.close()

    run_loop(main, loop_name)
    return 0


# --------------------------------------------------------------------------------------------
# The client process: `tunnels.py --role client`. One phase per process: it reads its job (a
# JSON line) on stdin, gets ready (warm-up tunnels, if asked), prints {"ready": true}, waits for
# a "go" line, runs the phase and prints the result (a JSON line). The orchestrator reads the
# proxy's and the upstream's CPU between "go" and the results, when nothing else runs, and
# starts several client processes for the rate phase, released together.


class _TunnelClient(asyncio.Protocol):
    """CONNECT (when through a proxy), 200, ClientHello, the first upstream byte: done."""

    __slots__ = ("buffer", "done", "head", "hello", "transport")

    def __init__(self, head: bytes | None, hello: bytes, done: asyncio.Future[None]) -> None:
        self.head = head
        self.hello = hello
        self.done = done
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.head if self.head is not None else self.hello)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        if self.head is None:
            self.done.set_result(None)
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > 16384:
                self.done.set_exception(ConnectionError("oversized CONNECT response"))
            return
        status = self.buffer[:end].split(b"\r\n", 1)[0]
        if status.split(b" ", 2)[1:2] != [b"200"]:
            self.done.set_exception(ConnectionError(f"CONNECT answered {status!r}"))
            return
        rest = self.buffer[end + 4 :]
        self.head = None
        self.buffer = b""
        assert self.transport is not None
        self.transport.write(self.hello)
        if rest:
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed before the first byte"))


@dataclass
class _Target:
    address: tuple[str, int]  # where the client connects: the proxy, or the upstream (direct)
    head: bytes | None  # the CONNECT request, or None (direct)
    hello: bytes


async def _one_tunnel(target: _Target) -> float:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    start = time.perf_counter()
    # create_connection with an IP literal: both loops skip getaddrinfo. (uvloop's sock_connect
    # does not: it resolves even a literal in libuv's thread pool.)
    transport, _ = await loop.create_connection(
        lambda: _TunnelClient(target.head, target.hello, done), *target.address
    )
    try:
        await done
        return time.perf_counter() - start
    finally:
        transport.close()


async def _tunnels(target: _Target, clients: int, count: int, seconds: float) -> dict[str, Any]:
    """`count` tunnels (or as many as `seconds` allow) by `clients` concurrent workers."""
    latencies: list[float] = []
    errors: list[str] = []
    started = 0
    cpu0 = time.process_time()
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def worker() -> None:
        nonlocal started
        while started < count and time.monotonic() < deadline and len(errors) < 50:
            started += 1
            try:
                latencies.append(await _one_tunnel(target))
            except (OSError, ConnectionError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    tasks = [asyncio.ensure_future(worker()) for _ in range(clients)]
    # Past the deadline no tunnel starts; one in flight gets SOCKET_TIMEOUT to finish.
    _, pending = await asyncio.wait(tasks, timeout=seconds + SOCKET_TIMEOUT)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5)
        errors.append(f"{len(pending)} client(s) stuck past the time limit")
    return client_result(t0, cpu0, latencies, errors)


def client_result(
    t0: float, cpu0: float, latencies: Sequence[float], errors: Sequence[str]
) -> dict[str, Any]:
    """What a client process reports for a phase that began at monotonic `t0` with process CPU
    time `cpu0`: counts, the first errors, every latency in ms, its own CPU."""
    return {
        "start": t0,
        "end": time.monotonic(),
        "tunnels": len(latencies),
        "errors": len(errors),
        "first_errors": list(errors[:3]),
        "latencies_ms": [round(x * 1e3, 4) for x in latencies],
        "client_cpu_s": time.process_time() - cpu0,
    }


def _open_tunnel(target: _Target) -> socket.socket:
    sock = socket.create_connection(target.address, timeout=SOCKET_TIMEOUT)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.head is not None:
            sock.sendall(target.head)
            response = b""
            while b"\r\n\r\n" not in response:
                chunk = sock.recv(4096)
                if not chunk or len(response) > 16384:
                    raise ConnectionError(f"no CONNECT response: {response[:80]!r}")
                response += chunk
            status = response.split(b"\r\n", 1)[0]
            if status.split(b" ", 2)[1:2] != [b"200"]:
                raise ConnectionError(f"CONNECT answered {status!r}")
        sock.sendall(target.hello)
        if recv_exact(sock, 1) != READY:
            raise ConnectionError("unexpected answer to the ClientHello")
    except BaseException:
        sock.close()
        raise
    return sock


def _bulk(sock: socket.socket, direction: str, size: int, seconds: float) -> dict[str, Any]:
    """`size` bytes up (client to upstream) or down through the open tunnel `sock`."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    error = None
    moved = 0
    # Blocking without a timeout (a timeout adds a poll() to every call): the deadline below
    # and the orchestrator's limit on this process bound the transfer.
    sock.settimeout(None)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    sock.sendall((b"U" if direction == "up" else b"D") + struct.pack("!Q", size))
    if direction == "up":
        while moved < size and time.perf_counter() < deadline:
            n = min(CHUNK, size - moved)
            sock.sendall(view[:n])
            moved += n
        if moved == size:
            received = struct.unpack("!Q", recv_exact(sock, 8))[0]
            if received != moved:
                error = f"upstream received {received} of {moved} bytes"
    else:
        while moved < size and time.perf_counter() < deadline:
            n = sock.recv_into(buffer)
            if not n:
                break
            moved += n
    wall = time.perf_counter() - t0
    if moved != size and error is None:
        error = f"moved {moved} of {size} bytes within {seconds:g} s"
    return {
        "direction": direction,
        "bytes": moved,
        "seconds": wall,
        "mb_per_s": moved / wall / MB if wall > 0 else 0.0,
        "error": error,
        "client_cpu_s": time.process_time() - cpu0,
    }


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _wait_go() -> bool:
    return sys.stdin.readline().strip() == "go"


def tunnel_target(job: dict[str, Any], host: str, hello: bytes) -> _Target:
    """Where a client job's tunnels go: through the proxy (a CONNECT to `host` at the job's
    upstream port) or, without a proxy port, straight to the upstream."""
    port = job["port"]
    return _Target(
        address=(LOOPBACK, job["proxy_port"] or port),
        head=f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
        if job["proxy_port"]
        else None,
        hello=hello,
    )


def client_main(loop_name: str) -> int:
    job = json.loads(sys.stdin.readline())
    target = tunnel_target(job, HOST, client_hello(HOST))
    if job["phase"] == "bulk":
        try:
            # A first transfer in a fresh process runs at half speed (down: the client's CPU per
            # GiB triples), whatever the proxy: warm up on a tunnel of its own.
            with _open_tunnel(target) as warm:
                _bulk(warm, job["direction"], min(job["bytes"], BULK_WARMUP), job["seconds"])
            sock = _open_tunnel(target)
        except OSError as exc:
            _say({"failed": f"bulk tunnel: {type(exc).__name__}: {exc}"})
            return 0
        with sock:
            _say({"ready": True})
            if _wait_go():
                _say(_bulk(sock, job["direction"], job["bytes"], job["seconds"]))
        return 0

    async def tunnels() -> None:
        if job["warmup"]:
            warm = await _tunnels(target, 1, job["warmup"], 10.0)
            if warm["errors"] or not warm["tunnels"]:
                _say({"failed": f"warm-up failed: {warm['first_errors']}"})
                return
        _say({"ready": True})
        if _wait_go():
            _say(await _tunnels(target, job["clients"], job["count"], job["seconds"]))

    run_loop(tunnels, loop_name)
    return 0


# --------------------------------------------------------------------------------------------
# The bare relay: `tunnels.py --role bare --upstream 127.0.0.1 --loop asyncio|uvloop`
#
# The reference configurations `bare` and `bare-uvloop`: the socket work of the fast path and
# nothing else (no DNS, no policy, no SNI gate, no audit, no metrics, no timeouts but the
# relay's idle one), with egress-proxy's own relay. The connection's port is the CONNECT's (the
# upstream process has two); its address is the one on the command line, never the head's.

BARE_HEAD_LIMIT = 16384
BARE_HELLO_LIMIT = 65536
BARE_IDLE_TIMEOUT = 600.0  # the proxy's default limits.idle_timeout
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


async def _bare_serve(sock: socket.socket, upstream_host: str, relay: Any) -> None:
    loop = asyncio.get_running_loop()
    upstream = None
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk or len(data) > BARE_HEAD_LIMIT:
                return
            data += chunk
        port = int(data[:end].split(b" ", 2)[1].rpartition(b":")[2])
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(upstream, (upstream_host, port))
        await loop.sock_sendall(sock, ESTABLISHED)
        hello = data[end + 4 :]
        while len(hello) < 5 or len(hello) < 5 + int.from_bytes(hello[3:5]):
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk or len(hello) > BARE_HELLO_LIMIT:
                return
            hello += chunk
        # The relay owns (and closes) both sockets from here.
        target, upstream = upstream, None
        await relay(sock, target, idle_timeout=BARE_IDLE_TIMEOUT, initial_up=hello)
    except (OSError, ValueError, IndexError):
        pass
    finally:
        if upstream is not None:
            upstream.close()
        sock.close()


def bare_main(loop_name: str, upstream_host: str) -> int:
    sys.path.insert(0, str(ROOT))
    from proxy.net.relay import relay

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, lambda: stopped.done() or stopped.set_result(None))
        server = socket.create_server((LOOPBACK, 0), backlog=1024)
        server.setblocking(False)
        tasks: set[asyncio.Task[None]] = set()

        async def accept() -> None:
            while True:
                try:
                    sock, _ = await loop.sock_accept(server)
                except OSError:
                    await asyncio.sleep(0.1)
                    continue
                task = loop.create_task(_bare_serve(sock, upstream_host, relay))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        acceptor = loop.create_task(accept())
        port = server.getsockname()[1]
        print(f"bare relay listening on {LOOPBACK}:{port} ({loop_name})", file=sys.stderr)
        sys.stderr.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped, UPSTREAM_LIFETIME)
        acceptor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acceptor
        loop.remove_reader(server.fileno())
        server.close()
        for task in tasks:
            task.cancel()  # the relay closes its sockets on cancellation
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    run_loop(main, loop_name)
    return 0


# --------------------------------------------------------------------------------------------
# The orchestrator: DNS server, upstream, proxies, client jobs, the report.


def _role_command(role: str, loop_name: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, "--loop", loop_name]


def _http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while len(data) < 1 << 20 and (chunk := sock.recv(65536)):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@dataclass
class Proxy:
    """One `egress-proxy run` process (or, for `bare*`, the bare relay), from start to stop."""

    config: str
    directory: Path
    process: subprocess.Popen[bytes]
    started: float
    port: int = 0
    admin_port: int = 0
    listening_s: float = 0.0
    ready_s: float = 0.0

    @property
    def bare(self) -> bool:
        return self.config.startswith("bare")

    @classmethod
    def start(
        cls, config: str, directory: Path, env: dict[str, str], baseline: Path | None = None
    ) -> Proxy:
        audit = directory / "audit.jsonl"
        audit.unlink(missing_ok=True)
        stderr = directory / "stderr.txt"
        args = ["run", str(directory / "agent.yaml"), "--config", str(directory / "config.yaml")]
        args += ["--listen", f"{LOOPBACK}:0", "--admin", f"{LOOPBACK}:0"]
        args += ["--session-id", f"bench-{config}", "--audit-log", str(audit)]
        if config == "engine":
            args.append("--engine-only")
        if config.startswith("bare"):
            loop = "uvloop" if config == "bare-uvloop" else "asyncio"
            command = [*_role_command("bare", loop), "--upstream", LOOPBACK]
        elif config == "fast-uvloop":
            command = [sys.executable, "-c", UVLOOP_LAUNCHER, *args]
        else:
            command = [sys.executable, "-m", "proxy", *args]
        tree = ROOT
        if config == "fast-baseline":
            assert baseline is not None
            # Ahead of the editable install's path entry: that tree's proxy/ and policy/.
            tree = baseline
            env = {**env, "PYTHONPATH": str(baseline)}
        with open(stderr, "wb") as err:
            started = time.perf_counter()
            process = subprocess.Popen(
                command,
                cwd=tree,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        proxy = cls(config, directory, process, started)
        try:
            proxy._wait_ready(stderr)
        except BaseException:
            proxy.stop()
            raise
        return proxy

    def _wait_ready(self, stderr: Path) -> None:
        deadline = self.started + READY_TIMEOUT
        while not self.port:
            text = stderr.read_text(errors="replace")
            match = (BARE_LISTENING if self.bare else LISTENING).search(text)
            if match and self.bare:
                # No admin endpoint: ready is listening.
                self.port = int(match[1])
                self.listening_s = self.ready_s = time.perf_counter() - self.started
                return
            if match:
                self.port, self.admin_port = int(match[1]), int(match[2])
                self.listening_s = time.perf_counter() - self.started
                break
            if self.process.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(
                    f"{self.config}: egress-proxy run not listening (exit "
                    f"{self.process.poll()}):\n{stderr.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.002)
        while True:
            with contextlib.suppress(OSError, ValueError, IndexError):
                if _http_get(self.admin_port, "/readyz")[0] == 200:
                    self.ready_s = time.perf_counter() - self.started
                    return
            if self.process.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"{self.config}: /readyz never answered 200")
            time.sleep(0.002)

    @property
    def pid(self) -> int:
        return self.process.pid

    def metrics(self) -> dict[str, float]:
        """The counters that show which plane served: connections by plane, engine loaded."""
        out: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError, IndexError):
            body = _http_get(self.admin_port, "/metrics")[1]
            for line in body.decode(errors="replace").splitlines():
                if line.startswith(("egress_connections_total{", "egress_engine_loaded ")):
                    name, _, value = line.rpartition(" ")
                    out[name] = float(value)
        return out

    def stop(self) -> int:
        return stop_child(self.process)


def stop_child(process: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> int:
    """SIGTERM (a proxy drains), SIGKILL after `timeout`; the exit status."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(timeout=10)


def end_by_stdin(process: subprocess.Popen[bytes]) -> None:
    """Closes a role process's stdin (its signal to end) and waits; SIGKILL after 10 s."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def upstream_process(loop_name: str) -> Iterator[dict[str, Any]]:
    process = subprocess.Popen(
        _role_command("upstream", loop_name), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("the upstream process did not start")
        yield json.loads(line)
    finally:
        end_by_stdin(process)


@dataclass
class Bench:
    """What every phase of a run needs: the upstream, the load generator's loop, the settings."""

    upstream: dict[str, Any]
    loop: str
    settings: Settings
    procs: int  # client processes in the rate phase
    directions: Sequence[str]
    proxy_env: dict[str, str]
    baseline: Path | None = None  # the tree `fast-baseline` runs


def _read_message(process: subprocess.Popen[bytes], timeout: float, log: Path) -> dict[str, Any]:
    """The next JSON line from a client process, within `timeout` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else b""
    if not line:
        process.kill()
        raise RuntimeError(
            f"client process gave no answer within {timeout:g} s (exit {process.poll()}):\n"
            + log.read_text(errors="replace")[-3000:]
        )
    message = json.loads(line)
    if "failed" in message:
        raise RuntimeError(f"client: {message['failed']}")
    return message


class Listening(Protocol):
    """What the client phases need of a proxy (egress-proxy's Proxy, or a peer of bench.py):
    its port, and its pid for its CPU time."""

    port: int

    @property
    def pid(self) -> int: ...


def client_phase(
    bench: Bench,
    proxy: Listening | None,
    jobs: Sequence[dict[str, Any]],
    limit: float,
    tmp: Path,
    command: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
    """Runs one phase in len(jobs) client processes released together; their results and the
    CPU seconds the proxy, the upstream (and the clients, as they report) spent on it. The
    client is this script's (`--role client`) unless `command` names another that speaks the
    same lines."""
    processes: list[subprocess.Popen[bytes]] = []
    logs = [tmp / f"client-{i}.stderr" for i in range(len(jobs))]
    try:
        for job, log in zip(jobs, logs, strict=True):
            with open(log, "wb") as err:
                process = subprocess.Popen(
                    command or _role_command("client", bench.loop),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            processes.append(process)
            assert process.stdin is not None
            process.stdin.write(json.dumps(job).encode() + b"\n")
            process.stdin.flush()
        for process, log in zip(processes, logs, strict=True):
            _read_message(process, 60.0, log)  # ready (warm-up done)
        pids = (proxy.pid if proxy else None, bench.upstream["pid"])
        before = [proc_cpu(pid) for pid in pids]
        for process in processes:
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            process.stdin.flush()
        results = [
            _read_message(process, limit, log) for process, log in zip(processes, logs, strict=True)
        ]
        # The proxy may still be closing the last tunnels (audit lines, metrics): that is theirs.
        time.sleep(0.2)
        after = [proc_cpu(pid) for pid in pids]
    finally:
        for process in processes:
            end_by_stdin(process)
    cpu: dict[str, float | None] = {}
    for who, a, b in zip(("proxy", "upstream"), before, after, strict=True):
        cpu[f"{who}_cpu_s"] = None if a is None or b is None else b - a
    cpu["client_cpu_s"] = sum(r["client_cpu_s"] for r in results)
    return results, cpu


def tunnel_phase(
    bench: Bench, proxy: Listening | None, tmp: Path, *, warmup: int, procs: int, clients: int,
    count: int, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    base = {
        "phase": "tunnels",
        "proxy_port": proxy.port if proxy else None,
        "port": bench.upstream["tunnel"],
        "seconds": seconds,
    }
    jobs = [
        {
            **base,
            "warmup": warmup,
            "clients": clients // procs + (i < clients % procs),
            "count": count // procs + (i < count % procs),
        }
        for i in range(procs)
    ]
    results, cpu = client_phase(bench, proxy, jobs, seconds + SOCKET_TIMEOUT + 10, tmp)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    done = sum(r["tunnels"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    errors = [e for r in results for e in r["first_errors"]]
    out: dict[str, Any] = {
        "procs": procs,
        "clients": clients,
        "tunnels": done,
        "errors": sum(r["errors"] for r in results),
        "first_errors": errors[:3],
        "seconds": wall,
        "tunnels_per_s": done / wall if wall > 0 else 0.0,
        **cpu,
    }
    if latencies:
        out["latency_ms"] = latency_summary(latencies)
    for who in ("proxy", "upstream", "client"):
        value = cpu[f"{who}_cpu_s"]
        out[f"{who}_cpu_us_per_tunnel"] = None if value is None or not done else value / done * 1e6
    return out


def bulk_phase(bench: Bench, proxy: Listening | None, tmp: Path, direction: str) -> dict[str, Any]:
    s = bench.settings
    job = {
        "phase": "bulk",
        "proxy_port": proxy.port if proxy else None,
        "port": bench.upstream["bulk"],
        "direction": direction,
        "bytes": s.bulk_bytes,
        "seconds": s.bulk_s,
    }
    results, cpu = client_phase(bench, proxy, [job], s.bulk_s + SOCKET_TIMEOUT + 10, tmp)
    out = {**results[0], **cpu}
    gib = out["bytes"] / GIB
    for who in ("proxy", "upstream", "client"):
        value = cpu[f"{who}_cpu_s"]
        out[f"{who}_cpu_s_per_gib"] = None if value is None or not gib else value / gib
    return out


def proxy_env(pycache: Path) -> dict[str, str]:
    """The proxy's environment: bytecode cached as an installed package has it. (This workplace
    sets PYTHONDONTWRITEBYTECODE, and the editable checkout has no __pycache__, so every start
    would compile proxy/ and policy/ from source.) The cache lives in the run's temp dir and the
    warm-up pass fills it; the checkout is not written to."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def write_inputs(directory: Path, dns_address: tuple[str, int], ca_dir: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "agent.yaml").write_text(MANIFEST)
    (directory / "config.yaml").write_text(
        f"dns:\n  nameservers: ['{dns_address[0]}:{dns_address[1]}']\n  timeout: 2s\n"
        "addresses:\n  allow: [127.0.0.0/8]\n"
        f"inspection:\n  enabled: true\n  ca_dir: {ca_dir}\n"
    )


def one_round(config: str, directory: Path, bench: Bench) -> dict[str, Any]:
    """One configuration once: (start the proxy,) latency, rate, bulk, (stop it)."""
    s = bench.settings
    proxy = (
        None
        if config == "direct"
        else Proxy.start(config, directory, bench.proxy_env, bench.baseline)
    )
    out: dict[str, Any] = {}
    try:
        if proxy is not None:
            time.sleep(SETTLE_S)
            idle = proc_memory(proxy.pid)
            out.update(listening_s=proxy.listening_s, ready_s=proxy.ready_s)
            out.update(rss_idle_mb=idle.get("VmRSS"))
        out["latency"] = tunnel_phase(
            bench, proxy, directory, warmup=s.warmup, procs=1, clients=1,
            count=s.latency_count, seconds=s.latency_s,
        )  # fmt: skip
        out["rate"] = tunnel_phase(
            bench, proxy, directory, warmup=10, procs=bench.procs, clients=CLIENTS,
            count=s.rate_count, seconds=s.rate_s,
        )  # fmt: skip
        out["bulk"] = {d: bulk_phase(bench, proxy, directory, d) for d in bench.directions}
        if proxy is not None:
            after = proc_memory(proxy.pid)
            out.update(rss_after_mb=after.get("VmRSS"), rss_peak_mb=after.get("VmHWM"))
            if not proxy.bare:
                out["metrics"] = proxy.metrics()
    finally:
        if proxy is not None:
            out["exit_code"] = proxy.stop()
    return out


# -- summary -----------------------------------------------------------------------------------


FIGURES: dict[str, tuple[str, ...]] = {
    "ready_s": ("ready_s",),
    "listening_s": ("listening_s",),
    "rss_idle_mb": ("rss_idle_mb",),
    "rss_after_mb": ("rss_after_mb",),
    "rss_peak_mb": ("rss_peak_mb",),
    "latency_p50_ms": ("latency", "latency_ms", "p50"),
    "latency_p99_ms": ("latency", "latency_ms", "p99"),
    "sequential_proxy_cpu_us_per_tunnel": ("latency", "proxy_cpu_us_per_tunnel"),
    "tunnels_per_s": ("rate", "tunnels_per_s"),
    "rate_latency_p50_ms": ("rate", "latency_ms", "p50"),
    "rate_latency_p99_ms": ("rate", "latency_ms", "p99"),
    "proxy_cpu_us_per_tunnel": ("rate", "proxy_cpu_us_per_tunnel"),
    "client_cpu_us_per_tunnel": ("rate", "client_cpu_us_per_tunnel"),
    "upstream_cpu_us_per_tunnel": ("rate", "upstream_cpu_us_per_tunnel"),
    "bulk_up_mb_s": ("bulk", "up", "mb_per_s"),
    "bulk_down_mb_s": ("bulk", "down", "mb_per_s"),
    "bulk_up_proxy_cpu_s_per_gib": ("bulk", "up", "proxy_cpu_s_per_gib"),
    "bulk_down_proxy_cpu_s_per_gib": ("bulk", "down", "proxy_cpu_s_per_gib"),
}
# Ratios to direct, taken within each round, then the median over rounds.
RATIOS = ("tunnels_per_s", "bulk_up_mb_s", "bulk_down_mb_s", "latency_p50_ms", "latency_p99_ms")


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    direct = runs.get("direct", [])
    for config, rounds in runs.items():
        row: dict[str, Any] = {}
        for figure, path in FIGURES.items():
            row[figure] = median([dig(r, path) for r in rounds])
        for figure in RATIOS:
            row[f"{figure}_vs_direct"] = median(ratios_by_round(rounds, direct, FIGURES[figure]))
        row["errors"] = sum(
            (dig(r, ("latency", "errors")) or 0) + (dig(r, ("rate", "errors")) or 0) for r in rounds
        )
        row["bulk_errors"] = [
            b["error"] for r in rounds for b in (dig(r, ("bulk",)) or {}).values() if b["error"]
        ]
        out[config] = row
    return out


def plane_problem(config: str, metrics: dict[str, float]) -> str | None:
    """What is wrong when egress-proxy served tunnels on the other plane than `config` means
    (from its /metrics counters), or None."""
    l4 = metrics.get('egress_connections_total{plane="l4",protocol="connect"}', 0)
    loaded = metrics.get("egress_engine_loaded")
    if config.startswith("fast") and (loaded or not l4):
        return f"the engine served (engine_loaded={loaded}, l4={l4})"
    if config == "engine" and l4:
        return f"the fast path served {l4:.0f} connections"
    return None


def _ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str, figure: str) -> float | None:
    """Median over rounds of figure(a) / figure(b) within each round."""
    return median(ratios_by_round(runs.get(a, []), runs.get(b, []), FIGURES[figure]))


def targets(
    summary: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    fast = summary.get("fast")
    if fast is None:
        return []
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None, detail: str) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met, "detail": detail})

    if "direct" in summary:
        for d in ("up", "down"):
            v = fast.get(f"bulk_{d}_mb_s_vs_direct")
            if v is not None:
                add(
                    f"bulk {d} vs direct",
                    v,
                    f">= {TARGET_BULK_RATIO}x",
                    v >= TARGET_BULK_RATIO,
                    f"{fast[f'bulk_{d}_mb_s']:,.0f} MB/s against "
                    f"{summary['direct'][f'bulk_{d}_mb_s']:,.0f}",
                )
        v = fast.get("tunnels_per_s_vs_direct")
        if v is not None:
            add(
                f"tunnels/s at {CLIENTS} clients vs direct",
                v,
                f">= {TARGET_RATE_RATIO}x",
                v >= TARGET_RATE_RATIO,
                f"{fast['tunnels_per_s']:,.0f} against {summary['direct']['tunnels_per_s']:,.0f}",
            )
    cpu = fast.get("proxy_cpu_us_per_tunnel")
    if cpu is not None:
        add(
            "proxy CPU per tunnel",
            cpu,
            f"<= {TARGET_CPU_US:g} µs",
            cpu <= TARGET_CPU_US,
            f"{cpu:,.0f} µs at {CLIENTS} clients",
        )
    if "engine" in summary:
        v = _ratio(runs, "fast", "engine", "proxy_cpu_us_per_tunnel")
        if v is not None:
            add(
                "proxy CPU per tunnel vs engine",
                v,
                f"<= {TARGET_CPU_RATIO}x",
                v <= TARGET_CPU_RATIO,
                f"{cpu:,.0f} µs against {summary['engine']['proxy_cpu_us_per_tunnel']:,.0f} µs",
            )
    rss = fast.get("rss_idle_mb")
    if rss is not None:
        add(
            "idle RSS (passthrough-only session)",
            rss,
            f"<= {TARGET_IDLE_RSS_MB:g} MB",
            rss <= TARGET_IDLE_RSS_MB,
            f"{rss:.1f} MB VmRSS {SETTLE_S:g} s after /readyz is 200",
        )
    ready = fast.get("ready_s")
    if ready is not None:
        worst = max(r["ready_s"] for r in runs["fast"])
        add(
            "ready (listening and /readyz 200)",
            ready * 1e3,
            f"<= {TARGET_READY_S * 1e3:g} ms",
            ready <= TARGET_READY_S,
            f"median from process start, slowest {worst * 1e3:.1f} ms; polled every 2 ms",
        )
    return out


def _cell(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = (
        "| config | ready s | idle RSS MB | RSS after MB | new tunnel p50 ms | p99 ms "
        f"| tunnels/s @{CLIENTS} | vs direct | proxy CPU µs/tunnel | client+upstream µs/tunnel "
        "| bulk up MB/s | vs direct | bulk down MB/s | vs direct | proxy CPU s/GiB up/down |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for config, r in summary.items():
        load = None
        if r["client_cpu_us_per_tunnel"] is not None and r["upstream_cpu_us_per_tunnel"]:
            load = r["client_cpu_us_per_tunnel"] + r["upstream_cpu_us_per_tunnel"]
        cpu_gib = (
            "-"
            if r["bulk_up_proxy_cpu_s_per_gib"] is None
            else f"{r['bulk_up_proxy_cpu_s_per_gib']:.2f} / "
            + _cell(r["bulk_down_proxy_cpu_s_per_gib"], ".2f")
        )
        lines.append(
            f"| {config} | {_cell(r['ready_s'], '.3f')} | {_cell(r['rss_idle_mb'], '.1f')} "
            f"| {_cell(r['rss_after_mb'], '.1f')} | {_cell(r['latency_p50_ms'], '.3f')} "
            f"| {_cell(r['latency_p99_ms'], '.3f')} | {_cell(r['tunnels_per_s'], ',.0f')} "
            f"| {_cell(r['tunnels_per_s_vs_direct'], '.2f', 'x')} "
            f"| {_cell(r['proxy_cpu_us_per_tunnel'], ',.0f')} | {_cell(load, ',.0f')} "
            f"| {_cell(r['bulk_up_mb_s'], ',.0f')} "
            f"| {_cell(r['bulk_up_mb_s_vs_direct'], '.2f', 'x')} "
            f"| {_cell(r['bulk_down_mb_s'], ',.0f')} "
            f"| {_cell(r['bulk_down_mb_s_vs_direct'], '.2f', 'x')} | {cpu_gib} |"
        )
    return "\n".join(lines)


def uvloop_line(summary: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> str:
    if "fast-uvloop" not in summary or "fast" not in summary:
        return ""
    u, f = summary["fast-uvloop"], summary["fast"]
    parts = []
    for label, figure in (
        ("tunnels/s", "tunnels_per_s"),
        ("proxy CPU/tunnel", "proxy_cpu_us_per_tunnel"),
        ("new tunnel p50", "latency_p50_ms"),
        ("bulk up", "bulk_up_mb_s"),
        ("bulk down", "bulk_down_mb_s"),
    ):
        ratio = _ratio(runs, "fast-uvloop", "fast", figure)
        parts.append(f"{label} {_cell(ratio, '.2f', 'x')}")
    for label, figure, unit in (("idle RSS", "rss_idle_mb", " MB"), ("ready", "ready_s", " s")):
        if u[figure] is not None and f[figure] is not None:
            parts.append(f"{label} {u[figure] - f[figure]:+.3g}{unit}")
    return "fast-uvloop against fast (same rounds): " + ", ".join(parts)


def notes(settings: Settings, client_loop: str, upstream_loop: str, procs: int) -> str:
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"""\
What each figure covers (medians of {settings.rounds} interleaved rounds; ratios to direct are
taken within each round, then the median):
- Every proxy is a fresh process per round, started after an untimed pass of every
  configuration (page cache, bytecode cache). Each client process warms up
  before it is released: tunnels ({settings.warmup} for latency, 10 per rate process) or a
  {BULK_WARMUP // MIB} MiB transfer on a tunnel of its own (bulk).
- ready s: from just before the proxy process is spawned until its "listening on" line is on
  stderr and GET /readyz answers 200 (both polled every 2 ms); bytecode cached. Idle RSS: VmRSS
  {SETTLE_S:g} s later; RSS after: VmRSS once the last phase is done (bulk included).
- new tunnel: one client, one tunnel at a time: TCP connect, CONNECT, 200, a real TLS
  ClientHello (SNI {HOST}), the upstream's first byte; {settings.latency_count:,} tunnels (at
  most {settings.latency_s:g} s). Direct: TCP connect, ClientHello, first byte.
- tunnels/s: the same tunnels by {CLIENTS} concurrent clients in {procs} client process(es)
  released together ({settings.rate_count:,} tunnels, at most {settings.rate_s:g} s). proxy CPU
  µs/tunnel: utime+stime of the proxy process (/proc/PID/stat, all threads) from the release to
  0.2 s after the last result, / tunnels. client+upstream: the load generator's own CPU per
  tunnel (client {client_loop}, upstream {upstream_loop}); it shares the {nproc} CPUs with the
  proxy, so it bounds what any configuration can reach.
- bulk: one tunnel, {settings.bulk_bytes / MIB:,.0f} MiB up (client sendall in 1 MiB chunks to an
  upstream that sinks them) and down (the upstream sends, the client reads into 1 MiB); from the
  command to the upstream's byte count (up) or the last byte (down). MB = 10^6 bytes.
  proxy CPU s/GiB: the proxy's utime+stime over the transfer / GiB moved.
- bare, bare-uvloop: not egress-proxy but this script's minimal CONNECT relay (accept, head,
  connect, 200, ClientHello, proxy.relay.relay; no DNS/policy/audit/metrics), on asyncio /
  uvloop: the floor of Python asyncio for the fast path's socket work. ready s: listening."""


def machine() -> dict[str, Any]:
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = None
    with contextlib.suppress(OSError):
        load = Path("/proc/loadavg").read_text().split()[:3]
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "system": f"{platform.system()} {platform.release()}",
        "loadavg_at_start": load,
        "git": commit,
    }


def command() -> str:
    argv = [sys.executable if os.path.isabs(sys.executable) else "python", *sys.argv]
    with contextlib.suppress(ValueError):
        argv[0] = os.path.relpath(argv[0], Path.cwd())
    return shlex.join(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tunnels, 256 MiB bulk")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 2)")
    parser.add_argument(
        "--configs",
        help=f"comma-separated, of {','.join(CONFIGS)} (default: all; fast-uvloop when "
        "uvloop is importable; bare-uvloop likewise)",
    )
    parser.add_argument("--bulk-mib", type=int, help="bulk size per direction (default 1024)")
    parser.add_argument(
        "--bulk", default="up,down", help="bulk directions: up,down (default), up, down or none"
    )
    parser.add_argument("--json", metavar="PATH", help="write every sample and the summary here")
    parser.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="the load generator's event loop (client and upstream; default uvloop if present)",
    )
    parser.add_argument(
        "--client-procs",
        type=int,
        default=2,
        help=f"client processes sharing the {CLIENTS} clients of the rate phase (default 2)",
    )
    parser.add_argument(
        "--baseline-tree",
        metavar="PATH",
        type=Path,
        help="another checkout (e.g. a git worktree of HEAD) run as the extra config "
        "fast-baseline, interleaved with the others for an A/B of a change",
    )
    parser.add_argument("--role", choices=("upstream", "client", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=LOOPBACK, help=argparse.SUPPRESS)  # bare only
    args = parser.parse_args(argv)
    loop_name = pick_loop(args.loop)
    if args.role == "upstream":
        return upstream_main(loop_name)
    if args.role == "client":
        return client_main(loop_name)
    if args.role == "bare":
        return bare_main(loop_name, args.upstream)

    if not 1 <= args.client_procs <= CLIENTS:
        parser.error(f"--client-procs must be between 1 and {CLIENTS}")
    settings = QUICK if args.quick else FULL
    if args.rounds is not None:
        settings = Settings(**{**settings.__dict__, "rounds": max(1, args.rounds)})
    if args.bulk_mib is not None:
        settings = Settings(**{**settings.__dict__, "bulk_bytes": max(1, args.bulk_mib) * MIB})
    directions = [d for d in args.bulk.split(",") if d in ("up", "down")]
    have_uvloop = pick_loop("auto") == "uvloop"
    if args.configs:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in configs if c not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}")
        for config in configs:
            if config in UVLOOP_CONFIGS and not have_uvloop:
                parser.error(f"{config} needs uvloop importable")
    else:
        configs = [c for c in CONFIGS if c not in UVLOOP_CONFIGS or have_uvloop]
        configs = [c for c in configs if c != "fast-baseline" or args.baseline_tree]
    baseline: Path | None = None
    if args.baseline_tree is not None:
        baseline = args.baseline_tree.resolve()
        if not (baseline / "proxy" / "__main__.py").is_file():
            parser.error(f"--baseline-tree {args.baseline_tree}: no proxy/__main__.py there")
        if "fast-baseline" not in configs:
            configs.append("fast-baseline")
    elif "fast-baseline" in configs:
        parser.error("fast-baseline needs --baseline-tree PATH")

    sys.path.insert(0, str(ROOT / "tests"))
    from dns_server import running_dns_server

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    began = time.perf_counter()
    info = machine()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    warm = Settings(1, 5, 10, 5.0, 50, 5.0, 16 * MIB, 30.0)
    with (
        tempfile.TemporaryDirectory(prefix="bench-tunnels-") as tmp,
        running_dns_server() as dns,
        upstream_process(loop_name) as upstream,
    ):
        dns.set(HOST, a=[LOOPBACK], ttl=3600)
        for config in configs:
            write_inputs(Path(tmp) / config, dns.address, Path(tmp) / "ca")
        log(f"upstream {upstream}; configs {', '.join(configs)}; {settings}")
        # One untimed pass: fills the page cache and the bytecode cache.
        env = proxy_env(Path(tmp) / "pycache")
        for config in configs:
            one_round(
                config,
                Path(tmp) / config,
                Bench(upstream, loop_name, warm, 1, directions, env, baseline),
            )
        log(f"warm-up pass done in {time.perf_counter() - began:.1f} s")
        bench = Bench(upstream, loop_name, settings, args.client_procs, directions, env, baseline)
        for n in range(settings.rounds):
            for config in configs:
                t0 = time.perf_counter()
                result = one_round(config, Path(tmp) / config, bench)
                result["round"] = n + 1  # ratios pair samples of the same round
                runs[config].append(result)
                log(
                    f"round {n + 1}/{settings.rounds} {config:<11} "
                    f"{result['rate']['tunnels_per_s']:8,.0f} tunnels/s, "
                    + (
                        f"proxy {cpu:,.0f} µs/tunnel, "
                        if (cpu := result["rate"].get("proxy_cpu_us_per_tunnel")) is not None
                        else ""
                    )
                    + f"p50 {result['latency']['latency_ms']['p50']:.3f} ms, "
                    + ", ".join(
                        f"bulk {d} {b['mb_per_s']:,.0f} MB/s" for d, b in result["bulk"].items()
                    )
                    + f" ({time.perf_counter() - t0:.1f} s)"
                )
    elapsed = time.perf_counter() - began
    summary = summarise(runs)
    goals = targets(summary, runs)
    out = [
        f"`{command()}`: {info['nproc']} CPUs, {info['cpu_model']}, "
        f"{info['implementation']} {info['python']}, {info['system']}, git {info['git']}, "
        f"load average {' '.join(info['loadavg_at_start'] or [])} at start, {elapsed:.0f} s.",
        "",
        table(summary),
        "",
    ]
    for g in goals:
        verdict = "met" if g["met"] else "NOT MET"
        value = g["value"]
        unit = g["goal"].split()[-1]
        shown = f"{value:.3f}x" if unit.endswith("x") else f"{value:,.1f} {unit}"
        out.append(f"- {g['target']}: {shown} (goal {g['goal']}): {verdict} [{g['detail']}]")
    line = uvloop_line(summary, runs)
    if line:
        out += ["", line]
    problems = [f"{c}: {r['errors']} failed tunnels" for c, r in summary.items() if r["errors"]] + [
        f"{c}: {e}" for c, r in summary.items() for e in r["bulk_errors"]
    ]
    for c, rounds in runs.items():
        for r in rounds:
            if wrong := plane_problem(c, r.get("metrics") or {}):
                problems.append(f"{c}: {wrong}")
    if problems:
        out += ["", "Problems:", *(f"- {p}" for p in problems)]
    out += ["", notes(settings, loop_name, upstream["loop"], args.client_procs)]
    print("\n".join(out))
    if args.json:
        document = {
            "benchmark": "tunnels",
            "command": command(),
            "machine": info,
            "elapsed_s": elapsed,
            "settings": {
                **settings.__dict__,
                "clients": CLIENTS,
                "bulk_directions": directions,
                "configs": configs,
                "load_generator_loop": loop_name,
                "client_procs": args.client_procs,
                "settle_s": SETTLE_S,
            },
            "summary": summary,
            "targets": goals,
            "uvloop": line or None,
            "problems": problems,
            "rounds": runs,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
        log(f"wrote {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
