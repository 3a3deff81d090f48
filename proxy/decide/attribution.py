"""Which names the session's DNS responder answered with which addresses, so that a connection
carrying no name of its own (a redirected SSH or database connection: no SNI, no Host; a SOCKS5
or CONNECT request that names an address) can be attributed to the name it was made for, as
Cilium's toFQDNs policy does.

    table = Attribution(grace=300.0)
    table.remember("git.test", ("192.0.2.7",), ttl=30)     # the DNS responder, per answer
    table.names("192.0.2.7")                               # ("git.test",): the data plane

Every address remembered here passed the address stage when it was answered, for a name the
policy allowed then; the data plane decides the name again (on the port, with the policy of the
moment) and connects to that very address, which is pinning. An address the session never got
from our DNS names nothing.

An entry lives for the answer's TTL plus `grace` (long-running clients keep an address well
past its TTL). Bounded: at most MAX_ENTRIES (address, name) pairs and MAX_NAMES names per
address (a shared CDN address keeps its most recent names); when full, expired entries go
first, then the addresses answered longest ago. A name answered again moves to the front.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable

__all__ = ["Attribution", "canonical_address"]

MAX_ENTRIES = 16384
MAX_NAMES = 16


def canonical_address(text: str) -> str | None:
    """The address's canonical text (an IPv4-mapped IPv6 address as its IPv4 address, which
    is how a dual-stack socket reports a v4 peer); None for anything that is not one."""
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


class Attribution:
    """The session's answered addresses and the names they were answered for."""

    def __init__(
        self,
        grace: float,
        *,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.max_entries = max_entries
        self._clock = clock
        # address -> {name: expiry}; both dicts in answer order, oldest first.
        self._by_address: dict[str, dict[str, float]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def remember(self, name: str, addresses: Iterable[str], ttl: float) -> None:
        """`name` was answered with `addresses` (checked), valid for `ttl` seconds."""
        expiry = self._clock() + max(ttl, 0.0) + self.grace
        for text in addresses:
            address = canonical_address(text)
            if address is None:
                continue
            names = self._by_address.pop(address, None)
            if names is None:
                names = {}
            elif name in names:
                del names[name]
                self._size -= 1
            names[name] = expiry
            self._size += 1
            while len(names) > MAX_NAMES:
                del names[next(iter(names))]
                self._size -= 1
            self._by_address[address] = names  # to the end: answered last
        if self._size > self.max_entries:
            self._shrink()

    def names(self, address: str) -> tuple[str, ...]:
        """The names `address` was answered for and that have not expired, the most recently
        answered first; () when it names nothing."""
        key = canonical_address(address)
        names = self._by_address.get(key) if key is not None else None
        if not names:
            return ()
        now = self._clock()
        live = tuple(name for name, expiry in reversed(names.items()) if expiry > now)
        if len(live) != len(names):
            self._expire(key, names, now)  # type: ignore[arg-type]
        return live

    def _expire(self, address: str, names: dict[str, float], now: float) -> None:
        for name in [n for n, expiry in names.items() if expiry <= now]:
            del names[name]
            self._size -= 1
        if not names:
            del self._by_address[address]

    def _shrink(self) -> None:
        """Down to 7/8 of the bound, so that a table full of live entries is swept once per
        eighth of its size rather than on every answer."""
        now = self._clock()
        for address, names in list(self._by_address.items()):
            self._expire(address, names, now)
        target = self.max_entries - self.max_entries // 8
        while self._size > target and self._by_address:
            address = next(iter(self._by_address))
            self._size -= len(self._by_address.pop(address))
