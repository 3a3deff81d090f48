"""Transparent listeners (`transparent://HOST:PORT`, `--mode transparent`): connections netfilter
redirected to us (REDIRECT/DNAT). What the client sends first says what the connection is
(proxy/decide/first_flight.py):

- TLS is decided on its SNI and relayed to a checked address of that name, never to the original
  destination, which is read only for its port; a TLS connection that is intercepted (its host's
  rules decide paths, or `inspection.mode: all`) is vetted here and then served by the
  interception engine, exactly as an explicit one;
- plain HTTP is decided on its Host header by the HTTP plane;
- anything else (SSH, a database, SMTP) carries no name: it is attributed by DNS, to the names
  the session's DNS responder answered the original destination for (proxy/decide/attribution.py),
  decided on those names and the port as an `ssh` or `tcp` stream (the operator's `opaque_ports`),
  and relayed to that very address, which was checked when it was answered. An address the
  session never got from our DNS is refused (`unattributed`).

Where an opaque stream to an attributed address would pass, the upstream is dialled at once and
what it sends reaches the client before the client speaks (server-first protocols); the
client's bytes still wait for the decision. A connection that was not redirected is refused.
The client asked nothing of a proxy, so a refusal speaks the client's own protocol: a TLS
connection refused after its ClientHello gets a fatal TLS alert (`access_denied`, or
`internal_error` when the upstream or DNS failed) before the close; SSH our identification
string and a disconnect naming the reason; any other stream a reset; one refused before anything
was read is closed. Its decision and close lines say why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.dimensions import Protocol, Stage
from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, refusal_alert
from proxy.dataplane import streams, tunnel
from proxy.dataplane.connection import Connection
from proxy.dataplane.http import HttpPlane
from proxy.decide.events import Details
from proxy.decide.first_flight import FirstFlight, is_opaque
from proxy.decide.interception import intercepted
from proxy.decide.sni_gate import read_hello
from proxy.net.sockets import original_destination

if TYPE_CHECKING:
    from policy import Decision
    from proxy.decide.sni_gate import GateOutcome


class Transparent(Connection):
    protocol = Protocol.TLS

    original: str | None = None  # the address the client connected to
    # The refusal of an attributed opaque stream, found before the client spoke.
    early_refusal: Refused | None = None

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
            self.refuse(refused, None, None, stage=Stage.ACCEPT)
            return
        self.original, self.port = original
        self.spawn(self._serve())

    def answer_refusal(self, refused: Refused, host: str | None, port: int | None) -> None:
        # Only after a TLS record arrived: then the client's TLS stack reads the alert.
        if self.buffer[:1] == b"\x16":
            self.transport.write(refusal_alert(refused))

    def answer_tls_refusal(self, refused: Refused) -> None:
        self.transport.write(refusal_alert(refused))

    async def _serve(self) -> None:
        assert self.original is not None and self.port is not None
        dialled = await self._server_first(self.original, self.port)
        try:
            kind = await streams.first_flight(self, patient=dialled is not None)
        except BaseException:
            streams.drop(dialled)
            raise
        if kind is None or isinstance(kind, Refused):
            streams.drop(dialled)
            if kind is None:
                self.close()
            else:
                self.refuse(kind, None, None, stage=Stage.ACCEPT)
            return
        if kind == FirstFlight.HTTP and self.counter.down:
            kind = FirstFlight.TCP  # the server spoke first: no HTTP exchange begins like that
        if not is_opaque(kind):
            self.attribution = self.attributed = None
            self.protocol = Protocol.TLS
            if kind == FirstFlight.HTTP:
                streams.drop(dialled)
                self.plain_http()
            else:
                await self._tls(dialled)
            return
        await self._opaque(kind, dialled)

    async def _server_first(self, address: str, port: int) -> tunnel.Dialled | None:
        """The upstream dialled before the client speaks, its bytes sent on as they come, when
        an opaque stream to this attributed address would pass; else None (the client's bytes
        decide, and any refusal is theirs to read first)."""
        names = tunnel.attributed_names(self, address)
        for name in names:
            if streams.stream_decision(self, FirstFlight.TCP, name, port).allowed:
                break
        else:
            return None
        self.protocol = Protocol.TCP
        try:
            vetted = await tunnel.vet_by_address(self, names, address, port, scheme=FirstFlight.TCP)
            dialled = await tunnel.dial_vetted(self, vetted, port)
        except Refused as refused:
            # Its line is written: an opaque stream is refused so without deciding again; TLS
            # and HTTP name their host themselves.
            self.early_refusal = refused
            return None
        dialled.upstream.forward_to(self.transport, self.counter)
        return dialled

    def plain_http(self) -> None:
        self.protocol = Protocol.HTTP
        HttpPlane(self, transparent=True).start()

    async def _opaque(self, kind: FirstFlight, dialled: tunnel.Dialled | None) -> None:
        """A stream that names no host: attributed to the names the session's DNS answered its
        address for, decided on them (`kind` on this port), relayed to that address."""
        assert self.original is not None and self.port is not None
        self.protocol = Protocol(kind)
        if self.early_refusal is not None:
            self.refuse_stream(self.early_refusal, kind, record=False)
            return
        vetted = self.vetted if dialled is not None else None
        if vetted is None:
            names = tunnel.attributed_names(self, self.original)
            if not names:
                self.refuse_stream(tunnel.unattributed(self.original, self.port), kind)
                return
            self.setting_up()
            try:
                vetted = await tunnel.vet_by_address(
                    self, names, self.original, self.port, scheme=kind
                )
            except Refused as refused:
                self.refuse_stream(refused, kind, record=False)
                return
        await streams.opaque(self, kind, vetted, self.port, dialled)

    async def _tls(self, early: tunnel.Dialled | None = None) -> None:
        """The ClientHello read whole (the header timer bounds it), its SNI naming the host.
        `early`: the upstream dialled before the client spoke (an attributed address), used
        if it is a checked address of the SNI's host, else closed."""
        try:
            outcome = await self._hello()
        except BaseException:
            streams.drop(early)
            raise
        if outcome is None or outcome.refused is not None:
            streams.drop(early)
        if outcome is None:
            return
        self.ech = outcome.ech
        if outcome.refused is not None:
            # `host`: the SNI's, when the hello named one (an ECH refusal); else None.
            self.refuse(
                outcome.refused, outcome.host, self.port, stage=Stage.SNI,
                details=Details(sni=outcome.sni, ech=self.ech),
            )  # fmt: skip
            return
        self.sni = outcome.sni
        self.attribution = "sni"
        self.setting_up()
        host = outcome.host
        assert host is not None
        assert self.port is not None
        target = authority(host, self.port)
        decision = self.door.vetter.decide(target)
        if intercepted(decision, self.door.config):
            streams.drop(early)
            await self._intercept(target, self.port, decision)
            return
        await self._tunnel(target, self.port, decision, early)

    async def _hello(self) -> GateOutcome | None:
        """The gate's outcome on the whole ClientHello; None when the connection is closed
        (the client ended first, or sent no whole hello in time)."""
        # `tls.ech` as it is now: a reload applies to later connections.
        ech = self.door.config.tls_ech
        outcome = await tunnel.whole_hello(self, lambda data: read_hello(data, ech=ech))
        if outcome is None:
            self.close()
            return None
        if outcome.refused is not None and outcome.refused.reason == Reason.HEADER_TIMEOUT:
            # No hello in time is refused at accept, as a silent client is: nothing was read.
            self.refuse(outcome.refused, None, None, stage=Stage.ACCEPT)
            return None
        return outcome

    async def _intercept(self, target: str, port: int, decision: Decision) -> None:
        """The hello is read and gated (its SNI named the host): vetted here, then the
        engine's, which dials the checked addresses when the first request inside needs them."""
        details = self._hello_details()
        try:
            vetted = await tunnel.vet(
                self, target, port, decision, inspecting=True, details=details
            )
        except Refused as refused:
            self.refuse(refused, None, port, record=False)
            return
        self.door.vetter.allowed(
            self.peer, self.protocol, stage=Stage.SNI, vetted=vetted, port=port, details=details
        )
        await self.door.intercept(self)

    async def _tunnel(
        self, target: str, port: int, decision: Decision, early: tunnel.Dialled | None
    ) -> None:
        details = self._hello_details()
        try:
            vetted = await tunnel.vet(self, target, port, decision, details=details)
            if early is not None and early.address in vetted.pinned and not early.upstream.lost:
                # The connection dialled before the client spoke goes to a checked address of
                # the SNI's host: it is that dial, not a second one.
                dialled = tunnel.Dialled(early.transport, early.upstream, vetted, early.address)
                early.upstream.sink = None  # held again until the relay takes it
                early = None
            else:
                streams.drop(early)
                dialled = await tunnel.dial_vetted(self, vetted, port, details)
        except Refused as refused:
            streams.drop(early)
            self.refuse(refused, None, port, record=False)
            return
        except BaseException:
            streams.drop(early)
            raise
        self.door.vetter.allowed(
            self.peer, self.protocol, stage=Stage.SNI, vetted=dialled.vetted, port=port,
            details=details,
        )  # fmt: skip
        tunnel.relay(self, dialled)

    def _hello_details(self) -> Details:
        """What every line of a decision on the gated ClientHello says of it (its SNI, ECH,
        and how the host was known), one value for them all."""
        return Details(
            sni=self.sni, ech=self.ech, attribution=self.attribution, attributed=self.attributed
        )
