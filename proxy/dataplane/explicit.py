"""The explicit proxy listener (`--listen HOST:PORT`, `http://`): a CONNECT is a tunnel, decided
and relayed here; any other request is plain HTTP, forwarded by the HTTP plane; a CONNECT that is
intercepted (its host's rules decide paths, or `inspection.mode: all`) is vetted, answered 200
and SNI-gated here, then served by the interception engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.dataplane import tunnel
from proxy.dataplane.connection import Connection
from proxy.dataplane.heads import ConnectHead, head_state, parse_connect
from proxy.dataplane.http import HttpPlane
from proxy.decide.interception import intercepted
from proxy.reasons import Refused, authority

if TYPE_CHECKING:
    from policy import Decision

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
        HttpPlane(self, transparent=False).start()

    def connect(self, head: ConnectHead) -> None:
        target = authority(head.host, head.port)
        decision = self.door.vetter.decide(target)
        self.protocol = "connect"
        del self.buffer[: len(self.buffer) - len(head.rest)]
        if intercepted(decision, self.door.config):
            self.spawn(self._intercept(target, head.host, head.port, decision))
            return
        self.spawn(self._tunnel(target, head.host, head.port, decision))

    async def _intercept(self, target: str, host: str, port: int, decision: Decision) -> None:
        """Vetted (DNS once, address stage) before the 200, SNI-gated after it, then the
        engine's: it dials the checked addresses when the first request inside needs them."""
        try:
            vetted = await tunnel.vet(
                self, target, port, decision, inspecting=True, method="CONNECT"
            )
        except Refused as refused:
            self.refuse(refused, host, port, stage="", record=False)
            return
        self.answered = True
        self.transport.write(ESTABLISHED)
        if await self._gate(vetted.decision.host, port):
            await self.door.intercept(self)

    async def _gate(self, host: str, port: int) -> bool:
        """The SNI gate on the ClientHello after the 200: True when it passed (its allow line
        written), False when the connection is closed (refused, or the client went first)."""
        outcome = await tunnel.client_hello(self, host)
        if outcome is None:
            return False
        self.sni = outcome.sni
        if outcome.refused is not None:
            self.door.vetter.refusal(
                outcome.refused, self.peer, host, port, self.protocol,
                stage="sni", sni=self.sni, ech=outcome.ech, vetted=self.vetted,
            )  # fmt: skip
            self.reason = outcome.refused.reason
            self.close()
            return False
        self.door.vetter.allowed(
            self.peer,
            self.protocol,
            stage="sni",
            ech=outcome.ech,
            vetted=self.vetted,
            port=port,
            sni=self.sni,
        )
        return True

    async def _tunnel(self, target: str, host: str, port: int, decision: Decision) -> None:
        try:
            dialled = await tunnel.dial(self, target, port, decision, method="CONNECT")
        except Refused as refused:
            self.refuse(refused, host, port, stage="", record=False)
            return
        try:
            self.answered = True
            self.transport.write(ESTABLISHED)
            if not await self._gate(dialled.name, port):
                dialled.transport.close()
                self.close()
                return
            tunnel.relay(self, dialled)
        except BaseException:
            if self.relay is None:
                dialled.transport.abort()
            raise
