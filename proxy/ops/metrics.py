"""Prometheus metrics of one proxy, shared by every plane.

Every plane records through the same `Metrics` methods, so a decision counts the same way
whichever plane made it. Each `Metrics` owns its own `CollectorRegistry`: the global default
registry would make a second proxy (or a second test) in the same process fail with
"Duplicated timeseries".

The values are plain numbers in dicts, one per series, and reach prometheus-client only when
`/metrics` is scraped, through a collector of ours (prometheus-client's extension point for
exactly this): a metric call sits on every connection's path, several times, and
prometheus-client's own metric objects take a lock and validate labels on every update. So
prometheus-client itself is imported only with the first scrape: a session nobody scrapes never
pays its start-up time and memory.

Label values are bounded: every label comes from a closed set or from a reason-code-shaped
string, and each label accepts at most `MAX_LABEL_VALUES` distinct values. Anything else is
recorded as `other`. A hostname, client address or path must never become a label value: one
series per value is memory the client controls.
"""

from __future__ import annotations

import math
import re
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policy.dimensions import Plane, Protocol, Stage, Verdict
from proxy.common.bounded import Bounded

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from policy.decisions import AddressDecision, Decision

PREFIX = "egress_"
OTHER = "other"
_UNKNOWN = "unknown"  # the protocol label of a connection opened without one
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# The reason codes of policy, resolver and engine together are a few dozen; this leaves room for
# codes added later while still capping the series a bug that leaks input into a label can create.
MAX_LABEL_VALUES = 128
# The closed sets of policy/dimensions.py, as the bare values the series are keyed by.
PLANES = frozenset(plane.value for plane in Plane)
# `would_deny`: a connection learning mode (`run --learn`) let through.
DECISIONS = frozenset(verdict.value for verdict in Verdict)
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
# The protocols a TLS tunnel's ClientHello is read on: CONNECT, SOCKS5, a transparent listener.
TUNNEL_PROTOCOLS = frozenset(p.value for p in (Protocol.CONNECT, Protocol.SOCKS5, Protocol.TLS))

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
        if type(value) is not str:
            # A Reason (a StrEnum) or another str subclass: the label is its bare value, never
            # the member (which would be kept as the series key and rendered by its own rules).
            value = str.__str__(value)
        if self._allowed is not None:
            return value if value in self._allowed else OTHER
        if value in self._seen:
            return value
        if not _CODE.fullmatch(value) or len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(value)
        return value


@dataclass(slots=True)
class _Histogram:
    """One histogram series: a count per bucket (not cumulative; made so when scraped)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1  # `le` is inclusive
        self.total += value


# eq=False: a spec is the key of its series' dict, hashed on every update; by identity that is one
# pointer, where a field-wise hash would hash every bucket bound each time.
@dataclass(frozen=True, slots=True, eq=False)
class _Spec:
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_DECISIONS = _Spec(
    "decisions",
    "Policy decisions, by decision, reason code, stage and plane.",
    ("decision", "reason", "stage", "plane"),
)
_DNS_LOOKUP = _Spec(
    "dns_lookup_seconds",
    "Time to resolve one host (cache hits included), by outcome.",
    ("outcome",),
    LATENCY_BUCKETS,
)
_UPSTREAM_CONNECT = _Spec(
    "upstream_connect_seconds",
    "Time to open the TCP connection to a pinned upstream address, by outcome.",
    ("outcome",),
    LATENCY_BUCKETS,
)
_CONNECTIONS = _Spec(
    "connections", "Client connections accepted, by plane and protocol.", ("plane", "protocol")
)
_DURATION = _Spec(
    "connection_duration_seconds",
    "Lifetime of closed client connections, by plane.",
    ("plane",),
    DURATION_BUCKETS,
)
_BYTES = _Spec(
    "bytes",
    "Payload bytes relayed; up is client to upstream, down is upstream to client.",
    ("direction", "plane"),
)
_RELOADS = _Spec(
    "reloads",
    "Policy reloads, by result (a failed reload keeps the last good policy).",
    ("result",),
)
_DNS_QUERIES = _Spec(
    "dns_queries",
    "Messages to the DNS responder, by query type and answer code (`dropped`: not answered). "
    "None is ever forwarded.",
    ("qtype", "rcode"),
)
_TLS_ECH = _Spec(
    "tls_ech",
    "TLS tunnels whose ClientHello carried ECH (encrypted_client_hello) or draft ESNI, by the "
    "tunnel's decision and protocol (tls.ech: refuse denies them as ech_refused).",
    ("decision", "protocol"),
)
_AUDIT_ERRORS = _Spec("audit_write_errors", "Audit log lines that could not be written.")
_CREDENTIALS = _Spec(
    "credential_injections",
    "Requests an operator credential was put into, by the credential's name (credentials[].name "
    "in the operator config; never its value).",
    ("credential",),
)
_WOULD_DENY = _Spec(
    "would_deny",
    "Connections and requests learning mode (run --learn) let through that the policy would "
    "refuse, by reason code.",
    ("reason",),
)
_ASKS = _Spec(
    "asks",
    "Asks to a person (run --ask), by outcome: a person's answer (allow-once, allow-session, "
    "deny, deny-session), timeout, overloaded (a connection refused without asking: over the "
    "caps) or reload (a reload decided it).",
    ("outcome",),
)
# The outcomes of an ask (proxy/decide/asks.py OUTCOMES), a closed set.
ASK_OUTCOMES = frozenset(
    {"allow-once", "allow-session", "deny", "deny-session", "timeout", "overloaded", "reload"}
)
_LABEL_SETS = 1024
_COUNTERS = (
    _DECISIONS,
    _CONNECTIONS,
    _BYTES,
    _RELOADS,
    _DNS_QUERIES,
    _TLS_ECH,
    _AUDIT_ERRORS,
    _CREDENTIALS,
    _WOULD_DENY,
    _ASKS,
)
_HISTOGRAMS = (_DNS_LOOKUP, _UPSTREAM_CONNECT, _DURATION)


class Metrics:
    """One proxy's metrics. Methods never raise on odd input: a metrics call sits on every
    connection's path, and a failing one must not turn into a failed (or, worse, an allowed)
    connection. Everything runs on the event loop's thread, scrapes included: no locks."""

    def __init__(self) -> None:
        self._registry: CollectorRegistry | None = None
        self._decision = _LabelGuard(DECISIONS)
        self._plane = _LabelGuard(PLANES)
        self._reason = _LabelGuard()
        self._stage = _LabelGuard()
        self._outcome = _LabelGuard()
        self._protocol = _LabelGuard()
        self._qtype = _LabelGuard(DNS_QTYPES)
        self._rcode = _LabelGuard(DNS_RCODES)
        self._tunnel_protocol = _LabelGuard(TUNNEL_PROTOCOLS)
        self._credential = _LabelGuard()  # names are code-shaped (proxy/app/credentials_config.py)
        self._ask_outcome = _LabelGuard(ASK_OUTCOMES)
        self._counters: dict[_Spec, dict[tuple[str, ...], float]] = {s: {} for s in _COUNTERS}
        self._histograms: dict[_Spec, dict[tuple[str, ...], _Histogram]] = {
            s: {} for s in _HISTOGRAMS
        }
        self._active: dict[str, int] = {}
        # The guarded labels of each decision asked for, so a repeat costs one lookup.
        # Bounded: its keys can come from clients (proxy/common/bounded.py).
        self._decision_labels: Bounded[tuple[Any, ...], tuple[str, ...]] = Bounded(_LABEL_SETS)
        self._engine = 0
        self._learn = 0
        self._open_files: float | None = None
        self._reload_success_time: float | None = None
        self._build: tuple[str, str] | None = None
        # Series that exist from the start, so rate() and alerts see a 0 instead of no data.
        for plane in sorted(PLANES):
            self._active[plane] = 0
            for direction in DIRECTIONS:
                self._counters[_BYTES][(direction, plane)] = 0.0
        for result in RELOAD_RESULTS:
            self._counters[_RELOADS][(result,)] = 0.0
        self._counters[_AUDIT_ERRORS][()] = 0.0
        # Every series of this small closed set: an alert on ech_refused tunnels sees a 0.
        for decision in (Verdict.ALLOW.value, Verdict.DENY.value):
            for protocol in sorted(TUNNEL_PROTOCOLS):
                self._counters[_TLS_ECH][(decision, protocol)] = 0.0

    @property
    def registry(self) -> CollectorRegistry:
        """This proxy's own registry (made with the first scrape)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=True)
            self._registry.register(_Collector(self))
        return self._registry

    def _add(self, spec: _Spec, labels: tuple[str, ...], amount: float = 1.0) -> None:
        series = self._counters[spec]
        series[labels] = series.get(labels, 0.0) + amount

    def _observe(self, spec: _Spec, labels: tuple[str, ...], value: float) -> None:
        series = self._histograms[spec]
        histogram = series.get(labels)
        if histogram is None:
            assert spec.buckets is not None
            histogram = series[labels] = _Histogram(spec.buckets)
        histogram.observe(value)

    # -- events -------------------------------------------------------------------------------

    def decision(
        self, decision: Verdict | bool, reason: str, stage: Stage, plane: Plane = Plane.L7
    ) -> None:
        """One policy decision. `decision` is a Verdict (or a bool: True is allow)."""
        if isinstance(decision, bool):
            decision = Verdict.ALLOW if decision else Verdict.DENY
        key = (decision, reason, stage, plane)
        labels = self._decision_labels.get(key)
        if labels is None:
            labels = (
                self._decision(decision),
                self._reason(reason),
                self._stage(stage),
                self._plane(plane),
            )
            self._decision_labels.put(key, labels)
        self._add(_DECISIONS, labels)
        if decision == Verdict.WOULD_DENY:
            self._add(_WOULD_DENY, (labels[1],))

    def record(self, decision: Decision | AddressDecision, plane: Plane = Plane.L7) -> None:
        """A policy `Decision` or `AddressDecision` as it came out of the policy core."""
        self.decision(decision.allowed, decision.reason, decision.stage, plane)

    def dns_lookup(self, seconds: float, outcome: str) -> None:
        """`outcome` is "ok" or the resolver's reason code (dns_nxdomain, dns_timeout, ...)."""
        self._observe(_DNS_LOOKUP, (self._outcome(outcome),), _amount(seconds))

    def upstream_connect(self, seconds: float, outcome: str) -> None:
        """`outcome` is "ok" or the failure's reason code (connect_refused, connect_timeout...)."""
        self._observe(_UPSTREAM_CONNECT, (self._outcome(outcome),), _amount(seconds))

    def connection_opened(self, plane: Plane, protocol: Protocol | None = None) -> None:
        label = self._plane(plane)
        shown = self._protocol(protocol if protocol is not None else _UNKNOWN)
        self._add(_CONNECTIONS, (label, shown))
        self._active[label] = self._active.get(label, 0) + 1

    def connection_closed(
        self, plane: Plane, bytes_up: int, bytes_down: int, seconds: float
    ) -> None:
        """Pairs with one `connection_opened(plane)`."""
        label = self._plane(plane)
        self._active[label] = self._active.get(label, 0) - 1
        self._add(_BYTES, ("up", label), _amount(bytes_up))
        self._add(_BYTES, ("down", label), _amount(bytes_down))
        self._observe(_DURATION, (label,), _amount(seconds))

    def engine_loaded(self, loaded: bool) -> None:
        self._engine = 1 if loaded else 0

    def learn_mode(self, learning: bool) -> None:
        """Whether learning mode lets refusals through (`egress_learn_mode`)."""
        self._learn = 1 if learning else 0

    def open_files_limit(self, limit: float) -> None:
        """The soft RLIMIT_NOFILE the process runs with (`math.inf`: unlimited)."""
        self._open_files = limit

    def reload(self, ok: bool) -> None:
        self._add(_RELOADS, ("success" if ok else "failure",))
        if ok:
            self._reload_success_time = time.time()

    def dns_query(self, qtype: str, rcode: str) -> None:
        """One message to the DNS responder: its type (`A`, ..., `none` when it had no single
        question) and the answer's code (`NOERROR`, `REFUSED`, ..., `dropped`)."""
        self._add(_DNS_QUERIES, (self._qtype(qtype), self._rcode(rcode)))

    def tls_ech(self, decision: Verdict, protocol: Protocol | None) -> None:
        """One tunnel whose ClientHello carried ECH or ESNI, with its decision (`allow` or
        `deny`) and protocol (`connect`, `socks5`, `tls`; any other is `other`)."""
        self._add(_TLS_ECH, (self._decision(decision), self._tunnel_protocol(protocol)))

    def credential_injected(self, name: str) -> None:
        """One request an operator credential was put into, by the credential's name."""
        self._add(_CREDENTIALS, (self._credential(name),))

    def ask(self, outcome: str) -> None:
        """One ask's outcome (or one connection refused as overloaded without asking)."""
        self._add(_ASKS, (self._ask_outcome(outcome),))

    def audit_write_error(self) -> None:
        self._add(_AUDIT_ERRORS, ())

    def set_build_info(self, version: str, python: str) -> None:
        """Replaces any earlier build info, so the gauge always has exactly one series."""
        # These come from our own package metadata, not from clients; the cap only keeps a
        # malformed value from making an absurd label.
        self._build = (str(version)[:64], str(python)[:64])

    # -- exposition ---------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its Content-Type, for the admin `/metrics` endpoint."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def families(self) -> Iterator[Metric]:
        """Every metric as prometheus-client's families, for the collector."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        for spec in _COUNTERS:
            family = CounterMetricFamily(PREFIX + spec.name, spec.help, labels=spec.labels)
            for labels, amount in sorted(self._counters[spec].items()):
                family.add_metric(labels, amount)
            yield family
        for spec in _HISTOGRAMS:
            histograms = HistogramMetricFamily(PREFIX + spec.name, spec.help, labels=spec.labels)
            assert spec.buckets is not None
            for labels, histogram in sorted(self._histograms[spec].items()):
                cumulative, running = [], 0
                for bound, count in zip((*spec.buckets, math.inf), histogram.counts, strict=True):
                    running += count
                    cumulative.append((_bound(bound), running))
                histograms.add_metric(labels, cumulative, histogram.total)
            yield histograms
        active = GaugeMetricFamily(
            f"{PREFIX}active_connections", "Client connections currently open, by plane.",
            labels=("plane",),
        )  # fmt: skip
        for plane, count in sorted(self._active.items()):
            active.add_metric((plane,), count)
        yield active
        yield GaugeMetricFamily(
            f"{PREFIX}engine_loaded",
            "1 once the interception engine (mitmproxy) is loaded.",
            value=self._engine,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}learn_mode",
            "1 while learning mode (run --learn) lets through what the policy would refuse.",
            value=self._learn,
        )
        open_files = GaugeMetricFamily(
            f"{PREFIX}open_files_limit",
            "The soft limit on open descriptors (RLIMIT_NOFILE) after start-up; each tunnel "
            "holds two.",
        )
        if self._open_files is not None:
            open_files.add_metric((), self._open_files)
        yield open_files
        reloaded = GaugeMetricFamily(
            f"{PREFIX}last_reload_success_timestamp_seconds",
            "Unix time of the last successful policy load or reload.",
        )
        if self._reload_success_time is not None:
            reloaded.add_metric((), self._reload_success_time)
        yield reloaded
        # A gauge set to 1 rather than an Info: an Info renders with an `_info` suffix added to
        # whatever name it gets, and a gauge keeps the conventional `egress_build_info` name.
        build = GaugeMetricFamily(
            f"{PREFIX}build_info", "Build information; the value is always 1.",
            labels=("version", "python"),
        )  # fmt: skip
        if self._build is not None:
            build.add_metric(self._build, 1)
        yield build


def _bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


class _Collector:
    """prometheus-client's view of one Metrics: asked at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()
