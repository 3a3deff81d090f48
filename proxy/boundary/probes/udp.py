"""The UDP probe: a datagram must be refused locally, or go unanswered."""

from __future__ import annotations

import socket

from proxy.boundary.probes.result import (
    ECHO_PAYLOAD,
    Expect,
    ProbeResult,
    awaited_reply,
    endpoint,
    family_of,
    oserror,
)


def udp_blocked(
    name: str, address: str, port: int, *, expect: Expect, timeout: float = 1.0
) -> ProbeResult:
    """Send one datagram. `local_refusal`: passed iff the send fails with EPERM (an nft drop in
    the output hook). `no_echo`: passed iff no reply arrives within `timeout` (the caller runs
    an echo observer at the address; a reply means the datagram got out)."""
    where = endpoint(address, port)
    with socket.socket(family_of(address), socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            # connect() makes a later ICMP port-unreachable visible to recv as ECONNREFUSED.
            sock.connect((address, port))
            sock.send(ECHO_PAYLOAD)
        except PermissionError as exc:
            return ProbeResult(name, True, f"UDP to {where} refused locally ({oserror(exc)})")
        except OSError as exc:
            return ProbeResult(
                name,
                False,
                f"UDP to {where} failed with {oserror(exc)}, not EPERM: the boundary did not "
                "refuse it (no drop rule?)",
            )
        if expect == "local_refusal":
            return ProbeResult(name, False, f"UDP to {where} was sent: nothing refused it locally")
        if awaited_reply(sock, timeout, lambda _data: True):
            return ProbeResult(
                name,
                False,
                f"UDP to {where} got an answer (a reply or an ICMP error): the datagram got out",
            )
        return ProbeResult(name, True, f"UDP to {where}: sent, no answer within {timeout:g}s")
