"""The operator config (YAML; JSON or TOML by file suffix): DNS, address rules, platform
destinations, ports, inspection, limits. Scripts outside this repo write these keys: their names
are a contract.

Every problem is collected and reported together; a config that is half understood is never
applied.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from policy import AddressRules, OperatorRules, PlatformDestination, PolicyError
from policy.addresses import IPNetwork
from policy.documents import parse_document, require_mapping, syntax_for
from policy.findings import Finding, describe_type, quote, unknown_key_message
from policy.hostnames import check_entry, parse_ip_literal
from policy.urls import split_authority
from proxy.errors import ProxyError
from proxy.settings import (
    ALL,
    DEFAULT_CA_DIR,
    INSPECTION_MODES,
    PREFIXES,
    Config,
    Limits,
    Nameserver,
)

_DURATION = re.compile(r"(?:(\d{1,6})h)?(?:(\d{1,6})m)?(?:(\d{1,6})s)?")
# Far beyond any sane timeout, and small enough that no event loop or socket call overflows.
MAX_DURATION = 7 * 24 * 3600.0

_SCHEMA: dict[str, tuple[str, ...] | None] = {
    "dns": ("nameservers", "timeout"),
    "addresses": ("allow", "deny", "in_cluster"),
    "platform_destinations": None,
    "ports": None,
    "inspection": ("enabled", "ca_dir", "upstream_ca", "mode"),
    "limits": ("connect_timeout", "idle_timeout", "header_timeout", "max_connections"),
    "internal_suffixes": None,
}


def parse_duration(text: Any) -> float:
    """Compact Go-style durations as the manifests write them: `45s`, `10m`, `1h30m`."""
    if not isinstance(text, str) or not text or not (match := _DURATION.fullmatch(text)):
        raise ValueError(f"{quote(text)} is not a duration; write it like '2s', '10m' or '1h'")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{quote(text)} must be longer than zero")
    if total > MAX_DURATION:
        raise ValueError(f"{quote(text)} is longer than the limit of 168h (a week)")
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
            self.problem(
                key, value, "not_a_mapping", f"must be a mapping, found {describe_type(value)}"
            )
            return {}
        known = _SCHEMA[key] or ()
        for sub in value:
            if sub not in known:
                self.problem(
                    f"{key}.{sub}", sub, "unknown_key", unknown_key_message(sub, key, known)
                )
        return value

    def items(self, value: Any, path: str) -> list[tuple[str, Any]]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.problem(path, value, "not_a_list", f"must be a list, found {describe_type(value)}")
            return []
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]

    def convert[T](self, path: str, value: Any, parse: Callable[[Any], T], default: T) -> T:
        try:
            return parse(value)
        except (ValueError, PolicyError) as exc:
            # PolicyError's str() would repeat a path; the finding names its own.
            why = exc.message if isinstance(exc, PolicyError) else str(exc)
            self.problem(path, value, "invalid_value", why)
            return default


def _port(value: Any) -> int:
    if type(value) is not int or not 0 < value < 65536:
        raise ValueError(f"{quote(value)} is not a port number from 1 to 65535")
    return value


def _nameserver(value: Any) -> Nameserver:
    if not isinstance(value, str):
        raise ValueError(
            f"{quote(value)} is not a nameserver string like '10.0.0.2' or '10.0.0.2:53'"
        )
    host, port = split_authority(value)
    address = parse_ip_literal(host)
    # Brackets belong to IPv6 only: '[10.0.0.1]:53' is a typo, not a nameserver.
    if address is None or (value.startswith("[") and address.version != 6):
        raise ValueError(
            f"{quote(value)} is not a nameserver: write an IP address, optionally with :PORT "
            "('10.0.0.2', '10.0.0.2:5353', '[fd00::2]:53')"
        )
    return Nameserver(str(address), port or 53)


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
    """Parse an operator config (YAML, or JSON/TOML by file suffix); any problem raises
    ProxyError('invalid_config') listing them all."""
    try:
        document = require_mapping(
            parse_document(data, source, syntax_for(source)), source, "a config"
        )
    except PolicyError as exc:
        raise ProxyError(
            exc.reason, exc.message, source=exc.source, line=exc.line, column=exc.column
        ) from None
    r = _Reader(source)
    for key in document:
        if key not in _SCHEMA:
            r.problem(
                str(key), key, "unknown_key", unknown_key_message(key, "the config", tuple(_SCHEMA))
            )

    dns = r.section(document, "dns")
    nameservers = None
    if dns.get("nameservers") is not None:
        entries = r.items(dns["nameservers"], "dns.nameservers")
        nameservers = tuple(r.convert(p, v, _nameserver, Nameserver("0.0.0.0")) for p, v in entries)
        if not nameservers and isinstance(dns["nameservers"], list):
            r.problem(
                "dns.nameservers",
                [],
                "empty_list",
                "is empty; omit it to use the system's resolv.conf",
            )
    dns_timeout = r.convert("dns.timeout", dns.get("timeout", "5s"), parse_duration, 5.0)

    section = r.section(document, "addresses")
    cidrs = {
        key: _cidrs(r, section.get(key), f"addresses.{key}")
        for key in ("allow", "deny", "in_cluster")
    }
    address_rules = AddressRules(**cidrs)

    platform: list[PlatformDestination] = []
    for p, item in r.items(document.get("platform_destinations"), "platform_destinations"):
        dest = _platform_destination(r, p, item)
        if dest is None:
            continue
        # The policy keys platform routes by host: a second entry would silently replace the
        # first, so its ports and CIDRs would be other than what the operator reads here.
        first = next((d for d in platform if d.host == dest.host), None)
        if first is not None:
            r.problem(
                f"{p}.host",
                dest.host,
                "duplicate_host",
                f"{dest.host!r} is already a platform destination ({first.id}); "
                "list its ports and CIDRs in one entry",
            )
            continue
        platform.append(dest)

    ports = None
    if document.get("ports") is not None:
        entries = r.items(document["ports"], "ports")
        ports = frozenset(r.convert(p, v, _port, 0) for p, v in entries)
        if not entries and isinstance(document["ports"], list):
            # An empty allow-list would refuse every connection; far likelier a slip than intent.
            r.problem("ports", [], "empty_list", "is empty; omit it to allow any port")

    inspection = r.section(document, "inspection")
    enabled = r.convert("inspection.enabled", inspection.get("enabled", True), _bool, True)
    ca_dir = r.convert(
        "inspection.ca_dir", inspection.get("ca_dir", DEFAULT_CA_DIR), _text, DEFAULT_CA_DIR
    )
    upstream_ca = None
    if inspection.get("upstream_ca") is not None:
        upstream_ca = r.convert("inspection.upstream_ca", inspection["upstream_ca"], _text, None)
    inspection_mode = _inspection_mode(r, inspection, enabled)

    lim = r.section(document, "limits")
    defaults = Limits()

    def duration(key: str, default: float) -> float:
        return r.convert(f"limits.{key}", lim.get(key, f"{int(default)}s"), parse_duration, default)

    limits = Limits(
        connect_timeout=duration("connect_timeout", defaults.connect_timeout),
        idle_timeout=duration("idle_timeout", defaults.idle_timeout),
        header_timeout=duration("header_timeout", defaults.header_timeout),
        max_connections=r.convert(
            "limits.max_connections",
            lim.get("max_connections", defaults.max_connections),
            _positive_int,
            defaults.max_connections,
        ),
    )

    suffixes = []
    for p, v in r.items(document.get("internal_suffixes"), "internal_suffixes"):
        # allow_internal: a suffix may be a single label ('corp') or lie under a built-in one.
        problem = check_entry(v, allow_internal=True) if isinstance(v, str) else None
        if not isinstance(v, str):
            r.problem(
                p, v, "invalid_suffix", f"must be a domain name string, found {describe_type(v)}"
            )
        elif problem is not None:
            r.problem(p, v, "invalid_suffix", problem.message)
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
    return Config(
        operator,
        nameservers,
        dns_timeout,
        ca_dir,
        upstream_ca,
        limits,
        source,
        inspection_mode=inspection_mode,
    )


def _inspection_mode(r: _Reader, inspection: dict[str, Any], enabled: bool) -> str:
    """`inspection.mode`: `prefixes` (the default: only hosts whose rules decide paths are
    intercepted) or `all` (every allowed TLS connection), which needs inspection enabled."""
    value = inspection.get("mode", PREFIXES)
    if value not in INSPECTION_MODES:
        r.problem(
            "inspection.mode",
            value,
            "invalid_value",
            f"{quote(value)} is not an inspection mode; write one of "
            + ", ".join(repr(mode) for mode in INSPECTION_MODES),
        )
        return PREFIXES
    if value == ALL and not enabled:
        r.problem(
            "inspection.mode",
            value,
            "invalid_value",
            "'all' intercepts every TLS connection, which needs inspection.enabled: true",
        )
    return str(value)


def _cidrs(r: _Reader, value: Any, path: str) -> tuple[IPNetwork, ...]:
    """Each CIDR parsed on its own, so every bad one is reported at its own index."""
    networks: list[IPNetwork] = []
    for p, item in r.items(value, path):
        try:
            networks.extend(AddressRules.from_strings(allow=[item]).allow)
        except PolicyError as exc:
            r.problem(p, item, exc.reason, exc.message)
    return tuple(networks)


def _platform_destination(r: _Reader, path: str, item: Any) -> PlatformDestination | None:
    if not isinstance(item, dict):
        r.problem(
            path,
            item,
            "not_a_mapping",
            f"must be a mapping with host, ports and optionally cidrs, found {describe_type(item)}",
        )
        return None
    known = ("host", "ports", "cidrs")
    for key in item:
        if key not in known:
            r.problem(f"{path}.{key}", key, "unknown_key", unknown_key_message(key, path, known))
    host = item.get("host")
    # allow_internal: platform routes are exactly the in-cluster names manifests may not declare.
    problem = check_entry(host, allow_internal=True) if isinstance(host, str) else None
    if not isinstance(host, str):
        r.problem(
            f"{path}.host",
            host,
            "invalid_host",
            f"is required and must be a hostname string, found {describe_type(host)}",
        )
    elif problem is not None:
        r.problem(f"{path}.host", host, "invalid_host", problem.message)
    raw_ports = item.get("ports")
    entries = r.items(raw_ports, f"{path}.ports")
    ports = frozenset(r.convert(p, v, _port, 0) for p, v in entries)
    if not entries and (raw_ports is None or isinstance(raw_ports, list)):
        r.problem(f"{path}.ports", raw_ports, "missing_key", "must list at least one port")
    cidrs = _cidrs(r, item.get("cidrs"), f"{path}.cidrs")
    if not isinstance(host, str) or problem is not None:
        return None
    return PlatformDestination(path, host, ports, cidrs)
