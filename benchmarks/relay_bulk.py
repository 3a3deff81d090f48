"""Bulk throughput of the L4 byte relay (proxy/relay.py) through one loopback TCP connection:
zero-copy splice against the asyncio copy against no relay at all (direct).

    .venv/bin/python benchmarks/relay_bulk.py                      # 1 GiB, 3 rounds
    .venv/bin/python benchmarks/relay_bulk.py --size-mib 256 --rounds 5
    .venv/bin/python benchmarks/relay_bulk.py --modes direct,splice,splice-64k,copy

Modes: `direct` (source to sink, no relay), `splice` (the relay's default: pipes that grow to
1 MiB), `splice-256k`, `splice-64k` (pipes capped there), `copy` (the asyncio copy).

A source process sends `--size-mib` from a reusable buffer and a sink process reads it, each a
subprocess of this script, so the relay (in this process, on the asyncio loop) is the only
thing measured here. Rounds are interleaved (every mode once per round, the order rotating), and
the table shows medians:

- MB/s: bytes / the sink's time from accept to EOF (decimal megabytes).
- relay CPU s/GiB: user + system CPU of this process while the relay ran (0 for direct).
- endpoints CPU s/GiB: user + system CPU of the source and sink processes while they send and
  receive (each measures itself, so interpreter start-up is left out). On loopback the
  kernel does part of the receiver's work in the sender's context, so the split between the
  processes is approximate; the sum of both columns compares fairly across modes.

Every socket operation has a timeout and every subprocess a deadline. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.net.relay import relay, splice_available  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
CHUNK = MIB
SOCKET_TIMEOUT = 60.0  # no single socket call of a round may take longer
ROUND_TIMEOUT = 300.0
# mode -> (prefer_splice, pipe size); direct has no relay.
MODES: dict[str, tuple[bool, int] | None] = {
    "direct": None,
    "splice": (True, 1 << 20),
    "splice-256k": (True, 256 << 10),
    "splice-64k": (True, 64 << 10),
    "copy": (False, 0),
}
DEFAULT_MODES = ("direct", "splice", "copy")


# ---- the endpoint subprocesses


def run_sink() -> None:
    """Listens on loopback, prints the port, reads one connection to EOF, prints bytes, seconds
    from accept to EOF and its own CPU seconds over that time."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        listener.settimeout(SOCKET_TIMEOUT)
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(SOCKET_TIMEOUT)
        cpu = self_cpu()
        started = time.perf_counter()
        buffer = bytearray(CHUNK)
        total = 0
        deadline = time.monotonic() + ROUND_TIMEOUT
        while time.monotonic() < deadline:
            n = conn.recv_into(buffer)
            if n == 0:
                break
            total += n
        elapsed = time.perf_counter() - started
        cpu = self_cpu() - cpu
    print(total, elapsed, cpu, flush=True)


def run_source(port: int, size: int) -> None:
    """Connects, sends `size` bytes, shuts down writing, waits for the peer's EOF and prints its
    own CPU seconds over that time."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as conn:
        cpu = self_cpu()
        view = memoryview(bytes(CHUNK))
        left = size
        while left > 0:
            conn.sendall(view[: min(left, CHUNK)])
            left -= CHUNK
        conn.shutdown(socket.SHUT_WR)
        for _ in range(1000):  # the peer sends nothing back: EOF at once
            if not conn.recv(4096):
                break
        print(self_cpu() - cpu, flush=True)


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


# ---- one round


@dataclass
class Sample:
    mbps: float
    relay_cpu: float  # seconds per GiB
    endpoints_cpu: float  # seconds per GiB


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def finish(process: subprocess.Popen[str]) -> str:
    out, _ = process.communicate(timeout=ROUND_TIMEOUT)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args} exited with {process.returncode}")
    return out


async def one_round(mode: str, size: int) -> Sample:
    sink = spawn("--role", "sink")
    try:
        assert sink.stdout is not None
        sink_port = int(sink.stdout.readline())
        setting = MODES[mode]
        relay_cpu = 0.0
        if setting is None:
            source = spawn("--role", "source", "--port", str(sink_port), "--size", str(size))
            source_cpu = float(finish(source))
        else:
            relay_cpu, source_cpu = await relayed_round(sink_port, size, *setting)
        total, elapsed, sink_cpu = finish(sink).split()
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=10)
    if int(total) != size:
        raise RuntimeError(f"{mode}: the sink got {total} of {size} bytes")
    per_gib = GIB / size
    return Sample(
        mbps=size / float(elapsed) / 1e6,
        relay_cpu=relay_cpu * per_gib,
        endpoints_cpu=(source_cpu + float(sink_cpu)) * per_gib,
    )


async def relayed_round(
    sink_port: int, size: int, prefer_splice: bool, pipe_size: int
) -> tuple[float, float]:
    """Source -> (this process: relay) -> sink; the CPU seconds of the relay and the source."""
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = str(listener.getsockname()[1])
        source = spawn("--role", "source", "--port", port, "--size", str(size))
        try:
            client, _ = await asyncio.wait_for(loop.sock_accept(listener), SOCKET_TIMEOUT)
            upstream = socket.create_connection(("127.0.0.1", sink_port), timeout=SOCKET_TIMEOUT)
            started = self_cpu()
            result = await asyncio.wait_for(
                relay(
                    client,
                    upstream,
                    idle_timeout=SOCKET_TIMEOUT,
                    prefer_splice=prefer_splice,
                    pipe_size=pipe_size or MIB,
                ),
                ROUND_TIMEOUT,
            )
            cpu = self_cpu() - started
            source_cpu = float(finish(source))
        finally:
            if source.poll() is None:
                source.kill()
                source.wait(timeout=10)
    if result.reason != "closed" or result.up != size:
        raise RuntimeError(f"relay ended {result}")
    return cpu, source_cpu


# ---- driver


@dataclass
class Results:
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def median(self, mode: str, attribute: str) -> float:
        return statistics.median(getattr(sample, attribute) for sample in self.samples[mode])


async def main_async(modes: list[str], size: int, rounds: int) -> Results:
    results = Results({mode: [] for mode in modes})
    for round_number in range(rounds):
        shift = round_number % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            sample = await one_round(mode, size)
            results.samples[mode].append(sample)
            print(
                f"round {round_number + 1}/{rounds} {mode:<12} {sample.mbps:8,.0f} MB/s "
                f"relay {sample.relay_cpu:.3f} s/GiB endpoints {sample.endpoints_cpu:.3f} s/GiB",
                file=sys.stderr,
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--role", choices=("sink", "source"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sink":
        run_sink()
        return
    if args.role == "source":
        run_source(args.port, args.size)
        return
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if any(mode.startswith("splice") for mode in modes) and not splice_available():
        parser.error("os.splice is not available here: leave the splice modes out")
    if not 1 <= args.size_mib <= 16 * 1024 or not 1 <= args.rounds <= 50:
        parser.error("--size-mib must be 1..16384 and --rounds 1..50")
    size = args.size_mib * MIB
    started = time.monotonic()
    results = asyncio.run(main_async(modes, size, args.rounds))
    print(
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"CPython {platform.python_version()}, Linux {platform.release()}, "
        f"{args.size_mib} MiB x {args.rounds} rounds, {time.monotonic() - started:.0f} s"
    )
    print()
    print("| mode | MB/s | relay CPU s/GiB | endpoints CPU s/GiB |")
    print("|---|---|---|---|")
    for mode in modes:
        print(
            f"| {mode} | {results.median(mode, 'mbps'):,.0f} "
            f"| {results.median(mode, 'relay_cpu'):.3f} "
            f"| {results.median(mode, 'endpoints_cpu'):.3f} |"
        )


if __name__ == "__main__":
    main()
