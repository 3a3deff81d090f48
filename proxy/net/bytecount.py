"""What a tunnel's relay reports, whichever mode moves its bytes: the bytes moved so far and why
it ended."""

from __future__ import annotations

# Why a relay ended (the close line's `reason`).


class Counter:
    """Bytes moved by one relay, readable at any time while it runs and after it ends: `up` is
    client to upstream, `down` upstream to client, each counted as written to the receiver."""

    __slots__ = ("down", "up")

    def __init__(self) -> None:
        self.up = 0
        self.down = 0

    def __repr__(self) -> str:
        return f"Counter(up={self.up}, down={self.down})"
