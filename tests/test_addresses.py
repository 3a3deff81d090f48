"""The address table and classifier (docs/manifests.md, "Runtime rules")."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.addresses import AddressRules, IPNetwork, Verdict, classify, parse_address
from policy.errors import PolicyError
from policy.findings import quote
from policy.special_addresses import (
    ADDRESS_SPACE,
    BLOCKS,
    IPV4_SPECIAL,
    IPV6_SPECIAL,
    METADATA,
    Block,
    MetadataAddress,
)

# (address, public, reason, range). Each registry row has an address inside it, and ranges have
# their first and last address and a neighbour just outside where that neighbour is interesting.
CASES: list[tuple[str, bool, str, str]] = [
    # 0.0.0.0/8 and 0.0.0.0/32
    ("0.0.0.0", False, "unspecified", "0.0.0.0/32"),
    ("0.0.0.1", False, "this_network", "0.0.0.0/8"),
    ("0.255.255.255", False, "this_network", "0.0.0.0/8"),
    ("1.0.0.0", True, "global", "0.0.0.0/0"),
    # 10.0.0.0/8
    ("9.255.255.255", True, "global", "0.0.0.0/0"),
    ("10.0.0.0", False, "private", "10.0.0.0/8"),
    ("10.0.0.1", False, "private", "10.0.0.0/8"),
    ("10.255.255.255", False, "private", "10.0.0.0/8"),
    ("11.0.0.0", True, "global", "0.0.0.0/0"),
    # 100.64.0.0/10
    ("100.63.255.255", True, "global", "0.0.0.0/0"),
    ("100.64.0.0", False, "shared_address", "100.64.0.0/10"),
    ("100.127.255.255", False, "shared_address", "100.64.0.0/10"),
    ("100.128.0.0", True, "global", "0.0.0.0/0"),
    # 127.0.0.0/8
    ("126.255.255.255", True, "global", "0.0.0.0/0"),
    ("127.0.0.0", False, "loopback", "127.0.0.0/8"),
    ("127.0.0.1", False, "loopback", "127.0.0.0/8"),
    ("127.255.255.255", False, "loopback", "127.0.0.0/8"),
    ("128.0.0.0", True, "global", "0.0.0.0/0"),
    # 169.254.0.0/16
    ("169.253.255.255", True, "global", "0.0.0.0/0"),
    ("169.254.0.0", False, "link_local", "169.254.0.0/16"),
    ("169.254.169.255", False, "link_local", "169.254.0.0/16"),
    ("169.254.255.255", False, "link_local", "169.254.0.0/16"),
    ("169.255.0.0", True, "global", "0.0.0.0/0"),
    # 172.16.0.0/12
    ("172.15.255.255", True, "global", "0.0.0.0/0"),
    ("172.16.0.0", False, "private", "172.16.0.0/12"),
    ("172.31.255.255", False, "private", "172.16.0.0/12"),
    ("172.32.0.0", True, "global", "0.0.0.0/0"),
    # 192.0.0.0/24 and the rows inside it
    ("191.255.255.255", True, "global", "0.0.0.0/0"),
    ("192.0.0.0", False, "ds_lite", "192.0.0.0/29"),
    ("192.0.0.7", False, "ds_lite", "192.0.0.0/29"),
    ("192.0.0.8", False, "dummy", "192.0.0.8/32"),
    ("192.0.0.9", True, "global", "192.0.0.9/32"),
    ("192.0.0.10", True, "global", "192.0.0.10/32"),
    ("192.0.0.11", False, "ietf_protocol", "192.0.0.0/24"),
    ("192.0.0.169", False, "ietf_protocol", "192.0.0.0/24"),
    ("192.0.0.170", False, "nat64_discovery", "192.0.0.170/32"),
    ("192.0.0.171", False, "nat64_discovery", "192.0.0.171/32"),
    ("192.0.0.172", False, "ietf_protocol", "192.0.0.0/24"),
    ("192.0.0.255", False, "ietf_protocol", "192.0.0.0/24"),
    ("192.0.1.0", True, "global", "0.0.0.0/0"),
    # 192.0.2.0/24
    ("192.0.2.0", False, "documentation", "192.0.2.0/24"),
    ("192.0.2.255", False, "documentation", "192.0.2.0/24"),
    ("192.0.3.0", True, "global", "0.0.0.0/0"),
    # Globally reachable special rows
    ("192.31.196.1", True, "global", "192.31.196.0/24"),
    ("192.52.193.1", True, "global", "192.52.193.0/24"),
    ("192.175.48.6", True, "global", "192.175.48.0/24"),
    # 192.88.99.0/24 (N/A, deprecated) and 192.88.99.2/32 (6a44)
    ("192.88.98.255", True, "global", "0.0.0.0/0"),
    ("192.88.99.0", False, "6to4_relay", "192.88.99.0/24"),
    ("192.88.99.1", False, "6to4_relay", "192.88.99.0/24"),
    ("192.88.99.2", False, "6a44_relay", "192.88.99.2/32"),
    ("192.88.99.3", False, "6to4_relay", "192.88.99.0/24"),
    ("192.88.99.255", False, "6to4_relay", "192.88.99.0/24"),
    ("192.88.100.0", True, "global", "0.0.0.0/0"),
    # 192.168.0.0/16
    ("192.167.255.255", True, "global", "0.0.0.0/0"),
    ("192.168.0.0", False, "private", "192.168.0.0/16"),
    ("192.168.1.1", False, "private", "192.168.0.0/16"),
    ("192.168.255.255", False, "private", "192.168.0.0/16"),
    ("192.169.0.0", True, "global", "0.0.0.0/0"),
    # 198.18.0.0/15
    ("198.17.255.255", True, "global", "0.0.0.0/0"),
    ("198.18.0.0", False, "benchmarking", "198.18.0.0/15"),
    ("198.19.255.255", False, "benchmarking", "198.18.0.0/15"),
    ("198.20.0.0", True, "global", "0.0.0.0/0"),
    # Documentation
    ("198.51.100.1", False, "documentation", "198.51.100.0/24"),
    ("203.0.112.255", True, "global", "0.0.0.0/0"),
    ("203.0.113.0", False, "documentation", "203.0.113.0/24"),
    ("203.0.113.255", False, "documentation", "203.0.113.0/24"),
    ("203.0.114.0", True, "global", "0.0.0.0/0"),
    # Multicast, reserved, broadcast
    ("223.255.255.255", True, "global", "0.0.0.0/0"),
    ("224.0.0.0", False, "multicast", "224.0.0.0/4"),
    ("224.0.0.251", False, "multicast", "224.0.0.0/4"),
    ("239.255.255.250", False, "multicast", "224.0.0.0/4"),
    ("239.255.255.255", False, "multicast", "224.0.0.0/4"),
    ("240.0.0.0", False, "reserved", "240.0.0.0/4"),
    ("255.255.255.254", False, "reserved", "240.0.0.0/4"),
    ("255.255.255.255", False, "broadcast", "255.255.255.255/32"),
    # Public IPv4
    ("8.8.8.8", True, "global", "0.0.0.0/0"),
    ("1.1.1.1", True, "global", "0.0.0.0/0"),
    ("151.101.1.69", True, "global", "0.0.0.0/0"),
    ("168.63.129.15", True, "global", "0.0.0.0/0"),
    ("168.63.129.17", True, "global", "0.0.0.0/0"),
    # Metadata
    ("169.254.169.254", False, "metadata", "169.254.169.254/32"),
    ("169.254.170.2", False, "metadata", "169.254.170.2/32"),
    ("169.254.169.253", False, "metadata", "169.254.169.253/32"),
    ("169.254.169.123", False, "metadata", "169.254.169.123/32"),
    ("100.100.100.200", False, "metadata", "100.100.100.200/32"),
    ("168.63.129.16", False, "metadata", "168.63.129.16/32"),
    ("192.0.0.192", False, "metadata", "192.0.0.192/32"),
    ("fd00:ec2::254", False, "metadata", "fd00:ec2::254/128"),
    ("fd00:ec2::23", False, "metadata", "fd00:ec2::23/128"),
    ("fd20:ce::254", False, "metadata", "fd20:ce::254/128"),
    ("[fd00:ec2::254]", False, "metadata", "fd00:ec2::254/128"),
    ("FD00:EC2:0:0:0:0:0:254", False, "metadata", "fd00:ec2::254/128"),
    ("fd00:ec2::255", False, "unique_local", "fc00::/7"),
    # ::/128, ::1/128 and ::/96 (IPv4-compatible)
    ("::", False, "unspecified", "::/128"),
    ("::1", False, "loopback", "::1/128"),
    ("[::1]", False, "loopback", "::1/128"),
    ("0:0:0:0:0:0:0:1", False, "loopback", "::1/128"),
    ("::2", False, "ipv4_compatible", "::/96"),
    ("::127.0.0.1", False, "ipv4_compatible", "::/96"),
    ("::ffff:ffff", False, "ipv4_compatible", "::/96"),
    ("::1:0:0", False, "reserved", "::/0"),
    # ::ffff:0:0/96 (IPv4-mapped)
    ("::fffe:ffff:ffff", False, "reserved", "::/0"),
    ("::ffff:0:0", False, "ipv4_mapped", "::ffff:0:0/96"),
    ("::ffff:127.0.0.1", False, "ipv4_mapped", "::ffff:0:0/96"),
    ("::ffff:8.8.8.8", False, "ipv4_mapped", "::ffff:0:0/96"),
    ("::ffff:169.254.169.254", False, "ipv4_mapped", "::ffff:0:0/96"),
    ("::ffff:ffff:ffff", False, "ipv4_mapped", "::ffff:0:0/96"),
    ("::1:0:0:0", False, "reserved", "::/0"),
    ("::ffff:0:1.2.3.4", False, "reserved", "::/0"),
    # 64:ff9b::/96 (NAT64): the embedded IPv4 decides
    ("64:ff9b::808:808", True, "global", "64:ff9b::/96"),
    ("64:ff9b::8.8.8.8", True, "global", "64:ff9b::/96"),
    ("64:ff9b::c000:9", True, "global", "64:ff9b::/96"),
    ("64:ff9b::", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::a00:1", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::7f00:1", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::a9fe:a9fe", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::a83f:8110", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::ffff:ffff", False, "nat64", "64:ff9b::/96"),
    ("64:ff9b::1:0:0", False, "reserved", "::/0"),
    ("64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff", False, "reserved", "::/0"),
    # 64:ff9b:1::/48 (local-use translation)
    ("64:ff9b:1::", False, "nat64_local", "64:ff9b:1::/48"),
    ("64:ff9b:1::a00:1", False, "nat64_local", "64:ff9b:1::/48"),
    ("64:ff9b:1:ffff:ffff:ffff:ffff:ffff", False, "nat64_local", "64:ff9b:1::/48"),
    ("64:ff9b:2::", False, "reserved", "::/0"),
    # 100::/64 and 100:0:0:1::/64
    ("100::", False, "discard", "100::/64"),
    ("100::ffff:ffff:ffff:ffff", False, "discard", "100::/64"),
    ("100:0:0:1::", False, "dummy", "100:0:0:1::/64"),
    ("100:0:0:1:ffff:ffff:ffff:ffff", False, "dummy", "100:0:0:1::/64"),
    ("100:0:0:2::", False, "reserved", "::/0"),
    # 2001::/23 and the rows inside it
    ("2001::", False, "teredo", "2001::/32"),
    ("2001::1", False, "teredo", "2001::/32"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False, "teredo", "2001::/32"),
    ("2001:0:ffff:ffff:ffff:ffff:ffff:ffff", False, "teredo", "2001::/32"),
    ("2001:1::", False, "ietf_protocol", "2001::/23"),
    ("2001:1::1", True, "global", "2001:1::1/128"),
    ("2001:1::2", True, "global", "2001:1::2/128"),
    ("2001:1::3", True, "global", "2001:1::3/128"),
    ("2001:1::4", False, "ietf_protocol", "2001::/23"),
    ("2001:2::", False, "benchmarking", "2001:2::/48"),
    ("2001:2:0:ffff::1", False, "benchmarking", "2001:2::/48"),
    ("2001:2:1::", False, "ietf_protocol", "2001::/23"),
    ("2001:3::1", True, "global", "2001:3::/32"),
    ("2001:3:ffff:ffff:ffff:ffff:ffff:ffff", True, "global", "2001:3::/32"),
    ("2001:4:112::1", True, "global", "2001:4:112::/48"),
    ("2001:4:113::", False, "ietf_protocol", "2001::/23"),
    ("2001:10::1", False, "orchid", "2001:10::/28"),
    ("2001:1f:ffff:ffff:ffff:ffff:ffff:ffff", False, "orchid", "2001:10::/28"),
    ("2001:20::", True, "global", "2001:20::/28"),
    ("2001:2f:ffff:ffff:ffff:ffff:ffff:ffff", True, "global", "2001:20::/28"),
    ("2001:30::1", True, "global", "2001:30::/28"),
    ("2001:40::", False, "ietf_protocol", "2001::/23"),
    ("2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff", False, "ietf_protocol", "2001::/23"),
    ("2001:200::", True, "global", "2000::/3"),
    # Documentation
    ("2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", True, "global", "2000::/3"),
    ("2001:db8::", False, "documentation", "2001:db8::/32"),
    ("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", False, "documentation", "2001:db8::/32"),
    ("2001:db9::", True, "global", "2000::/3"),
    ("3ffe:ffff::1", True, "global", "2000::/3"),
    ("3fff::", False, "documentation", "3fff::/20"),
    ("3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", False, "documentation", "3fff::/20"),
    ("3fff:1000::", True, "global", "2000::/3"),
    # 2002::/16 (6to4)
    ("2001:ffff:ffff:ffff:ffff:ffff:ffff:ffff", True, "global", "2000::/3"),
    ("2002::", False, "6to4", "2002::/16"),
    ("2002:7f00:1::1", False, "6to4", "2002::/16"),
    ("2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "6to4", "2002::/16"),
    ("2003::", True, "global", "2000::/3"),
    # 2620:4f:8000::/48 (AS112)
    ("2620:4f:8000::6", True, "global", "2620:4f:8000::/48"),
    ("2620:4f:8001::", True, "global", "2000::/3"),
    # Global unicast edges and unallocated space
    ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "reserved", "::/0"),
    ("2000::", True, "global", "2000::/3"),
    ("3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", True, "global", "2000::/3"),
    ("4000::", False, "reserved", "::/0"),
    ("4000::1", False, "reserved", "::/0"),
    ("e000::1", False, "reserved", "::/0"),
    # 5f00::/16 (SRv6)
    ("5eff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "reserved", "::/0"),
    ("5f00::", False, "srv6", "5f00::/16"),
    ("5f00:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "srv6", "5f00::/16"),
    ("5f01::", False, "reserved", "::/0"),
    # fc00::/7 (unique local)
    ("fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "reserved", "::/0"),
    ("fc00::", False, "unique_local", "fc00::/7"),
    ("fd12:3456:789a::1", False, "unique_local", "fc00::/7"),
    ("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "unique_local", "fc00::/7"),
    ("fe00::", False, "reserved", "::/0"),
    # fe80::/10 (link local), with zone ids
    ("fe7f:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "reserved", "::/0"),
    ("fe80::", False, "link_local", "fe80::/10"),
    ("fe80::1%eth0", False, "link_local", "fe80::/10"),
    ("[fe80::1%eth0]", False, "link_local", "fe80::/10"),
    ("fe80::1%1", False, "link_local", "fe80::/10"),
    ("febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "link_local", "fe80::/10"),
    # fec0::/10 (site local, deprecated)
    ("fec0::", False, "site_local", "fec0::/10"),
    ("fec0::1", False, "site_local", "fec0::/10"),
    ("feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "site_local", "fec0::/10"),
    # ff00::/8 (multicast)
    ("ff00::", False, "multicast", "ff00::/8"),
    ("ff02::1", False, "multicast", "ff00::/8"),
    ("ff0e::101", False, "multicast", "ff00::/8"),
    ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "multicast", "ff00::/8"),
    # Public IPv6
    ("2606:4700::1111", True, "global", "2000::/3"),
    ("[2606:4700:4700::1111]", True, "global", "2000::/3"),
    ("2a00:1450::1", True, "global", "2000::/3"),
    ("2001:4860:4860::8888", True, "global", "2000::/3"),
    ("2a00:1450::1%eth0", True, "global", "2000::/3"),
]

INVALID = [
    "127.1",
    "127.0.1",
    "0x7f000001",
    "0x7f.0.0.1",
    "0177.0.0.1",
    "010.0.0.1",
    "2130706433",
    "",
    " ",
    "abc",
    "localhost",
    "1.2.3.4.5",
    "1.2.3",
    "1.2.3.256",
    "1.2.3.-1",
    " 1.2.3.4",
    "1.2.3.4 ",
    "1.2.3.4\n",
    "1.2.3.4/32",
    "[1.2.3.4]",
    "1.2.3.4%eth0",
    "\u0661.\u0662.\u0663.\u0664",
    "::g",
    "1::2::3",
    "::1/128",
    "[::1",
    "::1]",
    "[[::1]]",
    "fe80::1%",
    "fe80::1%eth 0",
    "fe80::1%eth0%1",
    "::ffff:127.1",
    "12345::",
    "1:2:3:4:5:6:7:8:9",
]


def _case_id(address: str) -> str:
    return address if address.strip() else repr(address)


@pytest.mark.parametrize(
    ("address", "public", "reason", "range_"), CASES, ids=[_case_id(c[0]) for c in CASES]
)
def test_classify_table(address: str, public: bool, reason: str, range_: str) -> None:
    verdict = classify(address)
    assert (verdict.public, verdict.reason, verdict.range) == (public, reason, range_)


def test_every_row_is_exercised() -> None:
    ranges = {range_ for _, _, _, range_ in CASES}
    missing = [block.prefix for block in BLOCKS if block.prefix not in ranges]
    assert missing == []


@pytest.mark.parametrize("text", INVALID, ids=[_case_id(t) for t in INVALID])
def test_invalid_addresses(text: str) -> None:
    assert parse_address(text) is None
    assert classify(text) == Verdict(text, False, "invalid_address", None, "not an IP address", "")


@pytest.mark.parametrize("value", [None, 42, 2130706433, b"1.2.3.4", 1.5, ["::1"]], ids=repr)
def test_classify_never_raises_on_non_strings(value: object) -> None:
    verdict = classify(value)  # type: ignore[arg-type]
    assert (verdict.public, verdict.reason, verdict.range) == (False, "invalid_address", None)


# --- Verdict details ---------------------------------------------------------------------------


def test_verdict_fields_for_a_table_row() -> None:
    assert classify("10.1.2.3") == Verdict(
        "10.1.2.3", False, "private", "10.0.0.0/8", "Private-Use", "RFC 1918"
    )


def test_verdict_address_is_as_given_without_brackets() -> None:
    assert classify("[::1]").address == "::1"
    assert classify("[fe80::1%eth0]").address == "fe80::1%eth0"
    assert classify("0:0:0:0:0:0:0:1").address == "0:0:0:0:0:0:0:1"


def test_classify_accepts_address_objects() -> None:
    assert classify(ipaddress.ip_address("8.8.8.8")).reason == "global"
    verdict = classify(ipaddress.IPv6Address("::1"))
    assert (verdict.address, verdict.reason) == ("::1", "loopback")


def test_metadata_verdict_names_the_cloud() -> None:
    verdict = classify("168.63.129.16")
    assert verdict.public is False
    assert "Azure" in verdict.name


@pytest.mark.parametrize(
    ("address", "embedded", "name"),
    [
        ("64:ff9b::a00:1", "10.0.0.1", "NAT64 of 10.0.0.1 (Private-Use)"),
        ("64:ff9b::7f00:1", "127.0.0.1", "NAT64 of 127.0.0.1 (Loopback)"),
        ("64:ff9b::", "0.0.0.0", "NAT64 of 0.0.0.0 (This host on this network)"),
    ],
    ids=["private", "loopback", "unspecified"],
)
def test_nat64_names_the_embedded_address(address: str, embedded: str, name: str) -> None:
    verdict = classify(address)
    assert verdict == Verdict(address, False, "nat64", "64:ff9b::/96", name, "RFC 6052", embedded)


def test_nat64_of_metadata() -> None:
    verdict = classify("64:ff9b::169.254.169.254")
    assert (verdict.public, verdict.reason, verdict.embedded) == (False, "nat64", "169.254.169.254")
    assert verdict.name.startswith("NAT64 of 169.254.169.254 (")
    assert "metadata" in verdict.name


def test_nat64_of_public() -> None:
    verdict = classify("64:ff9b::1.1.1.1")
    assert (verdict.public, verdict.reason, verdict.embedded) == (True, "global", "1.1.1.1")
    assert verdict.range == "64:ff9b::/96"


@pytest.mark.parametrize(
    ("address", "embedded"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("::10.0.0.1", "10.0.0.1"),
        ("2002:a9fe:a9fe::1", "169.254.169.254"),
        ("2001::1", None),
        ("64:ff9b:1::a00:1", None),
    ],
    ids=["mapped", "compatible", "6to4", "teredo", "local-nat64"],
)
def test_tunnel_rows_report_the_embedded_address(address: str, embedded: str | None) -> None:
    verdict = classify(address)
    assert verdict.public is False
    assert verdict.embedded == embedded


# --- Operator rules ----------------------------------------------------------------------------

LOOPBACK_ALLOWED = AddressRules.from_strings(allow=["127.0.0.0/8", "::1/128"])


@pytest.mark.parametrize(
    ("address", "rules", "public", "reason", "range_"),
    [
        ("127.0.0.1", LOOPBACK_ALLOWED, True, "operator_allow", "127.0.0.0/8"),
        ("::1", LOOPBACK_ALLOWED, True, "operator_allow", "::1/128"),
        ("10.0.0.1", LOOPBACK_ALLOWED, False, "private", "10.0.0.0/8"),
        ("8.8.8.8", LOOPBACK_ALLOWED, True, "global", "0.0.0.0/0"),
        # A tunnel row smuggles the IPv4 past the IPv4 rules: allow does not reach it.
        ("::ffff:127.0.0.1", LOOPBACK_ALLOWED, False, "ipv4_mapped", "::ffff:0:0/96"),
        ("::127.0.0.1", LOOPBACK_ALLOWED, False, "ipv4_compatible", "::/96"),
        ("2002:7f00:1::", LOOPBACK_ALLOWED, False, "6to4", "2002::/16"),
        # NAT64 carries the operator rules through to the embedded address.
        ("64:ff9b::7f00:1", LOOPBACK_ALLOWED, True, "operator_allow", "64:ff9b::/96"),
    ],
    ids=["v4-loopback", "v6-loopback", "private", "public", "mapped", "compat", "6to4", "nat64"],
)
def test_allow_exempts_from_the_table(
    address: str, rules: AddressRules, public: bool, reason: str, range_: str
) -> None:
    verdict = classify(address, rules)
    assert (verdict.public, verdict.reason, verdict.range) == (public, reason, range_)


def test_allow_verdict_says_what_it_exempts() -> None:
    verdict = classify("127.0.0.1", LOOPBACK_ALLOWED)
    assert "Loopback" in verdict.name and "127.0.0.0/8" in verdict.name


EVERYTHING_ALLOWED = AddressRules.from_strings(allow=["0.0.0.0/0", "::/0"])


@pytest.mark.parametrize("entry", METADATA, ids=[m.address for m in METADATA])
def test_metadata_is_never_allowed(entry: MetadataAddress) -> None:
    verdict = classify(entry.address, EVERYTHING_ALLOWED)
    assert (verdict.public, verdict.reason) == (False, "metadata")


def test_metadata_beats_allow_of_its_exact_address() -> None:
    rules = AddressRules.from_strings(allow=["169.254.169.254/32", "168.63.129.16"])
    assert classify("169.254.169.254", rules).reason == "metadata"
    assert classify("168.63.129.16", rules).reason == "metadata"
    assert classify("64:ff9b::a83f:8110", rules).public is False


def test_allow_exempts_link_local_but_not_metadata_inside_it() -> None:
    rules = AddressRules.from_strings(allow=["169.254.0.0/16"])
    assert classify("169.254.1.1", rules).reason == "operator_allow"
    assert classify("169.254.169.254", rules).reason == "metadata"


def test_deny_beats_allow() -> None:
    rules = AddressRules.from_strings(allow=["10.0.0.0/8"], deny=["10.1.0.0/16"])
    assert classify("10.2.0.1", rules).reason == "operator_allow"
    verdict = classify("10.1.0.1", rules)
    assert (verdict.public, verdict.reason, verdict.range) == (
        False,
        "operator_deny",
        "10.1.0.0/16",
    )


def test_in_cluster_beats_allow() -> None:
    rules = AddressRules.from_strings(allow=["10.0.0.0/8"], in_cluster=["10.96.0.0/12"])
    verdict = classify("10.96.0.10", rules)
    assert (verdict.public, verdict.reason, verdict.range) == (False, "in_cluster", "10.96.0.0/12")
    assert classify("10.0.0.1", rules).reason == "operator_allow"


def test_deny_beats_in_cluster() -> None:
    rules = AddressRules.from_strings(deny=["10.96.0.1"], in_cluster=["10.96.0.0/12"])
    assert classify("10.96.0.1", rules).reason == "operator_deny"
    assert classify("10.96.0.2", rules).reason == "in_cluster"


def test_deny_of_a_public_range() -> None:
    rules = AddressRules.from_strings(deny=["1.1.1.0/24", "2606:4700::/32"])
    assert classify("1.1.1.1", rules).reason == "operator_deny"
    assert classify("2606:4700::1111", rules).reason == "operator_deny"
    assert classify("1.0.0.1", rules).reason == "global"
    # The embedded address of NAT64 meets the operator rules too.
    verdict = classify("64:ff9b::1.1.1.1", rules)
    assert (verdict.public, verdict.reason, verdict.embedded) == (False, "nat64", "1.1.1.1")
    assert "operator deny" in verdict.name


def test_deny_of_the_nat64_prefix_itself() -> None:
    rules = AddressRules.from_strings(deny=["64:ff9b::/96"])
    assert classify("64:ff9b::8.8.8.8", rules).reason == "operator_deny"


def test_in_cluster_of_embedded_nat64() -> None:
    rules = AddressRules.from_strings(in_cluster=["10.96.0.0/12"], allow=["10.0.0.0/8"])
    assert classify("64:ff9b::10.96.0.1", rules).reason == "nat64"
    assert classify("64:ff9b::10.0.0.1", rules).reason == "operator_allow"


def test_most_specific_operator_range_is_reported() -> None:
    rules = AddressRules.from_strings(deny=["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24"])
    assert classify("10.1.2.3", rules).range == "10.1.2.0/24"
    assert classify("10.1.3.3", rules).range == "10.1.0.0/16"
    assert classify("10.2.3.3", rules).range == "10.0.0.0/8"


def test_rules_of_one_family_do_not_touch_the_other() -> None:
    rules = AddressRules.from_strings(allow=["0.0.0.0/0"])
    assert classify("::1", rules).reason == "loopback"
    assert classify("127.0.0.1", rules).reason == "operator_allow"


# --- AddressRules.from_strings -----------------------------------------------------------------


def test_from_strings_parses_each_list() -> None:
    rules = AddressRules.from_strings(
        allow=["127.0.0.0/8", "::1/128"], deny=["203.0.113.7"], in_cluster=("10.96.0.0/12",)
    )
    assert rules.allow == (
        ipaddress.IPv4Network("127.0.0.0/8"),
        ipaddress.IPv6Network("::1/128"),
    )
    assert rules.deny == (ipaddress.IPv4Network("203.0.113.7/32"),)
    assert rules.in_cluster == (ipaddress.IPv4Network("10.96.0.0/12"),)


def test_from_strings_treats_none_as_empty() -> None:
    assert AddressRules.from_strings(allow=None, deny=None) == AddressRules()


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("10.0.0.1/8", "host bits set after the prefix length; write '10.0.0.0/8'"),
        ("fd00::1/8", "host bits set after the prefix length; write 'fd00::/8'"),
        ("not-a-cidr", "is not a CIDR"),
        ("127.1/32", "is not a CIDR"),
        ("10.0.0.0/33", "is not a CIDR"),
        ("10.0.0.0/255.0.0.0", "prefix length in digits"),
        ("10.0.0.0/0.255.255.255", "prefix length in digits"),
        ("10.0.0.0/", "prefix length in digits"),
        ("fe80::%eth0/64", "zone id"),
        ("[::1]/128", "is not a CIDR"),
        ("", "is not a CIDR"),
        (42, "is not a CIDR string"),
        (None, "is not a CIDR string"),
    ],
    ids=[
        "host-bits-v4",
        "host-bits-v6",
        "garbage",
        "short-ipv4",
        "long-prefix",
        "netmask",
        "hostmask",
        "empty-length",
        "zone",
        "brackets",
        "empty",
        "integer",
        "null",
    ],
)
def test_from_strings_refuses_bad_cidrs(value: object, fragment: str) -> None:
    with pytest.raises(PolicyError) as caught:
        AddressRules.from_strings(deny=["10.0.0.0/8", "::1/128", value])
    error = caught.value
    assert error.reason == "invalid_cidr"
    assert error.path == "addresses.deny[2]"
    assert fragment in error.message
    assert str(error).startswith("addresses.deny[2]: ")
    assert quote(value) in str(error)  # as documents spell it: null, not None


def test_from_strings_uses_the_path_prefix() -> None:
    with pytest.raises(PolicyError) as caught:
        AddressRules.from_strings(in_cluster=["10.0.0.0/8", "bad"], path_prefix="config.addresses")
    assert caught.value.path == "config.addresses.in_cluster[1]"
    assert "'bad'" in str(caught.value)


def test_from_strings_refuses_a_bare_string_for_a_list() -> None:
    with pytest.raises(PolicyError) as caught:
        AddressRules.from_strings(allow="10.0.0.0/8")
    assert (caught.value.reason, caught.value.path) == ("invalid_cidr", "addresses.allow")


def test_rules_refuse_strings_in_place_of_networks() -> None:
    with pytest.raises(TypeError):
        AddressRules(deny=("10.0.0.0/8",))  # type: ignore[arg-type]


def test_rules_are_hashable_values() -> None:
    one = AddressRules.from_strings(deny=["10.0.0.0/8"])
    two = AddressRules.from_strings(deny=["10.0.0.0/8"])
    assert one == two and hash(one) == hash(two)


# --- parse_address -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1", ipaddress.IPv4Address("127.0.0.1")),
        ("::1", ipaddress.IPv6Address("::1")),
        ("[::1]", ipaddress.IPv6Address("::1")),
        ("fe80::1%eth0", ipaddress.IPv6Address("fe80::1%eth0")),
        ("[fe80::1%eth0]", ipaddress.IPv6Address("fe80::1%eth0")),
        ("::ffff:1.2.3.4", ipaddress.IPv6Address("::ffff:1.2.3.4")),
    ],
    ids=["v4", "v6", "bracketed", "zone", "bracketed-zone", "dotted-tail"],
)
def test_parse_address(text: str, expected: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert parse_address(text) == expected


# --- The table itself --------------------------------------------------------------------------


def _key(prefix: str) -> tuple[int, int, int]:
    network = ipaddress.ip_network(prefix)
    return network.version, int(network.network_address), network.prefixlen


@pytest.mark.parametrize(
    "rows",
    [IPV4_SPECIAL, IPV6_SPECIAL, ADDRESS_SPACE],
    ids=["ipv4-special", "ipv6-special", "address-space"],
)
def test_table_rows_are_sorted(rows: tuple[Block, ...]) -> None:
    keys = [_key(block.prefix) for block in rows]
    assert keys == sorted(keys)


def test_table_rows_are_well_formed() -> None:
    assert {ipaddress.ip_network(b.prefix).version for b in IPV4_SPECIAL} == {4}
    assert {ipaddress.ip_network(b.prefix).version for b in IPV6_SPECIAL} == {6}
    prefixes = [block.prefix for block in BLOCKS]
    assert len(prefixes) == len(set(prefixes))
    for block in BLOCKS:
        # Not compared with str(): Python 3.13 spells ::ffff:0:0/96 as ::ffff:0.0.0.0/96.
        network = ipaddress.ip_network(block.prefix, strict=True)
        assert block.prefix == block.prefix.lower(), block
        assert network == ipaddress.ip_network(network.compressed), block
        assert re.fullmatch(r"RFC \d+(, \d+)*", block.rfc), block
        assert re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", block.reason), block
        assert (block.reason == "global") == block.globally_reachable, block


def test_metadata_list_is_well_formed() -> None:
    addresses = [ipaddress.ip_address(entry.address) for entry in METADATA]
    assert [str(a) for a in addresses] == [entry.address for entry in METADATA]
    keys = [(a.version, int(a)) for a in addresses]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def _brute_force(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> IPNetwork:
    networks = (ipaddress.ip_network(block.prefix) for block in BLOCKS)
    return max((n for n in networks if ip in n), key=lambda n: n.prefixlen)


_METADATA_INTS = {int(ipaddress.ip_address(entry.address)) for entry in METADATA}


@st.composite
def _addresses(draw: st.DrawFn) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """Anywhere at all, or near the first or last address of a row, where an index slips."""
    if draw(st.booleans()):
        if draw(st.booleans()):
            return ipaddress.IPv4Address(draw(st.integers(0, 2**32 - 1)))
        return ipaddress.IPv6Address(draw(st.integers(0, 2**128 - 1)))
    network = ipaddress.ip_network(draw(st.sampled_from(BLOCKS)).prefix)
    edge = draw(st.sampled_from([network.network_address, network.broadcast_address]))
    value = (int(edge) + draw(st.integers(-4096, 4096))) % (1 << network.max_prefixlen)
    return type(network.network_address)(value)


@given(_addresses())
def test_index_matches_a_linear_scan(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if int(ip) in _METADATA_INTS:
        return
    range_ = classify(ip).range
    assert range_ is not None
    assert ipaddress.ip_network(range_) == _brute_force(ip)


# --- Why not ipaddress.is_global ---------------------------------------------------------------

# Stable across 3.12 and 3.13: ipaddress calls each of these global, the registries do not.
KNOWN_DISAGREEMENTS = {
    "224.0.0.251",  # multicast
    "239.255.255.250",  # multicast (SSDP)
    "192.88.99.1",  # deprecated 6to4 relay anycast
    "168.63.129.16",  # Azure WireServer
    "ff02::1",  # multicast
    "fec0::1",  # site-local
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "5f00::",  # SRv6 SIDs
    "4000::1",  # unallocated
}


def test_where_ipaddress_is_global_disagrees() -> None:
    disagreements = set()
    for address, public, _, _ in CASES:
        ip = parse_address(address)
        assert ip is not None
        if ip.is_global != public:
            disagreements.add(address)
    assert disagreements >= KNOWN_DISAGREEMENTS, sorted(disagreements)
