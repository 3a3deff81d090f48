"""The one bounded cache of the hot path: a table that never holds more than its limit.

    encoded: Bounded[str, str] = Bounded(4096)
    text = encoded.get(value)              # a hit: a plain dict's own get, nothing added
    if text is None:
        text = encoded.put(value, encode(value))    # a miss: stored, starting over when full

The caches it serves (the Vetter's memo of decisions and address checks, the audit line's
encodings and clients, the metrics' label sets) are asked on every connection, and their keys
come from clients: a hostile client can name as many distinct hosts as it likes, so each needs a
bound, and a hit must cost no more than it did as a plain dict. `get` is the bound method of the
plain dict inside, kept in a slot: as cheap as `dict.get` (a dict subclass's lookup is about half
as slow again: CPython specialises a call of `get` on an exact dict only).

One eviction rule: a store into a full cache empties it first. It is the cheapest rule there is
(no order to keep on a hit, no bookkeeping per entry), and enough for caches whose working set
(a session's few hosts, reasons, planes) is far below their bound: only a flood of distinct
keys fills one, and then little in it was worth keeping. Dropping the oldest entry instead would
cost a scan over the dict's deleted slots on every store once it is full.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Bounded"]


class Bounded[K, V]:
    """At most `limit` entries: read with `get`, store with `put` (see the module docstring)."""

    __slots__ = ("_entries", "get", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a bounded cache holds at least one entry, not {limit!r}")
        self.limit = limit
        self._entries: dict[K, V] = {}
        # The dict's own bound method: a hit is one call of C code, with nothing of ours in it.
        self.get: Callable[[K], V | None] = self._entries.get

    def put(self, key: K, value: V) -> V:
        """Stores `value` under `key` (emptying a full cache first); returns `value`."""
        entries = self._entries
        if len(entries) >= self.limit and key not in entries:
            entries.clear()
        entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
