"""Targets as written on a command line or in a request: scheme, host, port and path."""

import pytest

from policy import PolicyError
from policy.urls import Target, parse_target, split_authority


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("github.com", Target("github.com")),
        ("github.com:8443", Target("github.com", 8443)),
        ("[::1]:80", Target("::1", 80)),
        ("[2001:db8::1]", Target("2001:db8::1")),
        ("::1", Target("::1")),
        ("https://a.example/x?q#f", Target("a.example", None, "https", "/x")),
        # A '#' before any '?' stays in the path, where path rules refuse it: a client never
        # sends a fragment, and a server may read '/x#/../y' as a path.
        ("https://a.example/x#f", Target("a.example", None, "https", "/x#f")),
        ("https://a.example?q", Target("a.example", None, "https", "/")),
        ("https://a.example#f", Target("a.example", None, "https", "/#f")),
        ("[fe80::1%eth0]:443", Target("fe80::1%eth0", 443)),
        ("HTTP://A.example:8080", Target("A.example", 8080, "http", "/")),
        ("wss://a.example/socket", Target("a.example", None, "wss", "/socket")),
        ("https://[2001:db8::1]:8443/", Target("2001:db8::1", 8443, "https", "/")),
    ],
)
def test_parse_target(text: str, expected: Target) -> None:
    assert parse_target(text) == expected


def test_effective_port_defaults_from_scheme() -> None:
    assert parse_target("https://a.example/").effective_port == 443
    assert parse_target("ws://a.example/").effective_port == 80
    assert parse_target("a.example").effective_port is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "invalid_target"),
        ("ftp://a.example/", "unsupported_scheme"),
        ("https://user:pw@a.example/", "invalid_target"),
        ("https://good.example@evil.example/", "invalid_target"),
        ("a.example:0", "invalid_port"),
        ("a.example:65536", "invalid_port"),
        ("a.example:+80", "invalid_port"),
        ("a.example:８０", "invalid_port"),
        ("a.example/path", "invalid_target"),
        ("[::1", "invalid_target"),
        ("[::1]x", "invalid_target"),
        ("a.example\r\nHost: evil", "invalid_target"),
        ("a" * 9000, "invalid_target"),
    ],
)
def test_parse_target_refuses(text: str, reason: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_target(text)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    "authority",
    [
        "[github.com]",
        "[github.com]:443",
        "[GitHub.com.]:443",
        "[1.2.3.4]",
        "[1.2.3.4]:80",
        "[]:443",
        "[v1.fe80::1]",
        "github.com]:443",
        "[xn--n3h.com]",
        "[\u2603.com]",
    ],
)
def test_brackets_hold_an_ipv6_literal_and_nothing_else(authority: str) -> None:
    for text in (authority, f"https://{authority}/"):
        with pytest.raises(PolicyError) as info:
            parse_target(text)
        assert info.value.reason == "invalid_host", text
        assert "IPv6" in info.value.message or "']'" in info.value.message


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        ("[::1]:443", ("::1", 443)),
        ("[2001:DB8::1]", ("2001:DB8::1", None)),
        ("[::ffff:1.2.3.4]:80", ("::ffff:1.2.3.4", 80)),
        # A zone id is kept: the name stage refuses it as an IP literal.
        ("[fe80::1%25eth0]:443", ("fe80::1%25eth0", 443)),
        ("github.com:443", ("github.com", 443)),
    ],
)
def test_split_authority_keeps_ipv6_literals(
    authority: str, expected: tuple[str, int | None]
) -> None:
    assert split_authority(authority) == expected
