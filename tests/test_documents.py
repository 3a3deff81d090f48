import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import PolicyError
from policy.documents import MAX_DEPTH, MAX_DOCUMENT_BYTES, parse_document
from policy.numbers import SpelledInt


def reason_of(data: bytes | str, source: str = "doc.yaml") -> tuple[str, int | None]:
    with pytest.raises(PolicyError) as info:
        parse_document(data, source)
    return info.value.reason, info.value.line


def test_parses_each_syntax() -> None:
    assert parse_document(b"a: [x, y]\n", "m.yaml") == {"a": ["x", "y"]}
    assert parse_document(b'a = ["x"]\n', "m.toml") == {"a": ["x"]}
    assert parse_document(b'{"a": ["x"]}', "m.json") == {"a": ["x"]}
    assert parse_document("\ufeffa: 1\n".encode(), "bom.yaml") == {"a": 1}


def test_yaml_syntax_error_names_line_and_column() -> None:
    with pytest.raises(PolicyError) as info:
        parse_document(b"network:\n  egress: [a.com,\n", "agent.yaml")
    err = info.value
    assert err.reason == "yaml_syntax"
    assert err.source == "agent.yaml" and err.line == 3 and err.column is not None
    assert str(err).startswith("agent.yaml:3:")


def test_toml_syntax_error_names_line_and_column() -> None:
    with pytest.raises(PolicyError) as info:
        parse_document(b'[network_access]\nallowed = ["a.com"\nx = 1\n', "agent.toml")
    err = info.value
    assert err.reason == "toml_syntax" and err.line == 3 and err.column is not None


def test_json_syntax_error_names_line_and_column() -> None:
    with pytest.raises(PolicyError) as info:
        parse_document(b'{\n  "a": [1,]\n}', "agent.json")
    assert info.value.reason == "json_syntax" and info.value.line == 2


@pytest.mark.parametrize(
    ("data", "source", "reason"),
    [
        (b"", "m.yaml", "empty_document"),
        (b"  \n\n", "m.yaml", "empty_document"),
        (b"a: 1\x00", "m.yaml", "binary_file"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "m.yaml", "binary_file"),
        (b"a: \xff\xfe\n", "m.yaml", "not_utf8"),
        (b"a: 1\na: 2\n", "m.yaml", "duplicate_key"),
        (b'{"a": 1, "a": 2}', "m.json", "duplicate_key"),
        (b"a = 1\na = 2\n", "m.toml", "toml_syntax"),
        (b"a: 1\n---\nb: 2\n", "m.yaml", "multiple_documents"),
        (b"? [a, b]\n: 1\n", "m.yaml", "yaml_syntax"),
    ],
)
def test_refuses_bad_documents(data: bytes, source: str, reason: str) -> None:
    assert reason_of(data, source)[0] == reason


def test_refuses_oversized_document_without_parsing() -> None:
    data = b"a: " + b"x" * MAX_DOCUMENT_BYTES
    assert reason_of(data)[0] == "too_large"


def test_refuses_deep_nesting_in_every_syntax() -> None:
    depth = MAX_DEPTH + 1
    assert reason_of("a: " + "[" * depth + "]" * depth)[0] == "too_deep"
    assert reason_of("[" * 100_000)[0] in ("too_deep", "yaml_syntax")
    assert reason_of('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "m.json")[0] == "too_deep"
    assert reason_of("a = " + "[" * 100_000 + "]" * 100_000, "m.toml")[0] == "too_deep"


def test_refuses_billion_laughs() -> None:
    lines = ["a0: &a0 [lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    reason, line = reason_of("\n".join(lines) + "\n")
    assert reason == "alias_bomb" and line is not None


def test_accepts_a_few_aliases() -> None:
    text = "base: &b [a.com]\nother: *b\n"
    assert parse_document(text, "m.yaml") == {"base": ["a.com"], "other": ["a.com"]}
    many = "".join(f"k{i}: *b\n" for i in range(500))
    assert len(parse_document(text + many, "m.yaml")) == 502


@settings(max_examples=300)
@given(st.binary(max_size=300), st.sampled_from(["m.yaml", "m.toml", "m.json"]))
def test_arbitrary_bytes_raise_only_policy_error(data: bytes, source: str) -> None:
    with contextlib.suppress(PolicyError):
        parse_document(data, source)


def test_dates_are_read_as_written() -> None:
    # An impossible date under a key that is not ours must not fail the document.
    assert parse_document(b"released: 2024-02-30\n", "m.yaml") == {"released": "2024-02-30"}


def test_toml_error_at_the_very_end_still_has_a_position() -> None:
    with pytest.raises(PolicyError) as info:
        parse_document(b'[network_access]\nallowed = ["a.com"', "agent.toml")
    assert (info.value.line, info.value.column) == (2, 19)
    assert "end of document" not in info.value.message


def test_application_tags_are_inert_plain_values() -> None:
    text = b"a: !!python/object/apply:os.system [ls]\nb: !Ref x\nc: !Custom {k: v}\n"
    assert parse_document(text, "m.yaml") == {"a": ["ls"], "b": "x", "c": {"k": "v"}}


def test_many_plain_values_are_not_called_an_alias_bomb() -> None:
    text = "a: [" + ",".join(["1"] * 1_000_001) + "]\n"
    reason, _ = reason_of(text)
    assert reason == "too_many_values"


# -- numbers (policy/numbers.py) ---------------------------------------------------------------


def refusal_of(data: str, source: str) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse_document(data, source)
    return info.value


@pytest.mark.parametrize(
    ("text", "source", "reason", "line", "column"),
    [
        ("a: 1\nb: [x, 18446744073709551616]\n", "m.yaml", "number_out_of_range", 2, 8),
        ("a: -9223372036854775809\n", "m.yaml", "number_out_of_range", 1, 4),
        ("a: " + "9" * 5000 + "\n", "m.yaml", "number_out_of_range", 1, 4),
        ("a: 0b" + "1" * 65 + "\n", "m.yaml", "number_out_of_range", 1, 4),
        ("a: {b: .inf}\n", "m.yaml", "number_not_finite", 1, 8),
        ("a: !!float 1e999\n", "m.yaml", "number_not_finite", 1, 4),
        ("a: !!int abc\n", "m.yaml", "yaml_value", 1, 4),
        ('{"a": [1,\n 2, 99999999999999999999]}', "m.json", "number_out_of_range", 2, 5),
        ('{"a": "99999999999999999999", "b": 1E400}', "m.json", "number_not_finite", 1, 36),
        ('{"a\\"1e400": -Infinity}', "m.json", "number_not_finite", 1, 14),
        ("a = 1\n[t]\nb = 0o" + "7" * 23 + "\n", "m.toml", "number_out_of_range", 3, 5),
        ("a = '1e400'\nb = [1, +inf]\n", "m.toml", "number_not_finite", 2, 9),
        ("a = 1\n\nb = { c = " + "9" * 4400 + " }\n", "m.toml", "number_out_of_range", 3, 11),
        ('a = """\n9e999\n"""\nb = 9e999\n', "m.toml", "number_not_finite", 4, 5),
        ("[t]\n99999999999999999999 = 1\nb = -9_223_372_036_854_775_809\n", "m.toml",
         "number_out_of_range", 3, 5),
    ],
)  # fmt: skip
def test_a_number_out_of_bounds_is_refused_at_its_line_and_column(
    text: str, source: str, reason: str, line: int, column: int
) -> None:
    err = refusal_of(text, source)
    assert (err.reason, err.line, err.column) == (reason, line, column), err
    assert err.source == source
    assert str(err).startswith(f"{source}:{line}:{column}: ")
    assert len(err.message) < 300


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("a: [18446744073709551615, -9223372036854775808, 1.7976931348623157e+308]\n", "m.yaml"),
        ('{"a": [18446744073709551615, -9223372036854775808, 1.7976931348623157e308]}', "m.json"),
        ("a = [18446744073709551615, -9223372036854775808, 1.7976931348623157e308]\n", "m.toml"),
    ],
)
def test_the_largest_numbers_in_bounds_are_read(text: str, source: str) -> None:
    assert parse_document(text, source) == {"a": [2**64 - 1, -(2**63), 1.7976931348623157e308]}


def test_yaml_integers_not_in_plain_decimal_keep_their_spelling() -> None:
    document = parse_document("a: [0x1bb, 0777, 0b11, 1_000, 7:23, 443, -0, +5]\n", "m.yaml")
    values = document["a"]
    assert values == [443, 511, 3, 1000, 443, 443, 0, 5]
    spelled = [v for v in values if isinstance(v, SpelledInt)]
    assert [v.text for v in spelled] == ["0x1bb", "0777", "0b11", "1_000", "7:23"]
    assert all(type(v) is int for v in values[5:])


def test_a_yaml_sexagesimal_integer_is_refused_by_its_length_before_it_is_computed() -> None:
    # PyYAML's reading multiplies by 60 once per part: a few MB of them would take hours.
    err = refusal_of("a: 1" + ":59" * 1_000_000 + "\n", "m.yaml")
    assert err.reason == "number_out_of_range" and (err.line, err.column) == (1, 4)
    assert "(3000001 characters)" in err.message


def test_a_huge_number_as_a_yaml_key_is_refused_at_the_key() -> None:
    err = refusal_of("a:\n  ? 0x" + "f" * 5000 + "\n  : 1\n", "m.yaml")
    assert (err.reason, err.line, err.column) == ("number_out_of_range", 2, 5)


def test_a_duplicate_key_message_is_bounded() -> None:
    key = "k" * 100_000
    for text, source in ((f"? {key}\n: 1\n? {key}\n: 2\n", "m.yaml"),
                         (f'{{"{key}": 1, "{key}": 2}}', "m.json")):  # fmt: skip
        err = refusal_of(text, source)
        assert err.reason == "duplicate_key" and len(err.message) < 400


_INT_TOKENS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=2**64 - 3, max_value=2**64 + 3).map(str),
    st.integers(min_value=-(2**63) - 3, max_value=-(2**63) + 3).map(str),
    st.integers(min_value=4290, max_value=4400).map(lambda n: "9" * n),
)


def _in_bounds(token: str) -> bool:
    return len(token) <= 21 and -(2**63) <= int(token) <= 2**64 - 1


@settings(max_examples=300, deadline=None)
@given(st.lists(_INT_TOKENS, min_size=1, max_size=6), st.sampled_from(["yaml", "json", "toml"]))
def test_integers_in_bounds_are_read_and_the_first_other_is_refused_where_it_stands(
    tokens: list[str], syntax: str
) -> None:
    head = {"yaml": "a: [", "json": '{"a": [', "toml": "a = ["}[syntax]
    tail = {"yaml": "]\n", "json": "]}", "toml": "]\n"}[syntax]
    text = head + ", ".join(tokens) + tail
    bad = next((i for i, t in enumerate(tokens) if not _in_bounds(t)), None)
    if bad is None:
        assert parse_document(text, f"m.{syntax}") == {"a": [int(t) for t in tokens]}
        return
    err = refusal_of(text, f"m.{syntax}")
    assert err.reason == "number_out_of_range"
    assert (err.line, err.column) == (1, len(head) + sum(len(t) + 2 for t in tokens[:bad]) + 1)
