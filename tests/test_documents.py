import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import PolicyError
from policy.documents import MAX_DEPTH, MAX_DOCUMENT_BYTES, parse_document


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
