"""Idle upstream connections of plain HTTP, kept for the next request to the same place: keyed by
the decided host, the port and the checked address the connection went to, so a connection is
only ever reused for a request whose own decision pinned that very address.

    pool = Pool(loop)
    reused = pool.take("up.test", 80, ("127.0.0.1",))   # (reading, address) or None
    pool.put("up.test", 80, "127.0.0.1", reading)       # after a complete exchange

A connection travels with its transport's read side (proxy/net/flow.py `Reading`): the pool
clears what the exchange held it for, since an idle connection must be read (a server's close
is seen at once).

Bounded: at most PER_KEY idle connections per key and TOTAL in all (the oldest goes first), each
closed after IDLE seconds unused, and dropped the moment its server closes it or sends anything
while idle (a byte nobody asked for makes the connection's framing unknowable).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from proxy.net.flow import Reading

# As many as a busy session keeps in flight to one place: a connection the pool cannot keep is
# closed and a later request dials again (with 8 and 16 clients, half of all requests did).
PER_KEY: Final = 32
TOTAL: Final = 256
# Servers close idle connections after a few seconds (Apache 5 s, nginx 75 s); a connection kept
# longer than the shortest common one is more likely dead than useful.
IDLE: Final = 4.0

type Key = tuple[str, int, str]


class _Idle(asyncio.Protocol):
    """The protocol of a pooled transport: anything but silence drops it."""

    __slots__ = ("key", "pool", "reading", "timer", "transport")

    def __init__(self, pool: Pool, key: Key, reading: Reading) -> None:
        self.pool = pool
        self.key = key
        self.reading = reading
        self.transport = reading.transport
        self.timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        self.pool.drop(self)

    def eof_received(self) -> bool:
        self.pool.drop(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.drop(self)


class Pool:
    """Idle keep-alive connections to upstreams; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._idle: OrderedDict[_Idle, None] = OrderedDict()  # oldest first
        self._by_key: dict[Key, list[_Idle]] = {}

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, host: str, port: int, addresses: Sequence[str]) -> tuple[Reading, str] | None:
        """The most recently pooled live connection to one of `addresses` (in their order), and
        the address; None when there is none. The caller sets its own protocol on it."""
        for address in addresses:
            entries = self._by_key.get((host, port, address))
            while entries:
                entry = entries[-1]
                self._forget(entry)
                if not entry.transport.is_closing():
                    return entry.reading, address
        return None

    def put(self, host: str, port: int, address: str, reading: Reading) -> None:
        """Keeps a connection whose last exchange ended cleanly, for a later request."""
        transport = reading.transport
        if transport.is_closing():
            return
        key = (host, port, address)
        entry = _Idle(self, key, reading)
        transport.set_protocol(entry)
        entries = self._by_key.setdefault(key, [])
        entries.append(entry)
        self._idle[entry] = None
        entry.timer = self.loop.call_later(IDLE, self.drop, entry)
        if len(entries) > PER_KEY:
            self.drop(entries[0])
        if len(self._idle) > TOTAL:
            self.drop(next(iter(self._idle)))
        reading.clear()  # a server's close must be seen while idle

    def drop(self, entry: _Idle) -> None:
        if self._forget(entry):
            entry.transport.close()

    def close(self) -> None:
        """Closes every idle connection (the drain)."""
        for entry in list(self._idle):
            self.drop(entry)

    def _forget(self, entry: _Idle) -> bool:
        if entry not in self._idle:
            return False
        del self._idle[entry]
        entries = self._by_key.get(entry.key)
        if entries is not None:
            entries.remove(entry)
            if not entries:
                del self._by_key[entry.key]
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        return True
