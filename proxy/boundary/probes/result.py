"""What a probe returns, and what every kind of probe shares: the address family of a literal,
an OSError in words, an address as a message names it, and waiting for a reply."""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from proxy.common.refusals import authority

Expect = Literal["local_refusal", "no_echo"]
EXPECTS: tuple[str, ...] = get_args(Expect)
ECHO_PAYLOAD = b"egress-boundary-probe"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    name: str  # e.g. "tcp_v4_direct", "udp_v6", "icmp_v4", "dns_denied_name"
    passed: bool  # True = the boundary held for this probe
    detail: str  # one line saying what was seen

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def family_of(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def oserror(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text} ({name})" if name else text


def endpoint(address: str, port: int | None = None) -> str:
    if port is None:
        return address
    return authority(address, port)


def awaited_reply(sock: socket.socket, timeout: float, matches: Callable[[bytes], bool]) -> bool:
    """True when a datagram `matches` accepts arrives within `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            return False
        try:
            data = sock.recv(65535)
        except BlockingIOError:
            continue
        except OSError:
            # An ICMP error from the destination (ECONNREFUSED) came back: the datagram got out.
            return True
        if matches(data):
            return True
    return False
