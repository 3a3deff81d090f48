"""The closed sets of values a decision line is told apart by, beside the reason code
(policy/reasons.py): its verdict, the stage that decided it, the plane that enforced it and the
protocol the client spoke. Audit lines (docs/observability.md), metric labels and the denial
feed carry them; `suggest` reads them back.

Members are `str` (StrEnums), as `Reason`'s are: they compare, hash and format as their bare
value, so `Stage.SNI == "sni"` and a line or label carries `"sni"`, never the member's name.
One module for the four: they are the dimensions of one line, documented and tested together.
They live in the policy core because it uses three of them (a `Decision`'s stage, the verdicts
and the DNS protocol of the lines `suggest` reads); `Plane` is the runtime's alone.
"""

from __future__ import annotations

from enum import StrEnum, unique

__all__ = ["Plane", "Protocol", "Stage", "Verdict"]


@unique
class Verdict(StrEnum):
    """What a decision line says happened (its `decision` field)."""

    ALLOW = "allow"
    DENY = "deny"
    WOULD_DENY = "would_deny"  # refused, and let through by learning mode (`run --learn`)


@unique
class Stage(StrEnum):
    """The step that decided (a line's `stage`), in the order a connection meets them."""

    ACCEPT = "accept"  # the connection itself: over the limits, no head or hello in time
    REQUEST = "request"  # what the client asked, before any name is decided (a head, a query)
    NAME = "name"  # the policy on the host (and port, scheme, path), before any DNS
    DNS = "dns"  # the proxy's own lookup of an allowed name
    ADDRESS = "address"  # every address of the answer checked, and the loop guard
    CONNECT = "connect"  # inside interception: an upstream dial no request allowed
    UPSTREAM = "upstream"  # the dial of a checked address, or the upstream's answer
    SNI = "sni"  # the ClientHello's server name against the tunnel's host
    HOST = "host"  # an HTTP request's Host (or :authority) against the connection's host
    STREAM = "stream"  # what the tunnel's first bytes say it is (TLS, HTTP, an opaque stream)
    ENGINE = "engine"  # the proxy itself: the interception engine, a failure of ours


@unique
class Plane(StrEnum):
    """Which part of the proxy enforced (a line's `plane`)."""

    L4 = "l4"  # the front door (proxy/dataplane/) and the DNS responder
    L7 = "l7"  # the interception engine (proxy/l7/)


@unique
class Protocol(StrEnum):
    """What the client spoke to the proxy, as the lines name it (their `protocol`)."""

    CONNECT = "connect"  # an HTTP CONNECT tunnel
    SOCKS5 = "socks5"  # a SOCKS5 tunnel
    TLS = "tls"  # TLS to a transparent listener
    HTTP = "http"  # plain HTTP (explicit, transparent, or inside a tunnel)
    WS = "ws"  # a plain-HTTP connection upgraded to a WebSocket
    HTTPS = "https"  # a request inside interception
    WSS = "wss"  # an intercepted connection upgraded to a WebSocket
    SSH = "ssh"  # an opaque stream that began with an SSH identification string
    TCP = "tcp"  # any other opaque stream
    DNS = "dns"  # a query to the session's DNS responder
