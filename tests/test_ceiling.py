import pytest

from policy import PolicyError, check_manifest, load_ceiling, load_manifest


def test_ceiling_loads_tenant_and_entries() -> None:
    c = load_ceiling("tenant: northwind\negress: [github.com, pypi.org]\n", source="c.yaml")
    assert c.tenant == "northwind"
    assert [(r.id, r.host) for r in c.rules] == [
        ("ceiling.egress[0]", "github.com"),
        ("ceiling.egress[1]", "pypi.org"),
    ]
    assert "northwind" in c.label and "c.yaml" in c.label


def test_empty_ceiling_is_nothing_and_json_works() -> None:
    assert load_ceiling('{"egress": []}', source="c.json").rules == ()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("egress: ['*.github.com']\n", "wildcard"),
        ("egress: [GitHub.com]\n", "not_canonical"),
        ("egress: [1]\n", "not_a_string"),
        ("egress: github.com\n", "not_a_list"),
        ("egress:\n", "not_a_list"),
        ("tenant: x\n", "missing_key"),
        ("tenant: ''\negress: []\n", "invalid_tenant"),
        ("egress: []\nceiling: []\n", "unknown_key"),
    ],
)
def test_bad_ceilings_refused_whole(text: str, reason: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_ceiling(text, source="c.yaml")
    assert info.value.reason == "invalid_ceiling"
    assert [d.reason for d in info.value.details] == [reason]
    assert info.value.details[0].file == "c.yaml"


def test_every_problem_is_listed() -> None:
    with pytest.raises(PolicyError) as info:
        load_ceiling("egress: ['*.a.com', B.com, 3, ok.com]\nextra: 1\n", source="c.yaml")
    assert len(info.value.details) == 4


def test_deploy_check_names_entry_and_ceiling() -> None:
    ceiling = load_ceiling("tenant: acme\negress: [github.com]\n", source="ceiling.yaml")
    manifest = load_manifest("network:\n  egress: [api.github.com, example.org]\n")
    findings = check_manifest(manifest, ceiling)
    assert [(f.path, f.reason) for f in findings] == [("network.egress[1]", "outside_ceiling")]
    message = findings[0].message
    assert "example.org" in message and "acme" in message and "ceiling.yaml" in message


def test_entry_wider_than_the_ceiling_fails_the_deploy_check() -> None:
    ceiling = load_ceiling("egress: [api.github.com]\n")
    findings = check_manifest(load_manifest("network: {egress: [github.com]}\n"), ceiling)
    assert [f.reason for f in findings] == ["outside_ceiling"]


def test_public_mode_with_a_ceiling_is_refused_and_without_one_is_fine() -> None:
    manifest = load_manifest("network: {egress_mode: public}\n")
    assert check_manifest(manifest) == ()
    findings = check_manifest(manifest, load_ceiling("egress: [a.com]\n"))
    assert [(f.path, f.reason) for f in findings] == [
        ("network.egress_mode", "public_mode_with_ceiling")
    ]


def test_access_github_is_checked_against_the_ceiling() -> None:
    manifest = load_manifest("access: {github: {repos: [a/b]}}\n")
    findings = check_manifest(manifest, load_ceiling("egress: [pypi.org]\n"))
    assert [f.path for f in findings] == ["access.github", "access.github"]


def test_agent_toml_patterns_are_checked_against_the_ceiling() -> None:
    text = "[network_access]\nallowed = ['*.acme.com', 'https://api.other.com/x/', 'a.acme.com']\n"
    findings = check_manifest(
        load_manifest(text, source="a.toml"), load_ceiling("egress: [acme.com]\n")
    )
    assert [f.path for f in findings if f.is_error] == ["network_access.allowed[1]"]


@pytest.mark.parametrize(
    ("text", "source", "path"),
    [
        ("egress: [12345, github.com]\n", "c.yaml", "egress[0]"),
        ("egress: [123.45]\n", "c.yaml", "egress[0]"),
        ("egress: [0x1bb]\n", "c.yaml", "egress[0]"),
        ("egress: [on]\n", "c.yaml", "egress[0]"),
        ('{"egress": [-0]}', "c.json", "egress[0]"),
        ("egress = [1e300]\n", "c.toml", "egress[0]"),
        ("tenant: 5\negress: []\n", "c.yaml", "tenant"),
        ("443: x\negress: []\n", "c.yaml", "443"),
    ],
)
def test_a_number_where_a_ceiling_holds_text_is_named_at_its_path(
    text: str, source: str, path: str
) -> None:
    with pytest.raises(PolicyError) as info:
        load_ceiling(text, source=source)
    assert path in [d.path for d in info.value.details]


def test_a_number_out_of_bounds_in_a_ceiling_is_refused_where_it_stands() -> None:
    with pytest.raises(PolicyError) as info:
        load_ceiling("tenant: t\negress: [github.com, " + "9" * 5000 + "]\n", source="c.yaml")
    assert (info.value.reason, info.value.line, info.value.column) == ("number_out_of_range", 2, 22)


def test_the_label_of_a_ceiling_bounds_its_tenant() -> None:
    ceiling = load_ceiling(f"tenant: {'t' * 100_000}\negress: []\n", source="c.yaml")
    assert len(ceiling.label) < 300
