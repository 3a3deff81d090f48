"""Plain HTTP through the proxy: wrk with absolute-form requests against the nginx origin.

wrk has no proxy option, but a forward proxy is exactly a server that takes requests in
absolute form (`GET http://bench.test:PORT/ HTTP/1.1`), so wrk connects to the proxy's port with
a Lua script that sends them. That every request went through the proxy is checked on every
sample: wrk connects only to the proxy's port, and nginx's own request count must equal wrk's
(plus at most one in flight per connection when wrk stops).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from typing import Any

from . import peers
from .context import Run, Running
from .proc import LOOPBACK, children_cpu, proc_cpu

HOST = "bench.test"
CONNECTIONS = 16
THREADS = 2
TIMEOUT_S = 5  # wrk's per-request timeout
WARM_REQUESTS = 20  # untimed, one connection, before wrk ...
WARM_S = 15.0  # ... for at most this long
ORIGIN_BODY_BYTES = 256
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


def run_wrk(
    run: Run, url: str, env: dict[str, str], threads: int, seconds: float
) -> dict[str, Any]:
    assert run.wrk is not None
    script = run.tmp / "absolute-form.lua"
    if not script.exists():
        script.write_text(WRK_SCRIPT)
    command = [run.wrk, "-t", str(threads), "-c", str(CONNECTIONS), "-d", f"{seconds}s"]
    command += ["--timeout", f"{TIMEOUT_S}s", "-s", str(script), url]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=seconds + TIMEOUT_S + 30
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"requests"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    return json.loads(lines[-1])


def http_warmup(port: int, path: str, host: str, count: int) -> dict[str, Any]:
    """`count` requests one after another on one connection (reopened when the proxy closes
    it), untimed: loads what the proxy loads on first use, and tells whether the proxy keeps a
    client connection alive between answers."""
    reconnects = statuses = 0
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=TIMEOUT_S)
    deadline = time.monotonic() + WARM_S
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
    """wrk at CONNECTIONS keep-alive connections: through the proxy with absolute-form
    requests, or straight to the origin (direct). Proxy, origin and wrk CPU per request."""
    assert run.origin is not None
    s = run.settings
    origin = run.origin.port
    port = proxy.port if proxy else origin
    url = f"http://{LOOPBACK}:{port}/"
    path = f"http://{HOST}:{origin}/" if proxy else "/"
    host = f"{HOST}:{origin}"
    env = {**os.environ, "BENCH_PATH": path, "BENCH_HOST": host}
    warm = http_warmup(port, path, host, WARM_REQUESTS)
    if s.http_warmup_s:
        run_wrk(run, url, env, 1, s.http_warmup_s)
    pids = (proxy.pid if proxy else None, run.origin.pid)
    seen0 = peers.origin_requests(origin)
    cpu0 = [proc_cpu(pid) for pid in pids]
    client0 = children_cpu()
    result = run_wrk(run, url, env, THREADS, s.http_s)
    client = children_cpu() - client0
    time.sleep(0.1)  # the proxy may still be finishing the last answers
    cpu1 = [proc_cpu(pid) for pid in pids]
    seen = peers.origin_requests(origin) - seen0 - 1  # the status request counts itself
    requests = result["requests"]
    seconds = result["duration_us"] / 1e6
    cpu = [None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1, strict=True)]
    out: dict[str, Any] = {
        "connections": CONNECTIONS,
        "threads": THREADS,
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds if seconds > 0 else 0.0,
        "latency_ms": {k: v / 1e3 for k, v in result["latency_us"].items()},
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
