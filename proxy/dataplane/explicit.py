"""The explicit proxy listener (`--listen HOST:PORT`, `http://`): a CONNECT is a tunnel, decided
and dialled here, answered 200, then carried as what its first bytes say it is (TLS through the
SNI gate, plain HTTP through the HTTP plane, an opaque stream on the operator's `opaque_ports`:
proxy/dataplane/streams.py); any other request is plain HTTP, forwarded by the HTTP plane; a
CONNECT that is intercepted (its host's rules decide paths, or `inspection.mode: all`) is vetted
before its 200 and its ClientHello served by the interception engine. A CONNECT to an address
the session's DNS answered for allowed names is decided on those names (`attribution: dns`)."""

from __future__ import annotations

from policy.dimensions import Protocol, Stage
from proxy.common.refusals import Refused, authority
from proxy.dataplane import streams
from proxy.dataplane.connection import Connection
from proxy.dataplane.heads import ConnectHead, head_state, parse_connect
from proxy.dataplane.http import HttpPlane
from proxy.decide.events import Details

ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
# What the lines of every CONNECT's decision say of it, one value for them all (as the tunnel
# notes its attribution, it finds it said already).
_CONNECT = Details(method="CONNECT", attribution="connect")


class Explicit(Connection):
    def begin(self) -> None:
        self.arm_timer(self.door.config.limits.header_timeout)

    def received(self) -> None:
        state = head_state(self.buffer)
        if state == "more":
            return
        self.cancel_timer()
        if state == "other":
            self.plain_http()
            return
        head = parse_connect(self.buffer)
        if isinstance(head, Refused):
            self.refuse(head, None, None, stage=Stage.REQUEST)
            return
        self.connect(head)

    def plain_http(self) -> None:
        HttpPlane(self, transparent=False).start()

    def connect(self, head: ConnectHead) -> None:
        self.protocol = Protocol.CONNECT
        self.attribution = "connect"
        del self.buffer[: len(self.buffer) - len(head.rest)]
        target = authority(head.host, head.port)
        self.spawn(
            streams.open_tunnel(
                self, target, head.host, head.port, what="CONNECT host", details=_CONNECT
            )
        )

    def answer_success(self, bound: tuple[str, int] | None) -> bool:
        self.mark_answered()
        self.transport.write(ESTABLISHED)
        return True
