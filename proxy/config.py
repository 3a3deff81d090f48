"""The operator config (YAML): DNS, address rules, platform destinations, ports, inspection,
limits. Scripts outside this repo write these keys: their names are a contract.

Every problem is collected and reported together; a config that is half understood is never
applied.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policy import AddressRules, OperatorRules, PlatformDestination, PolicyError
from policy.documents import parse_document, require_mapping
from policy.findings import Finding, quote
from policy.hostnames import check_entry, parse_ip_literal
from policy.urls import split_authority
from proxy.errors import ProxyError

_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
DEFAULT_CA_DIR = "~/.local/share/egress-proxy/ca"

_SCHEMA: dict[str, tuple[str, ...] | None] = {
    "dns": ("nameservers", "timeout"),
    "addresses": ("allow", "deny", "in_cluster"),
    "platform_destinations": None,
    "ports": None,
    "inspection": ("enabled", "ca_dir"),
    "limits": ("connect_timeout", "idle_timeout", "header_timeout", "max_connections"),
    "internal_suffixes": None,
}


@dataclass(frozen=True, slots=True)
class Nameserver:
    address: str
    port: int = 53


@dataclass(frozen=True, slots=True)
class Limits:
    connect_timeout: float = 10.0
    idle_timeout: float = 600.0
    header_timeout: float = 10.0
    max_connections: int = 1024


@dataclass(frozen=True, slots=True)
class Config:
    operator: OperatorRules = field(default_factory=OperatorRules)
    nameservers: tuple[Nameserver, ...] | None = None  # None: the system's resolv.conf
    dns_timeout: float = 5.0
    ca_dir: str = DEFAULT_CA_DIR
    limits: Limits = field(default_factory=Limits)
    source: str | None = None


def parse_duration(text: Any) -> float:
    """Compact Go-style durations as the manifests write them: `45s`, `10m`, `1h30m`."""
    if not isinstance(text, str) or not text or not (match := _DURATION.fullmatch(text)):
        raise ValueError(f"{quote(text)} is not a duration; write it like '2s', '10m' or '1h'")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{quote(text)} must be longer than zero")
    return float(total)


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[Finding] = []

    def problem(self, path: str, value: Any, reason: str, message: str) -> None:
        self.problems.append(Finding(path, value, reason, message, "error", self.source))

    def section(self, document: dict[str, Any], key: str) -> dict[str, Any]:
        value = document.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problem(key, value, "not_a_mapping", f"{key} must be a mapping")
            return {}
        known = _SCHEMA[key] or ()
        for sub in value:
            if sub not in known:
                self.problem(
                    f"{key}.{sub}",
                    sub,
                    "unknown_key",
                    f"unknown key {key}.{sub}; known: {', '.join(known)}",
                )
        return value

    def items(self, value: Any, path: str) -> list[tuple[str, Any]]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.problem(path, value, "not_a_list", f"{path} must be a list")
            return []
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]

    def convert[T](self, path: str, value: Any, parse: Callable[[Any], T], default: T) -> T:
        try:
            return parse(value)
        except (ValueError, PolicyError) as exc:
            self.problem(path, value, "invalid_value", f"{path}: {exc}")
            return default


def _port(value: Any) -> int:
    if type(value) is not int or not 0 < value < 65536:
        raise ValueError(f"{quote(value)} is not a port number from 1 to 65535")
    return value


def _nameserver(value: Any) -> Nameserver:
    if not isinstance(value, str):
        raise ValueError(f"{quote(value)} is not 'IP' or 'IP:PORT'")
    host, port = split_authority(value)
    if parse_ip_literal(host) is None:
        raise ValueError(f"{quote(value)}: a nameserver is an IP address, optionally with :PORT")
    return Nameserver(str(parse_ip_literal(host)), port or 53)


def _positive_int(value: Any) -> int:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{quote(value)} is not a positive whole number")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{quote(value)} is not true or false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{quote(value)} is not a non-empty string")
    return value


def load_config(data: bytes | str, *, source: str = "<config>") -> Config:
    """Parse an operator config; any problem raises ProxyError('invalid_config') listing all."""
    try:
        document = require_mapping(
            parse_document(data, source, "yaml" if not source.endswith(".json") else "json"),
            source,
            "a config",
        )
    except PolicyError as exc:
        raise ProxyError(
            exc.reason, exc.message, source=exc.source, line=exc.line, column=exc.column
        ) from None
    r = _Reader(source)
    for key in document:
        if key not in _SCHEMA:
            r.problem(
                str(key),
                key,
                "unknown_key",
                f"unknown key {quote(key)}; known: {', '.join(_SCHEMA)}",
            )

    dns = r.section(document, "dns")
    nameservers = None
    if dns.get("nameservers") is not None:
        nameservers = tuple(
            r.convert(p, v, _nameserver, Nameserver("0.0.0.0"))
            for p, v in r.items(dns["nameservers"], "dns.nameservers")
        )
        if not nameservers:
            r.problem(
                "dns.nameservers",
                [],
                "empty_list",
                "dns.nameservers is empty; omit it to use the system's resolv.conf",
            )
    dns_timeout = r.convert("dns.timeout", dns.get("timeout", "5s"), parse_duration, 5.0)

    section = r.section(document, "addresses")
    address_rules = AddressRules()
    cidr_lists = {}
    for key in ("allow", "deny", "in_cluster"):
        entries = r.items(section.get(key), f"addresses.{key}")
        for p, v in entries:
            if not isinstance(v, str):
                r.problem(p, v, "not_a_string", f"{p} must be a CIDR string")
        cidr_lists[key] = [v for _, v in entries if isinstance(v, str)]
    try:
        address_rules = AddressRules.from_strings(**cidr_lists)
    except PolicyError as exc:
        r.problem(exc.path or "addresses", None, exc.reason, exc.message)

    platform = []
    for p, item in r.items(document.get("platform_destinations"), "platform_destinations"):
        dest = _platform_destination(r, p, item)
        if dest is not None:
            platform.append(dest)

    ports = None
    if document.get("ports") is not None:
        ports = frozenset(r.convert(p, v, _port, 0) for p, v in r.items(document["ports"], "ports"))

    inspection = r.section(document, "inspection")
    enabled = r.convert("inspection.enabled", inspection.get("enabled", True), _bool, True)
    ca_dir = r.convert(
        "inspection.ca_dir", inspection.get("ca_dir", DEFAULT_CA_DIR), _text, DEFAULT_CA_DIR
    )

    lim = r.section(document, "limits")
    defaults = Limits()
    limits = Limits(
        connect_timeout=r.convert(
            "limits.connect_timeout",
            lim.get("connect_timeout", "10s"),
            parse_duration,
            defaults.connect_timeout,
        ),
        idle_timeout=r.convert(
            "limits.idle_timeout",
            lim.get("idle_timeout", "10m"),
            parse_duration,
            defaults.idle_timeout,
        ),
        header_timeout=r.convert(
            "limits.header_timeout",
            lim.get("header_timeout", "10s"),
            parse_duration,
            defaults.header_timeout,
        ),
        max_connections=r.convert(
            "limits.max_connections",
            lim.get("max_connections", 1024),
            _positive_int,
            defaults.max_connections,
        ),
    )

    suffixes = []
    for p, v in r.items(document.get("internal_suffixes"), "internal_suffixes"):
        problem = check_entry(v, allow_internal=True) if isinstance(v, str) else None
        if not isinstance(v, str) or (problem is not None and problem.reason != "single_label"):
            why = problem.message if problem else "must be a string"
            r.problem(p, v, "invalid_suffix", f"{p}: {why}")
        else:
            suffixes.append(v)

    if r.problems:
        listed = "; ".join(f"{f.path}: {f.message}" for f in r.problems[:5])
        more = f" (and {len(r.problems) - 5} more)" if len(r.problems) > 5 else ""
        raise ProxyError(
            "invalid_config",
            f"invalid config: {listed}{more}",
            source=source,
            details=tuple(r.problems),
        )
    operator = OperatorRules(
        addresses=address_rules,
        platform_destinations=tuple(platform),
        ports=ports,
        inspection_enabled=enabled,
        internal_suffixes=tuple(suffixes),
    )
    return Config(operator, nameservers, dns_timeout, ca_dir, limits, source)


def _platform_destination(r: _Reader, path: str, item: Any) -> PlatformDestination | None:
    if not isinstance(item, dict):
        r.problem(path, item, "not_a_mapping", f"{path} must be a mapping with host, ports, cidrs")
        return None
    for key in item:
        if key not in ("host", "ports", "cidrs"):
            r.problem(
                f"{path}.{key}",
                key,
                "unknown_key",
                f"unknown key {path}.{key}; known: host, ports, cidrs",
            )
    host = item.get("host")
    problem = check_entry(host, allow_internal=True) if isinstance(host, str) else None
    if not isinstance(host, str) or problem is not None:
        why = problem.message if problem else "is required and must be a hostname"
        r.problem(f"{path}.host", host, "invalid_host", f"{path}.host: {why}")
        return None
    ports = frozenset(
        r.convert(p, v, _port, 0) for p, v in r.items(item.get("ports"), f"{path}.ports")
    )
    if not ports:
        r.problem(
            f"{path}.ports",
            item.get("ports"),
            "missing_key",
            f"{path}.ports must list at least one port",
        )
    cidrs: tuple = ()
    raw_cidrs = [v for _, v in r.items(item.get("cidrs"), f"{path}.cidrs")]
    try:
        cidrs = AddressRules.from_strings(allow=raw_cidrs, path_prefix=path).allow
    except PolicyError as exc:
        r.problem(f"{path}.cidrs", None, exc.reason, exc.message)
    return PlatformDestination(path, host, ports, cidrs)
