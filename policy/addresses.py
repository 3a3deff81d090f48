"""Is an IP address a public destination? The address half of the runtime
rules (docs/manifests.md).

Every resolved address passes through `classify` before the proxy connects to it, so the
lookup is a handful of dict probes (one per distinct prefix length, longest first) rather than
a scan of the table. `ipaddress`'s own `is_global`/`is_private` are deliberately unused: they
disagree with the IANA registries for dozens of addresses (multicast, site-local, NAT64, ...).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from policy.errors import PolicyError
from policy.findings import quote
from policy.reasons import Reason
from policy.special_addresses import BLOCKS, METADATA, Block

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

__all__ = ["AddressRules", "IPAddress", "IPNetwork", "Verdict", "classify", "parse_address"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer for one address: `reason` is a stable code for audit lines and metrics."""

    address: str
    public: bool
    reason: str
    range: str | None
    name: str
    rfc: str
    embedded: str | None = None


class _PrefixIndex[T]:
    """Most-specific-prefix lookup: per prefix length, a dict from the prefix's bits to a value."""

    __slots__ = ("_levels",)

    def __init__(self, entries: Iterable[tuple[IPNetwork, T]], bits: int) -> None:
        by_length: dict[int, dict[int, T]] = {}
        for network, value in entries:
            shift = bits - network.prefixlen
            by_length.setdefault(network.prefixlen, {})[int(network.network_address) >> shift] = (
                value
            )
        self._levels = tuple(
            (bits - length, by_length[length]) for length in sorted(by_length, reverse=True)
        )

    def lookup(self, value: int) -> T | None:
        for shift, table in self._levels:
            hit = table.get(value >> shift)
            if hit is not None:
                return hit
        return None


def _table(version: int, bits: int) -> _PrefixIndex[Block]:
    rows = []
    for block in BLOCKS:
        network = ipaddress.ip_network(block.prefix)
        if network.version == version:
            rows.append((network, block))
    # A /0 row makes every lookup find a row, so `_classify` never meets an unknown address.
    if not any(network.prefixlen == 0 for network, _ in rows):
        raise RuntimeError(f"the IPv{version} address table needs a /0 default row")
    return _PrefixIndex(rows, bits)


_TABLE_V4 = _table(4, 32)
_TABLE_V6 = _table(6, 128)

# (version, address as int) -> (range as written in verdicts, name)
_METADATA: dict[tuple[int, int], tuple[str, str]] = {}
for _entry in METADATA:
    _ip = ipaddress.ip_address(_entry.address)
    _METADATA[(_ip.version, int(_ip))] = (f"{_ip}/{_ip.max_prefixlen}", _entry.name)

_NAT64_PREFIX = "64:ff9b::/96"
_NAT64_HIGH = int(IPv6Address("64:ff9b::")) >> 32
_NAT64_RFC = "RFC 6052"

# These rows spell an IPv4 destination inside an IPv6 address. Connecting to one would reach a
# host the IPv4 rules never saw, so they are refused whatever the operator allows.
_TUNNELS = frozenset(
    {Reason.IPV4_MAPPED, Reason.IPV4_COMPATIBLE, Reason.TO_6TO4, Reason.TEREDO, Reason.NAT64_LOCAL}
)


def _embedded_ipv4(reason: str, value: int) -> str | None:
    if reason in (Reason.IPV4_MAPPED, Reason.IPV4_COMPATIBLE):
        return str(IPv4Address(value & 0xFFFFFFFF))
    if reason == Reason.TO_6TO4:
        return str(IPv4Address((value >> 80) & 0xFFFFFFFF))
    return None


@dataclass(frozen=True, slots=True)
class AddressRules:
    """Operator CIDRs. `deny` and `in_cluster` refuse; `allow` exempts from the table only."""

    allow: tuple[IPNetwork, ...] = ()
    deny: tuple[IPNetwork, ...] = ()
    in_cluster: tuple[IPNetwork, ...] = ()
    _indexes: dict[tuple[str, int], _PrefixIndex[IPNetwork]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        indexes: dict[tuple[str, int], _PrefixIndex[IPNetwork]] = {}
        for kind in ("allow", "deny", "in_cluster"):
            networks = tuple(getattr(self, kind))
            for network in networks:
                if not isinstance(network, IPv4Network | IPv6Network):
                    raise TypeError(
                        f"AddressRules.{kind} holds {network!r}: use ipaddress networks "
                        "or AddressRules.from_strings"
                    )
            object.__setattr__(self, kind, networks)
            for version, bits in ((4, 32), (6, 128)):
                pairs = [(n, n) for n in networks if n.version == version]
                indexes[(kind, version)] = _PrefixIndex(pairs, bits)
        object.__setattr__(self, "_indexes", indexes)

    @classmethod
    def from_strings(
        cls,
        *,
        allow: Iterable[object] | None = (),
        deny: Iterable[object] | None = (),
        in_cluster: Iterable[object] | None = (),
        path_prefix: str = "addresses",
    ) -> AddressRules:
        """Parse CIDR strings; a bad one raises `PolicyError('invalid_cidr')` naming its place."""
        return cls(
            allow=_parse_cidrs(allow, f"{path_prefix}.allow"),
            deny=_parse_cidrs(deny, f"{path_prefix}.deny"),
            in_cluster=_parse_cidrs(in_cluster, f"{path_prefix}.in_cluster"),
        )

    def match(self, kind: str, ip: IPAddress) -> IPNetwork | None:
        """The most specific `kind` ('allow', 'deny', 'in_cluster') network holding `ip`."""
        return self._indexes[(kind, ip.version)].lookup(int(ip))


_PREFIX_LENGTH = re.compile(r"[0-9]{1,3}")


def _parse_cidrs(values: Iterable[object] | None, path: str) -> tuple[IPNetwork, ...]:
    if values is None:  # an empty YAML key (`deny:`) reads as None
        return ()
    if not isinstance(values, list | tuple | set | frozenset):
        raise PolicyError(
            "invalid_cidr", f"expected a list of CIDRs, got {quote(values)}", path=path
        )
    return tuple(_parse_cidr(value, f"{path}[{i}]") for i, value in enumerate(values))


def _parse_cidr(value: object, path: str) -> IPNetwork:
    def refuse(why: str) -> PolicyError:
        return PolicyError("invalid_cidr", f"{quote(value)} {why}", path=path)

    if not isinstance(value, str):
        raise refuse("is not a CIDR string like '10.0.0.0/8'")
    address, slash, length = value.partition("/")
    # ipaddress also takes netmasks ('/255.0.0.0') and zone ids; we want one spelling per range.
    if slash and not _PREFIX_LENGTH.fullmatch(length):
        raise refuse("needs a prefix length in digits after '/', like '10.0.0.0/8'")
    if "%" in address:
        raise refuse("has a zone id; write the network without '%zone'")
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise refuse("is not a CIDR like '10.0.0.0/8' or 'fd00::/8'") from None
    raise refuse(f"has host bits set after the prefix length; write {str(loose)!r}")


_ZONE = re.compile(r"[A-Za-z0-9._~-]+")


def parse_address(text: str) -> IPAddress | None:
    """An IP address in its strict spelling, or None.

    IPv4 is dotted-quad only (no '127.1', '0x7f.0.0.1', '017.0.0.1' or '2130706433'); IPv6 may
    be bracketed and carry a '%zone' id.
    """
    if not isinstance(text, str):
        return None
    # A host name (the common input, once per connection) cannot be an address: every IPv4
    # spelling accepted below starts with a digit and every IPv6 one has a colon. Saying so
    # here spares ipaddress raising and catching a ValueError for it.
    if not (text[:1].isdigit() or ":" in text):
        return None
    bracketed = text.startswith("[") and text.endswith("]")
    if bracketed:
        text = text[1:-1]
    _, percent, zone = text.partition("%")
    if percent and not _ZONE.fullmatch(zone):
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if (bracketed or percent) and ip.version != 6:
        return None
    return ip


def _strip_brackets(text: str) -> str:
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def classify(address: str | IPAddress, rules: AddressRules | None = None) -> Verdict:
    """Decide whether `address` is a public destination. Never raises for bad input.

    Order: metadata denylist, operator `deny`, operator `in_cluster`, then the table (most
    specific prefix wins), where the operator's `allow` may exempt an address from any
    not-reachable row but the IPv4-in-IPv6 tunnel rows. A NAT64 address (64:ff9b::/96) that
    passes the IPv6 metadata, `deny` and `in_cluster` checks is judged by its embedded IPv4,
    all steps again; an `allow` of IPv6 space does not reach it.
    """
    if isinstance(address, IPv4Address | IPv6Address):
        return _classify(address, str(address), rules)
    ip = parse_address(address)
    if ip is None:
        shown = address if isinstance(address, str) else repr(address)
        return Verdict(shown, False, Reason.INVALID_ADDRESS, None, "not an IP address", "")
    return _classify(ip, _strip_brackets(address), rules)


def _classify(ip: IPAddress, text: str, rules: AddressRules | None) -> Verdict:
    value = int(ip)
    metadata = _METADATA.get((ip.version, value))
    if metadata is not None:
        return Verdict(text, False, Reason.METADATA, metadata[0], metadata[1], "")
    if rules is not None:
        denied = rules.match("deny", ip)
        if denied is not None:
            return Verdict(text, False, Reason.OPERATOR_DENY, str(denied), "operator deny list", "")
        cluster = rules.match("in_cluster", ip)
        if cluster is not None:
            return Verdict(
                text, False, Reason.IN_CLUSTER, str(cluster), "operator in-cluster range", ""
            )
    if ip.version == 6 and value >> 32 == _NAT64_HIGH:
        return _nat64(ip, text, rules)
    table = _TABLE_V4 if ip.version == 4 else _TABLE_V6
    block = table.lookup(value)
    if block is None:  # pragma: no cover - `_table` checked for the /0 row
        raise AssertionError(f"address table has no row for {ip}")
    if block.reason in _TUNNELS:
        embedded = _embedded_ipv4(block.reason, value)
        return Verdict(text, False, block.reason, block.prefix, block.name, block.rfc, embedded)
    if rules is not None and not block.globally_reachable:
        allowed = rules.match("allow", ip)
        if allowed is not None:
            name = f"operator allow list (exempts {block.name}, {block.prefix})"
            return Verdict(text, True, Reason.OPERATOR_ALLOW, str(allowed), name, "")
    return Verdict(
        text, block.globally_reachable, block.reason, block.prefix, block.name, block.rfc
    )


def _nat64(ip: IPAddress, text: str, rules: AddressRules | None) -> Verdict:
    v4 = IPv4Address(int(ip) & 0xFFFFFFFF)
    inner = _classify(v4, str(v4), rules)
    name = f"NAT64 of {v4} ({inner.name})"
    reason = inner.reason if inner.public else Reason.NAT64
    return Verdict(text, inner.public, reason, _NAT64_PREFIX, name, _NAT64_RFC, str(v4))
