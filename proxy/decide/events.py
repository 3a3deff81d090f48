"""What the planes report, as values: one `DecisionEvent` per decision and one `CloseEvent` per
connection close, each with its audit-line form (`to_json`: the schema of DESIGN 5). And the two
sinks the planes report to, as protocols: the operations layer (proxy/ops/) implements them, so
the planes never import it.

Hosts, SNI, paths and methods come from clients. Each string is capped, and `truncated` names
the fields that were cut to their cap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from policy.decisions import AddressDecision, Decision

MAX_FIELD = 512
MAX_PATH = 2048
MAX_METHOD = 32
# An answer carries at most resolver.MAX_ADDRESSES (64); the cap keeps a line bounded even if a
# caller passes something larger.
MAX_ADDRESSES = 64
MAX_ADDRESS = 64  # longest IPv6 text with a zone id fits easily

Client = str | tuple[str, int] | tuple[str, int, int, int] | None


def _timestamp(seconds: float) -> str:
    """RFC 3339, UTC, millisecond precision, with a `Z` (what most log tooling parses)."""
    whole = math.floor(seconds)
    micro = round((seconds - whole) * 1_000_000)  # as datetime rounds
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    return f"{_second(whole)}.{micro // 1000:03d}Z"


@functools.lru_cache(maxsize=4)
def _second(whole: int) -> str:
    # Formatted once per second, not once per line: a busy proxy writes thousands a second.
    return datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _client(client: Client) -> str | None:
    """`ip:port`, with IPv6 addresses in brackets so the port stays unambiguous."""
    if client is None or isinstance(client, str):
        return client
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class _Record:
    """Collects fields, capping strings and remembering which ones were cut."""

    __slots__ = ("data", "truncated")

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.truncated: list[str] = []

    def text(self, key: str, value: object, cap: int = MAX_FIELD) -> None:
        if value is None or (type(value) is str and len(value) <= cap):
            self.data[key] = value  # the common case, a dozen times per line
            return
        if isinstance(value, bytes | bytearray):
            text = bytes(value).decode("utf-8", "backslashreplace")
        else:
            text = value if isinstance(value, str) else str(value)
        if len(text) > cap:
            text = text[:cap]
            self.truncated.append(key)
        self.data[key] = text

    def integer(self, key: str, value: object) -> None:
        # A port or byte count that is not an int is a caller bug or client junk: keep it
        # visible, as capped text, rather than dropping it or failing the line.
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            self.data[key] = value
        else:
            self.text(key, value, MAX_FIELD)

    def addresses(self, key: str, values: Iterable[object] | None) -> None:
        if values is None:
            self.data[key] = None
            return
        items: list[str] = []
        for count, value in enumerate(values):
            if count >= MAX_ADDRESSES:
                self.truncated.append(key)
                break
            text = str(value)
            if len(text) > MAX_ADDRESS:
                text = text[:MAX_ADDRESS]
                if key not in self.truncated:
                    self.truncated.append(key)
            items.append(text)
        self.data[key] = items

    def finish(self) -> dict[str, Any]:
        if self.truncated:
            self.data["truncated"] = self.truncated
        return self.data


def _seconds(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return round(max(float(value), 0.0), 3)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """One decision, at any stage (name, address, sni, host header, ...), on either plane."""

    decision: str  # "allow" or "deny"
    reason: str
    host: str | None = None  # as requested by the client (before normalisation)
    port: int | None = None
    stage: str | None = None
    plane: str | None = None  # "l4" or "l7"
    protocol: str | None = None  # "connect", "http", "socks5", ...
    client: Client = None
    connection: str | None = None  # correlates the decision lines of a connection and its close
    sni: str | None = None
    method: str | None = None
    path: str | None = None
    rule: str | None = None  # as written in the manifest, e.g. "network.egress[2]"
    ceiling: str | None = None
    resolved: tuple[str, ...] | None = None
    pinned: tuple[str, ...] | None = None
    message: str | None = None

    @classmethod
    def from_policy(cls, result: Decision | AddressDecision, **context: Any) -> DecisionEvent:
        """A policy-core answer plus the connection context (client, plane, sni, ...).
        For an address decision, `resolved` is every checked address and `pinned` the ones the
        proxy may connect to."""
        fields: dict[str, Any] = {
            "decision": "allow" if result.allowed else "deny",
            "reason": result.reason,
            "stage": result.stage,
            "rule": result.rule,
            "message": result.message,
            "host": result.host,
        }
        ceiling = getattr(result, "ceiling", None)
        if ceiling is not None:
            fields["ceiling"] = ceiling
        port = getattr(result, "port", None)
        if port is not None:
            fields["port"] = port
        verdicts = getattr(result, "verdicts", None)
        if verdicts is not None:
            fields["resolved"] = tuple(v.address for v in verdicts)
            fields["pinned"] = result.pinned  # type: ignore[union-attr]
        fields.update(context)
        return cls(**fields)

    def to_json(self, *, session: str | None, now: float) -> dict[str, Any]:
        record = _head("decision", self, session=session, now=now)
        record.text("method", self.method, MAX_METHOD)
        record.text("path", self.path, MAX_PATH)
        record.text("decision", self.decision)
        record.text("reason", self.reason)
        record.text("stage", self.stage)
        record.text("rule", self.rule)
        record.text("ceiling", self.ceiling)
        record.addresses("resolved", self.resolved)
        record.addresses("pinned", self.pinned)
        record.text("message", self.message)
        return record.finish()


def _head(
    event: str, source: DecisionEvent | CloseEvent, *, session: str | None, now: float
) -> _Record:
    """The fields every audit line starts with, in the same order for both kinds."""
    record = _Record()
    record.data["time"] = _timestamp(now)
    record.data["event"] = event
    record.text("session", session)
    record.text("connection", source.connection)
    record.text("client", _client(source.client))
    record.text("plane", source.plane)
    record.text("protocol", source.protocol)
    record.text("host", source.host)
    record.integer("port", source.port)
    record.text("sni", source.sni)
    return record


@dataclass(frozen=True, slots=True)
class CloseEvent:
    """The end of one client connection, with what it moved and how long it lived."""

    host: str | None = None
    port: int | None = None
    plane: str | None = None
    protocol: str | None = None
    client: Client = None
    connection: str | None = None
    sni: str | None = None
    upstream: str | None = None  # the pinned address actually connected to, if any
    bytes_up: int = 0  # client to upstream
    bytes_down: int = 0  # upstream to client
    duration: float | None = None  # seconds
    reason: str | None = None  # why it ended, e.g. "client_closed", "policy_reload", "idle_timeout"
    pinned: tuple[str, ...] | None = None

    def to_json(self, *, session: str | None, now: float) -> dict[str, Any]:
        record = _head("close", self, session=session, now=now)
        record.text("upstream", self.upstream, MAX_ADDRESS)
        record.addresses("pinned", self.pinned)
        record.integer("bytes_up", self.bytes_up)
        record.integer("bytes_down", self.bytes_down)
        record.data["duration_seconds"] = _seconds(self.duration)
        record.text("reason", self.reason)
        return record.finish()


class AuditSink(Protocol):
    """Where the planes' events go (proxy.ops.audit.AuditLog)."""

    def decision(self, event: DecisionEvent, /) -> None: ...

    def closed(self, event: CloseEvent, /) -> None: ...


class MetricsSink(Protocol):
    """The counters the planes move (proxy.ops.metrics.Metrics). Never raises."""

    def decision(self, decision: str | bool, reason: str, stage: str, plane: str = ...) -> None: ...

    def record(self, decision: Decision | AddressDecision, plane: str = ...) -> None: ...

    def dns_lookup(self, seconds: float, outcome: str) -> None: ...

    def upstream_connect(self, seconds: float, outcome: str) -> None: ...

    def connection_opened(self, plane: str, protocol: str = ...) -> None: ...

    def connection_closed(
        self, plane: str, bytes_up: int, bytes_down: int, seconds: float
    ) -> None: ...

    def dns_query(self, qtype: str, rcode: str) -> None: ...
