"""The address stage: one DNS answer checked address by address, refused whole if any fails.

A mixed answer (some public, some refused) is a rebinding signal, so it is refused whole; an
answer with no address at all is a denial too (`no_addresses`): there is nothing checked to
connect to.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, replace

from policy.addresses import AddressRules, Verdict, classify, parse_address
from policy.decisions import AddressDecision
from policy.errors import PolicyError
from policy.hostnames import name_refusal, normalize_host, parse_ip_literal
from policy.operator import PlatformDestination
from policy.reasons import Reason
from policy.rules import Rule

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# Verdicts that a platform destination's CIDRs never excuse.
_NEVER_EXEMPT = frozenset({Reason.METADATA, Reason.OPERATOR_DENY, Reason.INVALID_ADDRESS})


@dataclass(frozen=True, slots=True)
class AnswerChecker:
    """What the address stage needs of a compiled policy."""

    address_rules: AddressRules
    blocked_networks: tuple[Rule, ...]
    platform: dict[str, PlatformDestination]
    internal_suffixes: tuple[str, ...]

    def blocking_rule(self, address: Address) -> Rule | None:
        for rule in self.blocked_networks:
            if rule.network is not None and address in rule.network:
                return rule
        return None

    def check(
        self, host: str, addresses: Sequence[str | Address], cname_chain: Sequence[str]
    ) -> AddressDecision:
        """The address stage for one answer (raises on unusable input; the caller catches)."""
        literal = parse_ip_literal(host)
        name = str(literal) if literal is not None else normalize_host(host)
        refused_alias = self._refused_alias(name, cname_chain)
        if refused_alias is not None:
            return refused_alias
        if not addresses:
            return AddressDecision(
                False,
                Reason.NO_ADDRESSES,
                f"{name}: the answer has no address, so there is nothing checked to connect to",
                name,
                (),
            )
        platform = self.platform.get(name)
        verdicts: list[Verdict] = []
        rule_id: str | None = None
        for raw in addresses:
            verdict, rule = self._verdict(raw, platform)
            verdicts.append(verdict)
            if rule is not None and rule_id is None:
                rule_id = rule
        return _answer_decision(name, tuple(verdicts), rule_id, platform)

    def _refused_alias(self, name: str, cname_chain: Sequence[str]) -> AddressDecision | None:
        for alias in cname_chain:
            try:
                refusal = name_refusal(normalize_host(alias), self.internal_suffixes)
            except PolicyError as exc:
                refusal = (exc.reason, exc.message)
            if refusal is not None:
                return AddressDecision(
                    False,
                    Reason.INTERNAL_CNAME,
                    f"{name}: its CNAME chain passes through {alias[:100]!r} ({refusal[0]})",
                    name,
                    (),
                )
        return None

    def _verdict(
        self, raw: str | Address, platform: PlatformDestination | None
    ) -> tuple[Verdict, str | None]:
        address = parse_address(raw) if isinstance(raw, str) else raw
        verdict = classify(raw if address is None else address, self.address_rules)
        if address is None:
            return verdict, None
        blocked = self.blocking_rule(address)
        if blocked is not None:
            return replace(
                verdict,
                public=False,
                reason=Reason.BLOCKED_ADDRESS,
                name=f"blocked by {blocked.id}",
                range=str(blocked.network),
            ), blocked.id
        if platform is not None and platform.cidrs:
            inside = next((c for c in platform.cidrs if address in c), None)
            if inside is None:
                return replace(
                    verdict,
                    public=False,
                    reason=Reason.OUTSIDE_PLATFORM_CIDRS,
                    name=f"outside the CIDRs of {platform.id}",
                ), platform.id
            if not verdict.public and verdict.reason not in _NEVER_EXEMPT:
                return replace(
                    verdict,
                    public=True,
                    reason=Reason.PLATFORM_CIDR,
                    range=str(inside),
                    name=f"inside the CIDRs of {platform.id}",
                ), None
        return verdict, None


def _answer_decision(
    name: str,
    verdicts: tuple[Verdict, ...],
    rule_id: str | None,
    platform: PlatformDestination | None,
) -> AddressDecision:
    refused = [v for v in verdicts if not v.public]
    if not refused:
        shown = ", ".join(v.address for v in verdicts)
        return AddressDecision(
            True,
            Reason.ALLOWED,
            f"{name} -> {shown}: all addresses public",
            name,
            verdicts,
            platform.id if platform else None,
        )
    first = refused[0]
    if len(refused) < len(verdicts):
        return AddressDecision(
            False,
            Reason.MIXED_ANSWER,
            f"{name}: the answer mixes public and refused addresses "
            f"({first.address}: {first.reason}); refused whole",
            name,
            verdicts,
            rule_id,
        )
    return AddressDecision(
        False,
        first.reason,
        f"{name} -> {first.address}: {first.name} ({first.reason})",
        name,
        verdicts,
        rule_id,
    )
