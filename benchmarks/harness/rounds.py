"""One sample of each kind: a main round of one configuration (every workload on one process,
memory read between them), a scale sample, a DNS cold/warm sample, and N sessions side by side.
A failing phase is a problem of the run, never the end of it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import egress, peers
from .attributed import attributed_workload
from .context import Run, Running
from .dns_bench import HOST, LOOPBACK, dns_listen_workload, resolver_phase
from .http_bench import http_problems, http_workload
from .proc import descendants, memory, proc_cpu
from .stats import latency_summary
from .workloads import (
    bulk_workload,
    checkpoint,
    inspect_workload,
    opaque_route,
    opaque_workload,
    socks5_workload,
    tunnel_phase,
    tunnels_workload,
)

DOMAINS = (HOST,)  # every peer's allow-list: the name and its subdomains, as egress: [bench.test]
SCALE_SEED = 20_240_501  # the hostname stream of benchmarks/policy_decide.py (decisions/)
SESSION_START_WORKERS = 2  # proxies started at once in the sessions workload (2 CPUs here)


def start_config(run: Run, config: str, directory: Path, label: str) -> Running | None:
    """The proxy of `config` started in `directory` and ready (None for direct); an egress-proxy
    one profiled under `label` with --profile."""
    if config == "direct":
        return None
    directory.mkdir(parents=True, exist_ok=True)
    probe = int(run.upstream["tunnel"])
    if config in run.egress:
        chosen = run.egress[config]
        if not (directory / chosen.manifest_file).exists():
            run.write_inputs(directory, chosen)
        proxy = egress.start(chosen, directory, run.env, probe)
        run.profiled(proxy.pid, config, label)
        return proxy
    return peers.start_peer(run.statuses[config], directory, DOMAINS, run.env, run.tmp, probe)


def guarded(run: Run, label: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """measure(), or {"error": ...} (and a problem) when it fails: one failing phase or peer
    does not end the run."""
    try:
        return measure()
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
        run.problem(f"{label}: {type(exc).__name__}: {str(exc).strip()[:500]}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _failures(run: Run, label: str, phase: Any) -> None:
    """A problem for each failed unit of work in a phase's result (nested by level or kind)."""
    if not isinstance(phase, dict) or isinstance(phase.get("error"), str):
        return
    if phase.get("errors"):
        run.problem(f"{label}: {phase['errors']} failed: {phase.get('first_errors')}")
    for key, value in phase.items():
        if isinstance(value, dict) and ("errors" in value or "error" in value):
            if value.get("error"):
                run.problem(f"{label} {key}: {value['error']}")
            else:
                _failures(run, f"{label} {key}", value)


def inspected(run: Run, config: str) -> tuple[str, str] | None:
    """(host, path) of the intercepted HTTPS `config` is measured with, or None. Direct gets
    the same client straight to the origin, whenever any configuration of the run has one."""
    if not (run.wants("inspect") and run.loadgen.tls and run.origin_tls and run.tls_ca):
        return None
    chosen = run.egress.get(config)
    if chosen is not None and chosen.inspected_host:
        return chosen.inspected_host, chosen.inspected_path
    if config == "direct" and any(c.inspected_host for c in run.egress.values()):
        return HOST, "/"
    return None


@dataclass
class _Round:
    """One configuration in one round: its proxy, its sample, memory between the workloads."""

    run: Run
    config: str
    n: int
    directory: Path
    proxy: Running | None
    sample: dict[str, Any]
    mem: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"round {self.n + 1} {self.config}"

    def phase(self, name: str, measure: Callable[[], dict[str, Any]], after: str | None) -> None:
        """A workload: its result (or its error) in the sample, its failures as problems, and
        the proxy's memory once idle after it (`after`: the checkpoint's name)."""
        self.sample[name] = guarded(self.run, f"{self.label} {name}", measure)
        if name != "http":  # wrk's error counts are judged by http_problems
            _failures(self.run, f"{self.label} {name}", self.sample[name])
        if self.proxy is not None and after:
            self.mem[after] = checkpoint(self.run, self.proxy)

    def started(self, proxy: Running) -> None:
        self.sample["ready_s"] = proxy.ready_s
        self.sample["first_connect_s"] = getattr(proxy, "first_connect_s", None)
        self.sample["startup_cpu_s"] = proc_cpu(proxy.pid)
        self.mem["idle"] = checkpoint(self.run, proxy)
        self.sample["processes"] = 1 + len(descendants(proxy.pid))
        if self.sample["processes"] > 1:  # CPU and memory are read from the one pid
            self.run.problem(f"{self.label}: {self.sample['processes']} processes, not one")

    def workloads(self) -> None:
        run, proxy, directory = self.run, self.proxy, self.directory
        chosen = run.egress.get(self.config)
        passthrough = chosen is None or chosen.passthrough
        if passthrough and run.wants("tunnels"):
            self.phase("tunnels", lambda: tunnels_workload(run, proxy, directory), None)
        if passthrough and run.wants("opaque") and run.opaque_targets is not None:
            self.phase("opaque", lambda: opaque_workload(run, proxy, directory), None)
        if passthrough and run.wants("bulk"):
            self.phase("bulk", lambda: bulk_workload(run, proxy, directory), None)
        if proxy is not None and {"tunnels", "bulk"} & self.sample.keys():
            self.mem["after_connect"] = checkpoint(run, proxy)
        if run.wants("http") and run.origin is not None and run.wrk is not None:
            self.phase("http", lambda: http_workload(run, proxy), "after_http")
            for message in http_problems(self.sample["http"]):
                run.problem(f"{self.label} http: {message}")
        if isinstance(proxy, egress.EgressProxy):
            listening = proxy
            if listening.socks_port and passthrough and run.wants("socks5"):
                measure = lambda: socks5_workload(run, listening, directory)  # noqa: E731
                self.phase("socks5", measure, "after_socks5")
            if listening.socks_port and passthrough and run.wants("opaque"):
                route = opaque_route(run)
                measure = lambda: socks5_workload(run, listening, directory, **route)  # noqa: E731
                self.phase("opaque_socks5", measure, None)
            if listening.dns_port and run.wants("dns-listen"):
                measure = lambda: dns_listen_workload(run, listening, directory, self.n)  # noqa: E731
                self.phase("dns_listen", measure, "after_dns")
        if run.namespace is not None and (
            self.config == "direct" or (chosen is not None and passthrough and chosen.listeners)
        ):
            where = directory / "attributed"
            label = f"attributed-round{self.n + 1}"
            measure = lambda: attributed_workload(run, self.config, where, label)  # noqa: E731
            self.phase("attributed", measure, None)
        if target := inspected(run, self.config):
            measure = lambda: inspect_workload(run, proxy, directory, *target)  # noqa: E731
            self.phase("inspect", measure, "after_inspect")

    def egress_checks(self, proxy: egress.EgressProxy) -> None:
        """Audit lines were written to the file, and /metrics answers, as in a sidecar."""
        log = proxy.audit_log
        self.sample["audit_bytes"] = log.stat().st_size if log.exists() else 0
        if not self.sample["audit_bytes"]:
            self.run.problem(f"{self.label}: the audit log {log} is empty")
        try:
            self.sample["metrics_ok"] = proxy.metrics_ok()
        except (OSError, ValueError, IndexError) as exc:
            self.sample["metrics_ok"] = False
            self.run.problem(f"{self.label}: /metrics: {type(exc).__name__}: {exc}")
        else:
            if not self.sample["metrics_ok"]:
                self.run.problem(f"{self.label}: /metrics did not answer 200 with samples")


def main_round(run: Run, config: str, n: int) -> dict[str, Any]:
    """Every workload of the run on one fresh process of `config`."""
    directory = run.tmp / config
    directory.mkdir(parents=True, exist_ok=True)
    sample: dict[str, Any] = {"config": config, "round": n}
    try:
        proxy = start_config(run, config, directory, f"round{n + 1}")
    except RuntimeError as exc:
        run.problem(f"round {n + 1} {config}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    this = _Round(run, config, n, directory, proxy, sample)
    try:
        if proxy is not None:
            this.started(proxy)
        this.workloads()
        if isinstance(proxy, egress.EgressProxy):
            this.egress_checks(proxy)
        if proxy is not None:
            sample["memory"] = this.mem
            sample["worst_rss_mb"] = max(m.get("rss_mb", 0.0) for m in this.mem.values())
    finally:
        if proxy is not None:
            sample["exit_code"] = proxy.stop()
    if config in run.egress and sample.get("exit_code") != 0:
        run.problem(f"{this.label}: egress-proxy exited {sample.get('exit_code')} on SIGTERM")
    return sample


# -- policy scale -----------------------------------------------------------------------------


def scale_manifest(size: int) -> str:
    """`egress:` with bench.test and size - 1 other names (policy_decide.py's generator)."""
    from ..decisions.generate import hostnames, take, yaml_manifest

    stream = hostnames(SCALE_SEED, avoid=frozenset({HOST}))
    return yaml_manifest([HOST, *take(stream, size - 1)])


def scale_round(run: Run, size: int, n: int) -> dict[str, Any]:
    """The default configuration with `size` egress names: ready, start-up CPU, idle memory,
    sequential tunnels."""
    s = run.settings
    directory = run.tmp / f"scale-{size}"
    sample: dict[str, Any] = {"config": str(size), "rules": size, "round": n}
    chosen = dataclasses.replace(run.egress["egress-proxy"], manifest=scale_manifest(size))
    if not (directory / chosen.manifest_file).exists():
        run.write_inputs(directory, chosen)
    try:
        proxy = egress.start(chosen, directory, run.env, int(run.upstream["tunnel"]))
    except RuntimeError as exc:
        run.problem(f"scale {size:,} rules round {n + 1}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    try:
        run.profiled(proxy.pid, "egress-proxy", f"scale{size}-round{n + 1}")
        sample.update(ready_s=proxy.ready_s, first_connect_s=proxy.first_connect_s)
        sample["startup_cpu_s"] = proc_cpu(proxy.pid)
        sample["idle"] = checkpoint(run, proxy)
        label = f"scale {size:,} rules round {n + 1}"
        sample["tunnels"] = guarded(
            run,
            label,
            lambda: tunnel_phase(
                run,
                proxy,
                directory,
                clients=1,
                count=s.scale_count,
                seconds=max(2.0, s.latency_s),
            ),
        )
        _failures(run, label, sample["tunnels"])
    finally:
        sample["exit_code"] = proxy.stop()
    return sample


# -- the proxy's resolver: cold and warm ------------------------------------------------------


def dns_round(run: Run, config: str, n: int) -> dict[str, Any]:
    directory = run.tmp / f"dns-{config}"
    sample: dict[str, Any] = {"config": config, "round": n}
    label = f"dns {config} round {n + 1}"
    # A fresh name for every cold tunnel (all under bench.test, so all allowed). The last one
    # is the warm phase's name: its first lookup is a cold sample like the others.
    cold = [f"r{n}-{i}.{config}.cold.{HOST}" for i in range(run.settings.dns_count)]
    for name in cold:
        run.dns.set(name, a=[LOOPBACK], ttl=3600)
    try:
        proxy = start_config(run, config, directory, f"dns{n + 1}")
    except RuntimeError as exc:
        run.problem(f"{label}: did not start: {exc}")
        return {**sample, "error": str(exc)}
    try:
        sample["cold"] = guarded(
            run, f"{label} cold", lambda: resolver_phase(run, proxy, directory, cold)
        )
        warm = [cold[-1]] * len(cold)
        sample["warm"] = guarded(
            run, f"{label} warm", lambda: resolver_phase(run, proxy, directory, warm)
        )
    finally:
        if proxy is not None:
            sample["exit_code"] = proxy.stop()
    for kind in ("cold", "warm"):
        _failures(run, f"{label} {kind}", sample[kind])
    # The check that cold is cold and warm is warm: queries reached our server, or none did.
    cold_queries, warm_queries = (
        sample["cold"].get("dns_queries"),
        sample["warm"].get("dns_queries"),
    )
    if cold_queries is not None and cold_queries < sample["cold"]["tunnels"]:
        run.problem(
            f"{label}: {cold_queries} DNS queries for {sample['cold']['tunnels']} cold names"
        )
    if warm_queries:
        run.problem(f"{label}: {warm_queries} DNS queries with a warm cache")
    return sample


# -- sessions side by side --------------------------------------------------------------------


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
            proxy = start_config(run, config, base / f"s{i}", f"session{i + 1}")
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
        time.sleep(s.settle_s)
        mems = [memory(p.pid) for p in running]
        cpus = [proc_cpu(p.pid) for p in running]
        count = len(running)
        sample["sessions"] = count
        for key in ("rss_mb", "pss_mb", "uss_mb"):
            total = sum(m.get(key) or 0.0 for m in mems)
            sample[f"{key}_sum"] = total
            sample[f"{key}_per_session"] = total / count if count else None
        known = [c for c in cpus if c is not None]
        sample["startup_cpu_s_per_session"] = sum(known) / len(known) if known else None
        sample["ready_s"] = latency_summary(p.ready_s for p in running)
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
