"""The operator config (proxy/config.py): every key, its accepted spellings, and refusals that
name the key at fault. Scripts outside this repo write these files, so key names and the
"all problems at once" behaviour are a contract."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import PolicyError, classify
from proxy.app.config import Config, Limits, Nameserver, load_config, parse_duration
from proxy.common.errors import ProxyError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(document: dict[str, Any] | str, source: str = "config.yaml") -> Config:
    text = document if isinstance(document, str) else yaml.safe_dump(document)
    return load_config(text, source=source)


def problems(document: dict[str, Any] | str, source: str = "config.yaml") -> dict[str, Any]:
    """path -> finding, for a config that must be refused."""
    with pytest.raises(ProxyError) as info:
        load(document, source)
    err = info.value
    assert err.reason == "invalid_config"
    assert err.source == source
    assert err.details, "a refused config lists its problems"
    return {f.path: f for f in err.details}


def test_the_example_config_loads_every_key() -> None:
    config = load_config((EXAMPLES / "config.yaml").read_bytes(), source="config.yaml")
    assert config.nameservers == (Nameserver("127.0.0.1", 5353),)
    assert config.dns_timeout == 2.0
    op = config.operator
    assert op.addresses.allow == ()
    assert op.addresses.deny == (ipaddress.ip_network("203.0.113.0/24"),)
    assert op.addresses.in_cluster == (ipaddress.ip_network("10.96.0.0/12"),)
    (gateway,) = op.platform_destinations
    assert gateway.id == "platform_destinations[0]"
    assert gateway.host == "gateway.platform.svc.cluster.local"
    assert gateway.ports == frozenset({443})
    assert gateway.cidrs == (ipaddress.ip_network("10.96.0.0/12"),)
    assert op.ports == frozenset({80, 443, 22}) and op.opaque_ports == frozenset({22})
    assert config.attribution_grace == 300.0
    assert op.inspection_enabled is True
    assert config.ca_dir == "~/.local/share/egress-proxy/ca"
    assert config.limits == Limits(10.0, 600.0, 10.0, 1024)
    assert op.internal_suffixes == ("corp.example",)
    assert config.tls_ech == "allow"
    assert config.source == "config.yaml"


def test_an_empty_mapping_means_defaults() -> None:
    config = load("{}\n")
    assert config.nameservers is None  # the system's resolv.conf
    assert config.dns_timeout == 5.0
    assert config.operator.ports is None  # any port
    assert config.operator.inspection_enabled is True
    assert config.operator.platform_destinations == ()
    assert config.limits == Limits()


def test_null_sections_mean_defaults() -> None:
    config = load("dns:\naddresses:\ninspection:\nlimits:\nports:\n")
    assert config.limits == Limits() and config.operator.ports is None


# -- dns -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.2", Nameserver("10.0.0.2", 53)),
        ("10.0.0.2:5353", Nameserver("10.0.0.2", 5353)),
        ("[fd00::2]:53", Nameserver("fd00::2", 53)),
        ("[fd00::2]:5353", Nameserver("fd00::2", 5353)),
        ("fd00::2", Nameserver("fd00::2", 53)),
        ("[fd00::2]", Nameserver("fd00::2", 53)),
    ],
)
def test_nameserver_spellings(text: str, expected: Nameserver) -> None:
    assert load({"dns": {"nameservers": [text]}}).nameservers == (expected,)


@pytest.mark.parametrize(
    "value",
    [
        "dns.example.com",
        "10.0.0.2:0",
        "10.0.0.2:65536",
        "10.0.0.2:x",
        "[10.0.0.2]:53",
        "[fd00::2",
        "127.1",
        "fe80::1%eth0",
        "",
        53,
        None,
        ["10.0.0.2"],
    ],
)
def test_bad_nameserver_is_named_by_index(value: object) -> None:
    found = problems({"dns": {"nameservers": ["10.0.0.1", value]}})
    assert list(found) == ["dns.nameservers[1]"]
    assert found["dns.nameservers[1]"].reason == "invalid_value"


def test_nameservers_must_be_a_non_empty_list() -> None:
    assert problems({"dns": {"nameservers": []}})["dns.nameservers"].reason == "empty_list"
    # Not a list: one problem, not also "empty".
    found = problems({"dns": {"nameservers": "10.0.0.2"}})
    assert [(p, f.reason) for p, f in found.items()] == [("dns.nameservers", "not_a_list")]


def test_dns_timeout() -> None:
    assert load({"dns": {"timeout": "2s"}}).dns_timeout == 2.0
    assert problems({"dns": {"timeout": 2}})["dns.timeout"].reason == "invalid_value"


# -- durations -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2s", 2), ("45s", 45), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("1h2m3s", 3723)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert load({"limits": {"idle_timeout": text}}).limits.idle_timeout == seconds


@pytest.mark.parametrize(
    "value",
    ["1500ms", "0s", "0h0m0s", 5, 5.0, "", "5", "s", "1d", "1.5s", " 2s", "2S", "-1s", "169h",
     True, None, ["2s"], "99999999h", "1e9s", "0x10s", "+5s", "\u0661\u0662s", "9" * 5000 + "s",
     "1h" * 3, 2**64 - 1, -5],
)  # fmt: skip
def test_bad_durations_are_refused(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)
    with pytest.raises(ProxyError) as info:
        load({"limits": {"connect_timeout": value}})
    assert [(f.path, f.reason) for f in info.value.details] == [
        ("limits.connect_timeout", "invalid_value")
    ]
    assert "limits.connect_timeout" in str(info.value)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("99999999h", "longer than the limit of 168h"),
        ("9" * 5000 + "s", "longer than the limit of 168h"),
        ("604801s", "longer than the limit of 168h"),
        (30, "like '30s'"),
        (1.5, "like '2s', '1m30s'"),
        (True, "true is not a duration"),
    ],
)
def test_duration_messages_name_the_limit_and_the_unit(value: object, says: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert says in str(info.value) and len(str(info.value)) < 400


def test_the_longest_duration_is_a_week() -> None:
    assert parse_duration("168h") == parse_duration("604800s") == 7 * 24 * 3600


def test_duration_messages_say_how_to_write_one() -> None:
    found = problems({"limits": {"header_timeout": "1500ms"}})
    assert "'2s'" in found["limits.header_timeout"].message
    assert "zero" in problems({"limits": {"header_timeout": "0s"}})["limits.header_timeout"].message


# -- addresses -------------------------------------------------------------------------------------


def test_address_rules() -> None:
    config = load(
        {
            "addresses": {
                "allow": ["127.0.0.0/8", "::1/128"],
                "deny": ["203.0.113.0/24"],
                "in_cluster": ["10.96.0.0/12", "fd00:10:96::/112"],
            }
        }
    )
    rules = config.operator.addresses
    assert [str(n) for n in rules.allow] == ["127.0.0.0/8", "::1/128"]
    assert [str(n) for n in rules.deny] == ["203.0.113.0/24"]
    assert [str(n) for n in rules.in_cluster] == ["10.96.0.0/12", "fd00:10:96::/112"]
    assert classify("127.0.0.1", rules).reason == "operator_allow"
    assert classify("10.96.0.1", rules).reason == "in_cluster"
    assert classify("203.0.113.9", rules).reason == "operator_deny"


def test_every_bad_cidr_is_reported_at_its_own_index() -> None:
    found = problems(
        {
            "addresses": {
                "allow": [5, "10.0.0.0/8", "10.0.0.1/8"],
                "deny": ["nope", "192.168.0.0/255.255.0.0"],
                "in_cluster": ["fe80::/10", "10.0.0.0/8%eth0", None],
            }
        }
    )
    assert set(found) == {
        "addresses.allow[0]",
        "addresses.allow[2]",
        "addresses.deny[0]",
        "addresses.deny[1]",
        "addresses.in_cluster[1]",
        "addresses.in_cluster[2]",
    }
    assert all(f.reason == "invalid_cidr" for f in found.values())
    assert found["addresses.allow[2]"].value == "10.0.0.1/8"
    assert "write '10.0.0.0/8'" in found["addresses.allow[2]"].message


def test_address_lists_must_be_lists() -> None:
    found = problems({"addresses": {"deny": "10.0.0.0/8", "allow": {"a": 1}}})
    assert found["addresses.deny"].reason == "not_a_list"
    assert found["addresses.allow"].reason == "not_a_list"


# -- platform destinations -------------------------------------------------------------------------


def test_platform_destinations() -> None:
    config = load(
        {
            "platform_destinations": [
                {"host": "gateway.platform.svc.cluster.local", "ports": [443, 8443]},
                {"host": "hooks.example.net", "ports": [443], "cidrs": ["10.0.0.0/8", "fd00::/8"]},
            ]
        }
    )
    first, second = config.operator.platform_destinations
    assert first.id == "platform_destinations[0]" and first.ports == frozenset({443, 8443})
    assert first.cidrs == ()
    assert second.id == "platform_destinations[1]" and second.host == "hooks.example.net"
    assert [str(c) for c in second.cidrs] == ["10.0.0.0/8", "fd00::/8"]


@pytest.mark.parametrize("host", [None, 5, ["gw.example.net"], {"a": 1}, True])
def test_a_platform_destination_host_must_be_a_string(host: object) -> None:
    document: dict[str, Any] = {"platform_destinations": [{"ports": [443]}]}
    if host is not None:
        document["platform_destinations"][0]["host"] = host
    found = problems(document)
    assert list(found) == ["platform_destinations[0].host"]
    assert found["platform_destinations[0].host"].reason == "invalid_host"
    assert "hostname" in found["platform_destinations[0].host"].message


@pytest.mark.parametrize(
    ("host", "fix"),
    [
        ("GW.example.net", "write 'gw.example.net'"),
        ("gw.example.net.", "write 'gw.example.net'"),
        ("https://gw.example.net", "write 'gw.example.net'"),
        ("*.gw.example.net", "write 'gw.example.net'"),
        ("10.0.0.1", "IP address"),
    ],
)
def test_a_platform_destination_host_uses_the_entry_grammar(host: str, fix: str) -> None:
    found = problems({"platform_destinations": [{"host": host, "ports": [443]}]})
    assert fix in found["platform_destinations[0].host"].message


def test_platform_destination_cidrs_are_named_at_their_index() -> None:
    found = problems(
        {
            "platform_destinations": [
                {"host": "gw.example.net", "ports": [443], "cidrs": ["10.0.0.0/8", "bad", 7]}
            ]
        }
    )
    assert set(found) == {
        "platform_destinations[0].cidrs[1]",
        "platform_destinations[0].cidrs[2]",
    }
    assert found["platform_destinations[0].cidrs[1]"].value == "bad"
    assert all(f.reason == "invalid_cidr" for f in found.values())


def test_platform_destination_shape_problems() -> None:
    found = problems(
        {
            "platform_destinations": [
                "gw.example.net",
                {"host": "a.example.net"},
                {"host": "b.example.net", "ports": []},
                {"host": "c.example.net", "ports": 443},
                {"host": "d.example.net", "ports": [0, "443", True]},
                {"host": "e.example.net", "ports": [443], "cidrs": "10.0.0.0/8", "prots": [1]},
            ]
        }
    )
    assert found["platform_destinations[0]"].reason == "not_a_mapping"
    assert found["platform_destinations[1].ports"].reason == "missing_key"
    assert found["platform_destinations[2].ports"].reason == "missing_key"
    assert found["platform_destinations[3].ports"].reason == "not_a_list"
    for i in range(3):
        assert found[f"platform_destinations[4].ports[{i}]"].reason == "invalid_value"
    assert found["platform_destinations[5].cidrs"].reason == "not_a_list"
    assert found["platform_destinations[5].prots"].reason == "unknown_key"
    assert "did you mean 'ports'" in found["platform_destinations[5].prots"].message
    assert (
        problems({"platform_destinations": {"host": "x.example.net"}})[
            "platform_destinations"
        ].reason
        == "not_a_list"
    )


def test_a_platform_host_listed_twice_is_refused() -> None:
    # Decisions look a platform route up by host: a second entry would shadow the first.
    found = problems(
        {
            "platform_destinations": [
                {"host": "gw.example.net", "ports": [443]},
                {"host": "gw.example.net", "ports": [80]},
            ]
        }
    )
    assert list(found) == ["platform_destinations[1].host"]
    assert "platform_destinations[0]" in found["platform_destinations[1].host"].message


# -- ports, inspection, limits, internal suffixes --------------------------------------------------


def test_ports() -> None:
    assert load({"ports": [80, 443, 65535, 1]}).operator.ports == frozenset({1, 80, 443, 65535})


@pytest.mark.parametrize("value", [0, 65536, -1, "443", True, 443.0, None, 2**64 - 1, -(2**63)])
def test_bad_ports(value: object) -> None:
    found = problems({"ports": [443, value]})
    assert list(found) == ["ports[1]"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ports: [0x1bb]\n", "0x1bb is not plain decimal"),
        ("ports: [0777]\n", "YAML 1.1 reads 511"),
        ("ports: [0b111]\n", "not plain decimal"),
        ("ports: [4_43]\n", "not plain decimal"),
        ("ports: [7:23]\n", "7:23 is not plain decimal"),
        ("ports: [on]\n", "true is a boolean"),
        ("ports: [yes]\n", "true is a boolean"),
        ("ports: ['443']\n", "without quotes: 443"),
        ("ports: [443.0]\n", "write 443"),
    ],
)
def test_a_port_in_another_spelling_says_how_to_write_it(text: str, says: str) -> None:
    # YAML 1.1 (PyYAML) and YAML 1.2 readers disagree on all but the decimal spelling
    # (`0777` is 511 to one, 777 to the other): only decimal is taken.
    assert says in problems(text)["ports[0]"].message


def test_toml_spellings_of_integers_are_taken() -> None:
    # TOML defines one meaning for each: every TOML reader agrees.
    config = load_config(b"ports = [0x1bb, 0o17, 0b11, 8_443]\n", source="c.toml")
    assert config.operator.ports == {443, 15, 3, 8443}


def test_a_number_out_of_bounds_in_a_config_is_refused_at_its_place() -> None:
    with pytest.raises(ProxyError) as info:
        load_config(b"ports = [443]\n[limits]\nmax_connections = 1e400\n", source="c.toml")
    assert (info.value.reason, info.value.line, info.value.column) == ("number_not_finite", 3, 19)
    assert info.value.source == "c.toml"


def test_an_empty_port_list_is_refused_not_read_as_deny_all() -> None:
    found = problems({"ports": []})
    assert found["ports"].reason == "empty_list" and "omit" in found["ports"].message
    assert problems({"ports": 443})["ports"].reason == "not_a_list"


def test_opaque_ports_default_to_every_allowed_port_but_80_and_443() -> None:
    operator = load({}).operator
    assert operator.opaque_ports is None
    assert [operator.opaque_allowed(p) for p in (22, 80, 443, 5432)] == [True, False, False, True]
    listed = load({"ports": [443, 2222, 5432], "opaque_ports": [2222]}).operator
    assert listed.opaque_allowed(2222) and not listed.opaque_allowed(5432)
    off = load({"opaque_ports": []}).operator
    assert off.opaque_ports == frozenset() and not off.opaque_allowed(22)


def test_an_opaque_port_that_ports_refuses_is_named() -> None:
    found = problems({"ports": [443, 22], "opaque_ports": [22, 5432]})
    assert list(found) == ["opaque_ports[1]"]
    assert "5432 is not in ports" in found["opaque_ports[1]"].message
    assert list(problems({"opaque_ports": [22, "x"]})) == ["opaque_ports[1]"]
    assert problems({"opaque_ports": 22})["opaque_ports"].reason == "not_a_list"


def test_dns_attribution_grace() -> None:
    assert load({}).attribution_grace == 300.0
    assert load({"dns": {"attribution_grace": "90s"}}).attribution_grace == 90.0
    assert list(problems({"dns": {"attribution_grace": "soon"}})) == ["dns.attribution_grace"]


def test_inspection() -> None:
    config = load({"inspection": {"enabled": False, "ca_dir": "/var/lib/egress/ca"}})
    assert config.operator.inspection_enabled is False
    assert config.ca_dir == "/var/lib/egress/ca"
    found = problems({"inspection": {"enabled": "no", "ca_dir": ""}})
    assert set(found) == {"inspection.enabled", "inspection.ca_dir"}
    assert problems({"inspection": {"ca_dir": 5}})["inspection.ca_dir"].reason == "invalid_value"


def test_inspection_mode() -> None:
    assert load({}).inspection_mode == "prefixes"  # the default: today's behaviour
    assert load({"inspection": {"mode": "all"}}).inspection_mode == "all"
    assert load({"inspection": {"mode": "prefixes"}}).inspection_mode == "prefixes"


@pytest.mark.parametrize("value", ["All", "every", "", None, 1, True, ["all"], {"all": 1}])
def test_an_unknown_inspection_mode_is_refused_naming_the_choices(value: object) -> None:
    found = problems({"inspection": {"mode": value}})["inspection.mode"]
    assert found.reason == "invalid_value"
    assert "'prefixes', 'all'" in found.message


def test_inspection_mode_all_needs_inspection_enabled() -> None:
    found = problems({"inspection": {"mode": "all", "enabled": False}})["inspection.mode"]
    assert "needs inspection.enabled: true" in found.message


def test_limits() -> None:
    config = load(
        {
            "limits": {
                "connect_timeout": "3s",
                "idle_timeout": "1h30m",
                "header_timeout": "20s",
                "max_connections": 64,
            }
        }
    )
    assert config.limits == Limits(3.0, 5400.0, 20.0, 64)


@pytest.mark.parametrize("value", [0, -1, True, "64", 64.0, None, 1_000_001, 2**64 - 1])
def test_bad_max_connections(value: object) -> None:
    assert list(problems({"limits": {"max_connections": value}})) == ["limits.max_connections"]


def test_max_connections_is_bounded_at_a_million() -> None:
    assert load({"limits": {"max_connections": 1_000_000}}).limits.max_connections == 1_000_000
    message = problems({"limits": {"max_connections": 10**6 + 1}})["limits.max_connections"].message
    assert "from 1 to 1000000" in message


@pytest.mark.parametrize(
    ("cidr", "says"),
    [
        ("10.0.0.0/99999999999999999999", "an IPv4 prefix length is 0 to 32"),
        ("10.0.0.0/33", "an IPv4 prefix length is 0 to 32"),
        ("::/-1", "an IPv6 prefix length is 0 to 128"),
        ("fd00::/129", "an IPv6 prefix length is 0 to 128"),
    ],
)
def test_a_prefix_length_out_of_range_is_named(cidr: str, says: str) -> None:
    found = problems({"addresses": {"deny": [cidr]}, "platform_destinations": [
        {"host": "gw.example.net", "ports": [443], "cidrs": [cidr]}]})  # fmt: skip
    for path in ("addresses.deny[0]", "platform_destinations[0].cidrs[0]"):
        assert found[path].reason == "invalid_cidr" and says in found[path].message


def test_internal_suffixes() -> None:
    config = load({"internal_suffixes": ["corp.example", "corp", "svc.cluster.local"]})
    assert config.operator.internal_suffixes == ("corp.example", "corp", "svc.cluster.local")
    found = problems({"internal_suffixes": [5, "*.corp", "Corp.Example", "a..b", "ok.example"]})
    assert set(found) == {
        "internal_suffixes[0]",
        "internal_suffixes[1]",
        "internal_suffixes[2]",
        "internal_suffixes[3]",
    }
    assert all(f.reason == "invalid_suffix" for f in found.values())
    assert "write 'corp.example'" in found["internal_suffixes[2]"].message


# -- unknown keys, bad types, several problems at once ---------------------------------------------


def test_unknown_top_level_key_is_named() -> None:
    found = problems({"dns": {}, "adresses": {"allow": []}})
    assert found["adresses"].reason == "unknown_key"
    assert "did you mean 'addresses'" in found["adresses"].message


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("dns", "nameserver"),
        ("addresses", "in-cluster"),
        ("inspection", "enable"),
        ("limits", "max_conns"),
    ],
)
def test_unknown_nested_key_is_named(section: str, key: str) -> None:
    found = problems({section: {key: 1}})
    assert list(found) == [f"{section}.{key}"]
    assert found[f"{section}.{key}"].reason == "unknown_key"
    assert repr(key) in found[f"{section}.{key}"].message


@pytest.mark.parametrize("section", ["dns", "addresses", "inspection", "limits"])
@pytest.mark.parametrize("value", [[1], "text", 5, True])
def test_a_section_must_be_a_mapping(section: str, value: object) -> None:
    found = problems({section: value})
    assert found[section].reason == "not_a_mapping"


def test_several_problems_are_reported_together() -> None:
    with pytest.raises(ProxyError) as info:
        load(
            {
                "bogus": 1,
                "dns": {"nameservers": ["x"], "timeout": "1500ms"},
                "addresses": {"deny": ["nope"]},
                "ports": [0],
                "limits": {"max_connections": 0},
            }
        )
    err = info.value
    assert [f.path for f in err.details] == [
        "bogus",
        "dns.nameservers[0]",
        "dns.timeout",
        "addresses.deny[0]",
        "ports[0]",
        "limits.max_connections",
    ]
    assert all(f.file == "config.yaml" for f in err.details)
    # The one-line message names several, and says how many more there are.
    assert "bogus" in err.message and "dns.nameservers[0]" in err.message
    assert "(and 1 more)" in err.message


def test_problem_messages_do_not_repeat_their_path() -> None:
    found = problems({"dns": {"nameservers": ["x"]}, "limits": {"idle_timeout": "5"}})
    for path, finding in found.items():
        assert path not in finding.message


# -- document syntax -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "source", "reason"),
    [
        (b"", "config.yaml", "empty_document"),
        (b"- dns\n", "config.yaml", "not_a_mapping"),
        (b"dns: {}\ndns: {}\n", "config.yaml", "duplicate_key"),
        (b"dns: [\n", "config.yaml", "yaml_syntax"),
        (b'{"dns": {}, "dns": {}}', "config.json", "duplicate_key"),
        (b'{"dns": {}, "dns": {}}', "CONFIG.JSON", "duplicate_key"),
        (b'{"dns": ', "config.json", "json_syntax"),
        (b"ports = [80,\n", "config.toml", "toml_syntax"),
        (b"ports: [80]\x00", "config.yaml", "binary_file"),
    ],
)
def test_unusable_documents(data: bytes, source: str, reason: str) -> None:
    with pytest.raises(ProxyError) as info:
        load_config(data, source=source)
    assert info.value.reason == reason
    assert info.value.source == source


def test_the_suffix_chooses_the_parser() -> None:
    # JSON by its suffix, whatever its case: YAML would take `{"a": 1, "a": 2}` too, but as a
    # different document (and with different error messages) than the operator wrote.
    assert load_config(b'{"ports": [443]}', source="ops.JSON").operator.ports == {443}
    assert load_config(b"ports = [443]\n", source="ops.toml").operator.ports == {443}
    assert load_config(b"ports: [443]\n", source="ops.yml").operator.ports == {443}
    assert load_config(b"ports: [443]\n", source="<stdin>").operator.ports == {443}
    with pytest.raises(ProxyError) as info:
        load_config(b'{\n  "ports": [443,]\n}', source="ops.json")
    assert info.value.reason == "json_syntax" and info.value.line == 2


def test_errors_are_proxy_errors_and_policy_errors() -> None:
    with pytest.raises(PolicyError):
        load_config(b"bogus: 1\n", source="c.yaml")
    with pytest.raises(ProxyError):
        load_config(b"\xff\xfe", source="c.yaml")


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["10.0.0.0/8", "1.1.1.1", "2s", "gw.example.net", "[::1]:53", "443"]),
)
_keys = st.sampled_from(
    [
        "dns",
        "nameservers",
        "timeout",
        "addresses",
        "allow",
        "deny",
        "in_cluster",
        "platform_destinations",
        "host",
        "ports",
        "cidrs",
        "inspection",
        "enabled",
        "ca_dir",
        "limits",
        "connect_timeout",
        "max_connections",
        "internal_suffixes",
        "x",
    ]
)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=8))
def test_no_config_makes_the_loader_raise_anything_but_proxy_error(document: dict) -> None:
    try:
        load_config(json.dumps(document), source="c.json")
    except ProxyError as exc:
        assert exc.details or exc.reason != "invalid_config"
