"""SOCKS5 listeners (`--listen socks5://HOST:PORT`): RFC 1928, the server side, CONNECT only.

    client: 05 01 00                      greeting: version 5, one method, 0x00 (no auth)
    proxy:  05 00                         method 0x00 chosen (05 FF: none acceptable, closed)
    client: 05 01 00 03 07 'pypi.org' 01 BB   CONNECT pypi.org:443 (ATYP 1 IPv4, 3 name, 4 IPv6)
    proxy:  05 00 00 01 <BND.ADDR> <BND.PORT> once decided, resolved and dialled; then TLS

The destination is decided, resolved and dialled before the reply (streams.open_tunnel), so the
reply code says what happened: 0x02 for a denial (nothing dialled; a denied name is never looked
up), 0x04 for a DNS failure or an upstream that did not answer the connect in time, 0x05 when
every checked address refused. Success carries the address the upstream connection is bound to.
What the client sends next is carried as on a CONNECT tunnel (proxy/dataplane/streams.py: TLS
through the SNI gate, plain HTTP, an opaque stream on the operator's `opaque_ports`); a host whose
rules need inspection is resolved and checked before the reply too, and handed to the
interception engine (Door.intercept) once its ClientHello passed the gate. A request of type 1
or 4 (an address) that the session's DNS answered for allowed names is decided on those names and
dialled to that address (`attribution: dns`); any other address is decided as an IP literal.

Parsed strictly, judged on the bytes as they arrive, the greeting and the request timed
together by `limits.header_timeout` (like a CONNECT head): BIND and UDP ASSOCIATE are 0x07, an
unknown address type 0x08, a malformed request (another version, a reserved byte not 0, an
empty name or one with a NUL, a control or a non-ASCII byte, port 0, bytes after the request
before the reply) 0x01. A name that is an IP address in any spelling is 0x02 (`ip_literal`):
ATYP 3 carries names, an address goes as ATYP 1 or 4, where the policy decides it as one.
A client pipelining its request right behind a greeting that offered 0x00 is served.

Refusals speak SOCKS5. Before the method is chosen no SOCKS5 answer exists that a
client could not misread (a bare `05 FF` would read as "authentication needed"), so anything
refused then (SOCKS4, HTTP or TLS on this listener, overload, a timeout) is closed without a
byte; its decision line says what arrived.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from dataclasses import dataclass
from typing import Final

from policy import PolicyError
from policy.dimensions import Protocol, Stage
from policy.hostnames import normalize_host
from policy.reasons import Reason
from proxy.common.refusals import Refused, authority, shown, too_slow
from proxy.dataplane import streams
from proxy.dataplane.connection import Connection
from proxy.decide.events import Details

VERSION: Final = 5
NO_AUTHENTICATION: Final = 0x00
NO_ACCEPTABLE_METHODS: Final = 0xFF
CONNECT, BIND, UDP_ASSOCIATE = 1, 2, 3
IPV4, DOMAIN_NAME, IPV6 = 1, 3, 4
# Reply codes, RFC 1928 section 6.
SUCCEEDED: Final = 0x00
GENERAL_FAILURE: Final = 0x01
NOT_ALLOWED: Final = 0x02
HOST_UNREACHABLE: Final = 0x04
CONNECTION_REFUSED: Final = 0x05
COMMAND_NOT_SUPPORTED: Final = 0x07
ADDRESS_TYPE_NOT_SUPPORTED: Final = 0x08

_COMMANDS = {BIND: "BIND", UDP_ASSOCIATE: "UDP ASSOCIATE"}
# The reply for a refusal whose reason says more than its status. An upstream that did not
# answer the connect in time is "host unreachable", not 0x06 "TTL expired": RFC 1928 gives 0x06
# no meaning beyond its name, which is the IP hop limit (an ICMP time-exceeded), something a
# connect timeout is not; curl, the suite and the engine before this have 0x04 for it, and the
# close and decision lines keep `upstream_timeout` apart from DNS failures.
_REPLY_FOR_REASON: dict[str, int] = {
    Reason.UPSTREAM_REFUSED: CONNECTION_REFUSED,
    Reason.UPSTREAM_TIMEOUT: HOST_UNREACHABLE,
    Reason.SOCKS_COMMAND: COMMAND_NOT_SUPPORTED,
    Reason.SOCKS_ADDRESS_TYPE: ADDRESS_TYPE_NOT_SUPPORTED,
    Reason.INTERNAL_ERROR: GENERAL_FAILURE,  # fail closed, and say it was ours
}
# What a name's bytes may not hold: NUL and the other controls, DEL, anything not ASCII.
_NOT_NAME_BYTE = re.compile(rb"[\x00-\x1f\x7f-\xff]")
_NO_ADDRESS = b"\x01\x00\x00\x00\x00\x00\x00"  # ATYP IPv4, 0.0.0.0, port 0
_TIMED_OUT = too_slow("complete SOCKS5 greeting and request")


def reply_code(refused: Refused) -> int:
    """The SOCKS5 reply code of a refusal: a denial 0x02; DNS failures and upstream errors
    0x04 (0x05 when the upstream refused); a malformed request, a timeout or a failure of ours
    0x01 (general failure)."""
    code = _REPLY_FOR_REASON.get(refused.reason)
    if code is not None:
        return code
    if refused.error and refused.status in (502, 504):
        return HOST_UNREACHABLE
    return NOT_ALLOWED if refused.status == 403 else GENERAL_FAILURE


def reply(code: int, bound: tuple[str, int] | None = None) -> bytes:
    """A reply: VER, REP, RSV, then BND.ADDR and BND.PORT (`bound`, or 0.0.0.0:0)."""
    if bound is None:
        return bytes((VERSION, code, 0)) + _NO_ADDRESS
    host = bound[0]
    if ":" in host:
        atyp, packed = IPV6, socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    else:
        atyp, packed = IPV4, socket.inet_pton(socket.AF_INET, host)
    return bytes((VERSION, code, 0, atyp)) + packed + struct.pack("!H", bound[1])


# -- the wire ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """A CONNECT request: the host as sent (a name, or an address's canonical text), its port,
    and how many bytes the request took."""

    host: str
    port: int
    size: int
    is_name: bool


def what_arrived(data: bytes | bytearray) -> str:
    """What a client that is not speaking SOCKS5 sent, for its decision line."""
    head = bytes(data[:24])
    first = head[0]
    if first == 4:
        said = "a SOCKS4 request"
    elif first == 0x16:
        said = "a TLS record (a ClientHello?)"
    elif 0x41 <= first <= 0x5A:
        text = shown(head.decode("latin-1"))
        said = f"an HTTP request? ({text!r}...); HTTP clients use an http:// listener"
    else:
        said = f"version byte 0x{first:02x}"
    return f"not SOCKS5 on a SOCKS5 listener: {said}"


def parse_greeting(data: bytes | bytearray) -> int | Refused | None:
    """How many bytes the greeting takes (the client offered 0x00), the refusal, or None while
    it is incomplete."""
    if not data:
        return None
    if data[0] != VERSION:
        return Refused(400, Reason.NOT_SOCKS5, what_arrived(data))
    if len(data) < 2 or len(data) < 2 + data[1]:
        return None
    methods = bytes(data[2 : 2 + data[1]])
    if NO_AUTHENTICATION not in methods:
        offered = ", ".join(f"0x{m:02x}" for m in methods) or "none"
        return Refused(
            403,
            Reason.SOCKS_NO_METHOD,
            f"the client offers methods {offered}; only 0x00 (no authentication) is served",
        )
    return 2 + len(methods)


def _invalid(message: str) -> Refused:
    return Refused(400, Reason.INVALID_REQUEST, f"invalid SOCKS5 request: {message}")


def parse_request(data: bytes | bytearray) -> Request | Refused | None:
    """The request at the start of `data`, the refusal (as soon as the bytes so far show one),
    or None while it is incomplete. Bytes after it are the caller's to judge."""
    if not data:
        return None
    if data[0] != VERSION:
        return _invalid(f"version 0x{data[0]:02x}, not 0x05")
    if len(data) >= 2 and data[1] != CONNECT:
        command = _COMMANDS.get(data[1], f"command 0x{data[1]:02x}")
        return Refused(403, Reason.SOCKS_COMMAND, f"{command} is not served: CONNECT only")
    if len(data) >= 3 and data[2] != 0:
        return _invalid(f"reserved byte 0x{data[2]:02x}, not 0x00")
    if len(data) < 4:
        return None
    atyp = data[3]
    if atyp in (IPV4, IPV6):
        start, end = 4, 4 + (4 if atyp == IPV4 else 16)
        host = str(ipaddress.ip_address(bytes(data[start:end]))) if len(data) >= end else ""
    elif atyp == DOMAIN_NAME:
        if len(data) < 5:
            return None
        start, end = 5, 5 + data[4]
        problem = _name_problem(data[start:end], complete=len(data) >= end)
        if problem is not None:
            return problem
        host = bytes(data[start:end]).decode("ascii")
    else:
        return Refused(
            403,
            Reason.SOCKS_ADDRESS_TYPE,
            f"address type 0x{atyp:02x}: IPv4 (1), a name (3) or IPv6 (4)",
        )
    if len(data) < end + 2:
        return None
    (port,) = struct.unpack_from("!H", data, end)
    if port == 0:
        return _invalid(f"port 0 for {shown(host)!r}")
    return Request(host, port, end + 2, atyp == DOMAIN_NAME)


def _name_problem(name: bytes | bytearray, *, complete: bool) -> Refused | None:
    """What is wrong with a name's bytes so far (the name is never decoded in any other way
    than ASCII: an internationalised name goes as its A-label, xn--...)."""
    if complete and not name:
        return _invalid("a domain name of length 0")
    bad = _NOT_NAME_BYTE.search(name)
    if bad is None:
        return None
    index = bad.start()
    byte = name[index]
    if byte == 0:
        return _invalid(f"a NUL byte at offset {index} of the domain name")
    if byte < 0x20 or byte == 0x7F:
        return _invalid(f"control byte 0x{byte:02x} at offset {index} of the domain name")
    return _invalid(
        f"non-ASCII byte 0x{byte:02x} at offset {index} of the domain name "
        "(send an internationalised name as its A-label, xn--...)"
    )


def name_is_address(host: str) -> Refused | None:
    """The refusal of a name (ATYP 3) that is an IP address in some spelling (`127.1`,
    `0x7f.1`, `2130706433`, `[::1]`, a zone id, or plain dotted decimal)."""
    try:
        normalize_host(host)
    except PolicyError as exc:
        if exc.reason == Reason.IP_LITERAL:
            return Refused(
                403,
                exc.reason,
                f"{shown(host)!r} is an IP address sent as a domain name; ask for the hostname "
                "(an address goes as ATYP 1 or 4)",
            )
    return None  # a name, or not a usable one: the policy says which


# -- the connection ----------------------------------------------------------------------------


class Socks5(Connection):
    protocol = Protocol.SOCKS5

    greeted = False  # 05 00 went out: a refusal is now a reply

    def begin(self) -> None:
        self.arm_timer(self.door.config.limits.header_timeout, _TIMED_OUT)

    def answer_refusal(self, refused: Refused, host: str | None, port: int | None) -> None:
        if self.greeted:
            self.transport.write(reply(reply_code(refused)))
        elif refused.reason == Reason.SOCKS_NO_METHOD:
            self.transport.write(bytes((VERSION, NO_ACCEPTABLE_METHODS)))
        # else: see the module docstring; the close is the answer

    def received(self) -> None:
        buffer = self.buffer
        if not self.greeted:
            greeting = parse_greeting(buffer)
            if greeting is None:
                return
            if isinstance(greeting, Refused):
                self.refuse(greeting, None, None, stage=Stage.REQUEST)
                return
            del buffer[:greeting]
            self.greeted = True
            self.transport.write(bytes((VERSION, NO_AUTHENTICATION)))
        request = parse_request(buffer)
        if request is None:
            return
        self.cancel_timer()
        if isinstance(request, Refused):
            self.refuse(request, None, None, stage=Stage.REQUEST)
            return
        del buffer[: request.size]
        if buffer:
            self.refuse(_early_bytes(buffer), request.host, request.port, stage=Stage.REQUEST)
            return
        refused = name_is_address(request.host) if request.is_name else None
        if refused is not None:
            self.refuse(refused, request.host, request.port, stage=Stage.NAME)
            return
        self.connect(request.host, request.port)

    def connect(self, host: str, port: int) -> None:
        self.attribution = "socks5"
        self.spawn(
            streams.open_tunnel(
                self, authority(host, port), host, port, what=_WHAT, details=_SOCKS5
            )
        )

    def answer_success(self, bound: tuple[str, int] | None) -> bool:
        """The success reply (0.0.0.0:0 when the engine dials later), unless the client sent
        bytes before it (then refused)."""
        if self.buffer:
            self.refuse(_early_bytes(self.buffer), self.host, self.port, stage=Stage.REQUEST)
            return False
        self.mark_answered()
        self.transport.write(reply(SUCCEEDED, bound))
        return True


_WHAT = "SOCKS5 host"
# What the lines of every SOCKS5 tunnel's decision say of it (as the tunnel notes its
# attribution, it finds it said already).
_SOCKS5 = Details(attribution="socks5")


def _early_bytes(data: bytes | bytearray) -> Refused:
    size = len(data)
    what = "a second request" if data[:1] == b"\x05" else f"{size} byte{'' if size == 1 else 's'}"
    return _invalid(f"{what} after the request, before its reply (one CONNECT per connection)")


__all__ = ["Socks5", "parse_greeting", "parse_request", "reply", "reply_code"]
