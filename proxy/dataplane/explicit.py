"""The explicit proxy listener (`--listen HOST:PORT`, `http://`): a CONNECT is a tunnel, decided
and relayed here; any other request is plain HTTP, forwarded by the HTTP plane; a CONNECT whose
host needs inspection goes to the interception engine."""

from __future__ import annotations

from proxy.dataplane import tunnel
from proxy.dataplane.connection import Connection
from proxy.dataplane.heads import ConnectHead, head_state, parse_connect
from proxy.reasons import Refused, authority

ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


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
            self.refuse(head, None, None, stage="request")
            return
        self.connect(head)

    def plain_http(self) -> None:
        # Until the HTTP plane takes these, the engine serves them on the same socket.
        self.spawn(self.door.hand_off(self, bytes(self.buffer), "http"))

    def connect(self, head: ConnectHead) -> None:
        target = authority(head.host, head.port)
        decision = self.door.vetter.decide(target)
        if decision.allowed and decision.needs_inspection:
            # Interception is the engine's: it reads the CONNECT head again itself.
            self.spawn(self.door.hand_off(self, bytes(self.buffer), "http"))
            return
        self.protocol = "connect"
        del self.buffer[: len(self.buffer) - len(head.rest)]
        self.spawn(self._tunnel(target, head.host, head.port, decision))

    async def _tunnel(self, target: str, host: str, port: int, decision: object) -> None:
        try:
            dialled = await tunnel.dial(self, target, port, decision, method="CONNECT")  # type: ignore[arg-type]
        except Refused as refused:
            self.refuse(refused, host, port, stage="", record=False)
            return
        try:
            self.answered = True
            self.transport.write(ESTABLISHED)
            outcome = await tunnel.client_hello(self, dialled.name)
            if outcome is None:  # the client ended (or went) before its ClientHello
                dialled.transport.close()
                self.close()
                return
            self.sni = outcome.sni
            if outcome.refused is not None:
                dialled.transport.close()
                self.door.vetter.refusal(
                    outcome.refused, self.peer, dialled.name, port, self.protocol,
                    stage="sni", sni=outcome.sni, vetted=dialled.vetted,
                )  # fmt: skip
                self.reason = outcome.refused.reason
                self.close()
                return
            self.door.vetter.allowed(
                self.peer,
                self.protocol,
                stage="sni",
                vetted=dialled.vetted,
                port=port,
                sni=self.sni,
            )
            tunnel.relay(self, dialled)
        except BaseException:
            if self.relay is None:
                dialled.transport.abort()
            raise
