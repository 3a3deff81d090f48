"""SOCKS5 listeners (`--listen socks5://HOST:PORT`). Until the front door speaks SOCKS5 itself,
the engine serves these connections on the same socket."""

from __future__ import annotations

from proxy.dataplane.connection import Connection


class Socks5(Connection):
    protocol = "socks5"

    def begin(self) -> None:
        self.spawn(self.door.hand_off(self, b"", "socks5"))
