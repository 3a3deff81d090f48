"""The two manifest formats, validated into one intermediate form.

agent.yaml: `network.egress` (each entry covers its subdomains), `network.egress_mode`, and the
hosts `access.github` implies. agent.toml (also as YAML or JSON): `network_access.allowed` /
`blocked` patterns. Only the egress-related parts are ours; other keys are not looked at.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from policy.addresses import AddressRules, classify, parse_address
from policy.documents import Syntax, parse_document, require_mapping, syntax_for
from policy.errors import PolicyError
from policy.findings import Finding, Severity, describe_type, key_text, quote, unknown_key_message
from policy.hostnames import check_entry, parse_ip_literal
from policy.numbers import check_prefix_length
from policy.paths import canonical_prefix
from policy.rules import Action, Kind, Rule
from policy.trie import suffixes
from policy.urls import DEFAULT_PORTS, parse_port

Format = Literal["agent.yaml", "agent.toml"]
FORMATS: tuple[Format, ...] = ("agent.yaml", "agent.toml")
# allowlist: only the rules admit; public: any public name; inherit: this layer restricts
# nothing (agent.toml with no `allowed`), the ceiling and operator layers still apply.
Mode = Literal["allowlist", "public", "inherit"]

GITHUB_HOSTS = ("github.com", "api.github.com")
# Bounds the work one document can ask for: checking costs tens of microseconds an entry.
MAX_ENTRIES = 200_000
_NETWORK_KEYS = ("egress", "egress_mode")
_ACCESS_KEYS = ("allowed", "blocked")
_URL_SCHEMES = ("http", "https")


@dataclass(frozen=True, slots=True)
class Manifest:
    format: Format
    source: str
    mode: Mode
    rules: tuple[Rule, ...]
    findings: tuple[Finding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not any(f.is_error for f in self.findings)

    @property
    def mode_rule(self) -> str:
        """Where the manifest says what its mode is, for decisions that rest on the mode."""
        return "network.egress_mode" if self.format == "agent.yaml" else "network_access"


def detect_format(document: dict[str, Any], source: str) -> Format:
    if syntax_for(source) == "toml" or "network_access" in document or "schema_version" in document:
        return "agent.toml"
    return "agent.yaml"


def load_manifest(
    data: bytes | str,
    *,
    source: str = "<manifest>",
    format: Format | None = None,
    syntax: Syntax | None = None,
    internal_suffixes: Iterable[str] = (),
) -> Manifest:
    """Parse and validate a manifest. Unusable input raises PolicyError; problems in the egress
    parts become findings on the returned Manifest. `syntax` (yaml, toml, json) defaults to what
    the file name implies."""
    if format is not None and format not in FORMATS:
        raise PolicyError("unknown_format", f"format {format!r} is not one of {FORMATS}")
    document = require_mapping(parse_document(data, source, syntax), source, "a manifest")
    fmt = format or detect_format(document, source)
    checker = _Checker(source, tuple(internal_suffixes))
    mode = checker.agent_yaml(document) if fmt == "agent.yaml" else checker.agent_toml(document)
    return Manifest(fmt, source, mode, tuple(checker.rules), tuple(checker.findings))


class _Checker:
    def __init__(self, source: str, internal_suffixes: tuple[str, ...]) -> None:
        self.source = source
        self.internal_suffixes = internal_suffixes
        self.rules: list[Rule] = []
        self.findings: list[Finding] = []

    def find(
        self, path: str, value: Any, reason: str, message: str, severity: Severity = "error"
    ) -> None:
        self.findings.append(Finding(path, value, reason, message, severity, self.source))

    # -- shared shapes -----------------------------------------------------------------------

    def mapping(self, value: Any, path: str) -> dict[str, Any] | None:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.find(path, value, "not_a_mapping", f"{path} must be a mapping")
            return None
        return value

    def unknown_keys(
        self, mapping: dict[str, Any], path: str, known: tuple[str, ...], carry_x: bool
    ) -> None:
        for key in mapping:
            if carry_x and isinstance(key, str) and key.startswith("x-"):
                continue
            if key in known:
                continue
            self.find(
                f"{path}.{key_text(key)}", key, "unknown_key", unknown_key_message(key, path, known)
            )

    def string_list(self, value: Any, path: str) -> list[tuple[str, str]]:
        """(path, entry) for each string entry; a finding for everything else."""
        if value is None:
            return []
        if not isinstance(value, list):
            self.find(path, value, "not_a_list", f"{path} must be a list of strings")
            return []
        if len(value) > MAX_ENTRIES:
            self.find(
                path,
                value,
                "too_many_entries",
                f"{path} has {len(value)} entries; the limit is {MAX_ENTRIES}",
            )
            return []
        entries = []
        for i, item in enumerate(value):
            item_path = f"{path}[{i}]"
            if isinstance(item, str):
                entries.append((item_path, item))
            else:
                kind = describe_type(item)
                self.find(
                    item_path, item, "not_a_string", f"{item_path} must be a string, found {kind}"
                )
        return entries

    def duplicates(self, rules: list[Rule]) -> list[Rule]:
        """Drop repeated patterns (a warning each) and warn where one rule covers another."""
        seen: dict[tuple[Any, ...], Rule] = {}
        kept = []
        for rule in rules:
            key = (rule.kind, rule.pattern)
            if key in seen:
                first = seen[key]
                self.find(
                    rule.id,
                    rule.pattern,
                    "duplicate",
                    f"{quote(rule.pattern)} repeats {first.id}; remove one",
                    "warning",
                )
                continue
            seen[key] = rule
            kept.append(rule)
        subtrees = {r.host: r for r in kept if r.kind == "subtree"}
        for rule in kept:
            if rule.host is None:
                continue
            labels = rule.host.split(".")
            start = 1 if rule.kind == "subtree" else 0
            for i in range(start, len(labels) - 1):
                cover = subtrees.get(".".join(labels[i:]))
                if cover is not None and cover is not rule:
                    self.find(
                        rule.id,
                        rule.pattern,
                        "redundant",
                        f"{quote(rule.pattern)} is already covered by {cover.id} "
                        f"{quote(cover.pattern)}",
                        "warning",
                    )
                    break
        return kept

    def host_entry(
        self, path: str, value: str, *, allow_internal: bool = False, whole: str | None = None
    ) -> str | None:
        problem = check_entry(
            value, internal_suffixes=self.internal_suffixes, allow_internal=allow_internal
        )
        if problem is not None:
            # Name the whole pattern when only its host part was checked.
            prefix = f"{quote(whole)}: " if whole is not None and whole != value else ""
            self.find(path, whole or value, problem.reason, prefix + problem.message)
            return None
        return value

    # -- agent.yaml --------------------------------------------------------------------------

    def agent_yaml(self, document: dict[str, Any]) -> Mode:
        network = self.mapping(document.get("network"), "network")
        mode: Mode = "allowlist"
        rules: list[Rule] = []
        if network is not None:
            self.unknown_keys(network, "network", _NETWORK_KEYS, carry_x=True)
            raw_mode = network.get("egress_mode")
            if raw_mode is not None:
                if raw_mode in ("allowlist", "public"):
                    mode = raw_mode
                else:
                    self.find(
                        "network.egress_mode",
                        raw_mode,
                        "invalid_egress_mode",
                        f"network.egress_mode is {quote(raw_mode)}; write 'allowlist' or 'public'",
                    )
            entries = self.string_list(network.get("egress"), "network.egress")
            for path, value in entries:
                host = self.host_entry(path, value)
                if host is not None:
                    rules.append(Rule(path, value, "allow", "subtree", "manifest", host=host))
            if mode == "public" and network.get("egress"):
                self.find(
                    "network.egress",
                    network.get("egress"),
                    "public_mode_with_entries",
                    "network.egress must be absent or empty when network.egress_mode is "
                    "'public': public mode already admits every public hostname",
                )
        rules = self.duplicates(rules)
        rules.extend(self.github_rules(document))
        self.rules = rules
        return mode

    def github_rules(self, document: dict[str, Any]) -> list[Rule]:
        access = document.get("access")
        github = access.get("github") if isinstance(access, dict) else None
        if not isinstance(github, dict) or not ("repos" in github or "choose" in github):
            return []
        return [
            Rule("access.github", host, "allow", "subtree", "access.github", host=host)
            for host in GITHUB_HOSTS
        ]

    # -- agent.toml --------------------------------------------------------------------------

    def agent_toml(self, document: dict[str, Any]) -> Mode:
        version = document.get("schema_version", 1)
        if type(version) is not int or version != 1:
            self.find(
                "schema_version",
                version,
                "unsupported_schema_version",
                f"schema_version is {quote(version)}; this proxy reads schema_version 1",
            )
        access = self.mapping(document.get("network_access"), "network_access")
        if access is None:
            return "inherit"
        self.unknown_keys(access, "network_access", _ACCESS_KEYS, carry_x=False)
        allowed = [
            r
            for p, v in self.string_list(access.get("allowed"), "network_access.allowed")
            if (r := self.toml_pattern(p, v, "allow")) is not None
        ]
        blocked = [
            r
            for p, v in self.string_list(access.get("blocked"), "network_access.blocked")
            if (r := self.toml_pattern(p, v, "block")) is not None
        ]
        allowed = self.duplicates(allowed)
        blocked = self.duplicates(blocked)
        whole_blocks = _WholeBlocks(blocked)
        for rule in allowed:
            shadow = whole_blocks.refusing(rule)
            if shadow is not None:
                self.find(
                    rule.id,
                    rule.pattern,
                    "allowed_and_blocked",
                    f"{quote(rule.pattern)} is also blocked by {shadow.id}; blocked wins, "
                    "so this entry admits nothing",
                    "warning",
                )
        self.rules = allowed + blocked
        has_allowed = bool(access.get("allowed")) and isinstance(access.get("allowed"), list)
        return "allowlist" if has_allowed else "inherit"

    def toml_pattern(self, path: str, value: str, action: Action) -> Rule | None:
        if "://" in value:
            return self.url_pattern(path, value, action)
        address = parse_ip_literal(value)
        if address is not None:
            if action == "allow" and not classify(address).public:
                verdict = classify(address)
                self.find(
                    path,
                    value,
                    "non_public_address",
                    f"{quote(value)} is not a public address ({verdict.name}); it can never "
                    "be reached through the proxy",
                )
                return None
            network = ipaddress.ip_network(address)
            return Rule(path, value, action, "address", "manifest", network=network)
        if "/" in value and parse_address(value.partition("/")[0]) is not None:
            return self.address_range(path, value, action)
        kind: Kind = "exact"
        host_text = value
        if value.startswith("*."):
            kind, host_text = "subtree", value[2:]
        host = self.host_entry(path, host_text, allow_internal=action == "block", whole=value)
        if host is None:
            return None
        if kind == "subtree" and host.count(".") == 0:
            self.find(
                path,
                value,
                "broad_wildcard",
                f"{quote(value)} admits a whole top-level domain",
                "warning",
            )
        return Rule(path, value, action, kind, "manifest", host=host)

    def address_range(self, path: str, value: str, action: Action) -> Rule | None:
        """An address range (`10.0.0.0/8`), read as the operator config reads one: a blocked
        one is a rule, an allowed one is refused (allow hostnames)."""
        try:
            check_prefix_length(value)
            (network,) = AddressRules.from_strings(allow=[value]).allow
        except PolicyError as exc:
            self.find(path, value, "invalid_cidr", exc.message)
            return None
        if action == "allow":
            self.find(
                path,
                value,
                "cidr_not_allowed",
                f"{quote(value)}: an address range can only be blocked; allow hostnames",
            )
            return None
        return Rule(path, value, "block", "address", "manifest", network=network)

    def url_pattern(self, path: str, value: str, action: Action) -> Rule | None:
        scheme, _, rest = value.partition("://")
        if scheme not in _URL_SCHEMES:
            self.find(
                path,
                value,
                "scheme",
                f"{quote(value)}: URL patterns use http:// or https://, in lowercase",
            )
            return None
        slash = rest.find("/")
        authority, url_path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        if "?" in value or "#" in value:
            self.find(
                path,
                value,
                "url_query",
                f"{quote(value)}: a URL pattern is a path prefix; remove the query or fragment",
            )
            return None
        if "@" in authority:
            self.find(
                path,
                value,
                "url_userinfo",
                f"{quote(value)}: credentials do not belong in a URL pattern",
            )
            return None
        host_text, sep, port_text = authority.partition(":")
        port = DEFAULT_PORTS[scheme]
        if sep:
            try:
                port = parse_port(port_text)
            except PolicyError as exc:
                self.find(path, value, "port", f"{quote(value)}: {exc.message}")
                return None
        host = self.host_entry(path, host_text, allow_internal=action == "block", whole=value)
        if host is None:
            return None
        try:
            canonical = canonical_prefix(url_path)
        except PolicyError as exc:
            self.find(path, value, "invalid_path", f"{quote(value)}: {exc.message}")
            return None
        if canonical != url_path:
            fixed = value[: len(value) - len(url_path)] + canonical
            self.find(
                path,
                value,
                "not_canonical",
                f"{quote(value)}: the path is not in normal form; write {fixed!r}",
            )
            return None
        # A blocked prefix holds on every scheme and port of its host (blocks fail closed);
        # an allowed one on its own scheme and port only.
        blocked = action == "block"
        return Rule(
            path,
            value,
            "block" if blocked else "allow",
            "url",
            "manifest",
            host=host,
            scheme=None if blocked else scheme,
            port=None if blocked else port,
            path=url_path,
        )


class _WholeBlocks:
    """Host blocks indexed by name, to find one that refuses everything an allow admits."""

    def __init__(self, blocks: list[Rule]) -> None:
        self.exact: dict[str, Rule] = {}
        self.subtree: dict[str, Rule] = {}
        for rule in blocks:
            if rule.host is not None and rule.kind in ("exact", "subtree"):
                index = self.exact if rule.kind == "exact" else self.subtree
                index.setdefault(rule.host, rule)

    def refusing(self, allow: Rule) -> Rule | None:
        if allow.host is None:
            return None
        for name in suffixes(allow.host):
            if name and name in self.subtree:
                return self.subtree[name]
        if allow.kind in ("exact", "url"):
            return self.exact.get(allow.host)
        return None
