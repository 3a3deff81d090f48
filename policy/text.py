"""Text from clients, documents and libraries inside messages: cut to a bound, so that one
hostile value cannot make a message (an audit line, a refusal, a finding) as long as itself.
The one clipping of the project: the policy core's messages, the resolver's and the terminal's
lines all cut here."""

from __future__ import annotations

__all__ = ["brief", "clipped"]


def clipped(text: str, limit: int = 100) -> str:
    """`text`, or its first `limit` characters and an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"


def brief(exc: BaseException, limit: int = 119) -> str:
    """An exception's text (its type's name when it has none), clipped: libraries echo their
    whole input in their messages (idna, dnspython), and that input came from a client or a
    document."""
    return clipped(str(exc) or type(exc).__name__, limit)
