"""DNS through egress-proxy: queries to its DNS listener (`--dns-listen`), and the cost of its
own resolver to tunnels with a cold and a warm cache.

The listener's client is this script run as a process (`dns_bench.py --job FILE`; its
client half imports nothing of the package, so it runs as a plain script): dnspython
builds every query and parses every answer, one query in flight over UDP; it speaks the load
generator's ready/go lines. The cold/warm workload uses loadgen.c with a targets file of fresh
names (every one new to the proxy, answered by the harness's DNS server on 127.0.0.1).
"""

from __future__ import annotations

import json
import re
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

HOST = "bench.test"
LOOPBACK = "127.0.0.1"
QUERY_TIMEOUT_S = 2.0
LOOKUP_METRIC = re.compile(
    r'^egress_dns_lookup_seconds_(sum|count)\{outcome="ok"\} (\S+)$', re.MULTILINE
)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def query_main(job: dict[str, Any]) -> int:
    """The client process: each `cold` name once (untimed), then `count` queries of `name`
    (or `seconds`), one in flight. dnspython builds the query and parses the first answer
    (NOERROR with an A record of 127.0.0.1); in the timed loop only the id changes, and an
    answer identical to the checked one but for its id is accepted without parsing it again
    (any other answer is parsed and checked), so that the client costs little per query."""
    import dns.exception
    import dns.message
    import dns.rcode
    import dns.rdatatype

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(QUERY_TIMEOUT_S)
    sock.connect((LOOPBACK, job["port"]))

    def checked(name: str, wire: bytes) -> None:
        answer = dns.message.from_wire(wire)
        addresses = [r.to_text() for rrset in answer.answer for r in rrset]
        if answer.rcode() != dns.rcode.NOERROR or LOOPBACK not in addresses:
            raise ValueError(f"{name}: {dns.rcode.to_text(answer.rcode())} {addresses}")

    def ask(query: bytearray, ident: int) -> bytes:
        query[0:2] = ident.to_bytes(2)
        sock.send(query)
        while True:  # a late answer to an earlier (timed-out) query is skipped
            wire = sock.recv(4096)
            if wire[:2] == query[0:2]:
                return wire

    errors: list[str] = []
    reference = b""
    try:
        for name in [*job["cold"], job["name"]]:
            query = bytearray(dns.message.make_query(name, dns.rdatatype.A).to_wire())
            reference = ask(query, 1)
            checked(name, reference)
    except (OSError, ValueError, dns.exception.DNSException) as exc:
        _say({"failed": f"query of {name}: {type(exc).__name__}: {exc}"})
        return 0
    _say({"ready": True})
    if sys.stdin.readline().strip() != "go":
        return 0
    latencies: list[float] = []
    cpu0, t0 = _cpu(), time.perf_counter()
    deadline = t0 + job["seconds"]
    while len(latencies) < job["count"] and time.perf_counter() < deadline and len(errors) < 20:
        start = time.perf_counter()
        try:
            wire = ask(query, len(latencies) % 65535 + 2)
            if wire[2:] != reference[2:]:
                checked(job["name"], wire)
            latencies.append((time.perf_counter() - start) * 1e6)
        except (OSError, ValueError, dns.exception.DNSException) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    wall = time.perf_counter() - t0
    _say(
        {
            "done": len(latencies),
            "errors": len(errors),
            "first_errors": errors[:3],
            "seconds": wall,
            "client_cpu_s": _cpu() - cpu0,
            "latencies_us": [round(x, 1) for x in latencies],
        }
    )
    return 0


# --------------------------------------------------------------------------------------------
# The workloads (imported by bench.py; the client role above imports none of this)


def dns_listen_workload(run: Any, proxy: Any, directory: Path, n: int) -> dict[str, Any]:
    """Queries to the proxy's DNS listener: `dnsq_cold` fresh names once each (untimed; they
    pass through the proxy's resolver), then `dnsq_count` queries of bench.test (or `dnsq_s`).
    Proxy CPU per query, queries/s, latency."""
    from .loadgen import figures, run_phase

    s = run.settings
    cold = [f"q{i}.r{n}.{proxy.name}.dnsq.{HOST}" for i in range(s.dnsq_cold)]
    for name in cold:
        run.dns.set(name, a=[LOOPBACK], ttl=3600)
    job = {"port": proxy.dns_port, "cold": cold, "name": HOST}
    job |= {"count": s.dnsq_count, "seconds": s.dnsq_s}
    job_file = directory / "dns-job.json"
    job_file.write_text(json.dumps(job))
    command = [sys.executable, str(Path(__file__).resolve()), "--job", str(job_file)]
    watch = {"proxy": proxy.pid}
    result, cpu = run_phase(command, watch, s.dnsq_s + 30, directory / "dns-client.txt")
    return figures(result, cpu, result["done"], "query", "queries")


def lookup_metric(proxy: Any) -> tuple[float, float] | None:
    """(sum, count) of the proxy's egress_dns_lookup_seconds{outcome="ok"}, when it exports it."""
    from .proc import http_get

    try:
        body = http_get(proxy.admin_port, "/metrics")[1].decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    found = {kind: float(value) for kind, value in LOOKUP_METRIC.findall(body)}
    return (found["sum"], found["count"]) if len(found) == 2 else None


def resolver_phase(run: Any, proxy: Any, directory: Path, names: list[str]) -> dict[str, Any]:
    """One tunnel per name in `names`, one at a time, through the proxy: what its resolver
    adds. Also how many queries reached the harness's DNS server, and the proxy's own lookup
    time where it exports it."""
    from .loadgen import write_targets
    from .workloads import tunnel_phase

    targets = write_targets(directory / f"dns-{len(set(names))}-{names[0]}.bin", names)
    queries0 = len(run.dns.queries)
    metric0 = lookup_metric(proxy)
    seconds = max(3.0, run.settings.latency_s)
    out = tunnel_phase(
        run,
        proxy,
        directory,
        clients=1,
        count=len(names),
        seconds=seconds,
        targets=targets,
        warmup=0,
    )
    metric1 = lookup_metric(proxy)
    out["dns_queries"] = len(run.dns.queries) - queries0
    out["dns_lookup_ms_mean"] = None
    if metric0 and metric1 and metric1[1] > metric0[1]:
        out["dns_lookup_ms_mean"] = (metric1[0] - metric0[0]) / (metric1[1] - metric0[1]) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the DNS listener's client (of the harness)")
    parser.add_argument("--job", type=Path, required=True)
    args = parser.parse_args(argv)
    return query_main(json.loads(args.job.read_text()))


if __name__ == "__main__":
    sys.exit(main())
