"""Probes of an egress boundary from the agent's position: each tries one way out and says
whether the boundary held. Used by `egress-proxy boundary verify` (the Kubernetes verify init
container) and by `egress-proxy sandbox` (the canary run inside the session namespace).

    tcp_answered_by_proxy("tcp_v4_direct", "192.0.2.1", 80)   # the proxy must answer
    udp_blocked("udp_v4", "192.0.2.1", 9, expect="local_refusal")
    python -m proxy.probes --spec '{"tcp": [{"name": "t", "address": "192.0.2.1", "port": 80}]}' \
        --as-user 65534:65534

Every address is an IP literal: a probe never asks the OS resolver (a name could point anywhere).
A probe passes only on positive evidence that the boundary held; anything it cannot interpret is a
failure, said in `detail`.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import os
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NoReturn, get_args

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype

# dnspython loads a record type's module when an answer first holds one. Load the ones a probe
# can meet now: after --as-user drops privileges the interpreter's files may be out of reach.
import dns.rdtypes.ANY.CNAME
import dns.rdtypes.ANY.SOA
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA

from proxy.errors import ProxyError
from proxy.reasons import DENIED_HEADER, ERROR_HEADER, shown

Expect = Literal["local_refusal", "no_echo"]
EXPECTS: tuple[str, ...] = get_args(Expect)

PROBE_HOST = "egress-boundary-probe.invalid"
# A proxy's refusal is one short head and a one-line body; more than this is not the proxy.
_MAX_ANSWER = 16 * 1024
_ECHO_PAYLOAD = b"egress-boundary-probe"
INVALID_SPEC = "invalid_probe_spec"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    name: str  # e.g. "tcp_v4_direct", "udp_v6", "icmp_v4", "dns_denied_name"
    passed: bool  # True = the boundary held for this probe
    detail: str  # one line saying what was seen

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _oserror(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text} ({name})" if name else text


def _where(address: str, port: int | None = None) -> str:
    if port is None:
        return address
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# -- TCP -----------------------------------------------------------------------------------


def _answer_headers(data: bytes) -> tuple[str, dict[str, str]] | None:
    """The status line and headers (lowercase names) of an HTTP/1.x answer, or None when the
    bytes are not one."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1."):
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def tcp_answered_by_proxy(
    name: str, address: str, port: int, *, timeout: float = 3.0
) -> ProbeResult:
    """Passed iff the answer to a plain HTTP request to address:port carries the proxy's refusal
    header: the redirect works, the proxy answered, no direct connection was made."""
    where = _where(address, port)
    request = (
        f"GET / HTTP/1.1\r\nHost: {PROBE_HOST}\r\nUser-Agent: egress-proxy-probe\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    deadline = time.monotonic() + timeout
    data = b""
    try:
        with socket.socket(_family(address), socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect((address, port))
            except PermissionError as exc:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} refused locally ({_oserror(exc)}): TCP is dropped, "
                    "not redirected to the proxy",
                )
            except ConnectionRefusedError:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} refused: nothing answered, so the redirect to the "
                    "proxy is broken or the proxy is down",
                )
            except TimeoutError:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} timed out after {timeout:g}s: the redirect to the "
                    "proxy is broken or the proxy is down",
                )
            sock.sendall(request)
            while len(data) < _MAX_ANSWER and b"\r\n\r\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        pass  # judged on what arrived
    except OSError as exc:
        if not data:
            return ProbeResult(name, False, f"{where}: {_oserror(exc)}; no proxy answered")
    parsed = _answer_headers(data)
    if parsed is None:
        seen = shown(data[:60].decode("latin-1")) if data else "nothing"
        return ProbeResult(
            name, False, f"{where} did not answer as the proxy (no HTTP answer; got {seen})"
        )
    status, headers = parsed
    for header in (DENIED_HEADER, ERROR_HEADER):
        value = headers.get(header.lower())
        if value is not None:
            return ProbeResult(
                name,
                True,
                f"{where} answered by the proxy: {shown(status)}, {header}: {shown(value)}",
            )
    return ProbeResult(
        name,
        False,
        f"{where} answered {shown(status)!r} without {DENIED_HEADER} or {ERROR_HEADER}: "
        "a direct connection was made, not through the proxy",
    )


# -- UDP -----------------------------------------------------------------------------------


def _awaited_reply(sock: socket.socket, timeout: float, matches: Callable[[bytes], bool]) -> bool:
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


def udp_blocked(
    name: str, address: str, port: int, *, expect: Expect, timeout: float = 1.0
) -> ProbeResult:
    """Send one datagram. `local_refusal`: passed iff the send fails with EPERM (an nft drop in
    the output hook). `no_echo`: passed iff no reply arrives within `timeout` (the caller runs
    an echo observer at the address; a reply means the datagram got out)."""
    where = _where(address, port)
    with socket.socket(_family(address), socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            # connect() makes a later ICMP port-unreachable visible to recv as ECONNREFUSED.
            sock.connect((address, port))
            sock.send(_ECHO_PAYLOAD)
        except PermissionError as exc:
            return ProbeResult(name, True, f"UDP to {where} refused locally ({_oserror(exc)})")
        except OSError as exc:
            return ProbeResult(
                name,
                False,
                f"UDP to {where} failed with {_oserror(exc)}, not EPERM: the boundary did not "
                "refuse it (no drop rule?)",
            )
        if expect == "local_refusal":
            return ProbeResult(name, False, f"UDP to {where} was sent: nothing refused it locally")
        if _awaited_reply(sock, timeout, lambda _data: True):
            return ProbeResult(
                name,
                False,
                f"UDP to {where} got an answer (a reply or an ICMP error): the datagram got out",
            )
        return ProbeResult(name, True, f"UDP to {where}: sent, no answer within {timeout:g}s")


# -- ICMP ----------------------------------------------------------------------------------


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


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
        return header + _ECHO_PAYLOAD  # the kernel fills in the ICMPv6 checksum
    checksum = _checksum(header + _ECHO_PAYLOAD)
    return struct.pack("!BBHHH", kind, 0, checksum, ident, sequence) + _ECHO_PAYLOAD


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
    family = _family(address)
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
                name, True, f"ICMP echo to {address} refused locally ({_oserror(exc)})"
            )
        except OSError as exc:
            return ProbeResult(
                name,
                False,
                f"ICMP echo to {address} failed with {_oserror(exc)}, not EPERM: the boundary "
                "did not refuse it (no drop rule?)",
            )
        # An ICMPv6 ping socket is not told when netfilter drops its echo (the send reports
        # success either way), so there the only evidence is the absence of a reply.
        untold = family == socket.AF_INET6 and label == "ping"
        if expect == "local_refusal" and not untold:
            return ProbeResult(
                name, False, f"ICMP echo to {address} was sent ({label} socket): nothing refused it"
            )
        if _awaited_reply(
            sock, timeout, lambda data: _is_echo_reply(data, family, label, ident, sequence)
        ):
            return ProbeResult(name, False, f"ICMP echo to {address} was answered: it got out")
        note = " (an ICMPv6 ping socket is not told of a local drop)" if untold else ""
        return ProbeResult(
            name, True, f"ICMP echo to {address}: sent, no reply within {timeout:g}s{note}"
        )


# -- DNS -----------------------------------------------------------------------------------


def dns_refused(
    name: str, server: str, port: int, qname: str, *, timeout: float = 2.0
) -> ProbeResult:
    """Ask `server` for A `qname` over UDP: passed iff the answer is REFUSED or NXDOMAIN, or the
    query is refused locally; addresses in the answer, or no answer at all, fail."""
    where = _where(server, port)
    try:
        query = dns.message.make_query(dns.name.from_text(qname), dns.rdatatype.A)
    except dns.exception.DNSException as exc:
        return ProbeResult(name, False, f"cannot ask for {shown(qname)!r}: {exc}")
    try:
        answer = dns.query.udp(query, server, port=port, timeout=timeout)
    except PermissionError as exc:
        return ProbeResult(name, True, f"DNS query to {where} refused locally ({_oserror(exc)})")
    except dns.exception.Timeout:
        return ProbeResult(
            name,
            False,
            f"no DNS answer from {where} within {timeout:g}s: DNS is not redirected to the proxy "
            "or the proxy's DNS is down",
        )
    except (OSError, dns.exception.DNSException) as exc:
        detail = _oserror(exc) if isinstance(exc, OSError) else str(exc)
        return ProbeResult(name, False, f"DNS query to {where} failed: {shown(detail)}")
    rcode = answer.rcode()
    text = dns.rcode.to_text(rcode)
    if rcode in (dns.rcode.REFUSED, dns.rcode.NXDOMAIN):
        return ProbeResult(name, True, f"{shown(qname)} A from {where}: {text}")
    addresses = [
        item.to_text()
        for rrset in answer.answer
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
        for item in rrset
    ]
    if addresses:
        listed = ", ".join(addresses[:4])
        return ProbeResult(
            name, False, f"{shown(qname)} A from {where} was answered with {listed}: a leak"
        )
    return ProbeResult(
        name, False, f"{shown(qname)} A from {where}: {text} without addresses, not REFUSED"
    )


# -- specs ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TcpProbe:
    name: str
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class UdpProbe:
    name: str
    address: str
    port: int
    expect: Expect = "local_refusal"


@dataclass(frozen=True, slots=True)
class IcmpProbe:
    name: str
    address: str
    expect: Expect = "local_refusal"


@dataclass(frozen=True, slots=True)
class DnsProbe:
    name: str
    server: str
    port: int
    qname: str


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """The probes to run, in this order: TCP, UDP, ICMP, DNS. `timeout` (seconds) overrides
    each probe's default when given."""

    tcp: tuple[TcpProbe, ...] = ()
    udp: tuple[UdpProbe, ...] = ()
    icmp: tuple[IcmpProbe, ...] = ()
    dns: tuple[DnsProbe, ...] = ()
    timeout: float | None = field(default=None)

    def count(self) -> int:
        return len(self.tcp) + len(self.udp) + len(self.icmp) + len(self.dns)


def _guarded(name: str, probe: Callable[[], ProbeResult]) -> ProbeResult:
    """A probe that could not even be tried (no IPv6 in this kernel, too many open files)
    proved nothing: a failure, named, never a traceback."""
    try:
        return probe()
    except OSError as exc:
        return ProbeResult(name, False, f"could not probe: {_oserror(exc)}")


def run_probes(spec: ProbeSpec) -> list[ProbeResult]:
    extra: dict[str, Any] = {} if spec.timeout is None else {"timeout": spec.timeout}
    calls: list[tuple[str, Callable[[], ProbeResult]]] = []
    for t in spec.tcp:
        calls.append(
            (t.name, lambda t=t: tcp_answered_by_proxy(t.name, t.address, t.port, **extra))
        )
    for u in spec.udp:
        calls.append(
            (u.name, lambda u=u: udp_blocked(u.name, u.address, u.port, expect=u.expect, **extra))
        )
    for i in spec.icmp:
        calls.append(
            (i.name, lambda i=i: icmp_blocked(i.name, i.address, expect=i.expect, **extra))
        )
    for d in spec.dns:
        calls.append((d.name, lambda d=d: dns_refused(d.name, d.server, d.port, d.qname, **extra)))
    return [_guarded(name, call) for name, call in calls]


_FIELDS: dict[str, tuple[type, dict[str, str]]] = {
    "tcp": (TcpProbe, {"name": "name", "address": "address", "port": "port"}),
    "udp": (UdpProbe, {"name": "name", "address": "address", "port": "port", "expect": "expect"}),
    "icmp": (IcmpProbe, {"name": "name", "address": "address", "expect": "expect"}),
    "dns": (DnsProbe, {"name": "name", "server": "address", "port": "port", "qname": "qname"}),
}
_REQUIRED = {"tcp": 3, "udp": 3, "icmp": 2, "dns": 4}


def _bad(where: str, message: str) -> NoReturn:
    raise ProxyError(INVALID_SPEC, f"probe spec{' ' + where if where else ''}: {message}")


def _checked(where: str, kind: str, value: Any) -> Any:
    if kind == "name":
        if not isinstance(value, str) or not value or len(value) > 64 or not value.isprintable():
            _bad(where, "must be a non-empty printable string of at most 64 characters")
        return value
    if kind == "address":
        if not isinstance(value, str):
            _bad(where, "must be an IP address (a string)")
        try:
            # Only literals: a name here would go to the OS resolver, which could send it anywhere.
            return str(ipaddress.ip_address(value))
        except ValueError:
            _bad(where, f"{shown(value)!r} is not an IP address")
    if kind == "port":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            _bad(where, "must be a port number 1-65535")
        return value
    if kind == "expect":
        if value not in EXPECTS:
            _bad(where, f"must be one of {', '.join(EXPECTS)}")
        return value
    if kind == "qname":
        if not isinstance(value, str) or not value or len(value) > 253:
            _bad(where, "must be a DNS name")
        try:
            dns.name.from_text(value)
        except dns.exception.DNSException as exc:
            _bad(where, f"{shown(value)!r} is not a DNS name: {exc}")
        return value
    raise AssertionError(kind)


def parse_spec(value: Any) -> ProbeSpec:
    """A ProbeSpec from its JSON form:
    `{"tcp": [{"name", "address", "port"}], "udp": [{"name", "address", "port", "expect"}],
    "icmp": [{"name", "address", "expect"}], "dns": [{"name", "server", "port", "qname"}],
    "timeout": SECONDS}`. Raises ProxyError('invalid_probe_spec'); an empty spec is an error
    (it would pass without testing anything)."""
    if not isinstance(value, dict):
        _bad("", "must be a JSON object")
    unknown = sorted(set(value) - {*_FIELDS, "timeout"})
    if unknown:
        _bad("", f"unknown key {shown(unknown[0])!r} (expected tcp, udp, icmp, dns, timeout)")
    parsed: dict[str, Any] = {}
    names: set[str] = set()
    for key, (cls, kinds) in _FIELDS.items():
        items = value.get(key, [])
        if not isinstance(items, list):
            _bad(key, "must be a list")
        probes = []
        for index, item in enumerate(items):
            where = f"{key}[{index}]"
            if not isinstance(item, dict):
                _bad(where, "must be an object")
            extra = sorted(set(item) - set(kinds))
            if extra:
                _bad(where, f"unknown key {shown(extra[0])!r} (expected {', '.join(kinds)})")
            required = list(kinds)[: _REQUIRED[key]]
            missing = [k for k in required if k not in item]
            if missing:
                _bad(where, f"missing {', '.join(missing)}")
            fields = {k: _checked(f"{where}.{k}", kinds[k], item[k]) for k in item}
            if fields["name"] in names:
                _bad(f"{where}.name", f"{fields['name']!r} is used twice")
            names.add(fields["name"])
            probes.append(cls(**fields))
        parsed[key] = tuple(probes)
    timeout = value.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60
    ):
        _bad("timeout", "must be a number of seconds, more than 0 and at most 60")
    spec = ProbeSpec(**parsed, timeout=None if timeout is None else float(timeout))
    if spec.count() == 0:
        _bad("", "lists no probes (a check of nothing would always pass)")
    return spec


# -- privileges and the command line ---------------------------------------------------------


def parse_user(text: str) -> tuple[int, int]:
    """`UID:GID` → (uid, gid); root is refused (a probe as root proves nothing about the agent)."""
    uid_text, sep, gid_text = text.partition(":")
    if not sep or not uid_text.isdigit() or not gid_text.isdigit():
        raise ProxyError("usage", f"--as-user {shown(text)!r}: write UID:GID (numbers)")
    uid, gid = int(uid_text), int(gid_text)
    if not 0 < uid < 2**32 - 1 or not 0 < gid < 2**32 - 1:
        raise ProxyError(
            "usage", f"--as-user {shown(text)!r}: UID and GID must be non-root (1 to 4294967294)"
        )
    return uid, gid


def drop_privileges(uid: int, gid: int) -> None:
    """Become uid:gid for good (no supplementary groups), and check root cannot be regained.
    Already being exactly that user is fine; anything else without root is an error."""
    if os.getresuid() == (uid, uid, uid) and os.getresgid() == (gid, gid, gid):
        if os.getgroups() and os.geteuid() != 0:
            # Supplementary groups cannot be dropped without root; they carry no capability,
            # but ping_group_range can admit them: say so instead of probing as someone else.
            extra = set(os.getgroups()) - {gid}
            if extra:
                raise ProxyError(
                    "privileges",
                    f"running as {uid}:{gid} with supplementary groups {sorted(extra)}, "
                    "which cannot be dropped without root",
                )
        return
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except PermissionError as exc:
        raise ProxyError(
            "privileges", f"cannot become {uid}:{gid} ({_oserror(exc)}): --as-user needs root"
        ) from None
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise ProxyError("privileges", f"still able to regain root after becoming {uid}:{gid}")
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise ProxyError("privileges", f"did not become exactly {uid}:{gid}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def report(results: Sequence[ProbeResult]) -> dict[str, Any]:
    return {"results": [r.to_json() for r in results], "passed": all(r.passed for r in results)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m proxy.probes",
        description="Probe an egress boundary from the agent's position; print one JSON object.",
    )
    parser.add_argument("--spec", required=True, metavar="JSON", help="the probes (a JSON object)")
    parser.add_argument(
        "--as-user", metavar="UID:GID", help="drop to this user before probing (needs root)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        # Privileges go first: not one probe (or spec parse) runs as root by mistake.
        if args.as_user is not None:
            drop_privileges(*parse_user(args.as_user))
        try:
            document = json.loads(args.spec)
        except ValueError as exc:
            raise ProxyError(INVALID_SPEC, f"--spec is not JSON: {exc}") from None
        spec = parse_spec(document)
    except ProxyError as exc:
        sys.stderr.write(f"egress-proxy probes: {shown(exc.message)}\n")
        return 2
    results = run_probes(spec)
    sys.stdout.write(json.dumps(report(results)) + "\n")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
