"""Compile a manifest, a ceiling and operator rules into a Policy, and decide with it.

The ceiling is intersected with the manifest here, once: the trie holds only what both admit,
so a decision is one walk down the host's labels. Blocks are not intersected: they always apply.
"""

from __future__ import annotations

import gc
import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

from policy import decisions as d
from policy.addresses import Verdict, classify, parse_address
from policy.ceiling import Ceiling
from policy.decisions import AddressDecision, Decision
from policy.errors import PolicyError
from policy.findings import Finding, quote
from policy.hostnames import is_under, name_refusal, normalize_host, parse_ip_literal
from policy.manifests import Manifest
from policy.operator import OperatorRules, PlatformDestination
from policy.rules import Rule
from policy.trie import SubtreeIndex, SuffixTrie, suffixes
from policy.urls import (
    RULE_SCHEME,
    TLS_SCHEMES,
    Target,
    parse_target,
    path_has_prefix,
    path_views,
)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# Which trie slot holds a rule of each kind.
_ALLOW_SLOT = {"subtree": "subtree", "exact": "exact", "url": "urls"}
_BLOCK_SLOT = {"subtree": "block_subtree", "exact": "block_exact", "url": "block_urls"}
# Verdicts that a platform destination's CIDRs never excuse.
_NEVER_EXEMPT = frozenset({"metadata", "operator_deny", "invalid_address"})


class Grant(NamedTuple):
    """One effective allow: `host` may be narrower than the rule's when a ceiling cut it.
    (A tuple: compiling a large policy makes one per rule, and tuples are cheap to make.)"""

    host: str
    rule: Rule
    ceiling: Rule | None = None

    def to_json(self) -> dict[str, Any]:
        out = self.rule.to_json()
        out["host"] = self.host
        out["ceiling"] = self.ceiling.id if self.ceiling else None
        return out


def _allows(manifest: Manifest) -> list[Rule]:
    return [r for r in manifest.rules if r.action == "allow"]


def check_manifest(
    manifest: Manifest, ceiling: Ceiling | None = None, operator: OperatorRules | None = None
) -> tuple[Finding, ...]:
    """Every deploy-time finding: the manifest's own, then the ceiling and platform checks."""
    excluded = _intersect(_allows(manifest), ceiling).excluded
    return _deploy_findings(manifest, ceiling, operator or OperatorRules(), excluded)


def _deploy_findings(
    manifest: Manifest,
    ceiling: Ceiling | None,
    operator: OperatorRules,
    excluded: Sequence[Rule],
) -> tuple[Finding, ...]:
    findings = list(manifest.findings)
    if ceiling is not None:
        if manifest.mode == "public":
            findings.append(
                Finding(
                    "network.egress_mode",
                    "public",
                    "public_mode_with_ceiling",
                    f"egress_mode 'public' is refused because {ceiling.label} is configured; "
                    "declare the hostnames you need in network.egress instead",
                    "error",
                    manifest.source,
                )
            )
        shown = ", ".join(r.host or "" for r in ceiling.rules[:5]) or "nothing"
        if len(ceiling.rules) > 5:
            shown += f", … ({len(ceiling.rules)} entries)"
        findings.extend(
            Finding(
                rule.id,
                rule.pattern,
                d.OUTSIDE_CEILING,
                f"{quote(rule.pattern)} is outside {ceiling.label}, which admits: {shown}; "
                "declare a name under one of those or ask the administrator to widen it",
                "error",
                manifest.source,
            )
            for rule in excluded
        )
    for rule in _allows(manifest):
        if rule.host is None or rule.source != "manifest":
            continue
        for dest in operator.platform_destinations:
            if is_under(dest.host, rule.host) or is_under(rule.host, dest.host):
                findings.append(
                    Finding(
                        rule.id,
                        rule.pattern,
                        d.PLATFORM_DESTINATION,
                        f"{quote(rule.pattern)} overlaps the platform destination {dest.host!r} "
                        f"({dest.id}); platform routes are provided for you and not declarable",
                        "error",
                        manifest.source,
                    )
                )
                break
    return tuple(findings)


@dataclass(slots=True)
class _Intersection:
    grants: list[Grant]
    excluded: list[Rule]  # declared allows the ceiling does not wholly admit


def _intersect(allows: Iterable[Rule], ceiling: Ceiling | None) -> _Intersection:
    if ceiling is None:
        return _Intersection([Grant(r.host, r) for r in allows if r.host is not None], [])
    covers = SubtreeIndex((entry.host or "", entry) for entry in ceiling.rules)
    result = _Intersection([], [])
    cut_subtrees: dict[str, list[Rule]] = {}
    for rule in allows:
        cover = covers.covering(rule.host) if rule.host is not None else None
        if cover is not None:
            result.grants.append(Grant(rule.host or "", rule, cover))
            continue
        # An address allow has no name for a hostname ceiling to admit.
        result.excluded.append(rule)
        if rule.kind == "subtree" and rule.host is not None:
            cut_subtrees.setdefault(rule.host, []).append(rule)
    if cut_subtrees:
        # Ceiling entries below a declared name that no ceiling entry covers: what both admit.
        for host, entry in covers.items():
            for parent in suffixes(host, proper=True):
                for rule in cut_subtrees.get(parent, ()):
                    result.grants.append(Grant(host, rule, entry))
    return result


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Compiling allocates hundreds of thousands of small acyclic objects; every young-generation
    pass re-walks them, which measured as half the compile time of a 100 000-rule policy. The
    switch is process-wide, so it is restored at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_policy(
    manifest: Manifest, ceiling: Ceiling | None = None, operator: OperatorRules | None = None
) -> Policy:
    """A Policy from a valid manifest. Manifest errors raise PolicyError('invalid_manifest');
    deploy-time findings against the ceiling do not (a ceiling lowered after deploy narrows
    live sessions, it does not stop them) and are kept on `Policy.findings`."""
    errors = [f for f in manifest.findings if f.is_error]
    if errors:
        first = errors[0]
        raise PolicyError(
            "invalid_manifest",
            f"{len(errors)} error(s) in the manifest; first: {first.path}: {first.message}",
            source=manifest.source,
            details=tuple(errors),
        )
    with _collector_paused():
        return Policy(manifest, ceiling, operator or OperatorRules())


class Policy:
    """The compiled decision core. Immutable once built; safe to share between tasks."""

    def __init__(self, manifest: Manifest, ceiling: Ceiling | None, operator: OperatorRules):
        self.manifest = manifest
        self.ceiling = ceiling
        self.operator = operator
        declared = _allows(manifest)
        effective = declared
        if manifest.mode != "allowlist":
            pattern = "public" if manifest.mode == "public" else "(no allowed list)"
            effective = [Rule(manifest.mode_rule, pattern, "allow", "subtree", "manifest", host="")]
        intersection = _intersect(effective, ceiling)
        # Deploy findings speak of what the author declared, not of the mode's root rule.
        declared_cut = intersection.excluded
        if manifest.mode != "allowlist":
            declared_cut = _intersect(declared, ceiling).excluded
        self._declared_cut = declared_cut
        self.grants = tuple(intersection.grants)
        self._trie: SuffixTrie[Grant] = SuffixTrie()
        for grant in self.grants:
            self._trie.add(grant.host, _ALLOW_SLOT[grant.rule.kind], grant)
        blocks = [r for r in manifest.rules if r.action == "block"]
        self.blocks = tuple(blocks)
        self._blocked_networks = [r for r in blocks if r.kind == "address"]
        for rule in blocks:
            if rule.kind != "address":
                host = rule.host or ""
                self._trie.add(host, _BLOCK_SLOT[rule.kind], Grant(host, rule))
        # An address allow is admitted only where no hostname ceiling is configured.
        self._allowed_literals: dict[Address, Rule] = {}
        if ceiling is None:
            for rule in effective:
                if rule.kind == "address" and rule.network is not None:
                    self._allowed_literals[rule.network.network_address] = rule
        # What the ceiling cut, to tell "outside the ceiling" from "not declared".
        self._excluded: SuffixTrie[Rule] = SuffixTrie()
        for rule in intersection.excluded:
            if rule.host is not None:
                self._excluded.add(rule.host, _ALLOW_SLOT[rule.kind], rule)
        self._platform = {p.host: p for p in operator.platform_destinations}
        self._internal = operator.internal_suffixes

    # -- reporting ---------------------------------------------------------------------------

    @cached_property
    def findings(self) -> tuple[Finding, ...]:
        """The deploy-time findings (as `check_manifest`); worded only when asked for, since a
        running proxy never needs them and a lowered ceiling can cut thousands of entries."""
        return _deploy_findings(self.manifest, self.ceiling, self.operator, self._declared_cut)

    @cached_property
    def has_url_rules(self) -> bool:
        """Whether any rule (allowed or blocked) is a URL prefix: only then can a decision need
        HTTP semantics beyond the name (per-request paths, TLS inspection)."""
        return any(rule.kind == "url" for rule in self.manifest.rules)

    def rules_json(self) -> list[dict[str, Any]]:
        """The effective rules, as `check --json` prints them."""
        out = [g.to_json() for g in self.grants]
        out += [r.to_json() for r in self.blocks]
        out += [
            {
                "rule": r.id,
                "pattern": r.pattern,
                "action": "allow",
                "kind": "address",
                "source": r.source,
                "network": str(r.network),
            }
            for r in self._allowed_literals.values()
        ]
        out += [
            {
                "rule": p.id,
                "pattern": p.host,
                "action": "allow",
                "kind": "exact",
                "source": "platform",
                "host": p.host,
                "ports": sorted(p.ports),
                "cidrs": [str(c) for c in p.cidrs],
            }
            for p in self.operator.platform_destinations
        ]
        return out

    # -- name stage --------------------------------------------------------------------------

    def decide(self, target: str | Target) -> Decision:
        """Decide on a host, `host:port`, `[v6]:port` or URL, before any DNS. Never raises:
        anything unexpected is a denial (fail closed)."""
        shown = target if isinstance(target, str) else target.host
        try:
            parsed = parse_target(target) if isinstance(target, str) else target
            return self._decide(parsed)
        except PolicyError as exc:
            return Decision(False, exc.reason, exc.message, _shown(shown))
        except Exception as exc:
            return Decision(
                False, d.INTERNAL_ERROR, f"internal error: {type(exc).__name__}", _shown(shown)
            )

    def _decide(self, target: Target) -> Decision:
        port = target.effective_port
        literal = parse_ip_literal(target.host)
        if literal is not None:
            return self._decide_literal(literal, port)
        host = normalize_host(target.host)
        platform = self._platform.get(host)
        if platform is not None:
            if port is not None and port not in platform.ports:
                return Decision(
                    False,
                    d.PORT_NOT_ALLOWED,
                    f"{host}: port {port} is not a port of this platform destination",
                    host,
                    port,
                    platform.id,
                )
            return Decision(
                True,
                d.PLATFORM_DESTINATION,
                f"{host} is a platform destination",
                host,
                port,
                platform.id,
            )
        refusal = name_refusal(host, self._internal)
        if refusal is not None:
            return Decision(False, refusal[0], f"{host}: {refusal[1]}", host, port)
        refused_port = self._port_refusal(host, port)
        if refused_port is not None:
            return refused_port
        match = self._trie.match(host)
        if match.block:
            rule = match.block[0].rule
            return Decision(
                False,
                d.BLOCKED,
                f"{host} is blocked by {rule.id} {quote(rule.pattern)}",
                host,
                port,
                rule.id,
            )
        scheme = RULE_SCHEME.get(target.scheme) if target.scheme else None
        block_urls = [g.rule for g in match.block_urls or () if _port_fits(g.rule, scheme, port)]
        views = path_views(target.path) if target.path is not None else ()
        path = views[0] if views else None
        for rule in block_urls:
            prefix = (rule.path or "/").lower()  # blocks match case-blind: some servers do
            # '/admin/' blocks '/admin' too: many servers serve both alike.
            if any(_blocked_by(view.lower(), prefix) for view in views):
                return Decision(
                    False,
                    d.BLOCKED,
                    f"{host}{path} is blocked by {rule.id} {quote(rule.pattern)}",
                    host,
                    port,
                    rule.id,
                )
        grant = (match.exact or match.subtree or [None])[0]
        tls = target.scheme is None or target.scheme in TLS_SCHEMES
        if grant is not None:
            inspect = bool(block_urls) and tls
            return self._allow(host, port, grant, inspect, "")
        urls = [g for g in match.urls or () if _port_fits(g.rule, scheme, port)]
        if urls and path is None:
            return self._allow(host, port, urls[0], tls, " (paths are decided per request)")
        if urls and path is not None:
            admitting = [
                next((g for g in urls if path_has_prefix(view, g.rule.path or "/")), None)
                for view in views
            ]
            if all(admitting):
                return self._allow(host, port, admitting[0], tls, "")  # type: ignore[arg-type]
            prefixes = ", ".join(quote(g.rule.pattern) for g in urls[:3])
            return Decision(
                False,
                d.PATH_NOT_ALLOWED,
                f"{host}{path} is outside the URL prefixes allowed for this host ({prefixes})",
                host,
                port,
                urls[0].rule.id,
            )
        return self._not_allowed(host, port)

    def _allow(
        self, host: str, port: int | None, grant: Grant, inspect: bool, note: str
    ) -> Decision:
        ceiling = grant.ceiling.id if grant.ceiling else None
        if inspect and not self.operator.inspection_enabled:
            return Decision(
                False,
                d.INSPECTION_DISABLED,
                f"{host} is admitted only for some paths ({grant.rule.id}), which needs "
                "TLS inspection, and inspection is disabled",
                host,
                port,
                grant.rule.id,
                ceiling,
            )
        return Decision(
            True,
            d.ALLOWED,
            f"{host} is allowed by {grant.rule.id}{note}",
            host,
            port,
            grant.rule.id,
            ceiling,
            inspect,
        )

    def _not_allowed(self, host: str, port: int | None) -> Decision:
        if self.ceiling is not None:
            cut = self._excluded.match(host)
            rule = (cut.exact or cut.subtree or cut.urls or [None])[0]
            if rule is not None:
                return Decision(
                    False,
                    d.OUTSIDE_CEILING,
                    f"{host} is declared by {rule.id} but outside {self.ceiling.label}",
                    host,
                    port,
                    rule.id,
                )
        where = (
            "network.egress" if self.manifest.format == "agent.yaml" else "network_access.allowed"
        )
        return Decision(False, d.NOT_ALLOWED, f"{host} is not allowed by {where}", host, port)

    def _decide_literal(self, address: Address, port: int | None) -> Decision:
        host = str(address)
        blocked = self._blocking_rule(address)
        if blocked is not None:
            return Decision(
                False, d.BLOCKED, f"{host} is blocked by {blocked.id}", host, port, blocked.id
            )
        rule = self._allowed_literals.get(address)
        if rule is None:
            return Decision(
                False,
                "ip_literal",
                f"{host}: IP addresses are refused; ask for a hostname",
                host,
                port,
            )
        refused_port = self._port_refusal(host, port)
        if refused_port is not None:
            return refused_port
        return Decision(True, d.ALLOWED, f"{host} is allowed by {rule.id}", host, port, rule.id)

    def _port_refusal(self, host: str, port: int | None) -> Decision | None:
        ports = self.operator.ports
        if port is None or ports is None or port in ports:
            return None
        return Decision(
            False,
            d.PORT_NOT_ALLOWED,
            f"{host}: port {port} is not in the operator's port allow-list",
            host,
            port,
            "ports",
        )

    def _blocking_rule(self, address: Address) -> Rule | None:
        for rule in self._blocked_networks:
            if rule.network is not None and address in rule.network:
                return rule
        return None

    # -- address stage -----------------------------------------------------------------------

    def check_addresses(
        self, host: str, addresses: Sequence[str | Address], *, cname_chain: Sequence[str] = ()
    ) -> AddressDecision:
        """Check one DNS answer for `host`. Any refused address refuses the whole answer (a mixed
        answer is a rebinding signal). Never raises."""
        try:
            return self._check_addresses(host, addresses, cname_chain)
        except Exception as exc:
            return AddressDecision(
                False, d.INTERNAL_ERROR, f"internal error: {type(exc).__name__}", _shown(host), ()
            )

    def _check_addresses(
        self, host: str, addresses: Sequence[str | Address], cname_chain: Sequence[str]
    ) -> AddressDecision:
        literal = parse_ip_literal(host)
        name = str(literal) if literal is not None else normalize_host(host)
        for alias in cname_chain:
            try:
                alias_name = normalize_host(alias)
                refusal = name_refusal(alias_name, self._internal)
            except PolicyError as exc:
                refusal = (exc.reason, exc.message)
            if refusal is not None:
                return AddressDecision(
                    False,
                    d.INTERNAL_CNAME,
                    f"{name}: its CNAME chain passes through {alias[:100]!r} ({refusal[0]})",
                    name,
                    (),
                )
        if not addresses:
            return AddressDecision(
                False, d.NO_ADDRESSES, f"{name}: the answer has no address", name, ()
            )
        platform = self._platform.get(name)
        verdicts: list[Verdict] = []
        rule_id: str | None = None
        for raw in addresses:
            verdict, rule = self._verdict(raw, platform)
            verdicts.append(verdict)
            if rule is not None and rule_id is None:
                rule_id = rule
        refused = [v for v in verdicts if not v.public]
        if not refused:
            shown = ", ".join(v.address for v in verdicts)
            return AddressDecision(
                True,
                d.ALLOWED,
                f"{name} -> {shown}: all addresses public",
                name,
                tuple(verdicts),
                platform.id if platform else None,
            )
        first = refused[0]
        if len(refused) < len(verdicts):
            return AddressDecision(
                False,
                d.MIXED_ANSWER,
                f"{name}: the answer mixes public and refused addresses "
                f"({first.address}: {first.reason}); refused whole",
                name,
                tuple(verdicts),
                rule_id,
            )
        return AddressDecision(
            False,
            first.reason,
            f"{name} -> {first.address}: {first.name} ({first.reason})",
            name,
            tuple(verdicts),
            rule_id,
        )

    def _verdict(
        self, raw: str | Address, platform: PlatformDestination | None
    ) -> tuple[Verdict, str | None]:
        address = parse_address(raw) if isinstance(raw, str) else raw
        verdict = classify(raw if address is None else address, self.operator.addresses)
        if address is None:
            return verdict, None
        blocked = self._blocking_rule(address)
        if blocked is not None:
            return replace(
                verdict,
                public=False,
                reason=d.BLOCKED_ADDRESS,
                name=f"blocked by {blocked.id}",
                range=str(blocked.network),
            ), blocked.id
        if platform is not None and platform.cidrs:
            inside = next((c for c in platform.cidrs if address in c), None)
            if inside is None:
                return replace(
                    verdict,
                    public=False,
                    reason=d.OUTSIDE_PLATFORM_CIDRS,
                    name=f"outside the CIDRs of {platform.id}",
                ), platform.id
            if not verdict.public and verdict.reason not in _NEVER_EXEMPT:
                return replace(
                    verdict,
                    public=True,
                    reason="platform_cidr",
                    range=str(inside),
                    name=f"inside the CIDRs of {platform.id}",
                ), None
        return verdict, None


def _blocked_by(path: str, prefix: str) -> bool:
    return path_has_prefix(path, prefix) or (prefix.endswith("/") and path == prefix[:-1])


def _port_fits(rule: Rule, scheme: str | None, port: int | None) -> bool:
    if scheme is not None and rule.scheme != scheme:
        return False
    return port is None or rule.port == port


def _shown(text: str) -> str:
    return text if len(text) <= 100 else text[:100] + "…"
