"""What the planes report, as values: one `DecisionEvent` per decision and one `CloseEvent` per
connection close, each with its audit line (`line`, described on docs/observability.md). And the
sinks the planes report to, as protocols: the operations layer (proxy/ops/) implements them, so
the planes never import it.

Hosts, SNI, paths and methods come from clients. Each string is capped, and `truncated` names
the fields that were cut to their cap.

`"ech": true` follows `sni` on the decision and close lines of a tunnel whose ClientHello carried
ECH or draft ESNI (the SNI may not be the name served); like `truncated`, it is left out
otherwise, so the lines of the common case stay as they were. So is `"credential": "NAME"`,
after `message`, on the allow line of a request an operator credential was put into.

What a plane knows of a decision beyond the policy's answer (the request's method and path, the
SNI, how the host was known, ...) travels to the line as one typed value, `Details`.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING

from policy.decisions import Decision
from policy.dimensions import Plane, Protocol, Stage, Verdict
from proxy.common.bounded import Bounded
from proxy.common.refusals import authority

if TYPE_CHECKING:
    from policy.decisions import AddressDecision

MAX_FIELD = 512
MAX_PATH = 2048
MAX_METHOD = 32
# An answer carries at most resolver.MAX_ADDRESSES (64); the cap keeps a line bounded even if a
# caller passes something larger.
MAX_ADDRESSES = 64
MAX_ADDRESS = 64  # longest IPv6 text with a zone id fits easily
# The bound of each table of what recurs on line after line (encoded texts, clients).
_ENCODED_ENTRIES = 4096

Client = str | tuple[str, int] | tuple[str, int, int, int] | None


def timestamp(seconds: float) -> str:
    """RFC 3339, UTC, to the nearest millisecond, with a `Z` (what most log tooling parses).
    Public because the denial feed (proxy/ops/denials.py) must show the audit line's time."""
    whole, milli = divmod(round(seconds * 1000), 1000)
    second = _LAST_SECOND
    if second[0] != whole:
        # Formatted once per second, not once per line: a busy proxy writes thousands a second.
        second = (whole, datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
        globals()["_LAST_SECOND"] = second
    return f"{second[1]}.{milli:03d}Z"


_LAST_SECOND: tuple[int, str] = (-1, "")


def _client(client: Client) -> str | None:
    """`ip:port`, with IPv6 addresses in brackets so the port stays unambiguous."""
    if client is None or isinstance(client, str):
        return client
    return authority(str(client[0]), int(client[1]))


class _Fields:
    """Writes the JSON values of one audit line, capping what is too long and remembering which
    fields were cut (`truncated`). Written value by value rather than through a dict and
    json.dumps (a few microseconds instead of tens, on every connection's path), with the same
    escaping json.dumps(ensure_ascii=True) does."""

    __slots__ = ("truncated",)

    def __init__(self) -> None:
        self.truncated: list[str] | None = None

    def text(self, value: object, key: str, cap: int = MAX_FIELD) -> str:
        if value is None:
            return "null"
        if type(value) is str and len(value) <= cap:
            return _encoded(value)
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("utf-8", "backslashreplace")
        elif isinstance(value, str):
            # A Reason (a StrEnum) or another str subclass: written as its bare value, and
            # remembered under it, so the next line finds the member's encoding in _ENCODED.
            value = str.__str__(value)
            if len(value) <= cap:
                return _encoded(value)
        else:
            value = str(value)
        if len(value) > cap:
            value = value[:cap]
            self.cut(key)
        return encode_basestring_ascii(value)

    def once(self, value: object, key: str) -> str:
        """A value of one connection only (its id, its client): encoded, never remembered, so a
        burst of connections does not fill the table of values that recur (measured: it held
        the idle proxy's memory a megabyte above its start after a burst of tunnels)."""
        if type(value) is str and len(value) <= MAX_FIELD:
            return encode_basestring_ascii(value)
        return self.text(value, key)

    def integer(self, value: object, key: str) -> str:
        # A port or byte count that is not an int is a caller bug or client junk: kept visible,
        # as capped text, rather than dropped or failing the line.
        if value is None:
            return "null"
        if type(value) is int:
            return str(value)
        return self.text(value, key)

    def addresses(self, values: Iterable[object] | None, key: str) -> str:
        if values is None:
            return "null"
        if type(values) is tuple and len(values) <= 4:
            # The common answer, a few addresses seen before: their encodings are remembered.
            known = [_ENCODED.get(value) for value in values]
            if None not in known:
                return "[" + ",".join(known) + "]"  # type: ignore[arg-type]
        items: list[str] = []
        for count, value in enumerate(values):
            if count >= MAX_ADDRESSES:
                self.cut(key)
                break
            text = str(value)
            if len(text) > MAX_ADDRESS:
                text = text[:MAX_ADDRESS]
                self.cut(key)
            items.append(_encoded(text, MAX_ADDRESS))
        return "[" + ",".join(items) + "]"

    def cut(self, key: str) -> None:
        if self.truncated is None:
            self.truncated = [key]
        elif key not in self.truncated:
            self.truncated.append(key)

    def end(self) -> str:
        """What closes the line: the `truncated` list when something was cut."""
        if self.truncated is None:
            return "}"
        return ',"truncated":[' + ",".join(f'"{key}"' for key in self.truncated) + "]}"


def _encoded(value: str, remember: int = MAX_METHOD) -> str:
    """`value` as a JSON string. The same few values (hosts, rules, reasons, planes) recur on
    line after line: short ones are remembered, in a bounded table (its keys come from clients:
    proxy/common/bounded.py). Only values within every text field's cap (the smallest is a
    method's) are remembered by default, so a remembered value needs no cap check; addresses,
    written only where their own cap holds, up to theirs."""
    encoded = _ENCODED.get(value)
    if encoded is None:
        encoded = encode_basestring_ascii(value)
        if type(value) is str and len(value) <= remember:
            _ENCODED.put(value, encoded)
    return encoded


_ENCODED: Bounded[object, str] = Bounded(_ENCODED_ENTRIES)


def _seconds(value: object) -> str:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "null"
    if not math.isfinite(seconds):
        return "null"
    return repr(round(max(seconds, 0.0), 3))


def _head(kind: str, event: DecisionEvent | CloseEvent, f: _Fields, session: str | None,
          now: float) -> str:  # fmt: skip
    """The fields every audit line starts with, in the same order for both kinds. Each text is
    `"null"`, a remembered short encoding, or `_Fields.text`: the first two without a call."""
    E = _ENCODED
    client = _client(event.client)
    return (
        f'{{"time":"{timestamp(now)}","event":"{kind}"'
        f',"session":{"null" if (v := session) is None else E.get(v) or f.text(v, "session")}'
        f',"connection":{"null" if (v := event.connection) is None else f.once(v, "connection")}'
        f',"client":{"null" if (v := client) is None else f.once(v, "client")}'
        f',"plane":{"null" if (v := event.plane) is None else E.get(v) or f.text(v, "plane")}'
        f',"protocol":{"null" if (v := event.protocol) is None else E.get(v) or f.text(v, "protocol")}'  # noqa: E501
        f',"host":{"null" if (v := event.host) is None else E.get(v) or f.text(v, "host")}'
        f',"port":{"null" if (n := event.port) is None else str(n) if type(n) is int else f.integer(n, "port")}'  # noqa: E501
        f',"sni":{"null" if (v := event.sni) is None else E.get(v) or f.text(v, "sni")}'
        f"{_ECH if event.ech else ''}"
    )


_ECH = ',"ech":true'
_CREDENTIAL = ',"credential":'

# How a connection's host was known: the TLS SNI, an HTTP Host (or request target), a CONNECT
# head, a SOCKS5 request's name, or the session's DNS answers for the address it went to.
ATTRIBUTIONS = ("sni", "host", "connect", "socks5", "dns")


def _attribution(event: DecisionEvent | CloseEvent, f: _Fields) -> str:
    """`"attribution"` and `"attributed"`, where known (left out otherwise, so the lines of
    the planes that never set them stay as they were)."""
    how = event.attribution
    if how is None:
        return ""
    text = f',"attribution":{_ENCODED.get(how) or f.text(how, "attribution")}'
    names = event.attributed
    if names is not None:
        shown = ",".join(f.text(name, "attributed") for name in names[:MAX_ADDRESSES])
        text += f',"attributed":[{shown}]'
    return text


@dataclass(frozen=True, slots=True)
class Details:
    """What a plane knows of a decision beyond the policy's answer, for its line: the request
    decided (its HTTP method, or a DNS query's type, and its path), the ClientHello's server
    name and whether it carried ECH, the operator credentials put into the request, how the
    host was known, and the rule and ceiling entry the line names where no decision handed
    along names them (the DNS responder's, the vetting's before any address was checked).

    Built once by the caller and shared by every line of its decision (`NO_DETAILS` when there
    is nothing to add): frozen, so one value can serve many lines; `dataclasses.replace` only
    where a step adds to it."""

    method: str | None = None
    path: str | None = None
    sni: str | None = None
    ech: bool = False  # the ClientHello carried ECH or ESNI: the SNI may not be the name served
    credential: str | None = None  # the operator credential(s) put into the request, by name
    attribution: str | None = None  # how the host was known (ATTRIBUTIONS)
    attributed: tuple[str, ...] | None = None  # every name DNS answered its address for
    rule: str | None = None  # None: the rule of the decision the line is for, if any
    ceiling: str | None = None  # likewise, the ceiling entry


NO_DETAILS = Details()


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """One decision, at any stage (name, address, sni, host header, ...), on either plane."""

    decision: Verdict
    reason: str
    host: str | None = None  # as requested by the client (before normalisation)
    port: int | None = None
    stage: Stage | None = None
    plane: Plane | None = None
    protocol: Protocol | None = None
    client: Client = None
    connection: str | None = None  # correlates the decision lines of a connection and its close
    sni: str | None = None
    ech: bool = False  # the ClientHello carried ECH or ESNI: the SNI may not be the name served
    method: str | None = None
    path: str | None = None
    rule: str | None = None  # as written in the manifest, e.g. "network.egress[2]"
    ceiling: str | None = None
    resolved: tuple[str, ...] | None = None
    pinned: tuple[str, ...] | None = None
    message: str | None = None
    # The operator credential(s) put into this request (their names, never a value): on the
    # allow line of the request only, and left out otherwise.
    credential: str | None = None
    # How the host was known (`sni`, `host`, `connect`, `socks5`, `dns`: ATTRIBUTIONS), and
    # every name its address was answered for when DNS named several; left out when unknown.
    attribution: str | None = None
    attributed: tuple[str, ...] | None = None

    @classmethod
    def from_policy(
        cls,
        result: Decision | AddressDecision,
        *,
        plane: Plane | None = None,
        protocol: Protocol | None = None,
        client: Client = None,
        connection: str | None = None,
        details: Details = NO_DETAILS,
        named: Decision | None = None,
        port: int | None = None,
    ) -> DecisionEvent:
        """A policy-core answer plus what the plane knows of it (`details`). For a name-stage
        decision, its host, port, rule and ceiling. For an address decision, `resolved` is
        every checked address and `pinned` the ones the proxy may connect to, on `port`; its
        rule and ceiling are those of `named`, the name-stage decision it checked an answer
        for (even where that has none: the line is the name's, refused at its addresses)."""
        if isinstance(result, Decision):
            resolved = pinned = None
            rule, ceiling = result.rule, result.ceiling
            if port is None:
                port = result.port
        else:
            resolved = tuple(v.address for v in result.verdicts)
            pinned = result.pinned
            rule, ceiling = (
                (named.rule, named.ceiling) if named is not None else (result.rule, None)
            )
        return cls.of(
            Verdict.ALLOW if result.allowed else Verdict.DENY,
            result.reason,
            details,
            stage=result.stage,
            plane=plane,
            protocol=protocol,
            client=client,
            connection=connection,
            host=result.host,
            port=port,
            rule=rule,
            ceiling=ceiling,
            resolved=resolved,
            pinned=pinned,
            message=result.message,
        )

    @classmethod
    def of(
        cls,
        verdict: Verdict,
        reason: str,
        details: Details,
        *,
        stage: Stage | None,
        plane: Plane | None,
        protocol: Protocol | None,
        client: Client,
        connection: str | None,
        host: str | None = None,
        port: int | None = None,
        rule: str | None = None,
        ceiling: str | None = None,
        resolved: tuple[str, ...] | None = None,
        pinned: tuple[str, ...] | None = None,
        message: str | None = None,
    ) -> DecisionEvent:
        """A decision's line: what the deciding step found, and what the plane knows of it
        (`details`, whose rule and ceiling, where set, are the line's)."""
        return cls(
            verdict,
            reason,
            host=host,
            port=port,
            stage=stage,
            plane=plane,
            protocol=protocol,
            client=client,
            connection=connection,
            sni=details.sni,
            ech=details.ech,
            method=details.method,
            path=details.path,
            rule=details.rule if details.rule is not None else rule,
            ceiling=details.ceiling if details.ceiling is not None else ceiling,
            resolved=resolved,
            pinned=pinned,
            message=message,
            credential=details.credential,
            attribution=details.attribution,
            attributed=details.attributed,
        )

    def line(self, *, session: str | None, now: float) -> str:
        """The audit line (JSON, no newline)."""
        f = _Fields()
        E = _ENCODED
        return (
            f"{_head('decision', self, f, session, now)}"
            f',"method":{"null" if (v := self.method) is None else f.text(v, "method", MAX_METHOD)}'
            f',"path":{"null" if (v := self.path) is None else f.text(v, "path", MAX_PATH)}'
            f',"decision":{E.get(self.decision) or f.text(self.decision, "decision")}'
            f',"reason":{E.get(self.reason) or f.text(self.reason, "reason")}'
            f',"stage":{"null" if (v := self.stage) is None else E.get(v) or f.text(v, "stage")}'
            f',"rule":{"null" if (v := self.rule) is None else E.get(v) or f.text(v, "rule")}'
            f',"ceiling":{"null" if (v := self.ceiling) is None else E.get(v) or f.text(v, "ceiling")}'  # noqa: E501
            f',"resolved":{f.addresses(self.resolved, "resolved")}'
            f',"pinned":{f.addresses(self.pinned, "pinned")}'
            f',"message":{"null" if (v := self.message) is None else f.text(v, "message")}'
            f"{'' if (v := self.credential) is None else _CREDENTIAL + f.text(v, 'credential')}"
            f"{_attribution(self, f)}"
            f"{f.end()}"
        )


@dataclass(frozen=True, slots=True)
class CloseEvent:
    """The end of one client connection, with what it moved and how long it lived."""

    host: str | None = None
    port: int | None = None
    plane: Plane | None = None
    protocol: Protocol | None = None
    client: Client = None
    connection: str | None = None
    sni: str | None = None
    ech: bool = False  # the ClientHello carried ECH or ESNI
    upstream: str | None = None  # the pinned address actually connected to, if any
    bytes_up: int = 0  # client to upstream
    bytes_down: int = 0  # upstream to client
    duration: float | None = None  # seconds
    reason: str | None = None  # why it ended, e.g. "client_closed", "policy_reload", "idle_timeout"
    pinned: tuple[str, ...] | None = None
    attribution: str | None = None  # as on the decision lines
    attributed: tuple[str, ...] | None = None

    def line(self, *, session: str | None, now: float) -> str:
        """The audit line (JSON, no newline)."""
        f = _Fields()
        E = _ENCODED
        up, down = self.bytes_up, self.bytes_down
        return (
            f"{_head('close', self, f, session, now)}"
            f',"upstream":{"null" if (v := self.upstream) is None else E.get(v) or f.text(v, "upstream", MAX_ADDRESS)}'  # noqa: E501
            f',"pinned":{f.addresses(self.pinned, "pinned")}'
            f',"bytes_up":{str(up) if type(up) is int else f.integer(up, "bytes_up")}'
            f',"bytes_down":{str(down) if type(down) is int else f.integer(down, "bytes_down")}'
            f',"duration_seconds":{_seconds(self.duration)}'
            f',"reason":{"null" if (v := self.reason) is None else E.get(v) or f.text(v, "reason")}'
            f"{_attribution(self, f)}"
            f"{f.end()}"
        )


class AuditSink(typing.Protocol):
    """Where the planes' events go (proxy.ops.audit.AuditLog)."""

    def decision(self, event: DecisionEvent, /) -> None: ...

    def closed(self, event: CloseEvent, /) -> None: ...


class MetricsSink(typing.Protocol):
    """The counters the planes move (proxy.ops.metrics.Metrics). Never raises."""

    def decision(
        self, decision: Verdict | bool, reason: str, stage: Stage, plane: Plane = ...
    ) -> None: ...

    def record(self, decision: Decision | AddressDecision, plane: Plane = ...) -> None: ...

    def dns_lookup(self, seconds: float, outcome: str) -> None: ...

    def upstream_connect(self, seconds: float, outcome: str) -> None: ...

    def connection_opened(self, plane: Plane, protocol: Protocol) -> None: ...

    def connection_closed(
        self, plane: Plane, bytes_up: int, bytes_down: int, seconds: float
    ) -> None: ...

    def dns_query(self, qtype: str, rcode: str) -> None: ...

    def tls_ech(self, decision: Verdict, protocol: Protocol | None) -> None: ...

    def credential_injected(self, name: str) -> None: ...
