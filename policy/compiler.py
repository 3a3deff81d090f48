"""Compile a manifest, a ceiling and operator rules into a Policy, and decide with it.

The ceiling is intersected with the manifest once (policy/grants.py): the trie holds only what
both admit, so a name decision is one walk down the host's labels. Paths are decided by
policy/paths.py and addresses by policy/answers.py; `Policy.decide` and
`Policy.check_addresses` are the only doors to them.
"""

from __future__ import annotations

import dataclasses
import gc
import ipaddress
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from policy.answers import AnswerChecker
from policy.asking import DENY_SESSION, Question, SessionGrants, is_askable
from policy.ceiling import Ceiling
from policy.decisions import AddressDecision, Decision
from policy.errors import PolicyError
from policy.findings import Finding, quote
from policy.grants import Grant, check_manifest, declared_allows, deploy_findings, intersect
from policy.hostnames import name_refusal, normalize_host, parse_ip_literal
from policy.learning import learnable
from policy.manifests import Manifest
from policy.operator import OperatorRules, PlatformDestination
from policy.paths import PathDecision, decide_path
from policy.reasons import Reason
from policy.remedies import entry, path_prefix, remedy
from policy.rules import Rule
from policy.text import clipped
from policy.trie import Match, SubtreeIndex, SuffixTrie
from policy.urls import RULE_SCHEME, STREAM_SCHEMES, TLS_SCHEMES, Target, parse_target

__all__ = ["Grant", "Policy", "check_manifest", "compile_policy"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# Which trie slot holds a rule of each kind.
_ALLOW_SLOT = {"subtree": "subtree", "exact": "exact", "url": "urls"}
_BLOCK_SLOT = {"subtree": "block_subtree", "exact": "block_exact", "url": "block_urls"}
_SHOWN_PATH = 200


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
        declared = declared_allows(manifest)
        effective = declared
        if manifest.mode != "allowlist":
            pattern = "public" if manifest.mode == "public" else "(no allowed list)"
            effective = [Rule(manifest.mode_rule, pattern, "allow", "subtree", "manifest", host="")]
        intersection = intersect(effective, ceiling)
        # Deploy findings speak of what the author declared, not of the mode's root rule.
        declared_cut = intersection.excluded
        if manifest.mode != "allowlist":
            declared_cut = intersect(declared, ceiling).excluded
        self._declared_cut = declared_cut
        self.grants = tuple(intersection.grants)
        self._trie: SuffixTrie[Grant] = SuffixTrie()
        for grant in self.grants:
            self._trie.add(grant.host, _ALLOW_SLOT[grant.rule.kind], grant)
        self.blocks = tuple(r for r in manifest.rules if r.action == "block")
        for rule in self.blocks:
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
        self._answers = AnswerChecker(
            operator.addresses,
            tuple(r for r in self.blocks if r.kind == "address"),
            self._platform,
            operator.internal_suffixes,
        )

    # -- reporting ---------------------------------------------------------------------------

    @cached_property
    def findings(self) -> tuple[Finding, ...]:
        """The deploy-time findings (as `check_manifest`); worded only when asked for, since a
        running proxy never needs them and a lowered ceiling can cut thousands of entries."""
        return deploy_findings(self.manifest, self.ceiling, self.operator, self._declared_cut)

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
        """Decide on a host, `host:port`, `[v6]:port` or URL (its path included), before any
        DNS. Never raises: anything unexpected is a denial (fail closed)."""
        shown = target if isinstance(target, str) else target.host
        try:
            parsed = parse_target(target) if isinstance(target, str) else target
            return self._decide(parsed)
        except PolicyError as exc:
            return Decision(False, exc.reason, exc.message, clipped(shown))
        except Exception as exc:
            return Decision(
                False,
                Reason.INTERNAL_ERROR,
                f"internal error: {type(exc).__name__}",
                clipped(shown),
            )

    def _decide(self, target: Target) -> Decision:
        decision = self._decide_target(target)
        if decision.allowed and target.scheme in STREAM_SCHEMES:
            return self.opaque(decision, target.scheme)
        return decision

    def opaque(self, decision: Decision, scheme: str) -> Decision:
        """An allowed destination's decision for a stream of `scheme` (`ssh`, `tcp`) that is
        neither TLS nor HTTP: refused when its port does not take such streams (the operator's
        `opaque_ports`); a refusal as it is."""
        if not decision.allowed:
            return decision
        port = decision.port
        if port is not None and self.operator.opaque_allowed(port):
            return decision
        return Decision(
            False,
            Reason.OPAQUE_NOT_ALLOWED,
            f"{decision.host}: port {port} takes only TLS and HTTP, not an opaque {scheme} "
            "stream (the operator's opaque_ports)",
            decision.host,
            port,
            "opaque_ports",
            decision.ceiling,
        )

    def _decide_target(self, target: Target) -> Decision:
        port = target.effective_port
        literal = parse_ip_literal(target.host)
        if literal is not None:
            return self._decide_literal(literal, port)
        host = normalize_host(target.host)
        platform = self._platform.get(host)
        if platform is not None:
            return _platform_decision(platform, host, port)
        refusal = name_refusal(host, self._internal)
        if refusal is not None:
            return Decision(False, refusal[0], f"{host}: {refusal[1]}", host, port)
        refused_port = self._port_refusal(host, port)
        if refused_port is not None:
            return refused_port
        return self._decide_host(host, port, target)

    def _decide_host(self, host: str, port: int | None, target: Target) -> Decision:
        """The manifest's rules on a valid public name: blocks, then grants, then URL prefixes."""
        match = self._trie.match(host)
        if match.block:
            rule = match.block[0].rule
            return Decision(
                False,
                Reason.BLOCKED,
                f"{host} is blocked by {rule.id} {quote(rule.pattern)}",
                host,
                port,
                rule.id,
            )
        # A blocked URL prefix holds on every scheme and port of its host (fail closed); an
        # allowed one only on its own scheme and port.
        blocks = [g.rule for g in match.block_urls or ()]
        grant = _first(match.exact, match.subtree)
        if target.scheme in STREAM_SCHEMES:
            # A stream has no path: only an entry for the whole host admits it.
            if grant is None and match.urls:
                rule = match.urls[0].rule
                return Decision(
                    False,
                    Reason.INSPECTION_UNSUPPORTED,
                    f"{host} is admitted only for some URL paths ({rule.id}); an opaque "
                    f"{target.scheme} stream has no path to decide",
                    host,
                    port,
                    rule.id,
                )
            blocks = []
        urls = [] if grant is not None else self._urls_for(match, target.scheme, port)
        admitting = urls[0] if urls else None
        if target.path is not None and (blocks or urls):
            allowed = [g.rule.path or "/" for g in urls] if urls else None
            decided = decide_path(target.path, allowed, [r.path or "/" for r in blocks])
            if decided.verdict != "allowed":
                return _path_refusal(host, port, target.path, decided, urls, blocks)
            if urls and decided.index is not None:
                admitting = urls[decided.index]
        tls = target.scheme is None or target.scheme in TLS_SCHEMES
        if grant is not None:
            return self._allow(host, port, grant, bool(blocks) and tls, "")
        if admitting is not None:
            note = " (paths are decided per request)" if target.path is None else ""
            return self._allow(host, port, admitting, tls, note)
        return self._not_allowed(host, port)

    @staticmethod
    def _urls_for(match: Match[Grant], scheme: str | None, port: int | None) -> list[Grant]:
        rule_scheme = RULE_SCHEME.get(scheme) if scheme else None
        return [
            g
            for g in match.urls or ()
            if (rule_scheme is None or g.rule.scheme == rule_scheme)
            and (port is None or g.rule.port == port)
        ]

    def _allow(
        self, host: str, port: int | None, grant: Grant, inspect: bool, note: str
    ) -> Decision:
        ceiling = grant.ceiling.id if grant.ceiling else None
        if inspect and not self.operator.inspection_enabled:
            return Decision(
                False,
                Reason.INSPECTION_DISABLED,
                f"{host} is admitted only for some paths ({grant.rule.id}), which needs "
                "TLS inspection, and inspection is disabled",
                host,
                port,
                grant.rule.id,
                ceiling,
            )
        return Decision(
            True,
            Reason.ALLOWED,
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
            rule = _first(cut.exact, cut.subtree, cut.urls)
            if rule is not None:
                return Decision(
                    False,
                    Reason.OUTSIDE_CEILING,
                    f"{host} is declared by {rule.id} but outside {self.ceiling.label}",
                    host,
                    port,
                    rule.id,
                )
        where = (
            "network.egress" if self.manifest.format == "agent.yaml" else "network_access.allowed"
        )
        return Decision(False, Reason.NOT_ALLOWED, f"{host} is not allowed by {where}", host, port)

    def _decide_literal(self, address: Address, port: int | None) -> Decision:
        host = str(address)
        blocked = self._answers.blocking_rule(address)
        if blocked is not None:
            return Decision(
                False, Reason.BLOCKED, f"{host} is blocked by {blocked.id}", host, port, blocked.id
            )
        rule = self._allowed_literals.get(address)
        if rule is None:
            return Decision(
                False,
                Reason.IP_LITERAL,
                f"{host}: IP addresses are refused; ask for a hostname",
                host,
                port,
            )
        refused_port = self._port_refusal(host, port)
        if refused_port is not None:
            return refused_port
        return Decision(
            True, Reason.ALLOWED, f"{host} is allowed by {rule.id}", host, port, rule.id
        )

    def _port_refusal(self, host: str, port: int | None) -> Decision | None:
        ports = self.operator.ports
        if port is None or ports is None or port in ports:
            return None
        return Decision(
            False,
            Reason.PORT_NOT_ALLOWED,
            f"{host}: port {port} is not in the operator's port allow-list",
            host,
            port,
            "ports",
        )

    # -- learning mode -----------------------------------------------------------------------

    def learn(self, decision: Decision, target: str | Target) -> Decision:
        """Learning mode (`run --learn`): `decision` on `target`, let through (`would_deny`,
        reason kept) when it is a refusal only a manifest entry could lift
        (policy/learning.py); any other decision as it is. Never raises: on anything
        unexpected the refusal stands (fail closed)."""
        if decision.allowed or not learnable(decision.reason):
            return decision
        return self._let_through(
            decision,
            target,
            f"{decision.message}; learning: let through",
            "even while learning",
            would_deny=True,
        )

    def _let_through(
        self,
        decision: Decision,
        target: str | Target,
        message: str,
        why: str,
        *,
        would_deny: bool = False,
        rule: str | None = None,
    ) -> Decision:
        """A refused name-stage `decision` turned into an allow (by learning, or by a person's
        answer). A host with blocked URL prefixes, or one a path decided, is let through only
        inspected (TLS), so that its blocks and paths still hold on every request; refused as
        `inspection_disabled` where inspection is off. On anything unexpected the refusal
        stands (fail closed)."""
        try:
            parsed = parse_target(target) if isinstance(target, str) else target
            tls = parsed.scheme is None or parsed.scheme in TLS_SCHEMES
            blocked_paths = bool(self._trie.match(decision.host).block_urls)
            inspect = tls and (blocked_paths or decision.reason == Reason.PATH_NOT_ALLOWED)
            if inspect and not self.operator.inspection_enabled:
                return Decision(
                    False,
                    Reason.INSPECTION_DISABLED,
                    f"{decision.host} has path rules, which need TLS inspection {why}, and "
                    "inspection is disabled",
                    decision.host,
                    decision.port,
                    decision.rule,
                )
            let = dataclasses.replace(
                decision,
                allowed=True,
                message=message,
                needs_inspection=inspect,
                would_deny=would_deny,
                rule=rule if rule is not None else decision.rule,
            )
            if parsed.scheme in STREAM_SCHEMES:
                # What a manifest entry would lift is lifted; the operator's ports still hold.
                return self.opaque(let, parsed.scheme)
            return let
        except Exception:
            return decision

    # -- asking a person (policy/asking.py) ----------------------------------------------------

    @cached_property
    def _ceiling_index(self) -> SubtreeIndex[Rule] | None:
        if self.ceiling is None:
            return None
        return SubtreeIndex((rule.host or "", rule) for rule in self.ceiling.rules)

    def ceiling_admits(self, host: str) -> bool:
        """Whether the tenant ceiling admits `host` (a normalised name), declared or not: no
        ceiling admits every name."""
        index = self._ceiling_index
        return index is None or (bool(host) and index.covering(host) is not None)

    def question(self, decision: Decision, target: str | Target) -> Question | None:
        """What a person would be asked about a refused `decision` on `target`, or None when
        nobody may be asked (policy/asking.py): not a refusal a manifest entry lifts, outside
        the ceiling, or a path no URL prefix admits on every reading. Never raises."""
        if decision.allowed or not is_askable(decision.reason):
            return None
        try:
            if not self.ceiling_admits(decision.host):
                return None
            if decision.reason == Reason.NOT_ALLOWED:
                return Question(decision.host, decision.port)
            parsed = parse_target(target) if isinstance(target, str) else target
            if parsed.path is None or parsed.scheme is None:
                return None
            prefix = path_prefix(parsed.path)
            if prefix is None:
                return None
            scheme = RULE_SCHEME.get(parsed.scheme)
            return Question(decision.host, parsed.effective_port, prefix, scheme)
        except Exception:
            return None

    def entry(self, decision: Decision, target: str | Target) -> str | None:
        """The manifest entry, in this manifest's grammar, that would allow a refused
        `decision` on `target` (policy/remedies.py `entry`); None where there is none."""
        try:
            parsed = parse_target(target) if isinstance(target, str) else target
            return entry(
                decision.reason,
                decision.host,
                manifest_format=self.manifest.format,
                scheme=parsed.scheme,
                port=parsed.effective_port,
                path=parsed.path,
            )
        except Exception:
            return None

    def answered(
        self, decision: Decision, target: str | Target, rule: str, *, allow: bool
    ) -> Decision:
        """A refused `decision` as a person's answer `rule` (an ask, a grant) decides it: let
        through (inspected where paths or blocked prefixes need it), or refused as
        `ask_denied`. The ceiling and every other refusal are not a person's to lift: only a
        decision `question` admits is changed."""
        if self.question(decision, target) is None:
            return decision
        host = decision.host
        if not allow:
            return Decision(
                False,
                Reason.ASK_DENIED,
                f"{host} was refused by a person ({rule})",
                host,
                decision.port,
                rule,
            )
        let = self._let_through(
            decision, target, f"{host} is allowed by {rule} (a person's answer)",
            "even when a person allows it", rule=rule,
        )  # fmt: skip
        return dataclasses.replace(let, reason=Reason.ALLOWED) if let.allowed else let

    def granted(self, decision: Decision, target: str | Target, grants: SessionGrants) -> Decision:
        """`decision` with the session's grants applied: a refusal a person may be asked about
        that a grant answers is decided by that grant (`answered`); anything else as it is.
        Never raises: on anything unexpected the refusal stands."""
        try:
            question = self.question(decision, target)
            if question is None or not len(grants):
                return decision
            parsed = parse_target(target) if isinstance(target, str) else target
            grant = grants.find(question, parsed)
            if grant is None:
                return decision
            allow = grant.decision != DENY_SESSION
            return self.answered(decision, parsed, grant.rule, allow=allow)
        except Exception:
            return decision

    # -- remedies ----------------------------------------------------------------------------

    @cached_property
    def _patterns(self) -> dict[str, str]:
        """Each manifest entry's text by its id, for a remedy that names the entry to remove."""
        return {rule.id: rule.pattern for rule in self.manifest.rules}

    def remedy(self, result: Decision | AddressDecision, target: str | None = None) -> str | None:
        """The one change that would allow a refused `result` (policy/remedies.py), in this
        manifest's grammar; `target`: what was decided on (its scheme, port and path shape a
        URL prefix to add). None for an allow, or when there is no change to name. Never
        raises: a remedy is advice, and a refusal must go out without it rather than fail."""
        if result.allowed:
            return None
        try:
            reason = result.reason
            pattern = self._patterns.get(result.rule) if result.rule is not None else None
            if reason == Reason.MIXED_ANSWER and pattern is not None:
                # The refused address of the mix is one a manifest block names.
                reason = Reason.BLOCKED_ADDRESS
            scheme = path = None
            port = result.port if isinstance(result, Decision) else None
            if target is not None and reason == Reason.PATH_NOT_ALLOWED:
                parsed = parse_target(target)
                scheme, path = parsed.scheme, parsed.path
                port = parsed.effective_port
            return remedy(
                reason,
                result.host,
                manifest_format=self.manifest.format,
                rule=result.rule,
                pattern=pattern,
                scheme=scheme,
                port=port,
                path=path,
            )
        except Exception:
            return None

    # -- address stage -----------------------------------------------------------------------

    def check_addresses(
        self, host: str, addresses: Sequence[str | Address], *, cname_chain: Sequence[str] = ()
    ) -> AddressDecision:
        """Check one DNS answer for `host`. Any refused address refuses the whole answer (a mixed
        answer is a rebinding signal); an answer with no address is refused (`no_addresses`).
        Never raises."""
        try:
            return self._answers.check(host, addresses, cname_chain)
        except Exception as exc:
            return AddressDecision(
                False,
                Reason.INTERNAL_ERROR,
                f"internal error: {type(exc).__name__}",
                clipped(host),
                (),
            )


def _platform_decision(platform: PlatformDestination, host: str, port: int | None) -> Decision:
    if port is not None and port not in platform.ports:
        return Decision(
            False,
            Reason.PORT_NOT_ALLOWED,
            f"{host}: port {port} is not a port of this platform destination",
            host,
            port,
            platform.id,
        )
    return Decision(
        True,
        Reason.PLATFORM_DESTINATION,
        f"{host} is a platform destination",
        host,
        port,
        platform.id,
    )


def _path_refusal(
    host: str,
    port: int | None,
    path: str,
    decided: PathDecision,
    urls: Sequence[Grant],
    blocks: Sequence[Rule],
) -> Decision:
    """The denial for a path `decide_path` did not allow, worded with the reading that failed."""
    where = f"{host}{clipped(path, _SHOWN_PATH)}"
    reading = decided.reading
    read_as = ""
    if reading is not None and reading.path != path:
        read_as = f" (read as {clipped(reading.path, _SHOWN_PATH)}: {reading.how})"
    if decided.verdict == "blocked" and decided.index is not None:
        rule = blocks[decided.index]
        message = f"{where} is blocked by {rule.id} {quote(rule.pattern)}{read_as}"
        return Decision(False, Reason.BLOCKED, message, host, port, rule.id)
    rule_id = urls[0].rule.id if urls else None
    prefixes = ", ".join(quote(g.rule.pattern) for g in urls[:3])
    if decided.problem is not None:
        return Decision(
            False, Reason.AMBIGUOUS_PATH, f"{host}: {decided.problem}", host, port, rule_id
        )
    if decided.verdict == "outside":
        message = f"{where} is outside the URL prefixes allowed for this host ({prefixes}){read_as}"
        return Decision(False, Reason.PATH_NOT_ALLOWED, message, host, port, rule_id)
    message = (
        f"{where} is inside the URL prefixes allowed for this host ({prefixes}) as RFC 3986 "
        f"reads it, but not on every server{read_as}: servers disagree on what it names"
    )
    return Decision(False, Reason.AMBIGUOUS_PATH, message, host, port, rule_id)


def _first[T](*candidates: list[T] | None) -> T | None:
    """The first entry of the first non-empty list."""
    for entries in candidates:
        if entries:
            return entries[0]
    return None
