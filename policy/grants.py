"""What a manifest grants once the tenant ceiling is applied, and the deploy-time findings.

The ceiling is intersected with the declared allows here, once: what comes out (`Grant`s) is
what both admit, so the compiled trie holds nothing the ceiling refuses. Blocks are not
intersected: they always apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from policy.ceiling import Ceiling
from policy.findings import Finding, quote
from policy.hostnames import is_under
from policy.manifests import Manifest
from policy.operator import OperatorRules
from policy.reasons import Reason
from policy.rules import Rule
from policy.trie import SubtreeIndex, suffixes


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


def declared_allows(manifest: Manifest) -> list[Rule]:
    return [r for r in manifest.rules if r.action == "allow"]


def check_manifest(
    manifest: Manifest, ceiling: Ceiling | None = None, operator: OperatorRules | None = None
) -> tuple[Finding, ...]:
    """Every deploy-time finding: the manifest's own, then the ceiling and platform checks."""
    excluded = intersect(declared_allows(manifest), ceiling).excluded
    return deploy_findings(manifest, ceiling, operator or OperatorRules(), excluded)


def deploy_findings(
    manifest: Manifest,
    ceiling: Ceiling | None,
    operator: OperatorRules,
    excluded: Sequence[Rule],
) -> tuple[Finding, ...]:
    """The manifest's findings, then one per declared allow the ceiling excludes, then one per
    manifest allow overlapping a platform destination."""
    findings = list(manifest.findings)
    if ceiling is not None:
        findings.extend(_ceiling_findings(manifest, ceiling, excluded))
    for rule in declared_allows(manifest):
        if rule.host is None or rule.source != "manifest":
            continue
        dest = next(
            (
                p
                for p in operator.platform_destinations
                if is_under(p.host, rule.host) or is_under(rule.host, p.host)
            ),
            None,
        )
        if dest is not None:
            findings.append(
                Finding(
                    rule.id,
                    rule.pattern,
                    Reason.PLATFORM_DESTINATION,
                    f"{quote(rule.pattern)} overlaps the platform destination {dest.host!r} "
                    f"({dest.id}); platform routes are provided for you and not declarable",
                    "error",
                    manifest.source,
                )
            )
    return tuple(findings)


def _ceiling_findings(
    manifest: Manifest, ceiling: Ceiling, excluded: Sequence[Rule]
) -> list[Finding]:
    findings = []
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
            Reason.OUTSIDE_CEILING,
            f"{quote(rule.pattern)} is outside {ceiling.label}, which admits: {shown}; "
            "declare a name under one of those or ask the administrator to widen it",
            "error",
            manifest.source,
        )
        for rule in excluded
    )
    return findings


@dataclass(slots=True)
class Intersection:
    grants: list[Grant]
    excluded: list[Rule]  # declared allows the ceiling does not wholly admit


def intersect(allows: Iterable[Rule], ceiling: Ceiling | None) -> Intersection:
    """What the allows and the ceiling both admit, and the allows the ceiling cuts."""
    if ceiling is None:
        return Intersection([Grant(r.host, r) for r in allows if r.host is not None], [])
    covers = SubtreeIndex((entry.host or "", entry) for entry in ceiling.rules)
    result = Intersection([], [])
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
