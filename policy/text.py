"""Text from clients and documents inside messages: cut to a bound, so that one hostile value
cannot make a message (an audit line, a refusal, a finding) as long as itself."""

from __future__ import annotations

__all__ = ["clipped"]


def clipped(text: str, limit: int = 100) -> str:
    """`text`, or its first `limit` characters and an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"
