"""How the report and its plots write a figure: a cell of a table, a ratio, a configuration's
label, a value with its unit. One module for both, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LABELS = {
    "direct": "direct (no proxy)",
    "tinyproxy": "tinyproxy",
    "privoxy": "privoxy",
    "squid": "squid",
    "mitmdump": "mitmdump (no policy)",
}
UNIT_FORMATS = {"µs": ",.0f", "/s": ",.0f", "MB/s": ",.0f", "s/GiB": ".2f", "MB": ".1f", "s": ".3f"}


def cell(value: Any, fmt: str, suffix: str = "") -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if value != value:  # NaN
        return "-"
    return format(value, fmt) + suffix


def ratio(value: Any) -> str:
    """0.012x, 0.53x, 15.4x, 268x: two significant digits at least."""
    if cell(value, "g") == "-":
        return "-"
    digits = 3 if abs(value) < 0.1 else 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{digits}f}x"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def label(config: str) -> str:
    if config.isdigit():
        return f"{int(config):,} rules"
    return LABELS.get(config, config)


def with_unit(value: Any, unit: str) -> str:
    text = cell(value, UNIT_FORMATS.get(unit, ".3g"))
    return text if text == "-" else f"{text} {unit}" if unit != "/s" else f"{text}/s"
