"""The idle timeout of a connection that moves bytes: the relay of a tunnel (proxy/net/relay.py),
its splice mode (proxy/net/splice.py) and the HTTP plane (proxy/dataplane/http.py).

    idle = IdleTimer(loop, 300.0, on_idle)
    idle.start()
    idle.moved()        # on every read or write: notes the time, nothing more
    idle.stop()

Moving bytes must stay cheap, so `moved` only notes the loop's time; the one timer is not
pushed back then. When it fires it compares: the deadline passed, and `on_idle` is called
(once); else it is armed again for the deadline the last move set. A `timeout` of None never
fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["IdleTimer"]


class IdleTimer:
    """See the module docstring."""

    __slots__ = ("_handle", "_loop", "_on_idle", "last_moved", "timeout")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float | None,
        on_idle: Callable[[], None],
    ) -> None:
        self._loop = loop
        self.timeout = timeout
        self._on_idle = on_idle
        self.last_moved = loop.time()
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.timeout is not None and self._handle is None:
            self._handle = self._loop.call_at(self.last_moved + self.timeout, self._fire)

    def moved(self) -> None:
        self.last_moved = self._loop.time()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        assert self.timeout is not None
        deadline = self.last_moved + self.timeout
        if self._loop.time() < deadline:
            self._handle = self._loop.call_at(deadline, self._fire)
            return
        self._handle = None
        self._on_idle()
