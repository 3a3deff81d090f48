"""A DNS server of the tests' own: loopback only, UDP and TCP on one random port, answers from a
zone the test controls, every query logged.

Messages are parsed and built with dnspython (no hand-made wire format), so what the resolver
under test sees is what a real server would send. It runs in background threads with its own
sockets, which suits sync and async tests alike (an asyncio server would be tied to one loop).

    with running_dns_server() as server:
        server.set("example.test", a=["192.0.2.1"], aaaa=["2001:db8::1"], ttl=60)
        server.nxdomain("gone.test")
        ... Nameserver(*server.address) ...
        assert server.count("example.test", "A") == 1
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

LOOPBACK = "127.0.0.1"
# A classic UDP answer limit; EDNS clients (dnspython offers 1232) may raise it.
_UDP_LIMIT = 512
# Bounds: how long a TCP connection may sit idle, how long a CNAME chain the server follows.
_TCP_IDLE = 5.0
_MAX_CHASE = 32


@dataclass(frozen=True)
class _Entry:
    kind: str  # "records" | "nxdomain" | "servfail" | "refused" | "blackhole"
    a: tuple[str, ...] = ()
    aaaa: tuple[str, ...] = ()
    cname: str | None = None
    ttl: int = 300


def _key(name: str | dns.name.Name) -> str:
    return str(name).lower().rstrip(".")


class DNSServer:
    """The zone and the query log; the sockets live in `running_dns_server()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zone: dict[str, _Entry] = {}
        # (name, rdtype, transport): name lowercase without the trailing dot, rdtype as text
        # ("A", "AAAA"), transport "udp" or "tcp".
        self.queries: list[tuple[str, str, str]] = []
        # The SOA sent with negative answers (NXDOMAIN, NODATA): its TTL and MINIMUM both.
        # None sends negative answers without an SOA.
        self.negative_ttl: int | None = 60
        self.address: tuple[str, int] = (LOOPBACK, 0)
        self._stopping = threading.Event()

    # -- the zone ----------------------------------------------------------------------------

    def set(
        self,
        name: str,
        *,
        a: list[str] | tuple[str, ...] = (),
        aaaa: list[str] | tuple[str, ...] = (),
        ttl: int = 300,
        cname: str | None = None,
    ) -> None:
        """Records for `name` (replacing any); with `cname`, name is an alias of that target
        (the server follows the chain inside its zone, as an authoritative server would)."""
        entry = _Entry("records", tuple(a), tuple(aaaa), cname, ttl)
        with self._lock:
            self._zone[_key(name)] = entry

    def nxdomain(self, name: str) -> None:
        self._put(name, "nxdomain")

    def servfail(self, name: str) -> None:
        self._put(name, "servfail")

    def refused(self, name: str) -> None:
        self._put(name, "refused")

    def blackhole(self, name: str) -> None:
        """Queries for `name` are logged and never answered (for timeouts)."""
        self._put(name, "blackhole")

    def _put(self, name: str, kind: str) -> None:
        with self._lock:
            self._zone[_key(name)] = _Entry(kind)

    # -- the log -----------------------------------------------------------------------------

    def count(self, name: str, rdtype: str | None = None, transport: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for qname, qtype, qtransport in self.queries
                if qname == _key(name)
                and (rdtype is None or qtype == rdtype)
                and (transport is None or qtransport == transport)
            )

    def clear_log(self) -> None:
        with self._lock:
            self.queries.clear()

    # -- answering ---------------------------------------------------------------------------

    def answer(self, wire: bytes, transport: str) -> bytes | None:
        """The response to one query in wire format, or None to stay silent."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None  # not DNS: a real server would drop it too
        if len(query.question) != 1:
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        qname = _key(question.name)
        rdtype = question.rdtype
        with self._lock:
            self.queries.append((qname, dns.rdatatype.to_text(rdtype), transport))
            zone = dict(self._zone)
            negative_ttl = self.negative_ttl
        # Note that dnspython shuffles the records of an RRset when rendering (round robin), as
        # real servers do: tests may rely on A before AAAA, not on the order inside one RRset.
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        name = qname
        for _ in range(_MAX_CHASE):
            entry = zone.get(name)
            if entry is None or entry.kind == "nxdomain":
                response.set_rcode(dns.rcode.NXDOMAIN)
                break
            if entry.kind == "servfail":
                response.set_rcode(dns.rcode.SERVFAIL)
                return response.to_wire()
            if entry.kind == "refused":
                response.set_rcode(dns.rcode.REFUSED)
                return response.to_wire()
            if entry.kind == "blackhole":
                return None
            if entry.cname is not None:
                response.answer.append(
                    dns.rrset.from_text(name + ".", entry.ttl, "IN", "CNAME", entry.cname + ".")
                )
                name = _key(entry.cname)
                continue
            values = {dns.rdatatype.A: entry.a, dns.rdatatype.AAAA: entry.aaaa}.get(rdtype, ())
            if values:
                response.answer.append(
                    dns.rrset.from_text(name + ".", entry.ttl, "IN", rdtype, *values)
                )
            break
        negative = not response.answer or response.rcode() == dns.rcode.NXDOMAIN
        if negative and negative_ttl is not None:
            response.authority.append(
                dns.rrset.from_text(
                    "test.",
                    negative_ttl,
                    "IN",
                    "SOA",
                    f"ns.test. admin.test. 1 3600 600 86400 {negative_ttl}",
                )
            )
        if transport == "tcp":
            # Explicit: otherwise to_wire() limits itself to the query's EDNS payload size.
            return response.to_wire(max_size=65535)
        limit = max(_UDP_LIMIT, query.payload if query.edns >= 0 else 0)
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            # Too big for UDP: an empty answer with TC set tells the client to retry over TCP.
            truncated = dns.message.make_response(query)
            truncated.flags |= dns.flags.AA | dns.flags.TC
            return truncated.to_wire()


class _UDPHandler(socketserver.BaseRequestHandler):
    server: _UDPServer

    def handle(self) -> None:
        data, sock = self.request
        reply = self.server.dns.answer(data, "udp")
        if reply is not None:
            sock.sendto(reply, self.client_address)


class _TCPHandler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        conn: socket.socket = self.request
        # Short reads so a blackholed connection notices the server stopping.
        conn.settimeout(0.2)
        buffer = b""
        idle = 0.0
        dns_server = self.server.dns
        while not dns_server._stopping.is_set() and idle < _TCP_IDLE:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                idle += 0.2
                continue
            except OSError:
                return
            if not chunk:
                return
            idle = 0.0
            buffer += chunk
            while len(buffer) >= 2:
                (length,) = struct.unpack("!H", buffer[:2])
                if len(buffer) < 2 + length:
                    break
                wire, buffer = buffer[2 : 2 + length], buffer[2 + length :]
                reply = dns_server.answer(wire, "tcp")
                if reply is not None:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)


class _UDPServer(socketserver.UDPServer):
    allow_reuse_address = False

    def __init__(self, dns_server: DNSServer, port: int) -> None:
        self.dns = dns_server
        super().__init__((LOOPBACK, port), _UDPHandler)


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = False
    daemon_threads = True
    block_on_close = True  # server_close() joins the connection threads (each bounded)

    def __init__(self, dns_server: DNSServer, port: int) -> None:
        self.dns = dns_server
        super().__init__((LOOPBACK, port), _TCPHandler)


def _bind_pair(dns_server: DNSServer) -> tuple[_UDPServer, _TCPServer]:
    """UDP and TCP on the same free loopback port (retried: the TCP port may be taken)."""
    for _ in range(20):
        udp = _UDPServer(dns_server, 0)
        port = udp.server_address[1]
        try:
            tcp = _TCPServer(dns_server, port)
        except OSError:
            udp.server_close()
            continue
        return udp, tcp
    raise RuntimeError("no free loopback port for UDP and TCP together")


@contextlib.contextmanager
def running_dns_server() -> Iterator[DNSServer]:
    dns_server = DNSServer()
    udp, tcp = _bind_pair(dns_server)
    dns_server.address = (LOOPBACK, udp.server_address[1])
    threads = [
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        for srv in (udp, tcp)
    ]
    try:
        for thread in threads:
            thread.start()
        yield dns_server
    finally:
        dns_server._stopping.set()
        for srv, thread in zip((udp, tcp), threads, strict=True):
            if thread.is_alive():  # shutdown() waits for serve_forever: only if it runs
                srv.shutdown()
        for srv in (udp, tcp):
            srv.server_close()
        for thread in threads:
            thread.join(timeout=5)
