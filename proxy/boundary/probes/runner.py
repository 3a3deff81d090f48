"""Running the probes of a spec, in its order, and their report (the JSON object `python -m
proxy.probes` prints and `egress-proxy boundary verify --json` writes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from proxy.boundary.probes.dns_query import dns_refused
from proxy.boundary.probes.icmp import icmp_blocked
from proxy.boundary.probes.result import ProbeResult, oserror
from proxy.boundary.probes.spec import ProbeSpec
from proxy.boundary.probes.tcp import ssh_refused_by_proxy, tcp_answered_by_proxy
from proxy.boundary.probes.udp import udp_blocked


def _guarded(name: str, probe: Callable[[], ProbeResult]) -> ProbeResult:
    """A probe that could not even be tried (no IPv6 in this kernel, too many open files)
    proved nothing: a failure, named, never a traceback."""
    try:
        return probe()
    except OSError as exc:
        return ProbeResult(name, False, f"could not probe: {oserror(exc)}")


def run_probes(spec: ProbeSpec) -> list[ProbeResult]:
    # Each kind has a default timeout of its own; the spec's, when given, overrides them all.
    extra: dict[str, Any] = {} if spec.timeout is None else {"timeout": spec.timeout}
    calls: list[tuple[str, Callable[[], ProbeResult]]] = []
    for t in spec.tcp:
        probe = ssh_refused_by_proxy if t.speak == "ssh" else tcp_answered_by_proxy
        calls.append((t.name, partial(probe, t.name, t.address, t.port, **extra)))
    for u in spec.udp:
        calls.append(
            (u.name, partial(udp_blocked, u.name, u.address, u.port, expect=u.expect, **extra))
        )
    for i in spec.icmp:
        calls.append((i.name, partial(icmp_blocked, i.name, i.address, expect=i.expect, **extra)))
    for d in spec.dns:
        calls.append((d.name, partial(dns_refused, d.name, d.server, d.port, d.qname, **extra)))
    return [_guarded(name, call) for name, call in calls]


def report(results: Sequence[ProbeResult]) -> dict[str, Any]:
    return {"results": [r.to_json() for r in results], "passed": all(r.passed for r in results)}
