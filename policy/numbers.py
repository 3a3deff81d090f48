"""Numbers in documents: the bounds every number read from a file keeps, and one way to read
a bounded whole number where a document must hold one.

A number out of bounds is refused where the document is parsed, with its place. Python cannot
print an int of more than 4,300 digits (nor parse one from decimal text); other parsers read
big integers and infinities differently (JavaScript rounds beyond 2**53, Go refuses beyond 64
bits, JSON has no infinity at all, YAML 1.1 reads `1e999` as text and YAML 1.2 as infinity),
and NaN is not even equal to itself. So a document's integers lie in the 64-bit range and its
floats are finite.
"""

from __future__ import annotations

import math
import re
from typing import Any, Self

from policy.errors import PolicyError
from policy.findings import quote

MIN_INT = -(2**63)
MAX_INT = 2**64 - 1
# A YAML integer whose text is longer is refused before it is converted: PyYAML's sexagesimal
# reading (`1:59:59:...`) takes quadratic time, and no integer in range needs so many characters.
MAX_INT_TEXT = 100

# The most digits (leading zeros aside) an integer within bounds has, per base: a longer one is
# refused without being converted.
_MAX_DIGITS = {10: len(str(MAX_INT)), 16: 16, 8: 22, 2: 64}
_BASES = {"0x": 16, "0o": 8, "0b": 2}
_SHOWN_TEXT = 32

# Numbers as TOML and JSON write them (the two syntaxes whose parsers give no position for a
# value): integers in any TOML base with `_` separators, floats, and the non-finite words.
_INT_TOKEN = re.compile(r"[+-]?(?:0x[0-9A-Fa-f_]+|0o[0-7_]+|0b[01_]+|[0-9_]+)")
_FLOAT_TOKEN = re.compile(r"[+-]?[0-9_]+(?:\.[0-9_]+)?(?:[eE][+-]?[0-9_]+)?")
_NON_FINITE_TOKEN = re.compile(r"[+-]?(?:inf|nan|Infinity|NaN)")
_DECIMAL = re.compile(r"[+-]?[0-9]{1,20}")


class SpelledInt(int):
    """A YAML integer not written in plain decimal: hexadecimal `0x1bb`, YAML 1.1 octal `0755`,
    binary `0b1`, `1_000` or sexagesimal `7:23`. It holds the value YAML 1.1 (PyYAML) reads and
    the text as written, which it shows itself as: a YAML 1.2 reader takes `0755` for 755 and
    `1_000` or `7:23` for text, so where a number is read it must be written in decimal."""

    text: str

    def __new__(cls, value: int, text: str) -> Self:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]
        return int(self), self.text  # copy and pickle make a SpelledInt again

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def abridged(text: str) -> str:
    """A number's text as a message shows it: whole when short, else its ends and its length."""
    if len(text) <= _SHOWN_TEXT:
        return text
    return f"{text[:12]}…{text[-4:]} ({len(text)} characters)"


def out_of_range(shown: str) -> PolicyError:
    return PolicyError(
        "number_out_of_range",
        f"the integer {shown} is out of range: integers in a document must lie between "
        f"{MIN_INT} and {MAX_INT} (64 bits)",
    )


def not_finite(shown: str, *, overflow: bool = False) -> PolicyError:
    if overflow:
        why = "is too large for a floating-point number (it reads as infinity)"
    else:
        why = "is not a finite number"
    return PolicyError(
        "number_not_finite",
        f"{shown} {why}; write a finite number (JSON has no infinity or NaN, and the parsers "
        "that take them disagree on them)",
    )


def check_int(value: int, text: str | None = None) -> int:
    """`value` if it is within bounds; else PolicyError('number_out_of_range')."""
    if MIN_INT <= value <= MAX_INT:
        return value
    raise out_of_range(abridged(text) if text is not None else quote(value))


def check_float(value: float, text: str) -> float:
    """`value` if it is finite; else PolicyError('number_not_finite'), saying whether `text`
    named a non-finite value or overflowed into one."""
    if math.isfinite(value):
        return value
    # `.inf` (YAML), `inf` (TOML) and `Infinity` (JSON) name one; `1e400` overflows into it.
    named = text.replace(".", "").strip().lstrip("+-").lower() in ("inf", "infinity", "nan")
    raise not_finite(abridged(text), overflow=not named)


def int_from_text(text: str) -> int:
    """The integer a TOML or JSON token spells (sign, `0x`/`0o`/`0b`, `_` separators), refusing
    one out of bounds before converting it: Python cannot convert more than 4,300 decimal
    digits, and a long hexadecimal one would cost memory for nothing."""
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    base = _BASES.get(body[:2].lower(), 10)
    digits = (body[2:] if base != 10 else body).replace("_", "").lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS[base]:
        raise out_of_range(abridged(text))
    return check_int(sign * int(digits, base), text)


def token_refusal(token: str) -> PolicyError | None:
    """Why the number a TOML or JSON token spells is out of bounds; None for a number within
    bounds and for any text that is not a number (a date, a key)."""
    try:
        if _NON_FINITE_TOKEN.fullmatch(token):
            raise not_finite(token)
        if _INT_TOKEN.fullmatch(token):
            int_from_text(token)
        elif _FLOAT_TOKEN.fullmatch(token):
            check_float(float(token.replace("_", "")), token)
    except PolicyError as exc:
        return exc
    except ValueError:
        return None  # not a number after all (`1__2`): the parser has its own say on that
    return None


def whole_number(value: Any, low: int, high: int, what: str) -> int:
    """`value` as an int from `low` to `high` where a document must hold one (a port, a limit).
    Every other type and spelling is refused with a message that says how to write it: raises
    PolicyError('invalid_number')."""
    span = f"{what} from {low} to {high}"

    def refuse(why: str) -> PolicyError:
        return PolicyError("invalid_number", why)

    if isinstance(value, bool):
        # YAML 1.1 reads yes/no/on/off as booleans: `ports: [on]` is no typo for a port.
        raise refuse(f"{quote(value)} is a boolean, not {span} (YAML reads yes, no, on, off too)")
    if isinstance(value, SpelledInt):
        # Hexadecimal, YAML 1.1 octal (`0755`: 755 to a YAML 1.2 reader), `1_000`, `7:23`.
        raise refuse(
            f"{abridged(value.text)} is not plain decimal, and YAML readers differ on what it "
            f"means (YAML 1.1 reads {quote(int(value))}); write {what} in decimal digits, "
            f"from {low} to {high}"
        )
    if isinstance(value, int):
        if low <= value <= high:
            return value
        raise refuse(f"{quote(value)} is not {span}")
    if isinstance(value, float) and value.is_integer() and low <= value <= high:
        raise refuse(f"{value!r} is not a whole number; write {int(value)}")
    if isinstance(value, str) and _DECIMAL.fullmatch(value) and low <= int(value) <= high:
        raise refuse(f"{quote(value)} is a string; write the number without quotes: {int(value)}")
    raise refuse(f"{quote(value)} is not {span}")


_PREFIX_LENGTH = re.compile(r"-?[0-9]+")


def check_prefix_length(cidr: str) -> None:
    """Refuses a CIDR whose prefix length is a number out of range (`/33`, `/-1`, twenty
    digits) with a message that says the range: PolicyError('invalid_cidr'). Any other text
    passes, for the CIDR parser to judge."""
    address, slash, length = cidr.partition("/")
    if not slash or not _PREFIX_LENGTH.fullmatch(length):
        return
    bits, family = (128, "IPv6") if ":" in address else (32, "IPv4")
    digits = length.lstrip("-").lstrip("0") or "0"
    if not length.startswith("-") and len(digits) <= 3 and int(digits) <= bits:
        return
    raise PolicyError(
        "invalid_cidr",
        f"{quote(cidr)}: the prefix length {abridged(length)} is out of range; "
        f"an {family} prefix length is 0 to {bits}",
    )
