"""Bytes to a Python value: YAML, TOML or JSON, with limits for hostile input.

The loaders must never raise anything but PolicyError and must stay cheap on adversarial
documents: a size cap, a NUL check, a nesting cap, a cap on what aliases expand to (a
"billion laughs" document is a DAG that any naive walk or print expands exponentially), and
bounds on every number (policy/numbers.py), each refusal at its line and column.
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any, Literal, NoReturn

from policy.errors import PolicyError
from policy.findings import key_text, quote
from policy.numbers import (
    MAX_INT,
    MIN_INT,
    check_float,
    int_from_text,
    not_finite,
    out_of_range,
    token_refusal,
)
from policy.yaml_loader import parse_yaml

Syntax = Literal["yaml", "toml", "json"]

MAX_DOCUMENT_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64
# Aliases share one object when loaded, but anything that walks the value expands them.
MAX_EXPANDED_NODES = 1_000_000


def syntax_for(source: str) -> Syntax:
    """The syntax a file name implies: `.toml`, `.json`, else YAML."""
    lowered = source.lower()
    if lowered.endswith(".toml"):
        return "toml"
    if lowered.endswith(".json"):
        return "json"
    return "yaml"


def decode_text(data: bytes | str, source: str) -> str:
    """UTF-8 text of a document, refusing what is not a text document at all."""
    if isinstance(data, str):
        text = data
        if len(text) > MAX_DOCUMENT_BYTES:
            raise too_large(source, len(text.encode("utf-8", "surrogatepass")))
    else:
        if len(data) > MAX_DOCUMENT_BYTES:
            raise too_large(source, len(data))
        nul = data.find(b"\0")
        if nul >= 0:
            raise PolicyError(
                "binary_file",
                f"NUL byte at offset {nul}: this is not a text document",
                source=source,
            )
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise PolicyError(
                "not_utf8",
                f"not UTF-8 text (invalid byte at offset {exc.start}); save the file as UTF-8",
                source=source,
            ) from None
    if "\0" in text:
        raise PolicyError(
            "binary_file",
            f"NUL character at offset {text.index(chr(0))}: this is not a text document",
            source=source,
        )
    if not text.strip():
        raise PolicyError("empty_document", "the document is empty", source=source)
    return text


def too_large(source: str, size: int | None) -> PolicyError:
    """The refusal of a document over MAX_DOCUMENT_BYTES (`size` None: read until past it)."""
    what = f"{size} bytes is" if size is not None else "it is"
    return PolicyError(
        "too_large",
        f"{what} over the limit of {MAX_DOCUMENT_BYTES} bytes "
        f"({MAX_DOCUMENT_BYTES // (1024 * 1024)} MiB) for a document",
        source=source,
    )


def parse_document(data: bytes | str, source: str, syntax: Syntax | None = None) -> Any:
    """Parse `data` (named `source` in messages) as `syntax`, or as its file name implies."""
    text = decode_text(data, source)
    syntax = syntax or syntax_for(source)
    try:
        if syntax == "toml":
            return _parse_toml(text, source)
        if syntax == "json":
            return _parse_json(text, source)
        return parse_yaml(text, source, max_depth=MAX_DEPTH, max_nodes=MAX_EXPANDED_NODES)
    except RecursionError:
        raise PolicyError(
            "too_deep",
            f"nested deeper than this parser can follow (limit {MAX_DEPTH})",
            source=source,
        ) from None


_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)")
_TOML_END = re.compile(r"\s*\(at end of document\)")


def _parse_toml(text: str, source: str) -> Any:
    try:
        document = tomllib.loads(text, parse_float=_toml_float)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_syntax_error(exc, text, source) from None
    except PolicyError as exc:  # a float out of bounds, from _toml_float
        raise _located_number(text, _TOML_TOKENS, source, exc) from None
    except ValueError:
        # tomllib converts integers itself (no hook) and Python refuses more than 4,300 digits.
        refusal = out_of_range("written with more than 4300 digits")
        raise _located_number(text, _TOML_TOKENS, source, refusal) from None
    unbounded = _unbounded_int(document)
    if unbounded is not None:
        path, value = unbounded
        refusal = out_of_range(quote(value))
        refusal.path = path
        raise _located_number(text, _TOML_TOKENS, source, refusal)
    return document


def _toml_float(text: str) -> float:
    return check_float(float(text.replace("_", "")), text)


def _toml_syntax_error(exc: tomllib.TOMLDecodeError, text: str, source: str) -> PolicyError:
    message = str(exc)
    line = getattr(exc, "lineno", None)
    column = getattr(exc, "colno", None)
    match = _TOML_POSITION.search(message)
    if match and line is None:
        line, column = int(match.group(1)), int(match.group(2))
    elif line is None and "end of document" in message:
        line = text.count("\n") + 1
        column = len(text) - (text.rfind("\n") + 1) + 1
    detail = getattr(exc, "msg", None) or _TOML_END.sub("", _TOML_POSITION.sub("", message))
    return PolicyError(
        "toml_syntax", f"TOML syntax error: {detail}", source=source, line=line, column=column
    )


def _unbounded_int(document: dict[str, Any]) -> tuple[str, int] | None:
    """(path, value) of an integer out of bounds: tomllib converts integers with no hook, so
    they are checked after it. Paths are built only for containers and for the one found."""
    stack: list[tuple[dict[str, Any] | list[Any], str]] = [(document, "")]
    while stack:
        container, path = stack.pop()
        pairs = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in pairs:
            if isinstance(value, dict | list):
                stack.append((value, _child_path(path, key)))
            elif type(value) is int and not MIN_INT <= value <= MAX_INT:
                return _child_path(path, key), value
    return None


def _child_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key_text(key)}" if path else key_text(key)


# How a number's place is found in TOML and JSON, whose parsers give no position for a value:
# strings and comments are skipped, and every other run that may be a number is a token. Both
# parsers read a document in order, so the first token out of bounds is the one they refused.
_TOML_TOKENS = re.compile(
    r"""
      \#[^\n]*
    | \"\"\"(?:[^\\]|\\.)*?\"{3,5}
    | \'\'\'.*?\'{3,5}
    | "(?:[^"\\\n]|\\.)*"
    | '[^'\n]*'
    | (?<![\w.+-])(?P<number>[+-]?(?:inf|nan|[0-9][0-9A-Za-z_.+:-]*))(?!\w)
    """,
    re.VERBOSE | re.DOTALL,
)
_JSON_TOKENS = re.compile(
    r'"(?:[^"\\]|\\.)*"|(?P<number>-?[0-9][0-9.eE+-]*|NaN|-?Infinity)', re.DOTALL
)
_KEY_AFTER = re.compile(r"[ \t]*=")  # a TOML bare key of digits is text, not a number


def _located_number(
    text: str, tokens: re.Pattern[str], source: str, fallback: PolicyError
) -> PolicyError:
    """The refusal of the first number out of bounds in `text`, at its line and column; else
    `fallback` (named by its path where it has one)."""
    for match in tokens.finditer(text):
        token = match.group("number")
        if token is None or _KEY_AFTER.match(text, match.end()):
            continue
        refusal = token_refusal(token)
        if refusal is not None:
            start = match.start("number")
            refusal.line = text.count("\n", 0, start) + 1
            refusal.column = start - text.rfind("\n", 0, start)
            fallback = refusal
            break
    fallback.source = source
    return fallback


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {quote(key)}: a key may appear once in an object")
        result[key] = value
    return result


def _json_float(text: str) -> float:
    return check_float(float(text), text)


def _json_constant(text: str) -> NoReturn:
    raise not_finite(text)  # NaN, Infinity, -Infinity: Python reads them, JSON has none


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(
            text,
            object_pairs_hook=_pairs_without_duplicates,
            parse_int=int_from_text,
            parse_float=_json_float,
            parse_constant=_json_constant,
        )
    except PolicyError as exc:  # a number out of bounds, from the hooks
        raise _located_number(text, _JSON_TOKENS, source, exc) from None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            "json_syntax",
            f"JSON syntax error: {exc.msg}",
            source=source,
            line=exc.lineno,
            column=exc.colno,
        ) from None
    except ValueError as exc:
        raise PolicyError("duplicate_key", str(exc), source=source) from None


def require_mapping(value: Any, source: str, what: str) -> dict[str, Any]:
    """The top level of a manifest, ceiling or config must be a mapping with string keys."""
    if not isinstance(value, dict):
        kind = "nothing" if value is None else f"a {type(value).__name__}"
        raise PolicyError(
            "not_a_mapping",
            f"the top level of {what} must be a mapping, found {kind}",
            source=source,
        )
    return value
