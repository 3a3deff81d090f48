"""What an HTTP request must be before its destination is decided, on every plane: the upgrade
rule and the Host rule. Pure functions of header values (strings); no sockets, no mitmproxy.
The front door's HTTP plane (proxy/dataplane/http.py) and the interception engine's request
gate (proxy/l7/request_checks.py) both call these, so the two cannot drift apart.

    refused = check_upgrade(upgrade_values, has_http2_settings)     # None, or the Refused
    refused = check_host(host_values, "up.test", 8080, default_port=80, where="up.test:8080")

The only upgrade is WebSocket, decided as the request that opens it; any other (h2c among
them, with its HTTP2-Settings) would take the connection out of per-request decisions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from policy.errors import PolicyError
from policy.reasons import Reason
from policy.urls import split_authority
from proxy.common.refusals import Refused, shown
from proxy.decide.vetting import canonical_host

WEBSOCKET = "websocket"


def upgrade_tokens(values: Sequence[str]) -> list[str]:
    """The protocols Upgrade header fields ask for, lowercase, in order (all fields joined)."""
    return [
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    ]


def check_upgrade(values: Sequence[str], http2_settings: bool) -> Refused | None:
    """Every upgrade but WebSocket is refused; so is an h2c upgrade's HTTP2-Settings alone, and
    an Upgrade field that names nothing."""
    tokens = upgrade_tokens(values)
    if tokens and tokens != [WEBSOCKET]:
        return Refused(
            403,
            Reason.UPGRADE_REFUSED,
            f"upgrade to {shown(', '.join(tokens))!r} refused: only WebSocket is decided per "
            "request",
        )
    if http2_settings:
        return Refused(403, Reason.UPGRADE_REFUSED, "HTTP2-Settings (an h2c upgrade) refused")
    if values and not tokens:
        return Refused(403, Reason.UPGRADE_REFUSED, "an empty Upgrade header refused")
    return None


@functools.lru_cache(maxsize=4096)  # bounded; a session's requests repeat a few Host values
def parse_host_field(value: str, default_port: int) -> tuple[str, int] | None:
    """A Host field (`host[:port]`, `[v6][:port]`) as (the policy's spelling of the host, port),
    or None when it is no valid authority (brackets hold an IPv6 literal and nothing else)."""
    if not value or any(c in value for c in " \t/?#@\\"):
        return None
    try:
        host, port = split_authority(value)
    except PolicyError:
        return None
    if not host:
        return None
    return canonical_host(host), port if port is not None else default_port


def check_host(
    values: Sequence[str], host: str, port: int, *, default_port: int, where: str
) -> Refused | None:
    """Exactly one Host field, naming `host` (canonical) and `port` (`default_port` when it
    names none). `where`: how the refusal names what the request was decided for."""
    if len(values) != 1:
        return Refused(403, Reason.HOST_MISMATCH, f"{len(values)} Host headers for {where}")
    named = parse_host_field(values[0], default_port)
    if named is None or named != (canonical_host(host), port):
        return Refused(
            403, Reason.HOST_MISMATCH, f"Host header {shown(values[0])!r} does not name {where}"
        )
    return None
