"""The denial feed: a bounded ring of the most recent denials, served as `GET /denials?since=SEQ`
on the admin listener, so an agent's harness can tell its agent what was blocked without reading
the audit log.

The ring is fed by `AuditLog.write` (proxy/ops/audit.py), the one place every decision's audit
line is written: every deny `DecisionEvent` becomes exactly one entry, an allow never does, and
the entry's `time` is the audit line's. Nothing in the planes knows about it.

Each entry gets `seq`, a per-process counter starting at 1; the ring keeps the newest `capacity`
entries, so the seqs in it are always contiguous. A page starts at the first entry whose seq is
`since` or more, holds at most `per_request` entries, and says in `next` what to ask next time.

Hosts, rules and messages come from clients or echo them: each text is capped like its audit
field, and the page is encoded with `ensure_ascii=True`, so it is valid ASCII JSON whatever a
client sent.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from typing import Any, NamedTuple

from proxy.decide.events import MAX_FIELD, DecisionEvent, timestamp

__all__ = ["CAPACITY", "MAX_SINCE", "PER_REQUEST", "Denials"]

CAPACITY = 1000
PER_REQUEST = 200
# The largest `since` a client may ask with: the admin listener refuses more (400).
MAX_SINCE = 2**63


class _Entry(NamedTuple):
    seq: int
    time: str
    host: str | None
    port: int | str | None
    reason: str | None
    rule: str | None
    message: str | None
    plane: str | None
    protocol: str | None


def _text(value: object) -> str | None:
    # As the audit line writes it (events._Fields.text): a StrEnum as its bare value, bytes
    # decoded, and cut to the audit field cap, so an entry shows what its audit line shows and
    # 1,000 entries stay small whatever the clients sent.
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        text = bytes(value).decode("utf-8", "backslashreplace")
    elif isinstance(value, str):
        text = str.__str__(value)
    else:
        text = str(value)
    return text[:MAX_FIELD]


class Denials:
    """The ring of recent denials. `add` is called for every deny decision (from the proxy's
    event loop); `page` and `render` answer `/denials`. A lock keeps seq order and ring order
    the same even if a decision is ever recorded from another thread."""

    def __init__(self, capacity: int = CAPACITY, per_request: int = PER_REQUEST) -> None:
        if capacity < 1 or per_request < 1:
            raise ValueError("the denial ring needs a capacity and a page size of at least 1")
        self.capacity = capacity
        self.per_request = per_request
        self._ring: deque[_Entry] = deque(maxlen=capacity)
        self._next_seq = 1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def next_seq(self) -> int:
        """The seq the next denial will get."""
        return self._next_seq

    def add(self, event: DecisionEvent, now: float) -> None:
        """Record `event` (a deny) decided at `now` (epoch seconds, the audit line's clock)."""
        port = event.port if type(event.port) is int or event.port is None else _text(event.port)
        when = timestamp(now)
        with self._lock:
            self._ring.append(
                _Entry(
                    self._next_seq,
                    when,
                    _text(event.host),
                    port,
                    _text(event.reason),
                    _text(event.rule),
                    _text(event.message),
                    _text(event.plane),
                    _text(event.protocol),
                )
            )
            self._next_seq += 1

    def page(self, since: int = 0) -> dict[str, Any]:
        """The denials with seq >= `since`, oldest first, at most `per_request` of them:
        `{"denials": [...], "next": SEQ}`, plus `"dropped": N` when N denials from `since` on
        left the ring before they could be read."""
        if since < 0:
            raise ValueError("since must not be negative")
        with self._lock:
            next_seq = self._next_seq
            oldest = self._ring[0].seq if self._ring else next_seq
            # The ring's seqs are contiguous (oldest .. next_seq - 1): an index, not a search.
            # Clamped to the ring's length: islice refuses bounds past sys.maxsize (since=2**63).
            start = min(max(since - oldest, 0), len(self._ring))
            entries = list(itertools.islice(self._ring, start, start + self.per_request))
        page: dict[str, Any] = {"denials": [entry._asdict() for entry in entries]}
        if entries:
            page["next"] = entries[-1].seq + 1
        else:
            # Nothing new: ask with the same `since` again. Never a seq beyond the next one
            # this process will assign, so a harness that kept its `since` across a proxy
            # restart (the counter starts again at 1) still sees the new process's denials.
            page["next"] = min(since, next_seq)
        dropped = oldest - max(since, 1)
        if dropped > 0:
            page["dropped"] = dropped
        return page

    def render(self, since: int = 0) -> bytes:
        """`page(since)` as the JSON body of `/denials` (ASCII, one line and a newline)."""
        body = json.dumps(self.page(since), ensure_ascii=True, separators=(",", ":"))
        return body.encode("ascii") + b"\n"
