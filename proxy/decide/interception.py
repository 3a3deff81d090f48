"""Which connections the interception engine serves, and what the front door hands it with one.

    if intercepted(decision, config): ...          # a decided TLS destination goes to the engine
    await engine.intercept(sock, hello, Destination(...))

The front door decides the name, vets the addresses and passes the SNI gate itself; the engine
(proxy/l7/, mitmproxy) takes the connection from the TLS layer on, with the destination known.
No mitmproxy here: the front door imports this, and a passthrough session never loads the engine.
"""

from __future__ import annotations

import socket
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.dimensions import Protocol
from proxy.common.settings import ALL

if TYPE_CHECKING:
    from policy import Decision, Policy
    from proxy.common.settings import Config
    from proxy.decide.vetting import Peer


@dataclass(frozen=True, slots=True)
class Destination:
    """A TLS connection's decided destination, as the front door hands it to the engine."""

    host: str  # as the policy decided it (canonical); the SNI named it, the gate checked that
    port: int
    sni: str  # as the client sent it
    target: str  # what the name stage decided on (the authority), for reloads
    pinned: tuple[str, ...]  # the checked addresses of `host`, in answer order
    peer: Peer  # the client and the front door's connection id
    protocol: Protocol  # how it arrived: `connect`, `socks5` or `tls` (a transparent listener)
    ech: bool = False  # its ClientHello carried ECH or ESNI: its close line says so


class Interceptor(typing.Protocol):
    """What the front door needs of the interception engine."""

    async def intercept(self, sock: socket.socket, hello: bytes, destination: Destination) -> None:
        """Serve one client connection from its TLS layer on; `hello` is what the front door
        read of it (its ClientHello). Returns when the connection has ended, its close line
        written."""
        ...


def intercepted(decision: Decision, config: Config) -> bool:
    """Whether an allowed TLS destination is intercepted: when its rules decide paths, for
    every one under `inspection.mode: all`, and always for a host with a credential (it is put
    in inside, whatever the manifest's path rules say)."""
    return decision.allowed and (
        decision.needs_inspection
        or config.inspection_mode == ALL
        or (bool(config.credentials) and any(c.host == decision.host for c in config.credentials))
    )


def engine_needed(policy: Policy, config: Config) -> bool:
    """Whether a session can need the engine at all, so loads it (and its CA) at start: only
    with inspection enabled, and only when some rule decides paths, every TLS connection is
    intercepted or a credential is configured. Otherwise mitmproxy is never imported."""
    if not config.operator.inspection_enabled:
        return False
    return config.inspection_mode == ALL or policy.has_url_rules or bool(config.credentials)
