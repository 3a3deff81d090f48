"""Which connection class serves which kind of listener."""

from __future__ import annotations

from collections.abc import Callable

from proxy.common.listeners import Listener
from proxy.dataplane.connection import Connection, Door
from proxy.dataplane.explicit import Explicit
from proxy.dataplane.socks5 import Socks5
from proxy.dataplane.transparent import Transparent

_KINDS: dict[str, type[Connection]] = {
    "http": Explicit,
    "socks5": Socks5,
    "transparent": Transparent,
}


def protocol_for(door: Door, listener: Listener) -> Callable[[], Connection]:
    """The protocol factory of one listener, for `loop.create_server`."""
    kind = _KINDS.get(listener.scheme)
    if kind is None:
        raise ValueError(f"no connection class serves {listener.scheme!r} listeners")
    return lambda: kind(door, listener)
