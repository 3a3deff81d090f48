"""Prometheus metrics of one proxy, shared by the L7 engine and the L4 fast path.

Both planes record through the same `Metrics` methods, so a decision counts the same way
whichever plane made it. Each `Metrics` owns its own `CollectorRegistry`: the global default
registry would make a second proxy (or a second test) in the same process fail with
"Duplicated timeseries".

Label values are bounded: every label comes from a closed set or from a reason-code-shaped
string, and each label accepts at most `MAX_LABEL_VALUES` distinct values. Anything else is
recorded as `other`. A hostname, client address or path must never become a label value: one
series per value is memory the client controls.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from policy.decisions import AddressDecision, Decision

PREFIX = "egress_"
OTHER = "other"
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# The reason codes of policy, resolver and engine together are a few dozen; this leaves room for
# codes added later while still capping the series a bug that leaks input into a label can create.
MAX_LABEL_VALUES = 128
PLANES = frozenset({"l4", "l7"})
DECISIONS = frozenset({"allow", "deny"})
DIRECTIONS = ("up", "down")
# The DNS responder's query types and answer codes worth a series of their own; any other type
# is `other` (the type is the client's choice: 65536 values).
DNS_QTYPES = frozenset(
    {"A", "AAAA", "HTTPS", "SVCB", "TXT", "MX", "CNAME", "NS", "PTR", "SRV", "SOA", "ANY", "none"}
)
DNS_RCODES = frozenset(
    {"NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "dropped"}
)
RELOAD_RESULTS = ("success", "failure")

# Latency of one DNS lookup or one upstream TCP connect. A cache hit answers in microseconds, a
# loopback or in-cluster resolver in about a millisecond, an internet round trip in 10-300 ms, and
# failures end at the configured timeouts (seconds). The buckets therefore start below a
# millisecond and reach past common timeouts (5 s, 10 s), so a timeout lands in a finite bucket
# instead of being indistinguishable in +Inf from a hung lookup.
LATENCY_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Connection lifetimes range from a refused tunnel (milliseconds) to a long-lived stream or
# WebSocket (hours), so these buckets are spread logarithmically up to the idle timeouts in use.
DURATION_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)


def _amount(value: float) -> float:
    """Counters raise on negative increments and NaN poisons sums: a caller's arithmetic slip
    must cost a sample, not crash the connection that reported it."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) and number >= 0 else 0.0


class _LabelGuard:
    """Maps a label value to itself when it is code-shaped and among the first `limit` distinct
    values seen (or in the closed set), and to `other` otherwise."""

    __slots__ = ("_allowed", "_limit", "_seen")

    def __init__(self, allowed: Iterable[str] | None = None, limit: int = MAX_LABEL_VALUES) -> None:
        self._allowed = frozenset(allowed) if allowed is not None else None
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: object) -> str:
        if not isinstance(value, str):
            return OTHER
        if self._allowed is not None:
            return value if value in self._allowed else OTHER
        if value in self._seen:
            return value
        if not _CODE.fullmatch(value) or len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(value)
        return value


class Metrics:
    """One proxy's metrics. Methods never raise on odd input: a metrics call sits on every
    connection's path, and a failing one must not turn into a failed (or, worse, an allowed)
    connection."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[Any, ...], Any] = {}
        r = self.registry
        self._decision = _LabelGuard(DECISIONS)
        self._plane = _LabelGuard(PLANES)
        self._reason = _LabelGuard()
        self._stage = _LabelGuard()
        self._outcome = _LabelGuard()
        self._protocol = _LabelGuard()
        self._qtype = _LabelGuard(DNS_QTYPES)
        self._rcode = _LabelGuard(DNS_RCODES)

        self.decisions = Counter(
            f"{PREFIX}decisions",
            "Policy decisions, by decision, reason code, stage and plane.",
            ["decision", "reason", "stage", "plane"],
            registry=r,
        )
        self.dns_lookup_seconds = Histogram(
            f"{PREFIX}dns_lookup_seconds",
            "Time to resolve one host (cache hits included), by outcome.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_connect_seconds = Histogram(
            f"{PREFIX}upstream_connect_seconds",
            "Time to open the TCP connection to a pinned upstream address, by outcome.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_connections = Gauge(
            f"{PREFIX}active_connections",
            "Client connections currently open, by plane.",
            ["plane"],
            registry=r,
        )
        self.engine = Gauge(
            f"{PREFIX}engine_loaded",
            "1 once the L7 engine (mitmproxy) is loaded: at start when the policy can need "
            "it, else with the first connection that does.",
            registry=r,
        )
        self.connections = Counter(
            f"{PREFIX}connections",
            "Client connections accepted, by plane and protocol.",
            ["plane", "protocol"],
            registry=r,
        )
        self.connection_duration_seconds = Histogram(
            f"{PREFIX}connection_duration_seconds",
            "Lifetime of closed client connections, by plane.",
            ["plane"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bytes = Counter(
            f"{PREFIX}bytes",
            "Payload bytes relayed; up is client to upstream, down is upstream to client.",
            ["direction", "plane"],
            registry=r,
        )
        self.reloads = Counter(
            f"{PREFIX}reloads",
            "Policy reloads, by result (a failed reload keeps the last good policy).",
            ["result"],
            registry=r,
        )
        self.reload_success_time = Gauge(
            f"{PREFIX}last_reload_success_timestamp_seconds",
            "Unix time of the last successful policy load or reload.",
            registry=r,
        )
        self.dns_queries = Counter(
            f"{PREFIX}dns_queries",
            "Messages to the DNS responder, by query type and answer code (`dropped`: not "
            "answered). None is ever forwarded.",
            ["qtype", "rcode"],
            registry=r,
        )
        self.audit_write_errors = Counter(
            f"{PREFIX}audit_write_errors",
            "Audit log lines that could not be written.",
            registry=r,
        )
        # A gauge set to 1 rather than an Info: an Info renders with an `_info` suffix added to
        # whatever name it gets, and a gauge keeps the conventional `egress_build_info` name.
        self.build_info = Gauge(
            f"{PREFIX}build_info",
            "Build information; the value is always 1.",
            ["version", "python"],
            registry=r,
        )

        # Series that exist from the start, so rate() and alerts see a 0 instead of no data.
        for plane in sorted(PLANES):
            self.active_connections.labels(plane)
            for direction in DIRECTIONS:
                self.bytes.labels(direction, plane)
        for result in RELOAD_RESULTS:
            self.reloads.labels(result)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus-client validates and locks on every
        call, and the same few series are hit several times per connection. Labels are
        bounded (reason codes, planes), so the dict is too."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- events -------------------------------------------------------------------------------

    def decision(self, decision: str | bool, reason: str, stage: str, plane: str = "l7") -> None:
        """One policy decision. `decision` is "allow"/"deny" (or a bool: True is allow)."""
        if isinstance(decision, bool):
            decision = "allow" if decision else "deny"
        self._child(
            self.decisions,
            self._decision(decision),
            self._reason(reason),
            self._stage(stage),
            self._plane(plane),
        ).inc()

    def record(self, decision: Decision | AddressDecision, plane: str = "l7") -> None:
        """A policy `Decision` or `AddressDecision` as it came out of the policy core."""
        self.decision(decision.allowed, decision.reason, decision.stage, plane)

    def dns_lookup(self, seconds: float, outcome: str) -> None:
        """`outcome` is "ok" or the resolver's reason code (dns_nxdomain, dns_timeout, ...)."""
        self._child(self.dns_lookup_seconds, self._outcome(outcome)).observe(_amount(seconds))

    def upstream_connect(self, seconds: float, outcome: str) -> None:
        """`outcome` is "ok" or the failure's reason code (connect_refused, connect_timeout...)."""
        self._child(self.upstream_connect_seconds, self._outcome(outcome)).observe(_amount(seconds))

    def connection_opened(self, plane: str, protocol: str = "unknown") -> None:
        plane = self._plane(plane)
        self._child(self.connections, plane, self._protocol(protocol)).inc()
        self._child(self.active_connections, plane).inc()

    def connection_closed(self, plane: str, bytes_up: int, bytes_down: int, seconds: float) -> None:
        """Pairs with one `connection_opened(plane)`."""
        plane = self._plane(plane)
        self._child(self.active_connections, plane).dec()
        self._child(self.bytes, "up", plane).inc(_amount(bytes_up))
        self._child(self.bytes, "down", plane).inc(_amount(bytes_down))
        self._child(self.connection_duration_seconds, plane).observe(_amount(seconds))

    def engine_loaded(self, loaded: bool) -> None:
        self.engine.set(1 if loaded else 0)

    def reload(self, ok: bool) -> None:
        self.reloads.labels("success" if ok else "failure").inc()
        if ok:
            self.reload_success_time.set(time.time())

    def dns_query(self, qtype: str, rcode: str) -> None:
        """One message to the DNS responder: its type (`A`, ..., `none` when it had no single
        question) and the answer's code (`NOERROR`, `REFUSED`, ..., `dropped`)."""
        self._child(self.dns_queries, self._qtype(qtype), self._rcode(rcode)).inc()

    def audit_write_error(self) -> None:
        self.audit_write_errors.inc()

    def set_build_info(self, version: str, python: str) -> None:
        """Replaces any earlier build info, so the gauge always has exactly one series."""
        self.build_info.clear()
        # These come from our own package metadata, not from clients; the cap only keeps a
        # malformed value from making an absurd label.
        self.build_info.labels(str(version)[:64], str(python)[:64]).set(1)

    # -- exposition ---------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its Content-Type, for the admin `/metrics` endpoint."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
