"""What a rule set promises, and what the kernel holds: both read into the same keys (each
rule's verdict and the UID, ports, interface and address it matches), so that a load can be
compared with the text it came from, chain by chain."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from proxy.boundary.nft.chains import BOUNDARY_FAILED, check_table_name
from proxy.common.errors import ProxyError


@dataclass(frozen=True, slots=True)
class RuleKey:
    """The statements of one rule that decide what it does: its verdict, and the UID, ports and
    interface it matches. Compared between the rendered text and the read-back."""

    verdict: str  # accept, drop, return, redirect
    redirect_port: int | None
    skuid: int | None
    dports: frozenset[int]
    interface: str | None
    nat_address: str | None = None  # the address of a `dnat ... to ADDRESS:PORT` (sandbox)


@dataclass(frozen=True, slots=True)
class ChainKey:
    type: str
    hook: str
    priority: int
    policy: str
    rules: tuple[RuleKey, ...]


_CHAIN_OPEN = re.compile(r"chain\s+([A-Za-z][A-Za-z0-9_]*)\s*\{")
_CHAIN_HEAD = re.compile(
    r"type\s+(\w+)\s+hook\s+(\w+)\s+priority\s+(-?\d+)\s*;\s*policy\s+(accept|drop)\s*;"
)
_VERDICT = re.compile(r"(?:\b(accept|drop|return)|\bredirect\s+to\s+:(\d+))\s*$")
_DNAT = re.compile(r"\bdnat\s+ip6?\s+to\s+\[?([0-9A-Fa-f:.]+?)\]?:(\d+)\s*$")
_SKUID = re.compile(r"\bmeta\s+skuid\s+(\d+)\b")
_DPORT = re.compile(r"\bdport\s+(\d+|\{[^}]*\})")
_INTERFACE = re.compile(r'\b[io]ifname\s+"([^"]+)"')


def _rule_key_from_text(line: str, where: str) -> RuleKey:
    verdict = _VERDICT.search(line)
    dnat = _DNAT.search(line)
    if verdict is None and dnat is None:
        raise ProxyError(BOUNDARY_FAILED, f"{where}: no verdict in rule {line[:80]!r}")
    skuid = _SKUID.search(line)
    interface = _INTERFACE.search(line)
    dports: set[int] = set()
    for match in _DPORT.finditer(line):
        dports.update(int(p) for p in re.findall(r"\d+", match.group(1)))
    if dnat is not None:
        return RuleKey(
            verdict="dnat",
            redirect_port=int(dnat.group(2)),
            skuid=int(skuid.group(1)) if skuid else None,
            dports=frozenset(dports),
            interface=interface.group(1) if interface else None,
            nat_address=str(ipaddress.ip_address(dnat.group(1))),
        )
    assert verdict is not None
    return RuleKey(
        verdict="redirect" if verdict.group(2) else verdict.group(1),
        redirect_port=int(verdict.group(2)) if verdict.group(2) else None,
        skuid=int(skuid.group(1)) if skuid else None,
        dports=frozenset(dports),
        interface=interface.group(1) if interface else None,
    )


def expected_chains(text: str, table: str) -> dict[str, ChainKey]:
    """What a rule set in the form `render` writes promises for `table`, chain by chain. Raises
    ProxyError('boundary_failed') for text in another form: nothing we cannot check is loaded."""
    check_table_name(table)
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    opening = f"table inet {table} {{"
    if opening not in lines:
        raise ProxyError(BOUNDARY_FAILED, f"the rule set has no block {opening!r}")
    chains: dict[str, ChainKey] = {}
    index = lines.index(opening) + 1
    while index < len(lines) and lines[index] != "}":
        opened = _CHAIN_OPEN.fullmatch(lines[index])
        head = _CHAIN_HEAD.fullmatch(lines[index + 1]) if index + 1 < len(lines) else None
        if opened is None or head is None:
            raise ProxyError(
                BOUNDARY_FAILED,
                f"rule set line {lines[index][:80]!r}: expected `chain NAME {{` and its "
                "`type ... hook ... priority ...; policy ...;` line",
            )
        name = opened.group(1)
        index += 2
        rules = []
        while index < len(lines) and lines[index] != "}":
            rules.append(_rule_key_from_text(lines[index], f"chain {name}"))
            index += 1
        if index >= len(lines):
            raise ProxyError(BOUNDARY_FAILED, f"chain {name} is not closed")
        chains[name] = ChainKey(
            head.group(1), head.group(2), int(head.group(3)), head.group(4), tuple(rules)
        )
        index += 1
    if index >= len(lines) or not chains:
        raise ProxyError(BOUNDARY_FAILED, f"table {table} is not closed or holds no chain")
    return chains


def _match_values(right: Any) -> set[int]:
    if isinstance(right, int) and not isinstance(right, bool):
        return {right}
    if isinstance(right, dict) and isinstance(right.get("set"), list):
        return {v for v in right["set"] if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _rule_key_from_json(expressions: list[Any]) -> RuleKey:
    verdict, redirect_port, skuid, interface, nat_address = "", None, None, None, None
    dports: set[int] = set()
    for expression in expressions:
        if not isinstance(expression, dict) or len(expression) != 1:
            continue
        (kind, value), *_ = expression.items()
        if kind in ("accept", "drop", "return"):
            verdict = kind
        elif kind == "redirect":
            verdict = "redirect"
            redirect_port = value.get("port") if isinstance(value, dict) else None
        elif kind == "dnat" and isinstance(value, dict):
            verdict = "dnat"
            redirect_port = value.get("port")
            nat_address = _canonical_address(value.get("addr"))
        elif kind == "match" and isinstance(value, dict):
            left, right = value.get("left"), value.get("right")
            if not isinstance(left, dict):
                continue
            meta_expression, payload = left.get("meta"), left.get("payload")
            meta = meta_expression.get("key") if isinstance(meta_expression, dict) else None
            if not isinstance(payload, dict):
                payload = {}
            if meta == "skuid" and isinstance(right, int):
                skuid = right
            elif meta in ("oifname", "iifname") and isinstance(right, str):
                interface = right
            elif payload.get("field") == "dport":
                dports |= _match_values(right)
    return RuleKey(verdict, redirect_port, skuid, frozenset(dports), interface, nat_address)


def _canonical_address(value: Any) -> str | None:
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
    except ValueError:
        return str(value)


def loaded_chains(listing: Any, table: str) -> dict[str, ChainKey]:
    """What `nft -j list table inet TABLE` says is loaded, in the same form as
    `expected_chains`. Sets, maps and other objects in the table are reported as chains of
    their own kind so a comparison notices them."""
    items = listing.get("nftables") if isinstance(listing, dict) else None
    if not isinstance(items, list):
        raise ProxyError(BOUNDARY_FAILED, "nft -j list did not return an nftables listing")
    heads: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[RuleKey]] = {}
    for item in items:
        if not isinstance(item, dict) or len(item) != 1:
            continue
        (kind, value), *_ = item.items()
        if kind in ("metainfo", "table") or not isinstance(value, dict):
            continue
        if value.get("table") != table or value.get("family") != "inet":
            continue
        if kind == "chain":
            heads[str(value.get("name"))] = value
        elif kind == "rule":
            rules.setdefault(str(value.get("chain")), []).append(
                _rule_key_from_json(value.get("expr") or [])
            )
        else:
            heads[f"{kind}:{value.get('name')}"] = {"type": kind}
    chains: dict[str, ChainKey] = {}
    for name, head in heads.items():
        prio = head.get("prio")
        chains[name] = ChainKey(
            str(head.get("type", "")),
            str(head.get("hook", "")),
            prio if isinstance(prio, int) else 0,
            str(head.get("policy", "")),
            tuple(rules.get(name, [])),
        )
    for orphan in sorted(set(rules) - set(heads)):
        chains[orphan] = ChainKey("", "", 0, "", tuple(rules[orphan]))
    return chains


def compare_chains(expected: dict[str, ChainKey], loaded: dict[str, ChainKey]) -> list[str]:
    """Every difference between the promised and the loaded chains, one line each; empty when
    they agree."""
    problems = []
    for name in sorted(set(expected) - set(loaded)):
        problems.append(f"chain {name} is missing")
    for name in sorted(set(loaded) - set(expected)):
        problems.append(f"{name} is loaded but was not rendered")
    for name in sorted(set(expected) & set(loaded)):
        want, got = expected[name], loaded[name]
        for field in ("type", "hook", "priority", "policy"):
            if getattr(want, field) != getattr(got, field):
                problems.append(
                    f"chain {name}: {field} is {getattr(got, field)!r}, "
                    f"expected {getattr(want, field)!r}"
                )
        if len(want.rules) != len(got.rules):
            problems.append(
                f"chain {name}: {len(got.rules)} rules loaded, {len(want.rules)} rendered"
            )
            continue
        for position, (rule, held) in enumerate(zip(want.rules, got.rules, strict=True), 1):
            if rule != held:
                problems.append(f"chain {name} rule {position}: loaded {held}, rendered {rule}")
    return problems
