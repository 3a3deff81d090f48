"""Text bound for a terminal: documents and clients are hostile, a person's terminal is not."""

from __future__ import annotations

import re
import unicodedata

from policy.text import clipped

_UNPRINTABLE = re.compile(r"[^\t -~]")


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    # Control, format (bidi overrides) and separator characters could rewrite a terminal or
    # reorder a line: a hostile manifest's key names reach these tables and messages.
    if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
        return ch.encode("unicode_escape").decode("ascii")
    return ch


def printable(text: str) -> str:
    """`text` safe for a terminal: invisible and control characters spelled as escapes."""
    if text.isascii() and text.isprintable():
        return text
    return _UNPRINTABLE.sub(_escape, text)


def one_line(text: str, limit: int) -> str:
    """`text` as one line of at most `limit` characters: no control characters (it may end up
    in an HTTP body or a message that promises one line)."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[: limit + 1])
    return clipped(cleaned, limit - 1)
