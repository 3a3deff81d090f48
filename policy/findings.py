"""Findings: what validation says about one place in a document."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from policy.text import clipped

Severity = Literal["error", "warning"]

_MAX_TEXT = 200
_MAX_KEY = 100
# Integers shown as they are up to this size; beyond it (only values a caller built: documents
# refuse such numbers) by their length, since Python cannot print an int of more than 4,300
# digits and a person cannot read one.
_MAX_SHOWN_INT = 10**24
_LOG10_2 = math.log10(2)


def describe_value(value: Any) -> Any:
    """A bounded, JSON-safe rendering of a document value for messages and `--json`.

    Values come from hostile documents: a string may be megabytes long and a list may be the
    root of an alias bomb, so nothing here walks into containers.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -_MAX_SHOWN_INT < value < _MAX_SHOWN_INT:
            return value
        digits = int(abs(value).bit_length() * _LOG10_2) + 1
        return f"<{'negative ' if value < 0 else ''}integer of about {digits} digits>"
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "<NaN>" if math.isnan(value) else f"<{'-' if value < 0 else ''}infinity>"
    if isinstance(value, str):
        return clipped(value, _MAX_TEXT)
    if isinstance(value, list | tuple):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<mapping of {len(value)} keys>"
    return f"<{type(value).__name__}>"


def describe_type(value: Any) -> str:
    """'a string', 'a number', ... for messages about a value of the wrong type."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a value of type {type(value).__name__}"


def unknown_key_message(key: Any, where: str, known: Sequence[str]) -> str:
    """The message for a key that is not one of `known`, with the likeliest meant key."""
    close = difflib.get_close_matches(key_text(key), known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
    return f"unknown key {quote(key)} in {where}; {hint}"


def key_text(key: Any) -> str:
    """A mapping key as a finding's path writes it (`network.KEY`), bounded: keys come from
    hostile documents too, and a path is printed in every message about the place."""
    if isinstance(key, str):
        return clipped(key, _MAX_KEY - 1)
    return quote(key)


def quote(value: Any) -> str:
    """`value` as it appears inside a message: a repr of the bounded rendering, with the
    documents' spellings of booleans and null (`true`, not Python's `True`)."""
    shown = describe_value(value)
    if shown is None:
        return "null"
    if isinstance(shown, bool):
        return "true" if shown else "false"
    return repr(shown) if isinstance(shown, str) and not shown.startswith("<") else str(shown)


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem at one place: `path` is like `network.egress[2]`, `file` the document,
    `line` and `column` (1-based) where the path is in it, when known."""

    path: str
    value: Any
    reason: str
    message: str
    severity: Severity = "error"
    file: str | None = None
    line: int | None = None
    column: int | None = None

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "value": describe_value(self.value),
            "reason": self.reason,
            "message": self.message,
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "column": self.column,
        }
