"""The tenant ceiling: hostnames (each covering its subdomains) that a manifest is intersected
with. No file = unconfigured (any public name); `egress: []` = nothing at all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policy.documents import parse_document, require_mapping
from policy.errors import PolicyError
from policy.findings import Finding, describe_type, key_text, quote, unknown_key_message
from policy.hostnames import check_entry
from policy.manifests import MAX_ENTRIES
from policy.rules import Rule

_KEYS = ("tenant", "egress")


@dataclass(frozen=True, slots=True)
class Ceiling:
    tenant: str | None
    source: str
    rules: tuple[Rule, ...]

    @property
    def label(self) -> str:
        """How messages name this ceiling: the tenant and the file."""
        who = f"tenant {quote(self.tenant)}" if self.tenant else "the tenant"
        return f"the ceiling of {who} ({self.source})"


def load_ceiling(
    data: bytes | str, *, source: str = "<ceiling>", internal_suffixes: Iterable[str] = ()
) -> Ceiling:
    """Parse a ceiling file (YAML or JSON). Any problem raises PolicyError listing them all:
    a ceiling that is half understood must not be applied."""
    document = require_mapping(parse_document(data, source), source, "a ceiling")
    problems: list[Finding] = []

    def problem(path: str, value: object, reason: str, message: str) -> None:
        problems.append(Finding(path, value, reason, message, "error", source))

    for key in document:
        if key not in _KEYS:
            problem(
                key_text(key),
                key,
                "unknown_key",
                unknown_key_message(key, "a ceiling", _KEYS),
            )
    tenant = document.get("tenant")
    if tenant is not None and not (isinstance(tenant, str) and tenant.strip()):
        problem("tenant", tenant, "invalid_tenant", "must be a non-empty string")
        tenant = None
    if "egress" not in document:
        problem(
            "egress",
            None,
            "missing_key",
            "a ceiling needs an 'egress' list ('egress: []' admits nothing)",
        )
    egress = document.get("egress")
    rules: list[Rule] = []
    if egress is not None and not isinstance(egress, list):
        problem("egress", egress, "not_a_list", "must be a list of hostnames")
    elif egress is None and "egress" in document:
        problem(
            "egress",
            None,
            "not_a_list",
            "is empty (null); write 'egress: []' to admit nothing",
        )
    if isinstance(egress, list) and len(egress) > MAX_ENTRIES:
        problem(
            "egress",
            egress,
            "too_many_entries",
            f"has {len(egress)} entries; the limit is {MAX_ENTRIES}",
        )
        egress = []
    for i, value in enumerate(egress if isinstance(egress, list) else []):
        path = f"egress[{i}]"
        if not isinstance(value, str):
            problem(
                path, value, "not_a_string", f"must be a hostname, found {describe_type(value)}"
            )
            continue
        issue = check_entry(value, internal_suffixes=internal_suffixes)
        if issue is not None:
            problem(path, value, issue.reason, issue.message)
            continue
        rules.append(Rule(f"ceiling.{path}", value, "allow", "subtree", "ceiling", host=value))
    if problems:
        listed = "; ".join(f"{p.path}: {p.message}" for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PolicyError(
            "invalid_ceiling",
            f"invalid ceiling: {listed}{more}",
            source=source,
            details=tuple(problems),
        )
    return Ceiling(tenant, source, tuple(rules))
