"""The benchmark harness (issue 6): egress-proxy against what a user would pick instead, side by
side in one run, on loopback only.

    make bench                                   # full run (see benchmarks/README.md for time)
    make bench-quick                             # the same, small: under 2 minutes
    .venv/bin/python benchmarks/bench.py --quick --configs direct,fast,squid --workloads tunnels
    .venv/bin/python benchmarks/bench_report.py benchmarks/results/bench.json   # report again

Configurations: direct (no proxy), egress-proxy's fast path (`fast`), egress-proxy with every
connection through mitmproxy (`engine`, `--engine-only`), tinyproxy, privoxy, squid, and
mitmdump passing everything through with no policy. A peer that is not installed (or cannot
run here) is skipped with a note. Workloads:

1. tunnels: new CONNECT tunnels (a real TLS ClientHello each): latency p50/p99 of one client
   at a time, and tunnels/s at 1, 16 and 64 concurrent clients.
2. bulk: MB/s through one tunnel (1 GiB each way) and through 8 parallel tunnels.
3. http: plain HTTP keep-alive through the proxy (wrk, 16 connections, absolute-form requests
   to an nginx origin): requests/s and latency p50/p99.
4. scale: egress-proxy with 10, 10,000 and 100,000 egress rules: ready time, RSS, latency.
5. dns: egress-proxy's tunnel latency with a cold DNS cache (a fresh name every time) and a
   warm one, against the harness's own DNS server on 127.0.0.1.
6. sessions: RSS/PSS of one idle session proxy and of 50 side by side.

Workloads 1-3 and the idle memory of 6 run on the same proxy process, one per configuration per
round; configurations are interleaved round by round (A B C A B C ...), and the summary has
medians over rounds and ratios to direct taken within each round. Every figure comes with the
proxy's CPU time per unit of work (utime+stime from /proc), because the machine is shared.

Everything talks to 127.0.0.1 only; every phase is bounded in count and in time. Progress goes
to stderr; the report goes to stdout and to `--out` (bench.json, REPORT.md, PNG plots). The
exit code is 1 when a measurement failed (listed under "Problems" in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import http.client
import json
import os
import platform
import resource
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import bench_peers as peers
import bench_stats as stats
import tunnels

ROOT = tunnels.ROOT
HERE = Path(__file__).resolve().parent
LOOPBACK = tunnels.LOOPBACK
HOST = tunnels.HOST
DOMAINS = (HOST,)  # the test policy: `egress: [bench.test]` (the name and its subdomains)
EGRESS_CONFIGS = ("fast", "engine")
CONFIGS = ("direct", *EGRESS_CONFIGS, *peers.PEERS)
WORKLOADS = ("tunnels", "bulk", "http", "scale", "dns", "sessions")
MB = tunnels.MB
MIB = tunnels.MIB
GIB = tunnels.GIB
SETTLE_S = tunnels.SETTLE_S  # idle memory is read this long after the proxy is ready
HTTP_CONNECTIONS = 16
HTTP_THREADS = 2
HTTP_TIMEOUT_S = 5  # wrk's per-request timeout
HTTP_WARM_REQUESTS = 20  # untimed, one connection, before wrk ...
HTTP_WARM_S = 15.0  # ... for at most this long
ORIGIN_BODY_BYTES = 256
SCALE_SEED = 20_240_501  # the hostname stream of benchmarks/policy_decide.py
SESSION_START_WORKERS = 2  # proxies started at once in the sessions workload (2 CPUs here)
WRK_SCRIPT = """\
-- Absolute-form requests (`GET http://host:port/ HTTP/1.1`) sent to the proxy's port: wrk has
-- no proxy support, but a proxy is exactly a server that takes this form.
wrk.method = "GET"
wrk.path = os.getenv("BENCH_PATH")
wrk.headers["Host"] = os.getenv("BENCH_HOST")

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"bytes":%d,"errors":{"connect":%d,"read":%d,' ..
    '"write":%d,"status":%d,"timeout":%d},"latency_us":{"p50":%.1f,"p90":%.1f,' ..
    '"p99":%.1f,"max":%.1f,"mean":%.1f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean))
end
"""


@dataclass(frozen=True)
class Settings:
    rounds: int
    warm_pass: bool  # start and stop every proxy once before the first round
    warmup: int  # sequential tunnels before the latency phase
    latency_count: int  # one client, one tunnel at a time: at most this many ...
    latency_s: float  # ... or this long
    rate_count: int  # tunnels per concurrency level: at most this many ...
    rate_s: float  # ... or this long
    concurrency: tuple[int, ...]  # concurrent clients of the rate phases (1 is the latency phase)
    rate_procs: int  # client processes sharing the clients of a rate phase
    bulk_bytes: int  # through one tunnel, each direction
    parallel_tunnels: int
    parallel_bytes: int  # in all, over the parallel tunnels, each direction
    bulk_s: float  # a transfer taking longer is abandoned
    http_s: int  # the measured wrk run (wrk takes whole seconds)
    http_warmup_s: int  # an untimed wrk run before it (0: none; HTTP_WARM_REQUESTS always)
    scale_sizes: tuple[int, ...]
    scale_rounds: int
    scale_count: int  # sequential tunnels per scale sample
    dns_rounds: int
    dns_count: int  # tunnels per cold and per warm sample
    sessions: int  # proxies side by side
    sessions_s: float  # starting them stops after this long


FULL = Settings(
    rounds=3,
    warm_pass=True,
    warmup=30,
    latency_count=1000,
    latency_s=6.0,
    rate_count=8000,
    rate_s=5.0,
    concurrency=(16, 64),
    rate_procs=2,
    bulk_bytes=GIB,
    parallel_tunnels=8,
    parallel_bytes=GIB,
    bulk_s=60.0,
    http_s=5,
    http_warmup_s=1,
    scale_sizes=(10, 10_000, 100_000),
    scale_rounds=3,
    scale_count=300,
    dns_rounds=3,
    dns_count=200,
    sessions=50,
    sessions_s=240.0,
)
QUICK = Settings(
    rounds=1,
    warm_pass=False,
    warmup=10,
    latency_count=200,
    latency_s=0.4,
    rate_count=2000,
    rate_s=0.4,
    concurrency=(16, 64),
    rate_procs=1,
    bulk_bytes=32 * MIB,
    parallel_tunnels=8,
    parallel_bytes=32 * MIB,
    bulk_s=30.0,
    http_s=1,
    http_warmup_s=0,
    scale_sizes=(10, 10_000, 100_000),
    scale_rounds=1,
    scale_count=50,
    dns_rounds=1,
    dns_count=30,
    sessions=3,
    sessions_s=30.0,
)

# Figures of each workload: name -> path into a sample.
TUNNEL_FIGURES: dict[str, tuple[str, ...]] = {
    "latency_p50_ms": ("tunnels", "1", "latency_ms", "p50"),
    "latency_p99_ms": ("tunnels", "1", "latency_ms", "p99"),
}
for _c in (1, 16, 64):
    TUNNEL_FIGURES[f"tunnels_per_s_{_c}"] = ("tunnels", str(_c), "tunnels_per_s")
    TUNNEL_FIGURES[f"proxy_cpu_us_per_tunnel_{_c}"] = (
        "tunnels",
        str(_c),
        "proxy_cpu_us_per_tunnel",
    )
    TUNNEL_FIGURES[f"client_cpu_us_per_tunnel_{_c}"] = (
        "tunnels",
        str(_c),
        "client_cpu_us_per_tunnel",
    )
BULK_KINDS = ("up", "down", "parallel_up", "parallel_down")
BULK_FIGURES: dict[str, tuple[str, ...]] = {}
for _k in BULK_KINDS:
    BULK_FIGURES[f"{_k}_mb_s"] = ("bulk", _k, "mb_per_s")
    BULK_FIGURES[f"{_k}_proxy_cpu_s_per_gib"] = ("bulk", _k, "proxy_cpu_s_per_gib")
HTTP_FIGURES: dict[str, tuple[str, ...]] = {
    "requests_per_s": ("http", "requests_per_s"),
    "latency_p50_ms": ("http", "latency_ms", "p50"),
    "latency_p99_ms": ("http", "latency_ms", "p99"),
    "proxy_cpu_us_per_request": ("http", "proxy_cpu_us_per_request"),
    "origin_cpu_us_per_request": ("http", "origin_cpu_us_per_request"),
    "client_cpu_us_per_request": ("http", "client_cpu_us_per_request"),
}
IDLE_FIGURES: dict[str, tuple[str, ...]] = {
    "ready_s": ("ready_s",),
    "startup_cpu_s": ("startup_cpu_s",),
    "idle_rss_mb": ("idle", "rss_mb"),
    "idle_pss_mb": ("idle", "pss_mb"),
    "idle_uss_mb": ("idle", "uss_mb"),
    "rss_after_mb": ("after", "rss_mb"),
}
SCALE_FIGURES: dict[str, tuple[str, ...]] = {
    "ready_s": ("ready_s",),
    "startup_cpu_s": ("startup_cpu_s",),
    "idle_rss_mb": ("idle", "rss_mb"),
    "idle_pss_mb": ("idle", "pss_mb"),
    "latency_p50_ms": ("tunnels", "latency_ms", "p50"),
    "latency_p99_ms": ("tunnels", "latency_ms", "p99"),
    "proxy_cpu_us_per_tunnel": ("tunnels", "proxy_cpu_us_per_tunnel"),
}
DNS_FIGURES: dict[str, tuple[str, ...]] = {}
for _k in ("cold", "warm"):
    DNS_FIGURES[f"{_k}_p50_ms"] = (_k, "latency_ms", "p50")
    DNS_FIGURES[f"{_k}_p99_ms"] = (_k, "latency_ms", "p99")
    DNS_FIGURES[f"{_k}_proxy_cpu_us_per_tunnel"] = (_k, "proxy_cpu_us_per_tunnel")
    DNS_FIGURES[f"{_k}_lookup_ms"] = (_k, "dns_lookup_ms_mean")
SESSION_FIGURES: dict[str, tuple[str, ...]] = {
    "sessions": ("sessions",),
    "rss_mb_sum": ("rss_mb_sum",),
    "pss_mb_sum": ("pss_mb_sum",),
    "pss_mb_per_session": ("pss_mb_per_session",),
    "rss_mb_per_session": ("rss_mb_per_session",),
    "uss_mb_per_session": ("uss_mb_per_session",),
    "startup_cpu_s_per_session": ("startup_cpu_s_per_session",),
    "start_wall_s": ("start_wall_s",),
}


class Running(tunnels.Listening, Protocol):
    """A proxy under test: egress-proxy (tunnels.Proxy) or a peer (bench_peers.Served)."""

    ready_s: float

    def stop(self) -> int: ...


# --------------------------------------------------------------------------------------------
# /proc


def memory(pid: int) -> dict[str, float]:
    """RSS, PSS and USS (private pages) of `pid` in MB, from /proc/PID/smaps_rollup. PSS splits
    every shared page between the processes that map it, so PSS sums over processes add up."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        rss = tunnels.proc_memory(pid).get("VmRSS")
        return {} if rss is None else {"rss_mb": rss}
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[key] = int(parts[0])
    return {
        "rss_mb": kb.get("Rss", 0) * 1024 / MB,
        "pss_mb": kb.get("Pss", 0) * 1024 / MB,
        "uss_mb": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024 / MB,
    }


def descendants(pid: int) -> list[int]:
    """The live child processes of `pid`, their children, and so on."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 10_000:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    children = [int(c) for c in (task / "children").read_text().split()]
                    out += children
                    todo += children
    return out


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (wrk, once it has exited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Run:
    """What every phase of a run needs."""

    settings: Settings
    workloads: Sequence[str]
    tmp: Path
    dns: Any  # tests/dns_server.DNSServer
    bench: tunnels.Bench  # the upstream, the load generator's loop, tunnel/bulk settings
    env: dict[str, str]  # for egress-proxy and mitmdump: the run's bytecode cache
    statuses: dict[str, peers.PeerStatus]
    origin: peers.Served | None
    wrk: str | None
    log: Callable[[str], None]
    problems: list[str] = dataclasses.field(default_factory=list)

    def problem(self, message: str) -> None:
        self.problems.append(message)
        self.log(f"PROBLEM: {message}")


def start_config(run: Run, config: str, directory: Path) -> Running | None:
    """The proxy of `config` started in `directory` and ready (None for direct)."""
    if config == "direct":
        return None
    directory.mkdir(parents=True, exist_ok=True)
    if config in EGRESS_CONFIGS:
        if not (directory / "agent.yaml").exists():
            tunnels.write_inputs(directory, run.dns.address, run.tmp / "ca")
        return tunnels.Proxy.start(config, directory, run.env)
    return peers.start_peer(run.statuses[config], directory, DOMAINS, run.env, run.tmp)


def client_phase(
    run: Run, proxy: Running | None, jobs: Sequence[dict[str, Any]], limit: float, role: str
) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
    """tunnels.client_phase with one of this script's client roles."""
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role]
    command += ["--loop", run.bench.loop]
    return tunnels.client_phase(run.bench, proxy, jobs, limit, run.tmp, command)


def guarded(run: Run, label: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """measure(), or {"error": ...} (and a problem) when it fails: one failing phase or peer
    does not end the run."""
    try:
        return measure()
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
        run.problem(f"{label}: {type(exc).__name__}: {str(exc).strip()[:500]}")
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- workload 1: tunnels -----------------------------------------------------------------------


def tunnels_workload(run: Run, proxy: Running | None, directory: Path) -> dict[str, Any]:
    s = run.settings
    out: dict[str, Any] = {}
    out["1"] = tunnels.tunnel_phase(
        run.bench,
        proxy,
        directory,
        warmup=s.warmup,
        procs=1,
        clients=1,
        count=s.latency_count,
        seconds=s.latency_s,
    )
    for clients in s.concurrency:
        out[str(clients)] = tunnels.tunnel_phase(
            run.bench,
            proxy,
            directory,
            warmup=10,
            procs=min(s.rate_procs, clients),
            clients=clients,
            count=s.rate_count,
            seconds=s.rate_s,
        )
    return out


# -- workload 2: bulk --------------------------------------------------------------------------


def parallel_bulk(run: Run, proxy: Running | None, direction: str) -> dict[str, Any]:
    """`parallel_bytes` in all through `parallel_tunnels` tunnels at once, one process."""
    s = run.settings
    job = {
        "proxy_port": proxy.port if proxy else None,
        "port": run.bench.upstream["bulk"],
        "direction": direction,
        "tunnels": s.parallel_tunnels,
        "bytes": s.parallel_bytes // s.parallel_tunnels,
        "seconds": s.bulk_s,
    }
    results, cpu = client_phase(run, proxy, [job], s.bulk_s + 60, "bulk-parallel")
    out = {**results[0], **cpu}
    gib = out["bytes"] / GIB
    for who in ("proxy", "upstream", "client"):
        value = cpu[f"{who}_cpu_s"]
        out[f"{who}_cpu_s_per_gib"] = None if value is None or not gib else value / gib
    return out


def bulk_workload(run: Run, proxy: Running | None, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for direction in ("up", "down"):
        out[direction] = tunnels.bulk_phase(run.bench, proxy, directory, direction)
    for direction in ("up", "down"):
        out[f"parallel_{direction}"] = parallel_bulk(run, proxy, direction)
    return out


# -- workload 3: plain HTTP --------------------------------------------------------------------


def run_wrk(
    run: Run, url: str, env: dict[str, str], threads: int, seconds: float
) -> dict[str, Any]:
    assert run.wrk is not None
    script = run.tmp / "absolute-form.lua"
    if not script.exists():
        script.write_text(WRK_SCRIPT)
    command = [run.wrk, "-t", str(threads), "-c", str(HTTP_CONNECTIONS), "-d", f"{seconds}s"]
    command += ["--timeout", f"{HTTP_TIMEOUT_S}s", "-s", str(script), url]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=seconds + HTTP_TIMEOUT_S + 30
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"requests"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    return json.loads(lines[-1])


def http_warmup(port: int, path: str, host: str, count: int) -> dict[str, Any]:
    """`count` requests one after another on one connection (reopened when the proxy closes
    it), untimed: loads what the proxy loads on first use (egress-proxy's engine) and tells
    whether the proxy keeps a client connection alive between answers."""
    reconnects = statuses = 0
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=HTTP_TIMEOUT_S)
    deadline = time.monotonic() + HTTP_WARM_S
    try:
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            try:
                connection.request("GET", path, headers={"Host": host})
                response = connection.getresponse()
                response.read()
                statuses += response.status == 200
                if response.will_close:
                    reconnects += 1
                    connection.close()
            except (http.client.RemoteDisconnected, ConnectionError):
                # Closed without saying so (no `Connection: close`): the next request reopens.
                reconnects += 1
                connection.close()
    finally:
        connection.close()
    if not statuses:
        raise RuntimeError(f"no 200 answer to {count} requests for {path}")
    # The first request may close a connection the proxy never meant to keep; later ones tell.
    return {
        "requests": count,
        "ok": statuses,
        "reconnects": reconnects,
        "keep_alive": reconnects <= 1,
    }


def http_workload(run: Run, proxy: Running | None) -> dict[str, Any]:
    """wrk at HTTP_CONNECTIONS keep-alive connections: through the proxy with absolute-form
    requests, or straight to the origin (direct). The origin's own request count (nginx
    stub_status) must match wrk's: wrk connects only to the proxy's port, so every request the
    origin saw went through the proxy."""
    assert run.origin is not None
    s = run.settings
    origin = run.origin.port
    port = proxy.port if proxy else origin
    url = f"http://{LOOPBACK}:{port}/"
    path = f"http://{HOST}:{origin}/" if proxy else "/"
    host = f"{HOST}:{origin}"
    env = {**os.environ, "BENCH_PATH": path, "BENCH_HOST": host}
    warm = http_warmup(port, path, host, HTTP_WARM_REQUESTS)
    if s.http_warmup_s:
        run_wrk(run, url, env, 1, s.http_warmup_s)
    pids = (proxy.pid if proxy else None, run.origin.pid)
    seen0 = peers.origin_requests(origin)
    cpu0 = [tunnels.proc_cpu(pid) for pid in pids]
    client0 = children_cpu()
    result = run_wrk(run, url, env, HTTP_THREADS, s.http_s)
    client = children_cpu() - client0
    time.sleep(0.1)  # the proxy may still be finishing the last answers
    cpu1 = [tunnels.proc_cpu(pid) for pid in pids]
    seen = peers.origin_requests(origin) - seen0 - 1  # the status request counts itself
    requests = result["requests"]
    seconds = result["duration_us"] / 1e6
    cpu = [None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1, strict=True)]
    lat = result["latency_us"]
    out: dict[str, Any] = {
        "connections": HTTP_CONNECTIONS,
        "threads": HTTP_THREADS,
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds if seconds > 0 else 0.0,
        "latency_ms": {k: v / 1e3 for k, v in lat.items()},
        "errors": result["errors"],
        "origin_requests": seen,
        "keep_alive": warm["keep_alive"],
        "warmup": warm,
        "proxy_cpu_s": cpu[0],
        "origin_cpu_s": cpu[1],
        "client_cpu_s": client,
    }
    for who, value in (("proxy", cpu[0]), ("origin", cpu[1]), ("client", client)):
        out[f"{who}_cpu_us_per_request"] = (
            None if value is None or not requests else value / requests * 1e6
        )
    return out


def http_problems(result: dict[str, Any]) -> list[str]:
    """What makes an HTTP sample wrong: failed requests, non-2xx answers, or an origin count
    that does not match wrk's (requests that did not go through, or that wrk never saw)."""
    if "error" in result:
        return []
    out = []
    errors = {k: v for k, v in result["errors"].items() if v}
    if (
        not result["keep_alive"]
        and errors.get("read", 0) <= result["requests"] + 2 * result["connections"]
    ):
        # A proxy that closes the client connection after every answer: wrk counts each close
        # as a read error and reconnects. Its figures are one request per connection.
        errors.pop("read", None)
    if errors:
        out.append(f"wrk errors {errors}")
    if not result["requests"]:
        out.append("no request completed")
    # wrk stops with up to one request per connection in flight: the origin may count those.
    extra = result["origin_requests"] - result["requests"]
    if not 0 <= extra <= 2 * result["connections"]:
        out.append(f"the origin saw {result['origin_requests']} requests, wrk {result['requests']}")
    return out


# -- the main rounds (workloads 1-3 and one idle session of 6) --------------------------------


def main_round(run: Run, config: str, n: int) -> dict[str, Any]:
    directory = run.tmp / config
    directory.mkdir(parents=True, exist_ok=True)
    sample: dict[str, Any] = {"config": config, "round": n}
    label = f"round {n + 1} {config}"
    try:
        proxy = start_config(run, config, directory)
    except RuntimeError as exc:
        run.problem(f"{label}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    try:
        if proxy is not None:
            sample["ready_s"] = proxy.ready_s
            sample["startup_cpu_s"] = tunnels.proc_cpu(proxy.pid)
            time.sleep(SETTLE_S)
            sample["idle"] = memory(proxy.pid)
            sample["processes"] = 1 + len(descendants(proxy.pid))
            if sample["processes"] > 1:
                # Its CPU and memory are read from the one pid: children would be missed.
                run.problem(f"{label}: {sample['processes']} processes, not one")
        if "tunnels" in run.workloads:
            sample["tunnels"] = guarded(
                run, f"{label} tunnels", lambda: tunnels_workload(run, proxy, directory)
            )
            for clients, phase in sample["tunnels"].items():
                if isinstance(phase, dict) and phase.get("errors"):
                    run.problem(
                        f"{label}: {phase['errors']} failed tunnels at {clients} client(s): "
                        f"{phase['first_errors']}"
                    )
        if "bulk" in run.workloads:
            sample["bulk"] = guarded(
                run, f"{label} bulk", lambda: bulk_workload(run, proxy, directory)
            )
            for kind, phase in sample["bulk"].items():
                if isinstance(phase, dict) and phase.get("error"):
                    run.problem(f"{label} bulk {kind}: {phase['error']}")
        if isinstance(proxy, tunnels.Proxy) and {"tunnels", "bulk"} & set(run.workloads):
            sample["metrics"] = proxy.metrics()
            if wrong := tunnels.plane_problem(config, sample["metrics"]):
                run.problem(f"{label}: {wrong}")
        if "http" in run.workloads and run.origin is not None and run.wrk is not None:
            sample["http"] = guarded(run, f"{label} http", lambda: http_workload(run, proxy))
            for message in http_problems(sample["http"]):
                run.problem(f"{label} http: {message}")
        if proxy is not None:
            sample["after"] = memory(proxy.pid)
    finally:
        if proxy is not None:
            sample["exit_code"] = proxy.stop()
    if isinstance(proxy, tunnels.Proxy) and sample["exit_code"] != 0:
        run.problem(f"{label}: egress-proxy exited {sample['exit_code']} on SIGTERM")
    return sample


def round_line(sample: dict[str, Any]) -> str:
    parts = []
    rate = stats.dig(sample, ("tunnels", "16", "tunnels_per_s"))
    if rate is not None:
        parts.append(f"{rate:,.0f} tunnels/s @16")
    cpu = stats.dig(sample, ("tunnels", "16", "proxy_cpu_us_per_tunnel"))
    if cpu is not None:
        parts.append(f"{cpu:,.0f} µs CPU/tunnel")
    p50 = stats.dig(sample, ("tunnels", "1", "latency_ms", "p50"))
    if p50 is not None:
        parts.append(f"p50 {p50:.3f} ms")
    for kind in BULK_KINDS:
        value = stats.dig(sample, ("bulk", kind, "mb_per_s"))
        if value is not None:
            parts.append(f"{kind} {value:,.0f} MB/s")
    rps = stats.dig(sample, ("http", "requests_per_s"))
    if rps is not None:
        parts.append(f"http {rps:,.0f} req/s")
    rss = stats.dig(sample, ("idle", "rss_mb"))
    if rss is not None:
        parts.append(f"idle RSS {rss:.1f} MB")
    return ", ".join(parts)


# -- workload 4: policy scale ------------------------------------------------------------------


def scale_manifest(size: int) -> str:
    """`egress:` with bench.test and size - 1 other names (policy_decide.py's generator)."""
    import policy_decide

    stream = policy_decide.hostnames(SCALE_SEED, avoid=frozenset({HOST}))
    return policy_decide.yaml_manifest([HOST, *policy_decide.take(stream, size - 1)])


def scale_round(run: Run, size: int, n: int) -> dict[str, Any]:
    s = run.settings
    directory = run.tmp / f"scale-{size}"
    sample: dict[str, Any] = {"config": str(size), "rules": size, "round": n}
    if not (directory / "agent.yaml").exists():
        tunnels.write_inputs(directory, run.dns.address, run.tmp / "ca")
        (directory / "agent.yaml").write_text(scale_manifest(size))
    try:
        proxy = tunnels.Proxy.start("fast", directory, run.env)
    except RuntimeError as exc:
        run.problem(f"scale {size:,} rules round {n + 1}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    try:
        sample["ready_s"] = proxy.ready_s
        sample["startup_cpu_s"] = tunnels.proc_cpu(proxy.pid)
        time.sleep(SETTLE_S)
        sample["idle"] = memory(proxy.pid)
        sample["tunnels"] = guarded(
            run,
            f"scale {size:,} rules round {n + 1}",
            lambda: tunnels.tunnel_phase(
                run.bench,
                proxy,
                directory,
                warmup=10,
                procs=1,
                clients=1,
                count=s.scale_count,
                seconds=max(2.0, s.latency_s),
            ),
        )
        if sample["tunnels"].get("errors"):
            run.problem(f"scale {size:,} rules: {sample['tunnels']['errors']} failed tunnels")
    finally:
        sample["exit_code"] = proxy.stop()
    return sample


# -- workload 5: DNS ---------------------------------------------------------------------------


def dns_metrics(proxy: tunnels.Proxy) -> tuple[float, float]:
    """(sum, count) of egress_dns_lookup_seconds{outcome="ok"} on the proxy's /metrics."""
    body = tunnels._http_get(proxy.admin_port, "/metrics")[1].decode(errors="replace")
    total = count = 0.0
    for line in body.splitlines():
        if line.startswith('egress_dns_lookup_seconds_sum{outcome="ok"}'):
            total = float(line.rpartition(" ")[2])
        elif line.startswith('egress_dns_lookup_seconds_count{outcome="ok"}'):
            count = float(line.rpartition(" ")[2])
    return total, count


def dns_phase(run: Run, proxy: tunnels.Proxy, names: list[str]) -> dict[str, Any]:
    s = run.settings
    job = {
        "proxy_port": proxy.port,
        "port": run.bench.upstream["tunnel"],
        "names": names,
        "seconds": max(3.0, s.latency_s),
    }
    queries0 = len(run.dns.queries)
    sum0, count0 = dns_metrics(proxy)
    results, cpu = client_phase(run, proxy, [job], job["seconds"] + 60, "dns-client")
    sum1, count1 = dns_metrics(proxy)
    result = results[0]
    done = result["tunnels"]
    out = {
        "tunnels": done,
        "errors": result["errors"],
        "first_errors": result["first_errors"],
        "latency_ms": stats.latency_summary(result["latencies_ms"]),
        "dns_queries": len(run.dns.queries) - queries0,
        "dns_lookups": count1 - count0,
        "dns_lookup_ms_mean": (sum1 - sum0) / (count1 - count0) * 1e3 if count1 > count0 else None,
        **cpu,
    }
    out["proxy_cpu_us_per_tunnel"] = (
        None if cpu["proxy_cpu_s"] is None or not done else cpu["proxy_cpu_s"] / done * 1e6
    )
    return out


def dns_round(run: Run, config: str, n: int) -> dict[str, Any]:
    directory = run.tmp / f"dns-{config}"
    sample: dict[str, Any] = {"config": config, "round": n}
    label = f"dns {config} round {n + 1}"
    # A fresh name for every cold sample (all under bench.test, so all allowed). The last one
    # is the warm phase's name: its first lookup is a cold sample like the others.
    cold = [f"r{n}-{i}.{config}.cold.{HOST}" for i in range(run.settings.dns_count)]
    warm = cold[-1]
    for name in cold:
        run.dns.set(name, a=[LOOPBACK], ttl=3600)
    try:
        proxy = start_config(run, config, directory)
    except RuntimeError as exc:
        run.problem(f"{label}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    assert isinstance(proxy, tunnels.Proxy)
    try:
        sample["cold"] = guarded(run, f"{label} cold", lambda: dns_phase(run, proxy, cold))
        sample["warm"] = guarded(
            run, f"{label} warm", lambda: dns_phase(run, proxy, [warm] * len(cold))
        )
    finally:
        sample["exit_code"] = proxy.stop()
    for kind in ("cold", "warm"):
        phase = sample[kind]
        if phase.get("errors"):
            run.problem(f"{label} {kind}: {phase['errors']} failed: {phase['first_errors']}")
    # The check that cold is cold and warm is warm: queries reached our server, or none did.
    if (
        "dns_queries" in sample["cold"]
        and sample["cold"]["dns_queries"] < sample["cold"]["tunnels"]
    ):
        run.problem(f"{label}: {sample['cold']['dns_queries']} DNS queries for cold names")
    if sample["warm"].get("dns_queries"):
        run.problem(f"{label}: {sample['warm']['dns_queries']} DNS queries with a warm cache")
    return sample


# -- workload 6: sessions side by side ---------------------------------------------------------


def sessions_round(run: Run, config: str, n: int) -> dict[str, Any]:
    """settings.sessions proxies of `config` running at once (started SESSION_START_WORKERS at
    a time, for at most sessions_s): the sum of their PSS, and per session."""
    s = run.settings
    base = run.tmp / f"sessions-{config}"
    sample: dict[str, Any] = {"config": config, "round": n, "wanted": s.sessions}
    running: list[Running] = []
    errors: list[str] = []
    started = time.perf_counter()
    deadline = started + s.sessions_s
    lock = threading.Lock()

    def one(i: int) -> None:
        if time.perf_counter() > deadline:
            return
        try:
            proxy = start_config(run, config, base / f"s{i}")
        except RuntimeError as exc:
            with lock:
                errors.append(str(exc)[:300])
            return
        assert proxy is not None
        with lock:
            running.append(proxy)

    try:
        with concurrent.futures.ThreadPoolExecutor(SESSION_START_WORKERS) as pool:
            list(pool.map(one, range(s.sessions)))
        sample["start_wall_s"] = time.perf_counter() - started
        time.sleep(SETTLE_S)
        mems = [memory(p.pid) for p in running]
        cpus = [tunnels.proc_cpu(p.pid) for p in running]
        count = len(running)
        sample["sessions"] = count
        for key in ("rss_mb", "pss_mb", "uss_mb"):
            total = sum(m.get(key) or 0.0 for m in mems)
            sample[f"{key}_sum"] = total
            sample[f"{key}_per_session"] = total / count if count else None
        known = [c for c in cpus if c is not None]
        sample["startup_cpu_s_per_session"] = sum(known) / len(known) if known else None
        sample["ready_s"] = stats.latency_summary(p.ready_s for p in running)
    finally:
        for proxy in running:  # SIGTERM to all first: they drain side by side
            with contextlib.suppress(ProcessLookupError):
                os.kill(proxy.pid, signal.SIGTERM)
        for proxy in running:
            proxy.stop()
    if errors or len(running) < s.sessions:
        sample["errors"] = errors[:5]
        run.problem(
            f"sessions {config}: {len(running)} of {s.sessions} started within "
            f"{s.sessions_s:g} s ({len(errors)} failed{': ' + errors[0] if errors else ''})"
        )
    shutil.rmtree(base, ignore_errors=True)
    return sample


# --------------------------------------------------------------------------------------------
# Client roles (subprocesses): `bench.py --role bulk-parallel|dns-client`. Each reads its job
# (a JSON line) on stdin, gets ready, prints {"ready": true}, waits for "go", runs and prints
# its result, as tunnels.py's client does (tunnels.client_phase drives them).


def bulk_parallel_main() -> int:
    job = json.loads(sys.stdin.readline())
    target = tunnels.tunnel_target(job, HOST, tunnels.client_hello(HOST))
    direction, size, seconds = job["direction"], job["bytes"], job["seconds"]
    try:
        # As tunnels.py's bulk client: a first transfer in a fresh process runs slow.
        with tunnels._open_tunnel(target) as warm:
            tunnels._bulk(warm, direction, min(size, tunnels.BULK_WARMUP), seconds)
        socks = [tunnels._open_tunnel(target) for _ in range(job["tunnels"])]
    except OSError as exc:
        tunnels._say({"failed": f"bulk tunnels: {type(exc).__name__}: {exc}"})
        return 0
    results: list[dict[str, Any]] = []
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def transfer(sock: Any) -> None:
        t0 = time.perf_counter()
        try:
            result = tunnels._bulk(sock, direction, size, seconds)
        except OSError as exc:
            result = {"bytes": 0, "error": f"{type(exc).__name__}: {exc}"}
        with lock:
            results.append(result)
            spans.append((t0, time.perf_counter()))

    try:
        tunnels._say({"ready": True})
        if not tunnels._wait_go():
            return 0
        cpu0 = time.process_time()
        threads = [threading.Thread(target=transfer, args=(s,)) for s in socks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 30)
        wall = max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0
        moved = sum(r["bytes"] for r in results)
        errors = [r["error"] for r in results if r.get("error")]
        if len(results) < len(socks):
            errors.append(f"{len(socks) - len(results)} transfer(s) stuck")
        tunnels._say(
            {
                "direction": direction,
                "tunnels": len(socks),
                "bytes": moved,
                "seconds": wall,
                "mb_per_s": moved / wall / MB if wall > 0 else 0.0,
                "error": "; ".join(errors[:3]) or None,
                "client_cpu_s": time.process_time() - cpu0,
            }
        )
    finally:
        for sock in socks:
            sock.close()
    return 0


def dns_client_main(loop_name: str) -> int:
    job = json.loads(sys.stdin.readline())
    context = ssl.create_default_context()
    names: list[str] = job["names"]
    targets = {
        name: tunnels.tunnel_target(job, name, tunnels.client_hello(name, context))
        for name in set(names)
    }

    async def main() -> None:
        tunnels._say({"ready": True})
        if not tunnels._wait_go():
            return
        latencies: list[float] = []
        errors: list[str] = []
        cpu0 = time.process_time()
        t0 = time.monotonic()
        deadline = t0 + job["seconds"]
        for name in names:
            if time.monotonic() > deadline or len(errors) >= 20:
                break
            try:
                latencies.append(await asyncio.wait_for(tunnels._one_tunnel(targets[name]), 10.0))
            except (OSError, ConnectionError, TimeoutError) as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        tunnels._say(tunnels.client_result(t0, cpu0, latencies, errors))

    tunnels.run_loop(main, loop_name)
    return 0


# --------------------------------------------------------------------------------------------
# Orchestration


def machine(statuses: dict[str, peers.PeerStatus]) -> dict[str, Any]:
    info = tunnels.machine()
    info["kernel"] = platform.release()
    info["memory_mb"] = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_mb"] = int(line.split()[1]) * 1024 / MB
    versions = {name: s.version for name, s in statuses.items()}
    versions["egress-proxy"] = f"git {info.get('git')}"
    versions["python"] = f"{info['implementation']} {info['python']}"
    with contextlib.suppress(ImportError):
        import mitmproxy.version

        versions["mitmproxy (engine)"] = mitmproxy.version.VERSION
    info["versions"] = versions
    # System services of the peers' packages, running beside the run (not used; they share
    # the CPUs).
    info["peer_services_running"] = [
        f"{name} (pid {pid})"
        for name, pid in foreign_processes(("squid", "tinyproxy", "privoxy", "nginx"))
    ]
    return info


def foreign_processes(names: Sequence[str]) -> Iterator[tuple[str, int]]:
    """Processes named `names` that are not ours (checked before the run starts any)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            comm = (entry / "comm").read_text().strip()
            if comm in names:
                yield comm, int(entry.name)


def warm_pass(run: Run, configs: Sequence[str]) -> None:
    """Starts and stops every proxy once, untimed: fills the page cache, the run's bytecode
    cache, and mitmdump's CA. (Each phase warms its own connections up before it is timed.)"""
    for config in configs:
        if config == "direct":
            continue
        t0 = time.perf_counter()
        try:
            proxy = start_config(run, config, run.tmp / "warm" / config)
        except RuntimeError as exc:  # the rounds report it
            run.log(f"warm-up: {config} did not start: {str(exc)[:200]}")
            continue
        if proxy is not None:
            proxy.stop()
        run.log(f"warm-up: {config} started and stopped in {time.perf_counter() - t0:.1f} s")


def runnable(
    configs: Sequence[str], workloads: Sequence[str], statuses: dict[str, peers.PeerStatus]
) -> tuple[list[str], list[str]]:
    """The configurations that can run here, and a note for each one (or tool) that cannot:
    a missing peer is skipped, never an error."""
    notes = [s.note for name, s in statuses.items() if s.note and name in configs]
    for tool, what in (("nginx", "the HTTP origin"), ("wrk", "the HTTP load generator")):
        status = statuses.get(tool)
        if "http" in workloads and (status is None or not status.available):
            notes.append(
                f"http workload skipped: {what} ({tool}) is not installed ({peers.INSTALL_HINT})"
            )
    missing = peers.PeerStatus("", False)
    kept = [c for c in configs if c not in peers.PEERS or statuses.get(c, missing).available]
    return kept, notes


def choose(option: str | None, allowed: Sequence[str], what: str) -> list[str]:
    if not option:
        return list(allowed)
    chosen = [c.strip() for c in option.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise ValueError(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(allowed)})")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, 1 round, < 2 min")
    parser.add_argument("--configs", help=f"comma-separated, of {','.join(CONFIGS)} (default all)")
    parser.add_argument(
        "--workloads", help=f"comma-separated, of {','.join(WORKLOADS)} (default all)"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 1)")
    parser.add_argument("--sessions", type=int, help="proxies side by side (default 50, quick 3)")
    parser.add_argument("--bulk-mib", type=int, help="bulk size each way (default 1024)")
    parser.add_argument(
        "--out",
        type=Path,
        help="bench.json, REPORT.md and plots go here (default benchmarks/results; with "
        "--quick benchmarks/results/tmp/quick)",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="the load generator's event loop (default uvloop if importable)",
    )
    parser.add_argument("--role", choices=("bulk-parallel", "dns-client"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    loop_name = tunnels.pick_loop(args.loop)
    if args.role == "bulk-parallel":
        return bulk_parallel_main()
    if args.role == "dns-client":
        return dns_client_main(loop_name)

    settings = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.rounds is not None:
        changes.update(rounds=max(1, args.rounds), scale_rounds=max(1, args.rounds))
        changes.update(dns_rounds=max(1, args.rounds))
    if args.sessions is not None:
        changes["sessions"] = max(1, args.sessions)
    if args.bulk_mib is not None:
        changes.update(bulk_bytes=max(1, args.bulk_mib) * MIB)
        changes.update(parallel_bytes=max(8, args.bulk_mib) * MIB)
    settings = dataclasses.replace(settings, **changes)
    try:
        configs = choose(args.configs, CONFIGS, "configuration(s)")
        workloads = choose(args.workloads, WORKLOADS, "workload(s)")
    except ValueError as exc:
        parser.error(str(exc))
    out_dir = args.out or (HERE / "results" / ("tmp/quick" if args.quick else ""))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    began = time.perf_counter()
    statuses = {name: peers.peer_status(name) for name in (*peers.PEERS, "nginx", "wrk")}
    configs, notes = runnable(configs, workloads, statuses)
    info = machine(statuses)
    if info["peer_services_running"]:
        notes.append(
            "system services of the peers' packages were running (not used by the harness, "
            f"but sharing the CPUs): {', '.join(info['peer_services_running'])}"
        )
    for note in notes:
        log(f"note: {note}")
    log(f"configs {', '.join(configs)}; workloads {', '.join(workloads)}; {settings}")

    sys.path.insert(0, str(ROOT / "tests"))
    from dns_server import running_dns_server

    samples: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        tmp.chmod(0o755)  # a peer that drops privileges (squid) reads its files under here
        dns = stack.enter_context(running_dns_server())
        dns.set(HOST, a=[LOOPBACK], ttl=3600)
        upstream = stack.enter_context(tunnels.upstream_process(loop_name))
        origin = None
        if "http" in workloads and statuses["nginx"].available and statuses["wrk"].available:
            assert statuses["nginx"].binary is not None
            origin = peers.start_origin(statuses["nginx"].binary, tmp / "origin", ORIGIN_BODY_BYTES)
            stack.callback(origin.stop)
        # What tunnels.tunnel_phase and tunnels.bulk_phase read (bulk size and time limit).
        tunnel_settings = tunnels.Settings(
            rounds=settings.rounds,
            warmup=settings.warmup,
            latency_count=settings.latency_count,
            latency_s=settings.latency_s,
            rate_count=settings.rate_count,
            rate_s=settings.rate_s,
            bulk_bytes=settings.bulk_bytes,
            bulk_s=settings.bulk_s,
        )
        # Kept between runs (gitignored): a run after the first starts from compiled bytecode.
        env = tunnels.proxy_env(HERE / "results" / "tmp" / "pycache")
        run = Run(
            settings=settings,
            workloads=workloads,
            tmp=tmp,
            dns=dns,
            bench=tunnels.Bench(
                upstream=upstream,
                loop=loop_name,
                settings=tunnel_settings,
                procs=settings.rate_procs,
                directions=("up", "down"),
                proxy_env=env,
            ),
            env=env,
            statuses=statuses,
            origin=origin,
            wrk=statuses["wrk"].binary if statuses["wrk"].available else None,
            log=log,
        )
        if settings.warm_pass:
            warm_pass(run, configs)
            log(f"warm-up pass done in {time.perf_counter() - began:.1f} s")
        if {"tunnels", "bulk", "http", "sessions"} & set(workloads):
            samples["main"] = []
            for n in range(settings.rounds):
                for config in configs:
                    t0 = time.perf_counter()
                    sample = main_round(run, config, n)
                    samples["main"].append(sample)
                    log(
                        f"round {n + 1}/{settings.rounds} {config:<9} {round_line(sample)} "
                        f"({time.perf_counter() - t0:.1f} s)"
                    )
        if "scale" in workloads and "fast" in configs:
            samples["scale"] = []
            for n in range(settings.scale_rounds):
                for size in settings.scale_sizes:
                    sample = scale_round(run, size, n)
                    samples["scale"].append(sample)
                    log(
                        f"scale round {n + 1} {size:>7,} rules: ready "
                        f"{sample.get('ready_s', float('nan')):.3f} s, "
                        f"p50 {stats.dig(sample, ('tunnels', 'latency_ms', 'p50')) or 0:.3f} ms"
                    )
        if "dns" in workloads:
            samples["dns"] = []
            for n in range(settings.dns_rounds):
                for config in (c for c in EGRESS_CONFIGS if c in configs):
                    sample = dns_round(run, config, n)
                    samples["dns"].append(sample)
                    log(
                        f"dns round {n + 1} {config}: cold p50 "
                        f"{stats.dig(sample, ('cold', 'latency_ms', 'p50')) or 0:.3f} ms, warm "
                        f"{stats.dig(sample, ('warm', 'latency_ms', 'p50')) or 0:.3f} ms"
                    )
        if "sessions" in workloads:
            samples["sessions"] = []
            for config in (c for c in configs if c != "direct"):
                t0 = time.perf_counter()
                sample = sessions_round(run, config, 0)
                samples["sessions"].append(sample)
                log(
                    f"sessions {config}: {sample.get('sessions')} side by side, "
                    f"PSS {sample.get('pss_mb_per_session') or 0:.1f} MB each "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
        problems = run.problems
    elapsed = time.perf_counter() - began
    with contextlib.suppress(OSError):
        # The run's own load included (the sessions workload ends with dozens of start-ups).
        info["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    document = build_document(
        settings, args.quick, configs, workloads, info, statuses, notes, problems, samples, elapsed
    )
    import bench_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(document, indent=1) + "\n")
    report = bench_report.write(document, out_dir)
    print(report)
    log(f"wrote {out_dir / 'bench.json'}, {out_dir / 'REPORT.md'} and the plots in {elapsed:.0f} s")
    return 1 if problems else 0


def by_config(samples: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        out.setdefault(sample["config"], []).append(sample)
    return out


def summaries(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds and ratios within rounds, per workload."""
    main = by_config(samples.get("main", []))
    out: dict[str, Any] = {}
    for workload, figures in (
        ("tunnels", TUNNEL_FIGURES),
        ("bulk", BULK_FIGURES),
        ("http", HTTP_FIGURES),
        ("idle", IDLE_FIGURES),
    ):
        out[workload] = stats.summarise(main, figures)
    scale = by_config(samples.get("scale", []))
    smallest = min(scale, key=int) if scale else None
    out["scale"] = stats.summarise(scale, SCALE_FIGURES, baseline=smallest)
    out["dns"] = stats.summarise(by_config(samples.get("dns", [])), DNS_FIGURES, baseline="fast")
    out["sessions"] = stats.summarise(
        by_config(samples.get("sessions", [])), SESSION_FIGURES, baseline="fast"
    )
    return out


def build_document(
    settings: Settings,
    quick: bool,
    configs: Sequence[str],
    workloads: Sequence[str],
    info: dict[str, Any],
    statuses: dict[str, peers.PeerStatus],
    notes: Sequence[str],
    problems: Sequence[str],
    samples: dict[str, list[dict[str, Any]]],
    elapsed: float,
) -> dict[str, Any]:
    return {
        "benchmark": "bench",
        "command": tunnels.command(),
        "mode": "quick" if quick else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "machine": info,
        "settings": {
            **dataclasses.asdict(settings),
            "configs": list(configs),
            "workloads": list(workloads),
            "http_connections": HTTP_CONNECTIONS,
            "http_threads": HTTP_THREADS,
            "origin_body_bytes": ORIGIN_BODY_BYTES,
            "settle_s": SETTLE_S,
        },
        "peers": {name: dataclasses.asdict(s) for name, s in statuses.items()},
        "notes": list(notes),
        "problems": list(problems),
        "summary": summaries(samples),
        "samples": samples,
    }


if __name__ == "__main__":
    sys.exit(main())
