"""What the commands print and return: exit codes, JSON, and tables capped for a person's
terminal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO

from proxy.common.terminal import printable

EXIT_OK, EXIT_FINDINGS, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 70


def print_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# A person reads the tables; a hostile or generated document can hold a million findings or
# rules, which `--json` still lists in full.
MAX_TABLE_ROWS = 1000


def more(items: Sequence[Any], what: str, out: TextIO) -> None:
    if len(items) > MAX_TABLE_ROWS:
        hidden = len(items) - MAX_TABLE_ROWS
        out.write(f"  … and {hidden} more {what} (--json lists them all)\n")


def table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "  ") -> None:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out.write(indent + "  ".join([*cells, row[-1]]).rstrip() + "\n")
