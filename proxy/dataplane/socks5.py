"""SOCKS5 listeners (`--listen socks5://HOST:PORT`). The front door's SOCKS5 handshake is being
written (RFC 1928: decided, resolved and dialled before the reply); the engine no longer serves
SOCKS5, so until then a SOCKS5 connection is closed unanswered, its audit line saying why. An
intercepted SOCKS5 tunnel reaches the engine through `Door.intercept`, after its 0x00 reply."""

from __future__ import annotations

from proxy.dataplane.connection import Connection
from proxy.reasons import INTERNAL_ERROR, Refused


class Socks5(Connection):
    protocol = "socks5"

    def begin(self) -> None:
        self.answered = True  # no SOCKS5 reply can be given before the handshake is read
        refused = Refused(403, INTERNAL_ERROR, "SOCKS5 is not served by this build")
        self.refuse(refused, None, None, stage="accept")
