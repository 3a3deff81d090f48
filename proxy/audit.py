"""The audit log: JSON lines, one per decision and one per connection close (DESIGN 5).

Both planes (the L7 engine and the L4 fast path) write through `AuditLog`, so their lines have
one schema. Every key is present on every line of its kind (null when unknown), so consumers
need no per-plane cases; the only optional key is `truncated`, which names the fields that were
cut to their cap.

Hosts, SNI, paths and methods come from clients. Each string is capped, and lines are encoded
with `ensure_ascii=True`: newlines, U+2028, and terminal escape sequences all become `\\uXXXX`
escapes, so one record is always exactly one line, and `tail -f` on a terminal cannot be driven
by a client.

A write failure (disk full, closed pipe) never raises: an audit log that fails must not take the
proxy down with it. Failures are counted in `write_errors` (and `egress_audit_write_errors_total`
when a `Metrics` is given) and reported once on stderr.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from policy.decisions import AddressDecision, Decision
    from proxy.metrics import Metrics

MAX_FIELD = 512
MAX_PATH = 2048
MAX_METHOD = 32
# An answer carries at most resolver.MAX_ADDRESSES (64); the cap keeps a line bounded even if a
# caller passes something larger.
MAX_ADDRESSES = 64
MAX_ADDRESS = 64  # longest IPv6 text with a zone id fits easily

Client = str | tuple[str, int] | tuple[str, int, int, int] | None


# One encoder for every line (json.dumps builds a new one per call when given options).
_ENCODE = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), default=str).encode


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


class AuditLog:
    """Writes audit lines to a file path (appended, created 0600), a given text stream, or,
    by default, whatever `sys.stdout` is at write time."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        stream: TextIO | None = None,
        session: str | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if path is not None and stream is not None:
            raise ValueError("give an audit log path or a stream, not both")
        self.session = session
        self.metrics = metrics
        self.write_errors = 0
        self._clock = clock
        self._stream = stream
        self._fd: int | None = None
        self._closed = False
        self._reported = False
        # Set after a partial write: the next line then starts with a newline, so a torn line
        # stays a line of its own instead of corrupting the next record too.
        self._torn = False
        if path is not None:
            # Raw fd writes, one os.write per line: no userspace buffer keeps growing while the
            # disk is full, and with O_APPEND each line lands whole at the end even if another
            # process appends to the same file. Opening fails loudly: that is start-up, where a
            # misconfigured audit path must stop the proxy rather than run unaudited.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- events -------------------------------------------------------------------------------

    def decision(self, event: DecisionEvent | None = None, /, **fields: Any) -> None:
        """Log one decision: a `DecisionEvent`, or its fields as keyword arguments."""
        self.write(event if event is not None else DecisionEvent(**fields))

    def closed(self, event: CloseEvent | None = None, /, **fields: Any) -> None:
        """Log one connection close: a `CloseEvent`, or its fields as keyword arguments."""
        self.write(event if event is not None else CloseEvent(**fields))

    def write(self, event: DecisionEvent | CloseEvent) -> None:
        record = event.to_json(session=self.session, now=self._clock())
        line = _ENCODE(record) + "\n"
        self._emit(line)

    # -- output -------------------------------------------------------------------------------

    def _emit(self, line: str) -> None:
        if self._closed:
            self._failed(ValueError("audit log is closed"))
            return
        if self._torn:
            line = "\n" + line
        try:
            if self._fd is not None:
                data = line.encode("ascii")
                written = 0
                try:
                    while written < len(data):
                        written += os.write(self._fd, data[written:])
                finally:
                    # Nothing written leaves the previous state: a torn line still needs its
                    # newline, and a clean one still does not.
                    self._torn = written < len(data) and (written > 0 or self._torn)
            else:
                stream = self._stream if self._stream is not None else sys.stdout
                stream.write(line)
                stream.flush()
                self._torn = False
        # OSError: disk full, broken pipe. ValueError: a closed stream. RuntimeError: a
        # buffered stream re-entered (e.g. from a signal handler) refuses the nested write.
        except (OSError, ValueError, RuntimeError) as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.write_errors += 1
        if self.metrics is not None:
            self.metrics.audit_write_error()
        if self._reported:
            return
        # Set before writing to stderr, so a nested failure cannot report twice.
        self._reported = True
        with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
            print(
                f"egress-proxy: audit log write failed ({exc!r}); further failures are only "
                "counted (egress_audit_write_errors_total)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Closes a file the log opened; a stream it was given (or stdout) stays open."""
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
