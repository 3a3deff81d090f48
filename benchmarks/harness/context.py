"""What every part of a harness run shares: its settings (full and quick), the run itself (the
DNS server, the load generators, the origin, the configurations), and what a proxy under test
offers the workloads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .egress import EgressConfig, write_inputs
from .loadgen import Loadgen
from .peers import OriginTLS, PeerStatus, Served
from .profiling import Profiler

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Settings:
    rounds: int
    warm_pass: str  # before the first round, start and stop once: "all" proxies, or "egress"
    settle_s: float  # memory is read this long after the proxy is ready, or after a workload
    warmup: int  # tunnels one at a time before each tunnel phase (untimed)
    latency_count: int  # one client, one tunnel at a time: at most this many ...
    latency_s: float  # ... or this long
    rate_count: int  # tunnels per concurrency level: at most this many ...
    rate_s: float  # ... or this long
    concurrency: tuple[int, ...]  # concurrent clients of the rate phases (1 is the latency one)
    bulk_bytes: int  # through one tunnel, each direction
    parallel_tunnels: int
    parallel_bytes: int  # in all, over the parallel tunnels, each direction
    bulk_s: float  # a transfer taking longer is cut short (and reported)
    http_s: int  # the measured wrk run (wrk takes whole seconds)
    http_warmup_s: int  # an untimed wrk run before it (0: none)
    socks_count: int  # SOCKS5 tunnels at 16 clients: at most this many ...
    socks_s: float  # ... or this long
    dnsq_count: int  # queries to the DNS listener: at most this many ...
    dnsq_s: float  # ... or this long
    dnsq_cold: int  # fresh names queried once each before them (untimed)
    inspect_count: int  # intercepted HTTPS tunnels (or requests): at most this many ...
    inspect_s: float  # ... or this long, per phase
    inspect_clients: int
    inspect_requests: int  # requests per tunnel in the keep-alive phase
    scale_sizes: tuple[int, ...]
    scale_rounds: int
    scale_count: int  # sequential tunnels per scale sample
    dns_rounds: int
    dns_count: int  # tunnels per cold and per warm sample
    sessions: int  # proxies side by side
    sessions_s: float  # starting them stops after this long


FULL = Settings(
    rounds=3,
    warm_pass="all",
    settle_s=0.5,
    warmup=30,
    latency_count=2000,
    latency_s=3.0,
    rate_count=60_000,
    rate_s=5.0,
    concurrency=(16, 64),
    bulk_bytes=GIB,
    parallel_tunnels=8,
    parallel_bytes=GIB,
    bulk_s=60.0,
    http_s=5,
    http_warmup_s=1,
    socks_count=30_000,
    socks_s=3.0,
    dnsq_count=5000,
    dnsq_s=3.0,
    dnsq_cold=50,
    inspect_count=20_000,
    inspect_s=3.0,
    inspect_clients=16,
    inspect_requests=100_000,
    scale_sizes=(10, 10_000, 100_000),
    scale_rounds=3,
    scale_count=300,
    dns_rounds=3,
    dns_count=200,
    sessions=50,
    sessions_s=240.0,
)
# Short: for checking the harness and a first look (under 2 minutes here), not for numbers.
QUICK = dataclasses.replace(
    FULL,
    rounds=2,
    warm_pass="egress",
    settle_s=0.2,
    warmup=10,
    latency_count=300,
    latency_s=0.3,
    rate_count=10_000,
    rate_s=0.6,
    concurrency=(16,),
    bulk_bytes=64 * MIB,
    parallel_bytes=64 * MIB,
    bulk_s=30.0,
    http_s=1,
    http_warmup_s=0,
    socks_count=5000,
    socks_s=0.4,
    dnsq_count=500,
    dnsq_s=0.4,
    dnsq_cold=10,
    inspect_count=2000,
    inspect_s=0.6,
    scale_sizes=(10, 10_000),
    scale_rounds=1,
    scale_count=50,
    dns_rounds=1,
    dns_count=30,
    sessions=3,
    sessions_s=30.0,
)


class Running(Protocol):
    """A proxy under test: egress-proxy (egress.EgressProxy) or a peer (Served)."""

    name: str
    port: int  # the HTTP proxy port
    ready_s: float

    @property
    def pid(self) -> int: ...

    def stop(self) -> int: ...


@dataclass
class Run:
    """What every phase of a run needs."""

    settings: Settings
    workloads: Sequence[str]
    tmp: Path
    dns: Any  # tests/support/dns_server.DNSServer
    loadgen: Loadgen
    upstream: Mapping[str, Any]  # {"pid", "tunnel", "opaque", "bulk"}
    targets: Path  # loadgen targets file: bench.test with its ClientHello
    env: dict[str, str]  # for egress-proxy and mitmdump: the harness's bytecode cache
    statuses: dict[str, PeerStatus]
    egress: dict[str, EgressConfig]  # the egress-proxy configurations of the run
    base_config: dict[str, Any]  # the operator config they all start from
    origin: Served | None = None
    origin_tls: OriginTLS | None = None
    tls_ca: Path | None = None  # the CA of the origin's HTTPS certificate
    wrk: str | None = None
    opaque_targets: Path | None = None  # bench.test with an SSH identification line instead
    log: Callable[[str], None] = print
    # The attributed workload's network namespace (attributed.Namespace), when it runs.
    namespace: Any = None
    profiler: Profiler | None = None  # --profile: py-spy on every egress-proxy process
    problems: list[str] = dataclasses.field(default_factory=list)

    def problem(self, message: str) -> None:
        self.problems.append(message)
        self.log(f"PROBLEM: {message}")

    def profiled(self, pid: int, config: str, label: str) -> None:
        """With --profile, py-spy attached to the egress-proxy process `pid` of `config`, just
        ready (its samples in DIR/<config>-<label>.txt)."""
        if self.profiler is not None and (why := self.profiler.attach(pid, config, label)):
            self.problem(why)

    def wants(self, workload: str) -> bool:
        return workload in self.workloads

    def write_inputs(self, directory: Path, config: EgressConfig) -> None:
        """`config`'s manifest and operator config, for this run, into `directory`."""
        port = self.origin_tls.port if self.origin_tls else None
        write_inputs(directory, config, self.base_config, port)
