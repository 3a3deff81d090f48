"""The operator config (YAML; JSON or TOML by file suffix): DNS, address rules, platform
destinations, ports, inspection, TLS, limits. Scripts outside this repo write these keys: their
names are a contract.

Every problem is collected and reported together; a config that is half understood is never
applied. Each section is read by one function below, with the readers of
proxy/app/config_reader.py (a bounded number, a duration, a flag, a port, a CIDR list): a new
section is one function, its keys in SECTIONS and one line in `load_config`.
"""

from __future__ import annotations

from typing import Any

from policy import AddressRules, OperatorRules, PlatformDestination, PolicyError
from policy.documents import parse_document, require_mapping, syntax_for
from policy.findings import describe_type, quote
from policy.hostnames import check_entry, parse_ip_literal
from policy.urls import split_authority
from proxy.app.config_reader import ConfigReader, Section, parse_duration
from proxy.app.credentials_config import read_credentials
from proxy.common.errors import ProxyError
from proxy.common.settings import (
    ALL,
    ASK_ALLOW,
    ASK_MODES,
    DEFAULT_ATTRIBUTION_GRACE,
    DEFAULT_CA_DIR,
    ECH_ALLOW,
    ECH_MODES,
    INSPECTION_MODES,
    LEARN_ALLOW,
    LEARN_MODES,
    PREFIXES,
    Config,
    Limits,
    Nameserver,
)

__all__ = ["Config", "Limits", "Nameserver", "load_config", "parse_duration"]

# Each section's keys (None: the section is a list or a scalar, not a mapping).
SECTIONS: dict[str, tuple[str, ...] | None] = {
    "dns": ("nameservers", "timeout", "attribution_grace"),
    "addresses": ("allow", "deny", "in_cluster"),
    "platform_destinations": None,
    "ports": None,
    "opaque_ports": None,
    "inspection": ("enabled", "ca_dir", "upstream_ca", "mode", "trust_dir"),
    "tls": ("ech",),
    "limits": (
        "connect_timeout",
        "idle_timeout",
        "header_timeout",
        "max_connections",
        "ask_timeout",
        "max_asks",
        "max_held",
    ),
    "internal_suffixes": None,
    "learn": None,
    "ask": None,
    "credentials": None,  # proxy/app/credentials_config.py
}
_PLATFORM_KEYS = ("host", "ports", "cidrs")
# Far more than one session's file descriptors allow; a larger number is a typo.
MAX_CONNECTIONS = 1_000_000
# Each pending ask is a line a person reads: more than this is no longer a question anyone answers.
MAX_ASKS = 10_000


def load_config(data: bytes | str, *, source: str = "<config>") -> Config:
    """Parse an operator config (YAML, or JSON/TOML by file suffix); any problem raises
    ProxyError('invalid_config') listing them all."""
    try:
        document = require_mapping(
            parse_document(data, source, syntax_for(source)), source, "a config"
        )
    except PolicyError as exc:
        raise ProxyError(
            exc.reason,
            exc.message,
            source=exc.source,
            line=exc.line,
            column=exc.column,
            path=exc.path,
        ) from None
    reader = ConfigReader(source, text=data)
    top = reader.section(document, "", tuple(SECTIONS), where="the config")

    def section(key: str) -> Section:
        return top.sub(key, SECTIONS[key] or ())

    dns = section("dns")
    nameservers, dns_timeout = _dns(dns)
    # Long-running clients keep an address well past its TTL (a connection pool, git's
    # remote helper): this long after an answer expires, its address still names its host.
    grace = dns.duration("attribution_grace", DEFAULT_ATTRIBUTION_GRACE)
    addresses = _addresses(section("addresses"))
    platform = _platform_destinations(top)
    ports = _ports(top)
    opaque_ports = _opaque_ports(top, ports)
    enabled, ca_dir, upstream_ca, mode, trust_dir = _inspection(section("inspection"))
    ech = _tls(section("tls"))
    limits = _limits(section("limits"))
    suffixes = _internal_suffixes(top)
    learn = top.choice("learn", LEARN_MODES, LEARN_ALLOW)
    ask = top.choice("ask", ASK_MODES, ASK_ALLOW)
    credentials = read_credentials(top, inspection_enabled=enabled)
    reader.finish()
    operator = OperatorRules(
        addresses=addresses,
        platform_destinations=platform,
        ports=ports,
        opaque_ports=opaque_ports,
        inspection_enabled=enabled,
        internal_suffixes=suffixes,
    )
    return Config(
        operator,
        nameservers,
        dns_timeout,
        ca_dir,
        upstream_ca,
        limits,
        source,
        inspection_mode=mode,
        tls_ech=ech,
        learn=learn,
        ask=ask,
        trust_dir=trust_dir,
        credentials=credentials,
        attribution_grace=grace,
    )


# -- sections -----------------------------------------------------------------------------


def _dns(dns: Section) -> tuple[tuple[Nameserver, ...] | None, float]:
    """`dns.nameservers` (None: the system's resolv.conf) and `dns.timeout`."""
    nameservers = None
    raw = dns.get("nameservers")
    if raw is not None:
        entries = dns.items("nameservers")
        fallback = Nameserver("0.0.0.0")
        nameservers = tuple(dns.reader.convert(p, v, _nameserver, fallback) for p, v in entries)
        if not nameservers and isinstance(raw, list):
            dns.reader.problem(
                dns.path("nameservers"),
                [],
                "empty_list",
                "is empty; omit it to use the system's resolv.conf",
            )
    return nameservers, dns.duration("timeout", 5.0)


def _addresses(addresses: Section) -> AddressRules:
    return AddressRules(
        allow=addresses.cidrs("allow"),
        deny=addresses.cidrs("deny"),
        in_cluster=addresses.cidrs("in_cluster"),
    )


def _platform_destinations(top: Section) -> tuple[PlatformDestination, ...]:
    platform: list[PlatformDestination] = []
    for path, item in top.items("platform_destinations"):
        dest = _platform_destination(top.reader, path, item)
        if dest is None:
            continue
        # The policy keys platform routes by host: a second entry would silently replace the
        # first, so its ports and CIDRs would be other than what the operator reads here.
        first = next((d for d in platform if d.host == dest.host), None)
        if first is not None:
            top.reader.problem(
                f"{path}.host",
                dest.host,
                "duplicate_host",
                f"{quote(dest.host)} is already a platform destination ({first.id}); "
                "list its ports and CIDRs in one entry",
            )
            continue
        platform.append(dest)
    return tuple(platform)


def _platform_destination(reader: ConfigReader, path: str, item: Any) -> PlatformDestination | None:
    if not isinstance(item, dict):
        reader.problem(
            path,
            item,
            "not_a_mapping",
            f"must be a mapping with host, ports and optionally cidrs, found {describe_type(item)}",
        )
        return None
    entry = reader.section(item, path, _PLATFORM_KEYS)
    host = entry.get("host")
    # allow_internal: platform routes are exactly the in-cluster names manifests may not declare.
    problem = check_entry(host, allow_internal=True) if isinstance(host, str) else None
    if not isinstance(host, str):
        reader.problem(
            entry.path("host"),
            host,
            "invalid_host",
            f"is required and must be a hostname string, found {describe_type(host)}",
        )
    elif problem is not None:
        reader.problem(entry.path("host"), host, "invalid_host", problem.message)
    raw_ports = entry.get("ports")
    ports = entry.ports("ports")
    if not ports and (raw_ports is None or isinstance(raw_ports, list)):
        reader.problem(entry.path("ports"), raw_ports, "missing_key", "must list at least one port")
    cidrs = entry.cidrs("cidrs")
    if not isinstance(host, str) or problem is not None:
        return None
    return PlatformDestination(path, host, ports or frozenset(), cidrs)


def _ports(top: Section) -> frozenset[int] | None:
    """The destination ports allowed (None: any port)."""
    ports = top.ports("ports")
    if ports == frozenset():
        # An empty allow-list would refuse every connection; far likelier a slip than intent.
        top.reader.problem("ports", [], "empty_list", "is empty; omit it to allow any port")
    return ports


def _opaque_ports(top: Section, ports: frozenset[int] | None) -> frozenset[int] | None:
    """The ports where a stream that is neither TLS nor HTTP may pass (None: the default, every
    allowed port but 80 and 443; empty: none). Each must be a port `ports` allows: one it does
    not would never be reached, which is a slip worth naming."""
    opaque = top.ports("opaque_ports")
    if opaque and ports is not None:
        for path, value in top.items("opaque_ports"):
            if isinstance(value, int) and value in opaque and value not in ports:
                top.reader.problem(
                    path,
                    value,
                    "invalid_value",
                    f"port {value} is not in ports, which refuses it before any stream; add it "
                    "there too",
                )
    return opaque


def _inspection(inspection: Section) -> tuple[bool, str, str | None, str, str | None]:
    """`inspection.enabled`, `ca_dir`, `upstream_ca` (None: certifi's bundle), `mode`:
    `prefixes` (the default: only hosts whose rules decide paths are intercepted) or `all`
    (every allowed TLS connection), which needs inspection enabled, and `trust_dir` (None:
    the trust bundle goes beside the CA), likewise."""
    enabled = inspection.flag("enabled", True)
    mode = inspection.choice("mode", INSPECTION_MODES, PREFIXES)
    trust_dir = inspection.optional_text("trust_dir")
    needs = {"mode": mode == ALL, "trust_dir": trust_dir is not None}
    for key, what in (("mode", "'all' intercepts every TLS connection"),
                      ("trust_dir", "a trust bundle holds the inspection CA")):  # fmt: skip
        if needs[key] and not enabled:
            inspection.reader.problem(
                inspection.path(key),
                inspection.get(key),
                "invalid_value",
                f"{what}, which needs inspection.enabled: true",
            )
    return (
        enabled,
        inspection.text("ca_dir", DEFAULT_CA_DIR),
        inspection.optional_text("upstream_ca"),
        mode,
        trust_dir,
    )


def _tls(tls: Section) -> str:
    """`tls.ech`: `allow` (the default) or `refuse` a ClientHello that carries ECH or draft ESNI
    (proxy.common.settings.ECH_MODES)."""
    return tls.choice("ech", ECH_MODES, ECH_ALLOW)


def _limits(limits: Section) -> Limits:
    defaults = Limits()
    return Limits(
        connect_timeout=limits.duration("connect_timeout", defaults.connect_timeout),
        idle_timeout=limits.duration("idle_timeout", defaults.idle_timeout),
        header_timeout=limits.duration("header_timeout", defaults.header_timeout),
        max_connections=limits.number(
            "max_connections", 1, MAX_CONNECTIONS, "a connection limit", defaults.max_connections
        ),
        ask_timeout=limits.duration("ask_timeout", defaults.ask_timeout),
        max_asks=limits.number("max_asks", 1, MAX_ASKS, "a number of asks", defaults.max_asks),
        max_held=limits.number(
            "max_held", 1, MAX_CONNECTIONS, "a number of held connections", defaults.max_held
        ),
    )


def _internal_suffixes(top: Section) -> tuple[str, ...]:
    suffixes = []
    for path, value in top.items("internal_suffixes"):
        if not isinstance(value, str):
            top.reader.problem(
                path,
                value,
                "invalid_suffix",
                f"must be a domain name string, found {describe_type(value)}",
            )
            continue
        # allow_internal: a suffix may be a single label ('corp') or lie under a built-in one.
        problem = check_entry(value, allow_internal=True)
        if problem is not None:
            top.reader.problem(path, value, "invalid_suffix", problem.message)
        else:
            suffixes.append(value)
    return tuple(suffixes)


# -- values -------------------------------------------------------------------------------


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
