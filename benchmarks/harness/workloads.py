"""The load-generator workloads of a round: new tunnels (CONNECT or SOCKS5; a TLS ClientHello
or an opaque stream's first flight), bulk, and HTTPS through an intercepting proxy, each by
benchmarks/harness/loadgen.c; and the memory checkpoint
between them. Every phase reports the proxy's CPU per unit of work (utime + stime from /proc,
all threads) beside the load generator's own (client and upstream or origin)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .context import GIB, Run, Running
from .loadgen import client_args, figures, per_unit, run_phase, write_targets
from .proc import MB, memory

SOCKET_TIMEOUT_S = 10.0  # a tunnel (or a socket call of bulk) taking longer is an error
LIMIT_SLACK_S = 30.0  # past the phase's own bound, the client process is killed


def _proxy_port(proxy: Running | None, kind: str) -> int | None:
    if proxy is None or kind == "transparent":
        return None
    port = getattr(proxy, "socks_port", None) if kind == "socks5" else proxy.port
    if port is None:
        raise RuntimeError(f"{proxy.name} has no {kind} listener")
    return int(port)


def tunnel_phase(
    run: Run,
    proxy: Running | None,
    directory: Path,
    *,
    clients: int,
    count: int,
    seconds: float,
    kind: str = "connect",
    targets: Path | None = None,
    port: int | None = None,
    warmup: int = 10,
    address: str | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    """New tunnels by `clients` concurrent connections of one loadgen process: TCP connect,
    CONNECT (`kind` connect) or SOCKS5 (socks5) through `proxy` (none: direct), the target's
    first flight (`targets`: run.targets, the ClientHello), the upstream's answer on `port`
    (default: its TLS tunnel port), close. `count` tunnels or `seconds`, whichever first.
    `kind` transparent: the client connects to `address` (a loopback address its network
    namespace redirects to `proxy`) as if direct; `user`: the client runs as that user."""
    proxy_kind = "none" if proxy is None else kind
    command = client_args(
        run.loadgen,
        "tunnels",
        targets or run.targets,
        port or run.upstream["tunnel"],
        "none" if proxy_kind == "transparent" else proxy_kind,
        _proxy_port(proxy, kind),
    )
    command += ["--concurrency", str(clients), "--count", str(count), "--seconds", str(seconds)]
    command += ["--warmup", str(warmup), "--timeout", str(SOCKET_TIMEOUT_S)]
    if address is not None:
        command += ["--address", address]
    watch = {"proxy": proxy.pid if proxy else None, "upstream": run.upstream["pid"]}
    limit = seconds + LIMIT_SLACK_S
    result, cpu = run_phase(command, watch, limit, directory / "client.txt", user)
    out = figures(result, cpu, result["done"], "tunnel", "tunnels")
    return {"kind": proxy_kind, "clients": clients, **out}


def tunnels_workload(
    run: Run, proxy: Running | None, directory: Path, **route: Any
) -> dict[str, Any]:
    """One client one tunnel at a time (latency; tunnels/s @1), then each concurrency level.
    `route`: tunnel_phase's kind, targets, port, address and user."""
    s = run.settings
    out = {
        "1": tunnel_phase(
            run,
            proxy,
            directory,
            clients=1,
            count=s.latency_count,
            seconds=s.latency_s,
            warmup=s.warmup,
            **route,
        )
    }
    for clients in s.concurrency:
        out[str(clients)] = tunnel_phase(
            run, proxy, directory, clients=clients, count=s.rate_count, seconds=s.rate_s, **route
        )
    return out


def socks5_workload(run: Run, proxy: Running, directory: Path, **route: Any) -> dict[str, Any]:
    """The tunnels of the 16-client phase through the SOCKS5 listener (`route`: as in
    tunnels_workload)."""
    s = run.settings
    return tunnel_phase(
        run,
        proxy,
        directory,
        clients=16,
        count=s.socks_count,
        seconds=s.socks_s,
        kind="socks5",
        **route,
    )


def opaque_route(run: Run) -> dict[str, Any]:
    """An opaque stream instead of TLS: the SSH identification line as the first flight, to the
    upstream's opaque port (neither 80 nor 443: a port the proxy under test takes opaque streams
    on by default)."""
    assert run.opaque_targets is not None
    return {"targets": run.opaque_targets, "port": int(run.upstream["opaque"])}


def opaque_workload(run: Run, proxy: Running | None, directory: Path) -> dict[str, Any]:
    """The tunnels workload with an opaque stream in each tunnel (CONNECT, or direct)."""
    return tunnels_workload(run, proxy, directory, **opaque_route(run))


def bulk_phase(
    run: Run, proxy: Running | None, directory: Path, direction: str, tunnels: int, size: int
) -> dict[str, Any]:
    """`size` bytes in all `direction` (up: client to upstream) through `tunnels` tunnels at
    once (a thread each), after a warm-up transfer on a tunnel of its own. MB/s: the bytes over
    the time from the first transfer's start to the last one's end."""
    s = run.settings
    command = client_args(
        run.loadgen,
        "bulk",
        run.targets,
        run.upstream["bulk"],
        "none" if proxy is None else "connect",
        _proxy_port(proxy, "connect"),
    )
    command += ["--concurrency", str(tunnels), "--bytes", str(size), "--direction", direction]
    command += ["--seconds", str(s.bulk_s), "--timeout", str(SOCKET_TIMEOUT_S)]
    watch = {"proxy": proxy.pid if proxy else None, "upstream": run.upstream["pid"]}
    result, cpu = run_phase(command, watch, s.bulk_s + LIMIT_SLACK_S, directory / "client.txt")
    cpu["client_cpu_s"] = result["client_cpu_s"]
    moved, wall = result["bytes"], result["seconds"]
    return {
        "direction": direction,
        "tunnels": tunnels,
        "bytes": moved,
        "seconds": wall,
        "mb_per_s": moved / wall / MB if wall > 0 else 0.0,
        "error": "; ".join(result["first_errors"]) or None,
        **cpu,
        **per_unit(cpu, moved / GIB, 1.0, "s_per_gib"),
    }


def bulk_workload(run: Run, proxy: Running | None, directory: Path) -> dict[str, Any]:
    s = run.settings
    out: dict[str, Any] = {}
    for direction in ("up", "down"):
        out[direction] = bulk_phase(run, proxy, directory, direction, 1, s.bulk_bytes)
    for direction in ("up", "down"):
        out[f"parallel_{direction}"] = bulk_phase(
            run, proxy, directory, direction, s.parallel_tunnels, s.parallel_bytes
        )
    return out


# -- HTTPS through an intercepting proxy ---------------------------------------------------


def session_ca(ca_dir: Path) -> Path | None:
    """The session CA certificate egress-proxy made in `ca_dir` (a PEM certificate without a
    key in it), or None."""
    for path in sorted(ca_dir.glob("*.pem")):
        text = path.read_text(errors="replace")
        if "BEGIN CERTIFICATE" in text and "PRIVATE KEY" not in text:
            return path
    return None


def https_phase(
    run: Run, proxy: Running | None, directory: Path, host: str, path: str, requests: int
) -> dict[str, Any]:
    """HTTPS by `inspect_clients` concurrent tunnels: CONNECT, a TLS handshake with `host`
    (verified against the session CA through the proxy, the origin's CA direct), and `requests`
    GET `path` on it (1: a new tunnel per request). Latency: of each tunnel (1 request) or of
    each request."""
    s = run.settings
    assert run.origin is not None and run.origin_tls is not None and run.tls_ca is not None
    ca = run.tls_ca if proxy is None else session_ca(Path(run.base_config["inspection"]["ca_dir"]))
    if ca is None:
        raise RuntimeError("no session CA certificate in the inspection CA directory")
    targets = directory / f"https-{host}.bin"
    if not targets.exists():
        write_targets(targets, [host], hello=False)
    command = client_args(
        run.loadgen,
        "https",
        targets,
        run.origin_tls.port,
        "none" if proxy is None else "connect",
        _proxy_port(proxy, "connect"),
    )
    command += ["--ca", str(ca), "--path", path, "--requests", str(requests)]
    command += ["--concurrency", str(s.inspect_clients), "--count", str(s.inspect_count)]
    command += ["--seconds", str(s.inspect_s), "--warmup", "3", "--timeout", str(SOCKET_TIMEOUT_S)]
    watch = {"proxy": proxy.pid if proxy else None, "origin": run.origin.pid}
    result, cpu = run_phase(command, watch, s.inspect_s + LIMIT_SLACK_S, directory / "client.txt")
    unit = "tunnel" if requests == 1 else "request"
    out = figures(result, cpu, result[f"{unit}s"], unit, f"{unit}s")
    return {
        "host": host,
        "requests_per_tunnel": requests,
        **out,
        "tunnels": result["tunnels"],
        "requests": result["requests"],
    }


def inspect_workload(
    run: Run, proxy: Running | None, directory: Path, host: str, path: str
) -> dict[str, Any]:
    """A new intercepted tunnel per request, then keep-alive requests in long-lived tunnels."""
    return {
        "tunnel": https_phase(run, proxy, directory, host, path, 1),
        "request": https_phase(run, proxy, directory, host, path, run.settings.inspect_requests),
    }


def checkpoint(run: Run, proxy: Running) -> dict[str, float]:
    """The proxy's memory once it has been idle `settle_s`."""
    time.sleep(run.settings.settle_s)
    return memory(proxy.pid)
