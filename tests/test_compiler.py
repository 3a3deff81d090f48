"""Decisions: the name stage (`Policy.decide`) and the address stage (`check_addresses`)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import (
    AddressRules,
    OperatorRules,
    PlatformDestination,
    Policy,
    PolicyError,
    compile_policy,
    load_ceiling,
    load_manifest,
)


def yaml_policy(
    entries: list[str],
    ceiling: list[str] | None = None,
    mode: str = "allowlist",
    operator: OperatorRules | None = None,
) -> Policy:
    text = f"network:\n  egress_mode: {mode}\n  egress: {entries!r}\n"
    c = (
        load_ceiling(f"tenant: acme\negress: {ceiling!r}\n", source="ceiling.yaml")
        if ceiling is not None
        else None
    )
    return compile_policy(load_manifest(text, source="agent.yaml"), c, operator)


def toml_policy(
    allowed: list[str],
    blocked: list[str] = (),
    ceiling: list[str] | None = None,
    operator: OperatorRules | None = None,
) -> Policy:
    text = f"[network_access]\nallowed = {list(allowed)!r}\nblocked = {list(blocked)!r}\n"
    c = load_ceiling(f"egress: {ceiling!r}\n") if ceiling is not None else None
    return compile_policy(load_manifest(text, source="agent.toml"), c, operator)


def outcome(policy: Policy, target: str) -> tuple[bool, str, str | None]:
    d = policy.decide(target)
    return d.allowed, d.reason, d.rule


SEED = yaml_policy(["github.com", "api.example.com"])


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("github.com", (True, "allowed", "network.egress[0]")),
        ("api.github.com:443", (True, "allowed", "network.egress[0]")),
        ("a.b.github.com", (True, "allowed", "network.egress[0]")),
        ("GitHub.COM.", (True, "allowed", "network.egress[0]")),
        ("https://api.github.com/repos/x", (True, "allowed", "network.egress[0]")),
        ("api.example.com", (True, "allowed", "network.egress[1]")),
        ("example.com", (False, "not_allowed", None)),
        ("notgithub.com", (False, "not_allowed", None)),
        ("github.com.example", (False, "not_allowed", None)),
        ("github.com.evil.test", (False, "not_allowed", None)),
        ("140.82.121.4:443", (False, "ip_literal", None)),
        ("127.1", (False, "ip_literal", None)),
        ("0x7f.1", (False, "ip_literal", None)),
        ("2130706433", (False, "ip_literal", None)),
        ("[::1]:443", (False, "ip_literal", None)),
        ("[::ffff:127.0.0.1]:443", (False, "ip_literal", None)),
        ("localhost:80", (False, "loopback_name", None)),
        ("github:443", (False, "single_label", None)),
        ("a b.com", (False, "invalid_target", None)),
        ("github.com:0", (False, "invalid_port", None)),
    ],
)
def test_seed_semantics(target: str, expected: tuple[bool, str, str | None]) -> None:
    assert outcome(SEED, target) == expected


def test_decision_names_host_port_and_message() -> None:
    d = SEED.decide("API.GitHub.com:8443")
    assert (d.host, d.port, d.stage, d.needs_inspection) == ("api.github.com", 8443, "name", False)
    assert "api.github.com" in d.message and "network.egress[0]" in d.message
    denied = SEED.decide("evil.com")
    assert "evil.com" in denied.message and not denied.allowed


def test_ceiling_intersection_narrows_to_the_ceiling() -> None:
    policy = yaml_policy(["github.com", "pypi.org"], ceiling=["api.github.com", "pypi.org"])
    assert outcome(policy, "api.github.com") == (True, "allowed", "network.egress[0]")
    assert policy.decide("x.api.github.com").ceiling == "ceiling.egress[0]"
    assert outcome(policy, "github.com") == (False, "outside_ceiling", "network.egress[0]")
    assert outcome(policy, "www.github.com") == (False, "outside_ceiling", "network.egress[0]")
    assert outcome(policy, "files.pypi.org") == (True, "allowed", "network.egress[1]")
    # A ceiling lowered after deploy narrows: it compiles, and the finding is kept.
    assert [f.reason for f in policy.findings] == ["outside_ceiling"]


def test_ceiling_never_widens() -> None:
    policy = yaml_policy(["api.github.com"], ceiling=["github.com"])
    assert outcome(policy, "a.api.github.com")[0]
    assert outcome(policy, "github.com") == (False, "not_allowed", None)
    assert outcome(policy, "www.github.com") == (False, "not_allowed", None)


def test_empty_ceiling_admits_nothing() -> None:
    policy = yaml_policy(["github.com"], ceiling=[])
    assert outcome(policy, "github.com") == (False, "outside_ceiling", "network.egress[0]")


def test_public_mode() -> None:
    policy = yaml_policy([], mode="public")
    assert outcome(policy, "anything.example.org") == (True, "allowed", "network.egress_mode")
    assert outcome(policy, "x.internal")[1] == "internal_name"
    assert outcome(policy, "localhost")[1] == "loopback_name"
    assert outcome(policy, "10.0.0.1")[1] == "ip_literal"
    # At run time a ceiling still narrows public mode (check refuses the combination).
    narrowed = yaml_policy([], ceiling=["pypi.org"], mode="public")
    assert outcome(narrowed, "pypi.org") == (True, "allowed", "network.egress_mode")
    assert outcome(narrowed, "github.com")[0] is False


def test_operator_internal_suffixes_refuse_names_at_run_time() -> None:
    policy = yaml_policy(
        [], mode="public", operator=OperatorRules(internal_suffixes=("corp.example",))
    )
    assert outcome(policy, "wiki.corp.example")[1] == "internal_name"
    assert outcome(policy, "corp.example.org")[0] is True


def test_toml_exact_versus_wildcard() -> None:
    policy = toml_policy(["example.com", "*.acme.com"])
    assert outcome(policy, "example.com") == (True, "allowed", "network_access.allowed[0]")
    assert outcome(policy, "www.example.com") == (False, "not_allowed", None)
    assert outcome(policy, "acme.com")[0] and outcome(policy, "a.b.acme.com")[0]


def test_blocked_always_wins() -> None:
    policy = toml_policy(["*.example.com"], ["evil.example.com", "*.worse.example.com"])
    assert outcome(policy, "evil.example.com") == (False, "blocked", "network_access.blocked[0]")
    assert outcome(policy, "x.evil.example.com")[0] is True  # an exact block is exact
    assert outcome(policy, "worse.example.com") == (False, "blocked", "network_access.blocked[1]")
    assert outcome(policy, "a.worse.example.com")[1] == "blocked"
    assert outcome(policy, "fine.example.com")[0] is True


def test_blocks_apply_with_no_allowed_list() -> None:
    policy = toml_policy([], ["*.evil.com"])
    assert outcome(policy, "good.org") == (True, "allowed", "network_access")
    assert outcome(policy, "x.evil.com")[1] == "blocked"


URL = toml_policy(["https://api.acme.com/v1/", "http://plain.acme.com/p"])


@pytest.mark.parametrize(
    ("target", "allowed", "reason", "inspect"),
    [
        ("api.acme.com:443", True, "allowed", True),
        ("api.acme.com", True, "allowed", True),
        ("api.acme.com:8443", False, "not_allowed", False),
        ("https://api.acme.com/v1/", True, "allowed", True),
        ("https://api.acme.com/v1/users?x=1", True, "allowed", True),
        ("wss://api.acme.com/v1/socket", True, "allowed", True),
        ("https://api.acme.com/v1", False, "path_not_allowed", False),
        ("https://api.acme.com/v2/", False, "path_not_allowed", False),
        ("https://api.acme.com/v1/../admin", False, "path_not_allowed", False),
        ("https://api.acme.com/v1/%2e%2e/admin", False, "path_not_allowed", False),
        ("https://api.acme.com/v1/..%2fadmin", False, "ambiguous_path", False),
        ("https://api.acme.com/v1/..;/admin", False, "ambiguous_path", False),
        # RFC 3986 reads /v1/admin; servers that drop ';' and fold '//' read /admin.
        ("https://api.acme.com/v1/;/../admin", False, "ambiguous_path", False),
        ("https://api.acme.com/v1/a;b=c/d", True, "allowed", True),
        ("http://api.acme.com/v1/", False, "not_allowed", False),
        ("http://plain.acme.com/p/x", True, "allowed", False),
        ("http://plain.acme.com/px", False, "path_not_allowed", False),
        ("plain.acme.com:80", True, "allowed", True),
        ("x.api.acme.com", False, "not_allowed", False),
    ],
)
def test_url_prefix_rules(target: str, allowed: bool, reason: str, inspect: bool) -> None:
    d = URL.decide(target)
    assert (d.allowed, d.reason, d.needs_inspection) == (allowed, reason, inspect)


def test_url_rules_refused_when_inspection_is_disabled() -> None:
    policy = toml_policy(
        ["https://api.acme.com/v1/", "http://plain.acme.com/"],
        operator=OperatorRules(inspection_enabled=False),
    )
    d = policy.decide("api.acme.com:443")
    assert (d.allowed, d.reason) == (False, "inspection_disabled")
    assert "inspection" in d.message
    assert policy.decide("https://api.acme.com/v1/x").reason == "inspection_disabled"
    # Plain HTTP is seen whole by the engine: no TLS inspection is needed.
    assert policy.decide("http://plain.acme.com/x").allowed


def test_blocked_url_prefix_on_an_allowed_host() -> None:
    policy = toml_policy(["*.acme.com"], ["https://api.acme.com/admin/"])
    d = policy.decide("api.acme.com:443")
    assert (d.allowed, d.needs_inspection) == (True, True)
    # The block holds on every port, so every tunnel to the host is inspected.
    assert policy.decide("api.acme.com:8443").needs_inspection is True
    assert policy.decide("https://api.acme.com/admin/users").reason == "blocked"
    assert policy.decide("https://api.acme.com/ADMIN/users").reason == "blocked"
    assert policy.decide("https://api.acme.com/x/../admin/").reason == "blocked"
    assert policy.decide("https://api.acme.com/admin;jsessionid=1/users").reason == "blocked"
    assert policy.decide("https://api.acme.com/admin").reason == "blocked"
    assert policy.decide("https://api.acme.com/administrator").allowed
    assert policy.decide("https://api.acme.com/public").allowed
    assert policy.decide("www.acme.com:443").needs_inspection is False


# -- issue 11: paths on every reading, blocked prefixes on every scheme and port, brackets ----

PATHS = toml_policy(["https://ok.test/api/", "*.acme.com"], ["https://h.acme.com/admin/"])


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("https://ok.test/api/x", "allowed"),
        ("https://ok.test/api/x//y", "allowed"),
        # RFC 3986 (WHATWG, Node) reads /x/api/: outside, though folding '//' first gives /api/.
        ("https://ok.test/x//../api/", "path_not_allowed"),
        ("https://ok.test/x/.//../api/", "path_not_allowed"),
        # RFC 3986 reads /api/x, nginx and Go fold '//' first and read /x.
        ("https://ok.test/api//../x", "ambiguous_path"),
        ("https://ok.test/api/a/.//../../x", "ambiguous_path"),
        ("https://ok.test/api/x/..", "ambiguous_path"),
        ("https://ok.test/api/%2e%2e/x", "path_not_allowed"),
        ("https://ok.test/api/%2561", "ambiguous_path"),
        ("https://ok.test/api/..%20/x", "ambiguous_path"),
        ("https://ok.test/api/#/../../x", "ambiguous_path"),
        ("https://ok.test/api./x", "path_not_allowed"),
    ],
)
def test_a_path_is_decided_on_every_reading(target: str, reason: str) -> None:
    d = PATHS.decide(target)
    assert (d.allowed, d.reason) == (reason == "allowed", reason), d.message


def test_a_refused_path_names_the_reading_that_fails() -> None:
    d = PATHS.decide("https://ok.test/api//../x")
    assert "/x" in d.message and "folded" in d.message and "nginx" in d.message
    d = PATHS.decide("https://ok.test/x//../api/")
    assert "/x/api/" in d.message and "RFC 3986" in d.message


BLOCKED_SPELLINGS = [
    "/admin/",
    "/admin",
    "/ADMIN",
    "/Admin/users",
    "/admin./",
    "/admin.",
    "/admin%20/",
    "/admin;x/",
    "/admin;jsessionid=1/users",
    "/%61dmin/",
    "//admin/",
    "/x/../admin/",
    "/admin//../x",
    "/admin/../x",
    "/admin::$DATA/",
]


@pytest.mark.parametrize("scheme", ["https://", "http://", "wss://", "ws://"])
@pytest.mark.parametrize("port", ["", ":8443", ":80", ":8080", ":1"])
@pytest.mark.parametrize("path", BLOCKED_SPELLINGS)
def test_a_blocked_prefix_holds_on_every_scheme_and_spelling(
    scheme: str, port: str, path: str
) -> None:
    d = PATHS.decide(f"{scheme}h.acme.com{port}{path}")
    assert (d.allowed, d.reason, d.rule) == (False, "blocked", "network_access.blocked[0]")


@pytest.mark.parametrize("path", ["/%2561dmin/", "/%252e%252e/admin/", "/admin%2f"])
def test_a_blocked_prefix_spelled_in_a_refused_form_is_denied(path: str) -> None:
    for scheme in ("https", "http", "wss"):
        d = PATHS.decide(f"{scheme}://h.acme.com:8443{path}")
        assert (d.allowed, d.reason) == (False, "ambiguous_path"), d


def test_a_blocked_prefix_leaves_the_rest_of_the_host_open() -> None:
    for target in ("https://h.acme.com/public", "http://h.acme.com:8080/administrator"):
        assert PATHS.decide(target).allowed, target


@pytest.mark.parametrize(
    ("target", "inspect"),
    [
        ("h.acme.com", True),
        ("h.acme.com:443", True),
        ("h.acme.com:8443", True),
        ("h.acme.com:80", True),  # a CONNECT: what goes inside is not known before the hello
        ("https://h.acme.com:8443/public", True),
        ("wss://h.acme.com:9443/socket", True),
        ("http://h.acme.com:8080/public", False),  # plain HTTP is seen whole per request
        ("ws://h.acme.com/socket", False),
        ("www.acme.com:8443", False),  # no blocked path there
    ],
)
def test_a_blocked_prefix_needs_inspection_on_every_tls_port(target: str, inspect: bool) -> None:
    d = PATHS.decide(target)
    assert (d.allowed, d.needs_inspection) == (True, inspect), d


def test_without_inspection_every_tls_port_of_a_blocked_prefix_host_is_refused() -> None:
    policy = toml_policy(
        ["*.acme.com"],
        ["https://h.acme.com/admin/"],
        operator=OperatorRules(inspection_enabled=False),
    )
    for target in ("h.acme.com:443", "h.acme.com:8443", "https://h.acme.com:9443/x"):
        assert policy.decide(target).reason == "inspection_disabled", target
    assert policy.decide("http://h.acme.com:8080/x").allowed


def test_allowed_prefixes_stay_exact() -> None:
    for target in (
        "http://ok.test/api/x",
        "https://ok.test:8443/api/x",
        "ws://ok.test/api/x",
        "https://ok.test/API/x",
    ):
        d = PATHS.decide(target)
        assert not d.allowed and d.reason in ("not_allowed", "path_not_allowed"), target


def test_a_blocked_url_rule_names_no_scheme_or_port() -> None:
    (rule,) = [r for r in PATHS.rules_json() if r["action"] == "block"]
    assert (rule["kind"], rule["host"], rule["path"]) == ("url", "h.acme.com", "/admin/")
    assert (rule["scheme"], rule["port"]) == (None, None)


@pytest.mark.parametrize(
    "target",
    [
        "[github.com]",
        "[github.com]:443",
        "[GITHUB.COM.]:443",
        "https://[github.com]/",
        "wss://[github.com]:443/x",
        "[1.2.3.4]:443",
        "[]:443",
        "[api.github.com]",
    ],
)
def test_brackets_around_a_name_are_an_invalid_host(target: str) -> None:
    d = SEED.decide(target)
    assert (d.allowed, d.reason) == (False, "invalid_host"), d
    assert "IPv6" in d.message


@pytest.mark.parametrize("target", ["[::1]:443", "[2606:4700::1111]", "[fe80::1%eth0]:443"])
def test_brackets_around_an_ipv6_literal_are_an_ip_literal(target: str) -> None:
    assert SEED.decide(target).reason == "ip_literal"


def test_operator_ports() -> None:
    policy = yaml_policy(["github.com"], operator=OperatorRules(ports=frozenset({443})))
    assert outcome(policy, "github.com:443")[0]
    assert outcome(policy, "github.com:22") == (False, "port_not_allowed", "ports")


GATEWAY = PlatformDestination(
    "platform_destinations[0]",
    "gateway.svc.cluster.local",
    frozenset({443}),
    tuple(AddressRules.from_strings(allow=["10.96.0.0/12"]).allow),
)
PLATFORM = yaml_policy(
    ["github.com"], ceiling=[], operator=OperatorRules(platform_destinations=(GATEWAY,))
)


def test_platform_destinations_bypass_manifest_and_ceiling() -> None:
    assert outcome(PLATFORM, "gateway.svc.cluster.local:443") == (
        True,
        "platform_destination",
        "platform_destinations[0]",
    )
    assert outcome(PLATFORM, "gateway.svc.cluster.local:80")[1] == "port_not_allowed"
    assert outcome(PLATFORM, "other.svc.cluster.local:443")[1] == "internal_name"


def test_platform_cidrs_at_the_address_stage() -> None:
    ok = PLATFORM.check_addresses("gateway.svc.cluster.local", ["10.96.0.10"])
    assert ok.allowed and ok.pinned == ("10.96.0.10",)
    assert ok.verdicts[0].reason == "platform_cidr"
    outside = PLATFORM.check_addresses("gateway.svc.cluster.local", ["10.1.0.1"])
    assert (outside.allowed, outside.reason) == (False, "outside_platform_cidrs")
    public_outside = PLATFORM.check_addresses("gateway.svc.cluster.local", ["8.8.8.8"])
    assert public_outside.reason == "outside_platform_cidrs"


def test_platform_cidrs_never_excuse_metadata() -> None:
    meta = PlatformDestination(
        "platform_destinations[0]",
        "gw.example.com",
        frozenset({80}),
        tuple(AddressRules.from_strings(allow=["169.254.0.0/16"]).allow),
    )
    policy = yaml_policy([], operator=OperatorRules(platform_destinations=(meta,)))
    d = policy.check_addresses("gw.example.com", ["169.254.169.254"])
    assert (d.allowed, d.reason) == (False, "metadata")


def test_platform_host_in_a_manifest_is_a_deploy_finding() -> None:
    manifest = load_manifest("network: {egress: [svc.cluster.example, github.com]}\n")
    gw = PlatformDestination("platform_destinations[0]", "gw.svc.cluster.example", frozenset({443}))
    policy = compile_policy(manifest, None, OperatorRules(platform_destinations=(gw,)))
    assert [(f.path, f.reason) for f in policy.findings] == [
        ("network.egress[0]", "platform_destination")
    ]


# -- address stage ----------------------------------------------------------------------------


def test_address_stage_public_answer_is_pinned() -> None:
    d = SEED.check_addresses("github.com", ["140.82.121.4", "2606:4700::1111"])
    assert d.allowed and d.reason == "allowed" and d.stage == "address"
    assert d.pinned == ("140.82.121.4", "2606:4700::1111")


@pytest.mark.parametrize(
    ("addresses", "reason"),
    [
        (["127.0.0.1"], "loopback"),
        (["10.0.0.1", "192.168.1.1"], "private"),
        (["140.82.121.4", "10.0.0.1"], "mixed_answer"),
        (["2606:4700::1111", "::1"], "mixed_answer"),
        (["169.254.169.254"], "metadata"),
        (["168.63.129.16"], "metadata"),
        (["64:ff9b::a00:1"], "nat64"),
        (["::ffff:8.8.8.8"], "ipv4_mapped"),
        (["224.0.0.1"], "multicast"),
        (["not an address"], "invalid_address"),
        ([], "no_addresses"),
    ],
)
def test_address_stage_refusals(addresses: list[str], reason: str) -> None:
    d = SEED.check_addresses("github.com", addresses)
    assert (d.allowed, d.reason) == (False, reason)
    assert d.pinned == ()


def test_operator_allow_and_deny_at_the_address_stage() -> None:
    rules = AddressRules.from_strings(allow=["127.0.0.0/8"], deny=["140.82.112.0/20"])
    policy = yaml_policy(["github.com"], operator=OperatorRules(addresses=rules))
    assert policy.check_addresses("github.com", ["127.0.0.1"]).allowed
    assert policy.check_addresses("github.com", ["140.82.121.4"]).reason == "operator_deny"
    assert policy.check_addresses("github.com", ["169.254.169.254"]).reason == "metadata"


def test_blocked_addresses_block_names_that_resolve_to_them() -> None:
    policy = toml_policy(["*.example.com"], ["93.184.216.0/24", "2001:4860::/32"])
    d = policy.check_addresses("www.example.com", ["93.184.216.34"])
    assert (d.allowed, d.reason, d.rule) == (False, "blocked_address", "network_access.blocked[0]")
    d6 = policy.check_addresses("www.example.com", ["8.8.8.8", "2001:4860::8888"])
    assert (d6.allowed, d6.reason) == (False, "mixed_answer")
    assert policy.decide("93.184.216.34").reason == "blocked"


def test_allowed_ip_literal_in_agent_toml() -> None:
    policy = toml_policy(["93.184.216.34"])
    assert outcome(policy, "93.184.216.34:443") == (True, "allowed", "network_access.allowed[0]")
    assert outcome(policy, "93.184.216.35:443")[1] == "ip_literal"
    assert outcome(policy, "1572395042")[1] == "ip_literal"  # the same address, other spelling
    assert policy.check_addresses("93.184.216.34", ["93.184.216.34"]).allowed
    # A hostname ceiling cannot admit an address.
    capped = toml_policy(["93.184.216.34"], ceiling=["example.com"])
    assert outcome(capped, "93.184.216.34")[1] == "ip_literal"


def test_cname_chain_through_sandbox_names_is_refused() -> None:
    d = SEED.check_addresses(
        "github.com", ["140.82.121.4"], cname_chain=["lb.github.com", "node.svc.cluster.local"]
    )
    assert (d.allowed, d.reason) == (False, "internal_cname")
    assert SEED.check_addresses(
        "github.com", ["140.82.121.4"], cname_chain=["github.map.fastly.net"]
    ).allowed


def test_invalid_manifest_does_not_compile() -> None:
    with pytest.raises(PolicyError) as info:
        compile_policy(load_manifest("network: {egress: ['*.a.com', B.com]}\n"))
    assert info.value.reason == "invalid_manifest" and len(info.value.details) == 2


@settings(max_examples=500)
@given(st.text(max_size=80))
def test_decide_never_raises(target: str) -> None:
    d = SEED.decide(target)
    assert isinstance(d.allowed, bool) and d.reason
    if d.allowed:
        assert (
            d.host == "github.com"
            or d.host.endswith((".github.com", ".api.example.com"))
            or d.host == "api.example.com"
        )


@settings(max_examples=200)
@given(st.lists(st.text(max_size=40), max_size=4), st.lists(st.text(max_size=20), max_size=3))
def test_check_addresses_never_raises(addresses: list[str], chain: list[str]) -> None:
    d = SEED.check_addresses("github.com", addresses, cname_chain=chain)
    assert isinstance(d.allowed, bool) and d.reason
