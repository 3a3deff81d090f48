"""Transparent listeners (`transparent://HOST:PORT`, `--mode transparent`): connections netfilter
redirected to us (REDIRECT/DNAT). TLS is decided on its SNI and relayed to a checked address of
that name, never to the original destination, which is read only for its port; a TLS connection
that is intercepted (its host's rules decide paths, or `inspection.mode: all`) is vetted here and
then served by the interception engine, exactly as an explicit one. Plain HTTP is decided on its
Host header by the HTTP plane. No SNI, no Host, or a connection that was not redirected: refused.
The client asked nothing of a proxy, so a refusal speaks the client's own protocol: a TLS
connection refused after its ClientHello gets a fatal TLS alert (`access_denied`, or
`internal_error` when the upstream or DNS failed) before the close; one refused before anything
was read is closed. Its decision and close lines say why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.reasons import Reason
from proxy.dataplane import tunnel
from proxy.dataplane.connection import Connection
from proxy.dataplane.http import HttpPlane
from proxy.decide.clienthello import starts_like_tls
from proxy.decide.interception import intercepted
from proxy.decide.sni_gate import read_hello
from proxy.net.sockets import original_destination
from proxy.reasons import Refused, authority, refusal_alert

if TYPE_CHECKING:
    from policy import Decision


class Transparent(Connection):
    protocol = "tls"

    def begin(self) -> None:
        try:
            original = original_destination(self.raw_socket())
            if self.door.is_own(*original):
                # conntrack knows every connection, redirected or not: one that reached our
                # listener by its own address would make us dial ourselves.
                raise OSError("the connection was not redirected")
        except OSError as exc:
            refused = Refused(
                403,
                Reason.NO_ORIGINAL_DESTINATION,
                f"no original destination (not a redirected connection?): {exc.strerror or exc}",
            )
            self.refuse(refused, None, None, stage="accept")
            return
        self.port = original[1]
        self.arm_timer(self.door.config.limits.header_timeout)

    def answer_refusal(self, refused: Refused, host: str | None, port: int | None) -> None:
        # Only after a TLS record arrived: then the client's TLS stack reads the alert.
        if self.buffer[:1] == b"\x16":
            self.transport.write(refusal_alert(refused))

    def received(self) -> None:
        data = bytes(self.buffer)
        if not starts_like_tls(data):  # judged on what is there, even one byte
            self.cancel_timer()
            self.plain_http()
            return
        # The SNI gate of every plane; the SNI names the host here. `tls.ech` as it is now: a
        # reload applies to later connections.
        outcome = read_hello(data, ech=self.door.config.tls_ech)
        if outcome is None:
            return  # split across reads: the header timer still runs
        self.cancel_timer()
        self.ech = outcome.ech
        if outcome.refused is not None:
            # `host`: the SNI's, when the hello named one (an ECH refusal); else None.
            self.refuse(
                outcome.refused, outcome.host, self.port, stage="sni", sni=outcome.sni,
                ech=self.ech,
            )  # fmt: skip
            return
        self.sni = outcome.sni
        host = outcome.host
        assert host is not None
        assert self.port is not None
        target = authority(host, self.port)
        decision = self.door.vetter.decide(target)
        if intercepted(decision, self.door.config):
            self.spawn(self._intercept(target, self.port, decision))
            return
        self.spawn(self._tunnel(target, self.port, decision))

    def plain_http(self) -> None:
        self.protocol = "http"
        HttpPlane(self, transparent=True).start()

    async def _intercept(self, target: str, port: int, decision: Decision) -> None:
        """The hello is read and gated (its SNI named the host): vetted here, then the
        engine's, which dials the checked addresses when the first request inside needs them."""
        try:
            vetted = await tunnel.vet(
                self, target, port, decision, inspecting=True, sni=self.sni, ech=self.ech
            )
        except Refused as refused:
            self.refuse(refused, None, port, stage="", record=False)
            return
        self.door.vetter.allowed(
            self.peer, self.protocol, stage="sni", vetted=vetted, port=port, sni=self.sni,
            ech=self.ech,
        )  # fmt: skip
        await self.door.intercept(self)

    async def _tunnel(self, target: str, port: int, decision: Decision) -> None:
        try:
            dialled = await tunnel.dial(self, target, port, decision, sni=self.sni, ech=self.ech)
        except Refused as refused:
            self.refuse(refused, None, port, stage="", record=False)
            return
        self.door.vetter.allowed(
            self.peer, self.protocol, stage="sni", vetted=dialled.vetted, port=port, sni=self.sni,
            ech=self.ech,
        )  # fmt: skip
        tunnel.relay(self, dialled)
