"""The ICMP probe: an echo request must be refused locally, or go unanswered."""

from __future__ import annotations

import errno
import os
import socket
import struct

from proxy.boundary.probes.result import (
    ECHO_PAYLOAD,
    Expect,
    ProbeResult,
    awaited_reply,
    family_of,
    oserror,
)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def _icmp_socket(family: socket.AddressFamily) -> tuple[socket.socket, str] | None:
    """A ping socket (unprivileged, if net.ipv4.ping_group_range admits our group), else a raw
    socket (CAP_NET_RAW), else None: this user cannot send ICMP at all."""
    protocol = socket.IPPROTO_ICMPV6 if family == socket.AF_INET6 else socket.IPPROTO_ICMP
    for kind, label in ((socket.SOCK_DGRAM, "ping"), (socket.SOCK_RAW, "raw")):
        try:
            return socket.socket(family, kind, protocol), label
        except OSError as exc:
            # Anything but "not allowed" is a fault the caller reports as a failed probe.
            if exc.errno not in (errno.EACCES, errno.EPERM):
                raise
    return None


def _echo_request(family: socket.AddressFamily, ident: int, sequence: int) -> bytes:
    kind = 128 if family == socket.AF_INET6 else 8
    header = struct.pack("!BBHHH", kind, 0, 0, ident, sequence)
    if family == socket.AF_INET6:
        return header + ECHO_PAYLOAD  # the kernel fills in the ICMPv6 checksum
    checksum = _checksum(header + ECHO_PAYLOAD)
    return struct.pack("!BBHHH", kind, 0, checksum, ident, sequence) + ECHO_PAYLOAD


def _is_echo_reply(
    data: bytes, family: socket.AddressFamily, label: str, ident: int, sequence: int
) -> bool:
    if family == socket.AF_INET and label == "raw" and data and data[0] >> 4 == 4:
        data = data[(data[0] & 0x0F) * 4 :]  # a raw IPv4 socket hands us the IP header too
    if len(data) < 8:
        return False
    kind, _, _, got_ident, got_sequence = struct.unpack("!BBHHH", data[:8])
    reply = 129 if family == socket.AF_INET6 else 0
    # A ping socket's identifier is the kernel's (it rewrites ours), and only replies to it
    # reach the socket; a raw socket sees every ICMP packet, so match ours.
    return kind == reply and got_sequence == sequence and (label == "ping" or got_ident == ident)


def icmp_blocked(name: str, address: str, *, expect: Expect, timeout: float = 1.0) -> ProbeResult:
    """Send one ICMP echo request. `local_refusal`: passed iff the send fails with EPERM;
    `no_echo`: passed iff no echo reply arrives within `timeout`. A user who cannot open an
    ICMP socket at all passes: for that user the boundary holds."""
    family = family_of(address)
    opened = _icmp_socket(family)
    if opened is None:
        return ProbeResult(name, True, "cannot send ICMP as this user")
    sock, label = opened
    ident, sequence = os.getpid() & 0xFFFF, 1
    with sock:
        sock.setblocking(False)
        try:
            sock.sendto(_echo_request(family, ident, sequence), (address, 0))
        except PermissionError as exc:
            return ProbeResult(
                name, True, f"ICMP echo to {address} refused locally ({oserror(exc)})"
            )
        except OSError as exc:
            return ProbeResult(
                name,
                False,
                f"ICMP echo to {address} failed with {oserror(exc)}, not EPERM: the boundary "
                "did not refuse it (no drop rule?)",
            )
        # An ICMPv6 ping socket is not told when netfilter drops its echo (the send reports
        # success either way), so there the only evidence is the absence of a reply.
        untold = family == socket.AF_INET6 and label == "ping"
        if expect == "local_refusal" and not untold:
            return ProbeResult(
                name, False, f"ICMP echo to {address} was sent ({label} socket): nothing refused it"
            )
        if awaited_reply(
            sock, timeout, lambda data: _is_echo_reply(data, family, label, ident, sequence)
        ):
            return ProbeResult(name, False, f"ICMP echo to {address} was answered: it got out")
        note = " (an ICMPv6 ping socket is not told of a local drop)" if untold else ""
        return ProbeResult(
            name, True, f"ICMP echo to {address}: sent, no reply within {timeout:g}s{note}"
        )
