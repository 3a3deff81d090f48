"""What to probe: the probes of one run as values, and their JSON form as `python -m
proxy.probes --spec` takes it (from a manifest or the sandbox), checked before anything runs."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, NoReturn

import dns.exception
import dns.name

from proxy.boundary.probes.result import EXPECTS, Expect
from proxy.common.errors import ProxyError
from proxy.common.listeners import is_port
from proxy.common.refusals import shown

INVALID_SPEC = "invalid_probe_spec"


# What a TCP probe says once connected: an HTTP request (the proxy must answer it with its
# refusal header), or an SSH identification string (a stream that names no host: the proxy
# must refuse it in SSH's terms, as it refuses an address the session never resolved).
SPEAKS = ("http", "ssh")


@dataclass(frozen=True, slots=True)
class TcpProbe:
    name: str
    address: str
    port: int
    speak: str = "http"  # one of SPEAKS


@dataclass(frozen=True, slots=True)
class UdpProbe:
    name: str
    address: str
    port: int
    expect: Expect = "local_refusal"


@dataclass(frozen=True, slots=True)
class IcmpProbe:
    name: str
    address: str
    expect: Expect = "local_refusal"


@dataclass(frozen=True, slots=True)
class DnsProbe:
    name: str
    server: str
    port: int
    qname: str


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """The probes to run, in this order: TCP, UDP, ICMP, DNS. `timeout` (seconds) overrides
    each probe's default when given."""

    tcp: tuple[TcpProbe, ...] = ()
    udp: tuple[UdpProbe, ...] = ()
    icmp: tuple[IcmpProbe, ...] = ()
    dns: tuple[DnsProbe, ...] = ()
    timeout: float | None = field(default=None)

    def count(self) -> int:
        return len(self.tcp) + len(self.udp) + len(self.icmp) + len(self.dns)


_FIELDS: dict[str, tuple[type, dict[str, str]]] = {
    "tcp": (TcpProbe, {"name": "name", "address": "address", "port": "port", "speak": "speak"}),
    "udp": (UdpProbe, {"name": "name", "address": "address", "port": "port", "expect": "expect"}),
    "icmp": (IcmpProbe, {"name": "name", "address": "address", "expect": "expect"}),
    "dns": (DnsProbe, {"name": "name", "server": "address", "port": "port", "qname": "qname"}),
}
_REQUIRED = {"tcp": 3, "udp": 3, "icmp": 2, "dns": 4}


def _bad(where: str, message: str) -> NoReturn:
    raise ProxyError(INVALID_SPEC, f"probe spec{' ' + where if where else ''}: {message}")


def _checked(where: str, kind: str, value: Any) -> Any:
    if kind == "name":
        if not isinstance(value, str) or not value or len(value) > 64 or not value.isprintable():
            _bad(where, "must be a non-empty printable string of at most 64 characters")
        return value
    if kind == "address":
        if not isinstance(value, str):
            _bad(where, "must be an IP address (a string)")
        try:
            # Only literals: a name here would go to the OS resolver, which could send it anywhere.
            return str(ipaddress.ip_address(value))
        except ValueError:
            _bad(where, f"{shown(value)!r} is not an IP address")
    if kind == "port":
        if not is_port(value):
            _bad(where, "must be a port number 1-65535")
        return value
    if kind == "speak":
        if value not in SPEAKS:
            _bad(where, f"must be one of {', '.join(SPEAKS)}")
        return value
    if kind == "expect":
        if value not in EXPECTS:
            _bad(where, f"must be one of {', '.join(EXPECTS)}")
        return value
    if kind == "qname":
        if not isinstance(value, str) or not value or len(value) > 253:
            _bad(where, "must be a DNS name")
        try:
            dns.name.from_text(value)
        except dns.exception.DNSException as exc:
            _bad(where, f"{shown(value)!r} is not a DNS name: {exc}")
        return value
    raise AssertionError(kind)


def parse_spec(value: Any) -> ProbeSpec:
    """A ProbeSpec from its JSON form:
    `{"tcp": [{"name", "address", "port", "speak"}], "udp": [{"name", "address", "port", "expect"}],
    "icmp": [{"name", "address", "expect"}], "dns": [{"name", "server", "port", "qname"}],
    "timeout": SECONDS}`. Raises ProxyError('invalid_probe_spec'); an empty spec is an error
    (it would pass without testing anything)."""
    if not isinstance(value, dict):
        _bad("", "must be a JSON object")
    unknown = sorted(set(value) - {*_FIELDS, "timeout"})
    if unknown:
        _bad("", f"unknown key {shown(unknown[0])!r} (expected tcp, udp, icmp, dns, timeout)")
    parsed: dict[str, Any] = {}
    names: set[str] = set()
    for key, (cls, kinds) in _FIELDS.items():
        items = value.get(key, [])
        if not isinstance(items, list):
            _bad(key, "must be a list")
        probes = []
        for index, item in enumerate(items):
            where = f"{key}[{index}]"
            if not isinstance(item, dict):
                _bad(where, "must be an object")
            extra = sorted(set(item) - set(kinds))
            if extra:
                _bad(where, f"unknown key {shown(extra[0])!r} (expected {', '.join(kinds)})")
            required = list(kinds)[: _REQUIRED[key]]
            missing = [k for k in required if k not in item]
            if missing:
                _bad(where, f"missing {', '.join(missing)}")
            fields = {k: _checked(f"{where}.{k}", kinds[k], item[k]) for k in item}
            if fields["name"] in names:
                _bad(f"{where}.name", f"{fields['name']!r} is used twice")
            names.add(fields["name"])
            probes.append(cls(**fields))
        parsed[key] = tuple(probes)
    timeout = value.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60
    ):
        _bad("timeout", "must be a number of seconds, more than 0 and at most 60")
    spec = ProbeSpec(**parsed, timeout=None if timeout is None else float(timeout))
    if spec.count() == 0:
        _bad("", "lists no probes (a check of nothing would always pass)")
    return spec
