"""The canary: before COMMAND runs, `python -m proxy.probes` inside the namespace tries the
ways out (TCP, UDP, ICMP, DNS), aimed only at the host side of the veth, where the observers
listen. TCP must be answered by the proxy instead, UDP get no echo, DNS for a name outside
every policy be refused, ICMP get no reply; and the observers must have seen nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.boundary.sandbox.children import without_proxy_variables
from proxy.boundary.sandbox.net import AddressPlan, SessionNames
from proxy.boundary.sandbox.observers import Observers
from proxy.boundary.sandbox.options import RunAs
from proxy.boundary.sandbox.outcome import ActivationRefused
from proxy.boundary.sandbox.preflight import Tools

CANARY_TIMEOUT = 30.0
# A name outside every policy (`.invalid` is refused before DNS in any egress mode).
CANARY_DNS_SUFFIX = "egress-sandbox-canary.invalid"

# One probe, in the JSON form of `python -m proxy.probes --spec` (proxy/boundary/probes/spec.py).
Probe = dict[str, Any]


@dataclass(frozen=True, slots=True)
class CanaryRun:
    spec: dict[str, list[Probe]]
    as_root: bool  # False: as COMMAND's user


def canary_runs(
    plan: AddressPlan, observers: Observers, names: SessionNames, user_is_root: bool
) -> list[CanaryRun]:
    """The canary's probe runs, aimed only at the host side of the veth: one per address
    family as COMMAND's user (TCP, UDP, ICMP, DNS), and, for an unprivileged user, ICMP once
    more as root. An unprivileged user usually cannot open an ICMP socket at all, so its probe
    proves nothing about the rules; root's raw socket does (the drop is the same for all)."""
    runs: list[CanaryRun] = []
    icmp: list[Probe] = []
    for version, host in ((4, str(plan.host4)), (6, str(plan.host6))):
        icmp.append({"name": f"icmp_v{version}", "address": host, "expect": "no_echo"})
        spec: dict[str, list[Probe]] = {
            "tcp": [
                {"name": f"tcp_v{version}_direct", "address": host,
                 "port": observers.port(host, "tcp")},
                # A stream that names no host, to an address never resolved through us.
                {"name": f"tcp_v{version}_direct_ssh", "address": host,
                 "port": observers.port(host, "tcp"), "speak": "ssh"},
            ],
            "udp": [
                {"name": f"udp_v{version}", "address": host,
                 "port": observers.port(host, "udp"), "expect": "no_echo"},
            ],
            "dns": [
                {"name": f"dns_v{version}_denied_name", "server": host, "port": 53,
                 "qname": f"v{version}-{names.suffix}.{CANARY_DNS_SUFFIX}"},
            ],
        }  # fmt: skip
        if user_is_root:
            spec["icmp"] = [icmp[-1]]
        runs.append(CanaryRun(spec, as_root=user_is_root))
    if not user_is_root:
        runs.append(CanaryRun({"icmp": [dict(x, name=f"{x['name']}_root") for x in icmp]}, True))
    return runs


def run_canary(tools: Tools, names: SessionNames, plan: AddressPlan, run_as: RunAs) -> int:
    """Run the canary; how many probes held. ActivationRefused when one got through, an
    observer saw anything, or the canary could not run."""
    observers = Observers.open(plan)
    try:
        runs = canary_runs(plan, observers, names, run_as.is_root)
        results = _probe(tools, names, run_as, runs, observers)
        observers.serve(0)  # anything still queued
    finally:
        observers.close()
    failed = [r for r in results if not r.get("passed")]
    problems = [f"{r.get('name')}: {r.get('detail')}" for r in failed]
    problems += [f"observer saw a {what}" for what in observers.seen]
    if problems:
        raise ActivationRefused("the canary got through: " + "; ".join(problems))
    return len(results)


def _probe(
    tools: Tools,
    names: SessionNames,
    run_as: RunAs,
    runs: Sequence[CanaryRun],
    observers: Observers,
) -> list[dict[str, Any]]:
    """Run the probes inside the namespace (python starts as root, so it can read the
    package, and drops to COMMAND's user before its first probe); their results, while
    the observers answer whatever reaches them."""
    processes = []
    for run in runs:
        command = [tools.ip, "netns", "exec", names.netns, sys.executable, "-m",
                   "proxy.probes", "--spec", json.dumps(run.spec)]  # fmt: skip
        if not run.as_root:
            command += ["--as-user", f"{run_as.uid}:{run_as.gid}"]
        processes.append(
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd="/",
                env=without_proxy_variables(os.environ),
            )
        )
    deadline = time.monotonic() + CANARY_TIMEOUT
    try:
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline:
                raise ActivationRefused(f"the canary did not finish within {CANARY_TIMEOUT:g}s")
            observers.serve(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return [result for process in processes for result in _results(process)]


def _results(process: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    """The results one finished probe run printed (the last line of its stdout)."""
    out, err = process.communicate(timeout=10)
    try:
        report = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
        return [r for r in report["results"] if isinstance(r, dict)]
    except (ValueError, IndexError, KeyError, TypeError):
        detail = (err or out).decode("utf-8", "replace").strip()[-300:]
        raise ActivationRefused(
            f"the canary failed to run (status {process.returncode}): {detail}"
        ) from None
