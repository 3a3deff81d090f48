"""policy/numbers.py and the bounded rendering of values in policy/findings.py: the bounds of
a document's numbers, how one is read where a whole number must stand, and how a value that a
message echoes is shown (never thousands of digits, never Python's spelling of true)."""

from __future__ import annotations

import copy
import json
import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy import PolicyError
from policy.findings import Finding, describe_value, key_text, quote
from policy.numbers import (
    MAX_INT,
    MIN_INT,
    SpelledInt,
    check_prefix_length,
    int_from_text,
    token_refusal,
    whole_number,
)


def ident(value: object) -> str:
    """A test id for any value: pytest's own str() fails on an int of over 4,300 digits."""
    return quote(value)[:40]


def test_the_bounds_are_the_64_bit_range() -> None:
    assert (MIN_INT, MAX_INT) == (-(2**63), 2**64 - 1)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("-0", 0),
        ("+5", 5),
        ("18446744073709551615", MAX_INT),
        ("-9223372036854775808", MIN_INT),
        ("0x1bb", 443),
        ("0o777", 511),
        ("0b101", 5),
        ("1_000", 1000),
        ("0x" + "0" * 5000 + "1", 1),  # leading zeros cost nothing and mean nothing
    ],
)
def test_int_from_text_reads_what_is_in_bounds(text: str, value: int) -> None:
    assert int_from_text(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "18446744073709551616",
        "-9223372036854775809",
        "9" * 21,
        "9" * 4300,
        "9" * 5000,
        "0x1" + "0" * 16,
        "0b1" + "0" * 64,
        "0o" + "7" * 30,
    ],
)
def test_int_from_text_refuses_what_is_out_of_bounds(text: str) -> None:
    with pytest.raises(PolicyError) as info:
        int_from_text(text)
    assert info.value.reason == "number_out_of_range"
    assert len(info.value.message) < 300


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("inf", "number_not_finite"),
        ("-inf", "number_not_finite"),
        ("nan", "number_not_finite"),
        ("+nan", "number_not_finite"),
        ("NaN", "number_not_finite"),
        ("-Infinity", "number_not_finite"),
        ("1e400", "number_not_finite"),
        ("-1.5e99999999999", "number_not_finite"),
        ("9" * 5000, "number_out_of_range"),
        ("0xffff_ffff_ffff_ffff_f", "number_out_of_range"),
    ],
)
def test_token_refusal_names_each_kind(token: str, reason: str) -> None:
    refusal = token_refusal(token)
    assert refusal is not None and refusal.reason == reason


@pytest.mark.parametrize(
    "token", ["0", "1.5", "1e308", "1e-400", "0x10", "1979-05-27", "07:32:00", "12abc", "1__2"]
)
def test_token_refusal_passes_numbers_in_bounds_and_non_numbers(token: str) -> None:
    assert token_refusal(token) is None


def test_an_overflow_is_told_from_a_named_infinity() -> None:
    overflow, named = token_refusal("1e400"), token_refusal("inf")
    assert overflow is not None and "too large" in overflow.message
    assert named is not None and "not a finite number" in named.message


# -- whole_number: where a document must hold one ---------------------------------------------


def port(value: object) -> int:
    return whole_number(value, 1, 65535, "a port number")


def refusal(value: object) -> str:
    with pytest.raises(PolicyError) as info:
        port(value)
    assert info.value.reason == "invalid_number"
    return info.value.message


def test_whole_number_takes_an_int_in_its_range() -> None:
    assert port(1) == 1 and port(65535) == 65535


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (0, "0 is not a port number from 1 to 65535"),
        (65536, "65536 is not a port number"),
        (-1, "-1 is not"),
        (True, "true is a boolean"),
        (False, "false is a boolean"),
        (443.0, "443.0 is not a whole number; write 443"),
        (443.5, "443.5 is not a port number"),
        (math.inf, "<infinity> is not"),
        (math.nan, "<NaN> is not"),
        ("443", "'443' is a string; write the number without quotes: 443"),
        ("０443", "is not a port number"),  # fullwidth digit: no number at all
        ("0x1bb", "'0x1bb' is not a port number"),
        (None, "null is not"),
        ([443], "<list of 1 items> is not"),
        (SpelledInt(443, "0x1bb"), "0x1bb is not plain decimal"),
        (SpelledInt(511, "0777"), "YAML 1.1 reads 511"),
        (SpelledInt(16**40 - 1, "0x" + "f" * 40), "0xffffffffff…ffff (42 characters) is not plain"),
        (10**5000, "integer of about 5001 digits"),
    ],
    ids=ident,
)
def test_whole_number_refuses_every_other_value_saying_how_to_write_it(
    value: object, says: str
) -> None:
    message = refusal(value)
    assert says in message, message
    assert len(message) < 300


def test_a_spelled_int_is_its_value_and_shows_its_text() -> None:
    spelled = SpelledInt(443, "0x1bb")
    assert spelled == 443 and hash(spelled) == hash(443)
    assert repr(spelled) == str(spelled) == f"{spelled}" == "0x1bb"
    assert json.dumps(spelled) == "443"  # --json shows the value
    assert quote(spelled) == "0x1bb"  # messages show what was written
    for again in (copy.deepcopy(spelled), pickle.loads(pickle.dumps(spelled))):
        assert type(again) is SpelledInt and again == 443 and again.text == "0x1bb"


# -- prefix lengths ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cidr", "says"),
    [
        ("10.0.0.0/33", "prefix length 33 is out of range; an IPv4 prefix length is 0 to 32"),
        ("10.0.0.0/99999999999999999999", "an IPv4 prefix length is 0 to 32"),
        ("::/-1", "prefix length -1 is out of range; an IPv6 prefix length is 0 to 128"),
        ("::/129", "0 to 128"),
        ("10.0.0.0/" + "9" * 5000, "999999999999…9999 (5000 characters)"),
    ],
)
def test_a_prefix_length_out_of_range_is_refused(cidr: str, says: str) -> None:
    with pytest.raises(PolicyError) as info:
        check_prefix_length(cidr)
    assert info.value.reason == "invalid_cidr"
    assert says in info.value.message
    assert len(info.value.message) < 400


@pytest.mark.parametrize(
    "cidr", ["10.0.0.0/0", "10.0.0.0/32", "10.0.0.0/032", "::/128", "10.0.0.0", "a/+8", "x/1e3"]
)
def test_other_prefix_texts_are_left_to_the_cidr_parser(cidr: str) -> None:
    check_prefix_length(cidr)


# -- rendering values in messages -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "true"),
        (False, "false"),
        (None, "null"),
        (5, "5"),
        (-(10**23), str(-(10**23))),
        (10**24, "<integer of about 25 digits>"),
        (10**5000, "<integer of about 5001 digits>"),
        (-(10**5000), "<negative integer of about 5001 digits>"),
        (2**80000, "<integer of about 24083 digits>"),
        (1.5, "1.5"),
        (math.inf, "<infinity>"),
        (-math.inf, "<-infinity>"),
        (math.nan, "<NaN>"),
        ("x" * 5000, repr("x" * 200 + "…")),
    ],
    ids=ident,
)
def test_quote_is_bounded_and_spells_values_as_documents_do(value: object, shown: str) -> None:
    assert quote(value) == shown


@given(st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text()))
def test_every_scalar_renders_as_strict_json(value: object) -> None:
    finding = Finding("a", value, "r", "m")
    json.dumps(finding.to_json(), allow_nan=False)
    assert len(quote(value)) < 300


def test_huge_ints_render_without_converting_to_text() -> None:
    # More digits than Python converts: a str() here would raise ValueError.
    assert "digits" in quote(10**10000)
    assert "digits" in json.dumps(describe_value(10**10000))


def test_key_text_bounds_a_key_in_a_path() -> None:
    assert key_text("egress") == "egress"
    assert key_text("k" * 5000) == "k" * 99 + "…"
    assert key_text(443) == "443"
    assert key_text(True) == "true"
    assert key_text(10**5000) == "<integer of about 5001 digits>"
