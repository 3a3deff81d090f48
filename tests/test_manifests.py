"""Manifest loading: both formats, format detection, and findings with paths."""

import json

import pytest

from policy import PolicyError, load_manifest
from policy.manifests import GITHUB_HOSTS


def reasons(manifest) -> dict[str, str]:
    return {f.path: f.reason for f in manifest.findings}


def test_seed_agent_yaml_example() -> None:
    m = load_manifest(
        "network:\n  egress:\n    - github.com\n    - api.example.com\n", source="agent.yaml"
    )
    assert m.format == "agent.yaml" and m.mode == "allowlist" and m.ok
    assert [(r.id, r.host, r.kind) for r in m.rules] == [
        ("network.egress[0]", "github.com", "subtree"),
        ("network.egress[1]", "api.example.com", "subtree"),
    ]


def test_other_top_level_keys_are_not_our_business() -> None:
    text = (
        "name: x\npolicy: {approval_required_tools: [Bash]}\nfoo: 1\nnetwork:\n  egress: [a.com]\n"
    )
    assert load_manifest(text).ok


def test_no_network_section_admits_nothing() -> None:
    m = load_manifest("name: x\n")
    assert m.ok and m.mode == "allowlist" and m.rules == ()


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("*.github.com", "wildcard"),
        ("https://github.com", "scheme"),
        ("github.com:443", "port"),
        ("github.com/path", "path"),
        ("140.82.121.4", "ip_address"),
        ("[::1]", "ip_address"),
        ("localhost", "loopback_name"),
        ("svc.cluster.local", "internal_name"),
        ("printer.local", "internal_name"),
        ("vault.internal", "internal_name"),
        ("GitHub.com", "not_canonical"),
        ("github.com.", "not_canonical"),
        ("github", "single_label"),
        ("example.123", "numeric_tld"),
        (" github.com", "whitespace"),
    ],
)
def test_seed_refused_entries(entry: str, reason: str) -> None:
    m = load_manifest(json.dumps({"network": {"egress": ["ok.example", entry]}}), source="a.json")
    assert not m.ok
    finding = next(f for f in m.findings if f.path == "network.egress[1]")
    assert finding.reason == reason and finding.value == entry
    assert [r.host for r in m.rules] == ["ok.example"]


def test_not_canonical_message_names_the_fix() -> None:
    m = load_manifest("network:\n  egress: [GitHub.com]\n")
    assert "write 'github.com'" in m.findings[0].message


def test_egress_mode_public_and_its_rules() -> None:
    assert load_manifest("network: {egress_mode: public}\n").mode == "public"
    assert load_manifest("network: {egress_mode: public, egress: []}\n").ok
    m = load_manifest("network: {egress_mode: public, egress: [a.com]}\n")
    assert reasons(m) == {"network.egress": "public_mode_with_entries"}
    m = load_manifest("network: {egress_mode: open}\n")
    assert reasons(m) == {"network.egress_mode": "invalid_egress_mode"}


def test_unknown_keys_in_network_refused_with_hint_but_x_keys_carried() -> None:
    m = load_manifest("network:\n  egres: [a.com]\n  x-note: fine\n")
    assert reasons(m) == {"network.egres": "unknown_key"}
    assert "did you mean 'egress'" in m.findings[0].message


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        ("network: [a.com]\n", "network", "not_a_mapping"),
        ("network: {egress: a.com}\n", "network.egress", "not_a_list"),
        ("network: {egress: [1]}\n", "network.egress[0]", "not_a_string"),
        ("network: {egress: [null]}\n", "network.egress[0]", "not_a_string"),
        ("network: {egress: [[a.com]]}\n", "network.egress[0]", "not_a_string"),
        ("network: {egress: [{a: b}]}\n", "network.egress[0]", "not_a_string"),
    ],
)
def test_shapes(text: str, path: str, reason: str) -> None:
    assert reasons(load_manifest(text))[path] == reason


def test_duplicates_and_covered_entries_are_warnings() -> None:
    m = load_manifest("network:\n  egress: [github.com, api.github.com, github.com]\n")
    assert m.ok
    found = {(f.path, f.reason, f.severity) for f in m.findings}
    assert ("network.egress[2]", "duplicate", "warning") in found
    assert ("network.egress[1]", "redundant", "warning") in found
    assert [r.id for r in m.rules] == ["network.egress[0]", "network.egress[1]"]


@pytest.mark.parametrize("block", ["repos: [acme/app]", "choose: {target: {can: [read]}}"])
def test_access_github_adds_github_hosts(block: str) -> None:
    m = load_manifest(f"access:\n  github:\n    {block}\n")
    assert [(r.id, r.host, r.source) for r in m.rules] == [
        ("access.github", h, "access.github") for h in GITHUB_HOSTS
    ]


def test_access_github_without_repos_or_choose_adds_nothing() -> None:
    assert load_manifest("access:\n  github: {}\n").rules == ()


# -- agent.toml ---------------------------------------------------------------------------

TOML = """
schema_version = 1
[network_access]
allowed = ["*.example.com", "https://api.acme.com/", "pypi.org", "http://h.example.org:8080/v1/x"]
blocked = ["169.254.169.254", "10.0.0.0/8", "evil.example.com", "https://api.acme.com/admin/"]
"""


def test_seed_agent_toml_example() -> None:
    m = load_manifest(TOML, source="agent.toml")
    assert m.format == "agent.toml" and m.mode == "allowlist" and m.ok, m.findings
    by_id = {r.id: r for r in m.rules}
    assert by_id["network_access.allowed[0]"].kind == "subtree"
    assert by_id["network_access.allowed[0]"].host == "example.com"
    url = by_id["network_access.allowed[1]"]
    assert (url.kind, url.scheme, url.host, url.port, url.path) == (
        "url",
        "https",
        "api.acme.com",
        443,
        "/",
    )
    assert by_id["network_access.allowed[2]"].kind == "exact"
    assert by_id["network_access.allowed[3]"].port == 8080
    assert str(by_id["network_access.blocked[0]"].network) == "169.254.169.254/32"
    assert str(by_id["network_access.blocked[1]"].network) == "10.0.0.0/8"
    assert by_id["network_access.blocked[2]"].action == "block"


@pytest.mark.parametrize(
    ("source", "text", "fmt"),
    [
        ("agent.toml", "name = 'x'\n", "agent.toml"),
        ("agent.yaml", "network_access: {allowed: [a.com]}\n", "agent.toml"),
        ("agent.yaml", "schema_version: 1\n", "agent.toml"),
        ("agent.json", '{"network_access": null}', "agent.toml"),
        ("agent.json", '{"network": {"egress": []}}', "agent.yaml"),
        ("manifest", "network: {egress: [a.com]}\n", "agent.yaml"),
    ],
)
def test_format_detection(source: str, text: str, fmt: str) -> None:
    assert load_manifest(text, source=source).format == fmt


def test_format_override() -> None:
    m = load_manifest("network_access: {allowed: [a.com]}\n", format="agent.yaml")
    assert m.format == "agent.yaml" and m.rules == ()
    with pytest.raises(PolicyError) as info:
        load_manifest("a: 1\n", format="agent.json")  # type: ignore[arg-type]
    assert info.value.reason == "unknown_format"


def test_empty_or_absent_allowed_inherits() -> None:
    assert load_manifest("schema_version = 1\n", source="a.toml").mode == "inherit"
    m = load_manifest("[network_access]\nallowed = []\nblocked = ['x.com']\n", source="a.toml")
    assert m.mode == "inherit" and [r.action for r in m.rules] == ["block"]


@pytest.mark.parametrize(
    ("pattern", "where", "reason"),
    [
        ("*.*.example.com", "allowed", "wildcard"),
        ("a.*.example.com", "allowed", "wildcard"),
        ("ftp://example.com/", "allowed", "scheme"),
        ("HTTPS://example.com/", "allowed", "scheme"),
        ("https://example.com/api/../admin/", "allowed", "not_canonical"),
        ("https://example.com/a?b=1", "allowed", "url_query"),
        ("https://u@example.com/", "allowed", "url_userinfo"),
        ("https://example.com:99999/", "allowed", "port"),
        ("https://localhost/", "allowed", "loopback_name"),
        ("example.com:8443", "allowed", "port"),
        ("10.0.0.0/8", "allowed", "cidr_not_allowed"),
        ("10.0.0.1", "allowed", "non_public_address"),
        ("127.1", "allowed", "ip_address"),
        ("Example.com", "blocked", "not_canonical"),
        ("10.0.0.1/8", "blocked", "invalid_cidr"),
        ("10.0.0.0/33", "blocked", "invalid_cidr"),
        ("10.0.0.0/99999999999999999999", "blocked", "invalid_cidr"),
        ("::/-1", "blocked", "invalid_cidr"),
        ("10.0.0.0/33", "allowed", "invalid_cidr"),
    ],
)
def test_toml_patterns_refused(pattern: str, where: str, reason: str) -> None:
    text = f"[network_access]\n{where} = [{json.dumps(pattern)}]\n"
    m = load_manifest(text, source="agent.toml")
    assert reasons(m) == {f"network_access.{where}[0]": reason}, m.findings


def test_toml_blocked_may_name_internal_names_and_addresses() -> None:
    text = "[network_access]\nblocked = ['*.internal', 'metadata.google.internal', 'fd00::/8']\n"
    assert load_manifest(text, source="agent.toml").ok


def test_toml_allowed_public_ip_literal() -> None:
    m = load_manifest("[network_access]\nallowed = ['93.184.216.34']\n", source="a.toml")
    assert m.ok and m.rules[0].kind == "address"


def test_toml_unknown_keys_and_schema_version() -> None:
    m = load_manifest("schema_version = 2\n[network_access]\nallow = []\n", source="a.toml")
    assert reasons(m) == {
        "schema_version": "unsupported_schema_version",
        "network_access.allow": "unknown_key",
    }
    m = load_manifest('{"schema_version": true}', source="a.json")
    assert reasons(m) == {"schema_version": "unsupported_schema_version"}


def test_toml_allowed_and_blocked_overlap_warns() -> None:
    text = "[network_access]\nallowed = ['a.example.com']\nblocked = ['*.example.com']\n"
    m = load_manifest(text, source="a.toml")
    assert m.ok
    assert reasons(m) == {"network_access.allowed[0]": "allowed_and_blocked"}


def test_unparsable_manifests_raise_policy_error_with_location() -> None:
    with pytest.raises(PolicyError) as info:
        load_manifest(b"network:\n  egress: [a.com\n", source="agent.yaml")
    assert info.value.reason == "yaml_syntax" and info.value.line is not None
    with pytest.raises(PolicyError) as info:
        load_manifest(b"- a\n- b\n", source="agent.yaml")
    assert info.value.reason == "not_a_mapping"


def test_ten_thousand_entries() -> None:
    hosts = [f"h{i}.example{i % 97}.com" for i in range(10_000)]
    m = load_manifest(json.dumps({"network": {"egress": hosts}}), source="big.json")
    assert m.ok and len(m.rules) == 10_000


def test_value_in_findings_is_bounded() -> None:
    m = load_manifest(json.dumps({"network": {"egress": ["a" * 100_000]}}), source="a.json")
    assert len(m.findings[0].to_json()["value"]) < 300
    assert len(m.findings[0].message) < 1000


def test_too_many_entries_is_a_finding_not_a_hang() -> None:
    from policy.manifests import MAX_ENTRIES

    text = json.dumps({"network": {"egress": ["a.com"] * (MAX_ENTRIES + 1)}})
    m = load_manifest(text, source="big.json")
    assert [(f.path, f.reason) for f in m.findings] == [("network.egress", "too_many_entries")]


def test_non_string_message_names_the_type() -> None:
    m = load_manifest("network: {egress: [1, true, [a]]}\n")
    assert [f.message.rsplit(" ", 2)[-2:] for f in m.findings] == [
        ["a", "number"],
        ["a", "boolean"],
        ["a", "list"],
    ]


@pytest.mark.parametrize(
    ("text", "source", "shown"),
    [
        ("schema_version: 0x1\nnetwork_access: {}\n", "a.yaml", "schema_version is 0x1;"),
        ("schema_version: true\nnetwork_access: {}\n", "a.yaml", "schema_version is true;"),
        ('{"schema_version": 1.0, "network_access": {}}', "a.json", "schema_version is 1.0;"),
        ("schema_version = 2\n", "a.toml", "schema_version is 2;"),
    ],
)
def test_a_schema_version_other_than_the_integer_1_is_shown_as_written(
    text: str, source: str, shown: str
) -> None:
    (finding,) = load_manifest(text, source=source).findings
    assert finding.reason == "unsupported_schema_version" and shown in finding.message


def test_a_key_in_a_finding_path_is_bounded() -> None:
    key = "9" * 5000
    m = load_manifest('{"network": {"' + key + '": 1, "443": 2}}', source="a.json")
    paths = [f.path for f in m.findings]
    assert paths[0] == "network." + "9" * 99 + "…" and paths[1] == "network.443"
    assert all(len(f.message) < 500 for f in m.findings)
    m = load_manifest("network:\n  443: x\n  true: y\n", source="a.yaml")
    assert [f.path for f in m.findings] == ["network.443", "network.true"]
