"""Hostname grammar (deploy time), normaliser (run time), name classes and IP literals."""

from __future__ import annotations

import re
from ipaddress import IPv4Address, IPv6Address
from typing import NoReturn

import idna
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policy.errors import PolicyError
from policy.hostnames import (
    DEFAULT_INTERNAL_SUFFIXES,
    EntryProblem,
    check_entry,
    is_under,
    name_refusal,
    normalize_host,
    parse_ip_literal,
    suggest_entry,
)

ENTRY_REASONS = {
    "empty",
    "whitespace",
    "wildcard",
    "scheme",
    "port",
    "path",
    "ip_address",
    "loopback_name",
    "internal_name",
    "not_canonical",
    "single_label",
    "numeric_tld",
    "too_long",
    "invalid_hostname",
}


def fullwidth(text: str, keep: str = "") -> str:
    """The FULLWIDTH compatibility spelling of printable ASCII (U+FF01..U+FF5E), but `keep`."""
    return "".join(
        chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" and ch not in keep else ch for ch in text
    )


# Written through a helper because the literal characters are indistinguishable on screen.
FW_GITHUB = fullwidth("github.com")
FW_LOOPBACK = fullwidth("127.0.0.1", keep=".")

LABEL_63 = "a" * 63
NAME_253 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
NAME_254 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 62])
assert len(NAME_253) == 253 and len(NAME_254) == 254


# --------------------------------------------------------------------------------------------
# check_entry: the deploy-time grammar

ACCEPTED_ENTRIES = [
    "github.com",
    "api.github.com",
    "a.b.c.example.co.uk",
    "xn--bcher-kva.example",
    "xn--fa-hia.de",
    f"{LABEL_63}.com",
    f"x.{LABEL_63}",
    NAME_253,
    "1password.com",
    "123.example.com",
    "a-b.example.com",
    "foo.test",
    "foo.example",
    "notlocal.com",
    "localhost.example.com",
    # Reserved-LDH labels other than 'xn--' are plain LDH and occur in the wild.
    "r3---sn-abc.googlevideo.com",
]


@pytest.mark.parametrize("entry", ACCEPTED_ENTRIES)
def test_accepted_entries(entry: str) -> None:
    assert check_entry(entry) is None
    assert suggest_entry(entry) == entry
    assert normalize_host(entry) == entry


# (value, reason, exact fix the message must name or None when no rewrite exists)
REFUSED_ENTRIES: list[tuple[str, str, str | None]] = [
    ("", "empty", None),
    ("   ", "empty", None),
    (" github.com", "whitespace", "github.com"),
    ("github.com\n", "whitespace", "github.com"),
    ("\tGitHub.com ", "whitespace", "github.com"),
    ("*.github.com", "wildcard", "github.com"),
    ("*.github.com.", "wildcard", "github.com"),
    ("*", "wildcard", None),
    ("git*hub.com", "wildcard", None),
    ("api.*.github.com", "wildcard", None),
    ("*github.com", "wildcard", None),
    ("https://github.com", "scheme", "github.com"),
    ("http://github.com/", "scheme", "github.com"),
    ("https://GitHub.com/x", "scheme", "github.com"),
    ("https://github.com:443/path", "scheme", "github.com"),
    ("//github.com", "scheme", "github.com"),
    ("github.com:443", "port", "github.com"),
    ("github.com:", "port", "github.com"),
    ("github.com/path", "path", "github.com"),
    ("github.com/", "path", "github.com"),
    ("github.com?q", "path", "github.com"),
    ("github.com#frag", "path", "github.com"),
    ("140.82.121.4", "ip_address", None),
    ("140.82.121.4:443", "ip_address", None),
    ("https://140.82.121.4/x", "ip_address", None),
    ("10.0.0.0/8", "ip_address", None),
    ("127.1", "ip_address", None),
    ("0x7f.1", "ip_address", None),
    ("2130706433", "ip_address", None),
    ("0177.0.0.1", "ip_address", None),
    ("::1", "ip_address", None),
    ("[::1]", "ip_address", None),
    ("[::1]:443", "ip_address", None),
    ("2001:db8::1", "ip_address", None),
    ("[2001:db8::1]:8443", "ip_address", None),
    ("fe80::1%eth0", "ip_address", None),
    ("::ffff:127.0.0.1", "ip_address", None),
    ("localhost", "loopback_name", None),
    ("api.localhost", "loopback_name", None),
    ("https://localhost:8080", "loopback_name", None),
    ("*.localhost", "loopback_name", None),
    ("svc.cluster.local", "internal_name", None),
    ("kubernetes.default.svc.cluster.local", "internal_name", None),
    ("printer.local", "internal_name", None),
    ("vault.internal", "internal_name", None),
    ("router.home.arpa", "internal_name", None),
    ("duckduckgogg42xjoc72x3sjasowoarfbgcmvfimaftt6twagswzczad.onion", "internal_name", None),
    ("host.localdomain", "internal_name", None),
    ("nas.lan", "internal_name", None),
    ("wiki.intranet", "internal_name", None),
    ("mail.corp", "internal_name", None),
    ("box.home", "internal_name", None),
    ("db.private", "internal_name", None),
    ("name.alt", "internal_name", None),
    ("nothing.invalid", "internal_name", None),
    ("4.3.2.1.in-addr.arpa", "internal_name", None),
    ("1.0.ip6.arpa", "internal_name", None),
    ("GitHub.com", "not_canonical", "github.com"),
    ("github.com.", "not_canonical", "github.com"),
    ("GITHUB.COM.", "not_canonical", "github.com"),
    ("Bücher.example", "not_canonical", "xn--bcher-kva.example"),
    ("bücher.example", "not_canonical", "xn--bcher-kva.example"),
    ("faß.de", "not_canonical", "xn--fa-hia.de"),
    ("XN--BCHER-KVA.example", "not_canonical", "xn--bcher-kva.example"),
    ("bücher。example", "not_canonical", "xn--bcher-kva.example"),
    (FW_GITHUB, "not_canonical", "github.com"),
    ("github", "single_label", None),
    ("com", "single_label", None),
    ("example.123", "numeric_tld", None),
    ("foo.0x1", "numeric_tld", None),
    ("foo.0X1F", "numeric_tld", None),
    ("foo.0x", "numeric_tld", None),
    (f"{'a' * 64}.com", "too_long", None),
    (NAME_254, "too_long", None),
    ("a." * 300 + "com", "too_long", None),
    ("git_hub.com", "invalid_hostname", None),
    ("_dmarc.example.com", "invalid_hostname", None),
    ("-github.com", "invalid_hostname", None),
    ("github-.com", "invalid_hostname", None),
    ("a..b.com", "invalid_hostname", None),
    ("github.com..", "invalid_hostname", None),
    ("git hub.com", "invalid_hostname", None),
    ("git\x00hub.com", "invalid_hostname", None),
    ("xn--abc-.com", "invalid_hostname", None),
    ("xn--.com", "invalid_hostname", None),
    ("xn--bcher-kva8.example", "invalid_hostname", None),
    ("-bücher.example", "invalid_hostname", None),
    ("\U0001f4a9.la", "invalid_hostname", None),
    ("[not-an-address]", "invalid_hostname", None),
    ("a:b:c", "invalid_hostname", None),
    (".github.com", "invalid_hostname", "github.com"),
    ("user@github.com", "invalid_hostname", "github.com"),
    ("https://", "invalid_hostname", None),
]


@pytest.mark.parametrize(("value", "reason", "fix"), REFUSED_ENTRIES)
def test_refused_entries(value: str, reason: str, fix: str | None) -> None:
    problem = check_entry(value)
    assert isinstance(problem, EntryProblem)
    assert problem.reason == reason, problem.message
    assert problem.message
    assert suggest_entry(value) == fix
    if fix is not None:
        assert f"write {fix!r}" in problem.message
        assert check_entry(fix) is None


def test_whitespace_message_gives_trimmed_value() -> None:
    problem = check_entry("  api.github.com ")
    assert problem is not None and "'api.github.com'" in problem.message


def test_not_canonical_u_label_names_the_idna_a_label() -> None:
    problem = check_entry("faß.de")
    assert problem is not None
    # IDNA 2003 (Python's built-in codec) would have mapped this to a different name.
    assert "'xn--fa-hia.de'" in problem.message and "fass" not in problem.message


def test_non_string_entry_is_a_problem_not_a_crash() -> None:
    problem = check_entry(443)  # type: ignore[arg-type]
    assert problem is not None and problem.reason == "invalid_hostname"
    assert suggest_entry(None) is None  # type: ignore[arg-type]


def test_operator_suffixes_add_to_the_defaults() -> None:
    assert check_entry("db.corp.example.com") is None
    problem = check_entry("db.corp.example.com", internal_suffixes=["corp.example.com"])
    assert problem is not None and problem.reason == "internal_name"
    # The defaults still apply alongside operator suffixes.
    problem = check_entry("vault.internal", internal_suffixes=["corp.example.com"])
    assert problem is not None and problem.reason == "internal_name"


@pytest.mark.parametrize(
    "entry", ["localhost", "svc.cluster.local", "gateway", "metadata.internal"]
)
def test_allow_internal_lifts_name_class_refusals(entry: str) -> None:
    assert check_entry(entry) is not None
    assert check_entry(entry, allow_internal=True) is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("GitHub.com", "not_canonical"),
        ("Gateway", "not_canonical"),
        ("a..b", "invalid_hostname"),
        ("*.svc.cluster.local", "wildcard"),
        ("10.0.0.1", "ip_address"),
        ("svc.cluster.local:443", "port"),
        ("gateway.123", "numeric_tld"),
        ("gate_way", "invalid_hostname"),
    ],
)
def test_allow_internal_keeps_syntax_rules(value: str, reason: str) -> None:
    problem = check_entry(value, allow_internal=True)
    assert problem is not None and problem.reason == reason


# --------------------------------------------------------------------------------------------
# normalize_host: the runtime normaliser

NORMALIZED = [
    ("github.com", "github.com"),
    ("GitHub.com", "github.com"),
    ("github.com.", "github.com"),
    ("API.GITHUB.COM.", "api.github.com"),
    ("faß.de", "xn--fa-hia.de"),
    ("Bücher.example", "xn--bcher-kva.example"),
    ("bücher。example", "xn--bcher-kva.example"),
    ("bücher\uff0eexample", "xn--bcher-kva.example"),
    (FW_GITHUB, "github.com"),
    (FW_GITHUB + "\u3002", "github.com"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("git\u00adhub.com", "github.com"),
    ("localhost", "localhost"),
    ("localhost.", "localhost"),
    ("github", "github"),
    (NAME_253, NAME_253),
    (NAME_253 + ".", NAME_253),
    # Documented leniency: underscores and hyphen placement in ASCII labels.
    ("_dmarc.example.com", "_dmarc.example.com"),
    ("foo-.blogspot.com", "foo-.blogspot.com"),
    ("r3---sn-abc.googlevideo.com", "r3---sn-abc.googlevideo.com"),
    ("1.2.3.com", "1.2.3.com"),
]


@pytest.mark.parametrize(("raw", "expected"), NORMALIZED)
def test_normalize_host(raw: str, expected: str) -> None:
    assert normalize_host(raw) == expected
    assert normalize_host(expected) == expected


IP_SPELLINGS = [
    "127.0.0.1",
    "127.0.0.1.",
    "127.1",
    "127.0.1",
    "0x7f.1",
    "0X7F.0.0.1",
    "0x7f000001",
    "2130706433",
    "0177.0.0.1",
    "017700000001",
    "0",
    "169.254.169.254",
    "1.2.3.4.5",
    "[::1]",
    "::1",
    "[::]",
    "fe80::1%eth0",
    "[fe80::1%25eth0]",
    "::ffff:127.0.0.1",
    "[::ffff:7f00:1]",
    "2001:db8::1",
    "example.123",
    "foo.0x1",
    "foo.0x",
    "foo.0X",
    FW_LOOPBACK,
    fullwidth("127.0.0.1"),
    "127。0。0。1",
    fullwidth("[::1]"),
    "[::1]:443",
    "127.0.0.1:80",
]


@pytest.mark.parametrize("raw", IP_SPELLINGS)
def test_normalize_host_refuses_ip_literals(raw: str) -> None:
    with pytest.raises(PolicyError) as info:
        normalize_host(raw)
    assert info.value.reason == "ip_literal"


INVALID_HOSTS = [
    "",
    ".",
    "..",
    "a..b",
    ".github.com",
    "github.com..",
    " github.com",
    "github.com ",
    "git hub.com",
    "github.com\n",
    "git\thub.com",
    "a\x00b.com",
    "a\x7fb.com",
    "*",
    "*.github.com",
    "git*hub.com",
    "github.com:443",
    "github.com/path",
    "user@github.com",
    "[not-an-address]",
    "[::1",
    f"{'a' * 64}.com",
    NAME_254,
    "x" * 100_000,
    "é" * 5000,
    "xn--abc-.com",
    "xn--.com",
    "xn--bcher-kva8.example",
    "XN--ABC-.com",
    "-bücher.example",
    "\U0001f4a9.la",
    "a\u2488com",
    "bü cher.example",
    "\u3000",
    # Labels idna refuses, long: their messages once echoed the label whole (hundreds of
    # characters, as many as the input has), and idna's message echoes it again.
    "a" * 50 + "\u200d" * 40 + ".test",
    "ü" * 30 + "\u200d" * 300 + ".test",
]


@pytest.mark.parametrize("raw", INVALID_HOSTS)
def test_normalize_host_refuses_garbage(raw: str) -> None:
    with pytest.raises(PolicyError) as info:
        normalize_host(raw)
    assert info.value.reason == "invalid_host"
    # The message names the host (bounded) and says what is wrong.
    assert repr(raw)[:20] in info.value.message
    assert len(info.value.message) < 400


def test_normalize_host_refuses_non_strings() -> None:
    with pytest.raises(PolicyError) as info:
        normalize_host(b"github.com")  # type: ignore[arg-type]
    assert info.value.reason == "invalid_host"


def test_normalize_host_is_not_idna_2003() -> None:
    assert normalize_host("faß.de") != "fass.de"


def test_plain_ascii_names_take_no_idna_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fast path runs per connection; idna is only for U-labels and 'xn--' labels.
    def forbidden(*_args: object, **_kwargs: object) -> NoReturn:
        raise AssertionError("idna called on the ASCII fast path")

    for name in ("uts46_remap", "alabel", "ulabel", "encode", "decode"):
        monkeypatch.setattr(idna, name, forbidden)
    assert normalize_host("API.GitHub.com.") == "api.github.com"
    assert normalize_host("_dmarc.example.com") == "_dmarc.example.com"
    with pytest.raises(PolicyError):
        normalize_host("127.1")


# --------------------------------------------------------------------------------------------
# name_refusal, is_under, parse_ip_literal


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("localhost", "loopback_name"),
        ("a.localhost", "loopback_name"),
        ("a.b.localhost", "loopback_name"),
        ("svc.cluster.local", "internal_name"),
        ("local", "internal_name"),
        ("vault.internal", "internal_name"),
        ("router.home.arpa", "internal_name"),
        ("home.arpa", "internal_name"),
        ("x.onion", "internal_name"),
        ("4.3.2.1.in-addr.arpa", "internal_name"),
        ("github", "single_label"),
        ("github.com", None),
        ("localhost.example.com", None),
        ("notlocal.com", None),
        ("local.example.com", None),
        ("arpa.example.com", None),
        ("foo.test", None),
        ("foo.example", None),
        ("example.arpa", None),
    ],
)
def test_name_refusal(host: str, reason: str | None) -> None:
    refusal = name_refusal(host)
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert refusal[0] == reason
        assert host in refusal[1]


def test_name_refusal_with_operator_suffixes() -> None:
    assert name_refusal("db.corp.example.com") is None
    refusal = name_refusal("db.corp.example.com", ["corp.example.com"])
    assert refusal is not None and refusal[0] == "internal_name"
    # Operator spellings are folded the way they are likely written.
    for spelling in ("Corp.Example.com.", ".corp.example.com", "*.corp.example.com"):
        refusal = name_refusal("db.corp.example.com", (spelling,))
        assert refusal is not None and refusal[0] == "internal_name"
    assert name_refusal("notcorp.example.com", ["corp.example.com"]) is None


def test_default_internal_suffixes() -> None:
    for suffix in ("local", "internal", "home.arpa", "onion", "in-addr.arpa", "ip6.arpa"):
        assert suffix in DEFAULT_INTERNAL_SUFFIXES
    # Tests run their own DNS server for names under these, so they must stay usable.
    assert "test" not in DEFAULT_INTERNAL_SUFFIXES
    assert "example" not in DEFAULT_INTERNAL_SUFFIXES
    for suffix in DEFAULT_INTERNAL_SUFFIXES:
        assert suffix == suffix.lower() and not suffix.startswith(".")


@pytest.mark.parametrize(
    ("host", "suffix", "expected"),
    [
        ("github.com", "github.com", True),
        ("api.github.com", "github.com", True),
        ("a.b.github.com", "github.com", True),
        ("notgithub.com", "github.com", False),
        ("github.com.evil.test", "github.com", False),
        ("github.com", "api.github.com", False),
        ("com", "github.com", False),
        ("github.com", "com", True),
        ("github.com", "", False),
        ("", "github.com", False),
    ],
)
def test_is_under(host: str, suffix: str, expected: bool) -> None:
    assert is_under(host, suffix) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("140.82.121.4", IPv4Address("140.82.121.4")),
        ("169.254.169.254", IPv4Address("169.254.169.254")),
        ("0.0.0.0", IPv4Address("0.0.0.0")),
        ("255.255.255.255", IPv4Address("255.255.255.255")),
        ("::1", IPv6Address("::1")),
        ("[::1]", IPv6Address("::1")),
        ("2001:db8::1", IPv6Address("2001:db8::1")),
        ("[2001:DB8::1]", IPv6Address("2001:db8::1")),
        ("::ffff:1.2.3.4", IPv6Address("::ffff:1.2.3.4")),
        ("127.1", None),
        ("0x7f.0.0.1", None),
        ("0177.0.0.1", None),
        ("01.2.3.4", None),
        ("1.2.3.04", None),
        ("2130706433", None),
        ("256.1.1.1", None),
        ("1.2.3.4.5", None),
        ("1.2.3", None),
        (" 1.2.3.4", None),
        ("1.2.3.4 ", None),
        ("1.2.3.4\n", None),
        ("1.2.3.4:80", None),
        ("[1.2.3.4]", None),
        (fullwidth("1.2.3.4", keep="."), None),
        ("fe80::1%eth0", None),
        ("[fe80::1%eth0]", None),
        ("[::1]:443", None),
        ("[::1", None),
        ("github.com", None),
        ("", None),
    ],
)
def test_parse_ip_literal(text: str, expected: IPv4Address | IPv6Address | None) -> None:
    assert parse_ip_literal(text) == expected


# --------------------------------------------------------------------------------------------
# Properties

_LABEL_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
_INTERESTING = [
    *_LABEL_CHARS,
    *".:[]%*/@ ",
    "ß",
    "ü",
    "Ü",
    "é",
    "\u3002",
    "\uff0e",
    "\uff61",
    "\u00ad",
    "\u200b",
    "\u200d",
    "\u212a",  # KELVIN SIGN, lowercases to ASCII 'k'
    "\uff11",  # FULLWIDTH DIGIT ONE
    "\u0661",  # ARABIC-INDIC DIGIT ONE
    "\u05d0",  # HEBREW LETTER ALEF: exercises the bidi rule
    "\u0308",  # COMBINING DIAERESIS
    "xn--",
    "0x",
]

host_like_text = st.lists(st.sampled_from(_INTERESTING), max_size=40).map("".join)

_ldh_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
_unicode_label = st.sampled_from(["bücher", "faß", "münchen", "例え", "пример", "ελληνικά"])
_label = st.one_of(_ldh_label, _unicode_label, st.sampled_from(["xn--bcher-kva", "123", "0x1f"]))


@st.composite
def generated_hostnames(draw: st.DrawFn) -> str:
    labels = draw(st.lists(_label, min_size=1, max_size=5))
    name = ".".join(labels)
    if draw(st.booleans()):
        name = name.upper() if draw(st.booleans()) else name.title()
    if draw(st.booleans()):
        name += draw(st.sampled_from([".", "\u3002"]))
    return name


@st.composite
def decorated_entries(draw: st.DrawFn) -> str:
    host = draw(generated_hostnames())
    prefix = draw(st.sampled_from(["", "https://", "http://", "*.", " ", "user@", "."]))
    suffix = draw(st.sampled_from(["", ":443", "/path", "/", "?q=1", " ", ":8080/x"]))
    return prefix + host + suffix


def _normalized_or_none(raw: str) -> str | None:
    # Only PolicyError may escape: anything else propagates and fails the property.
    try:
        return normalize_host(raw)
    except PolicyError as exc:
        assert exc.reason in {"ip_literal", "invalid_host"}
        return None


@settings(max_examples=500)
@given(st.one_of(st.text(), host_like_text, generated_hostnames()))
@example("faß.de")
@example(FW_GITHUB + "\u3002")
@example("git\u00adhub.com.")
@example("a.b.\u3002")
def test_normalize_host_is_idempotent(raw: str) -> None:
    once = _normalized_or_none(raw)
    if once is not None:
        assert normalize_host(once) == once
        assert once.isascii() and once == once.lower() and not once.endswith(".")
        assert 0 < len(once) <= 253


@settings(max_examples=300)
@given(st.text(st.characters(exclude_categories=()), max_size=60))
def test_normalize_host_raises_only_policy_error(raw: str) -> None:
    # Lone surrogates included: a hostile client controls every code point.
    _normalized_or_none(raw)


@settings(max_examples=300)
@given(generated_hostnames())
def test_normalize_host_agrees_with_idna_uts46(raw: str) -> None:
    once = _normalized_or_none(raw)
    stripped = raw[:-1] if raw.endswith((".", "\u3002")) else raw
    try:
        expected = idna.encode(stripped, uts46=True, transitional=False).decode("ascii")
    except idna.IDNAError:
        return
    if re.fullmatch(r"[0-9]+|0x[0-9a-f]*", expected.rpartition(".")[2]):
        assert once is None
    else:
        assert once == expected


@settings(max_examples=300)
@given(st.one_of(generated_hostnames(), host_like_text, st.text(max_size=30)))
def test_accepted_entries_are_fixed_points_of_normalize_host(value: str) -> None:
    if check_entry(value) is None:
        assert normalize_host(value) == value
        assert suggest_entry(value) == value


@settings(max_examples=300)
@given(st.from_regex(r"[a-z0-9]{1,10}(\.[a-z0-9-]{1,10}){1,3}\.[a-z]{2,6}", fullmatch=True))
def test_generated_canonical_entries(value: str) -> None:
    if check_entry(value) is None:
        assert normalize_host(value) == value


@settings(max_examples=500)
@given(st.one_of(st.text(), host_like_text, generated_hostnames(), decorated_entries()))
@example("https://GitHub.com/x")
@example(" *.Bücher.example. ")
def test_suggestions_are_valid_entries(value: str) -> None:
    problem = check_entry(value)
    assert problem is None or problem.reason in ENTRY_REASONS
    assert problem is None or problem.message
    suggestion = suggest_entry(value)
    if suggestion is not None:
        assert check_entry(suggestion) is None
        assert normalize_host(suggestion) == suggestion


@settings(max_examples=200)
@given(decorated_entries())
def test_fix_in_message_is_the_suggestion(value: str) -> None:
    problem = check_entry(value)
    suggestion = suggest_entry(value)
    if problem is not None and suggestion is not None and suggestion != value:
        assert f"write {suggestion!r}" in problem.message


@settings(max_examples=300)
@given(st.text(), st.text())
def test_is_under_matches_label_boundaries(host: str, suffix: str) -> None:
    expected = bool(suffix) and (host == suffix or host.endswith("." + suffix))
    assert is_under(host, suffix) is expected


@given(st.ip_addresses())
def test_parse_ip_literal_round_trips_canonical_text(address: IPv4Address | IPv6Address) -> None:
    assert parse_ip_literal(str(address)) == address
    if isinstance(address, IPv6Address):
        assert parse_ip_literal(f"[{address}]") == address
    with pytest.raises(PolicyError) as info:
        normalize_host(str(address) if address.version == 4 else f"[{address}]")
    assert info.value.reason == "ip_literal"


@settings(max_examples=500)
@given(st.one_of(st.text(alphabet="abz09-.*:/_XN", max_size=40), st.text(max_size=30)))
def test_fast_path_agrees_with_the_full_check(value: str) -> None:
    from policy.entries import _check_entry_in_full

    for suffixes, allow_internal in (((), False), (("b.a",), False), ((), True)):
        assert check_entry(value, internal_suffixes=suffixes, allow_internal=allow_internal) == (
            _check_entry_in_full(value, suffixes, allow_internal)
        )
