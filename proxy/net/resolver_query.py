"""The resolver's exchanges with its nameservers: the A and AAAA questions of one name, asked
over UDP on one socket of their own (TCP for an answer that came back truncated), every answer
parsed with dnspython and matched to its question.

    replies = await ask(("192.0.2.53", 53), qname, (A, AAAA), timeout=1.0)
    replies[A]        # a dns.message.Message, a Failed(detail), or absent: no answer in time

Why not dnspython's resolver: its machinery per query (a Resolution, a nameserver list, a
backend socket and a task per family, a message rendered through its renderer) cost about 2.7 ms
of CPU per cold lookup here, where the messages themselves need a few hundred microseconds. So
the query's wire form is built directly (12-byte header, the name's wire form from dnspython,
type and class), both families share one connected UDP socket (its random
source port and a random 16-bit id per query, as stub resolvers do), and only the answers are
parsed, by dnspython. A datagram that is not the answer to one of our questions (another id, a
question that does not match, not even a message) is ignored, as dnspython does: an off-path
sender must guess port and id, and can then only make us wait.

Nothing here hands a name to the OS: every nameserver is an IP address, and the sockets connect
to it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass

# Queries carry no EDNS record (as dnspython's resolver sends them by default): the answers then
# carry none either, which saves parsing it (about 15% of a cold lookup's CPU, measured with
# benchmarks/dns_lookup.py), and an answer over 512 bytes comes back truncated and is asked again
# over TCP (rare for A and AAAA: 512 bytes hold a CNAME chain and a dozen addresses).
_HEADER = struct.Struct("!HHHHHH")
_RD = 0x0100
_IN = dns.rdataclass.IN
# Answers that end the question for this nameserver; any other rcode is its failure.
_FINAL = frozenset({dns.rcode.NOERROR, dns.rcode.NXDOMAIN})


@dataclass(frozen=True, slots=True)
class Failed:
    """A nameserver that answered but not usefully (SERVFAIL, REFUSED, ...), or a socket error."""

    detail: str


Reply = dns.message.QueryMessage | Failed


@dataclass(frozen=True, slots=True)
class _Question:
    rdtype: int
    id: int
    wire: bytes


def _questions(qname: dns.name.Name, rdtypes: Iterable[int]) -> dict[int, _Question]:
    """One query per type, each with an id of its own (random, distinct), keyed by id."""
    name = qname.to_wire()
    assert name is not None
    questions: dict[int, _Question] = {}
    for rdtype in rdtypes:
        query_id = secrets.randbits(16)
        while query_id in questions:
            query_id = secrets.randbits(16)
        wire = _HEADER.pack(query_id, _RD, 1, 0, 0, 0) + name + struct.pack("!HH", rdtype, _IN)
        questions[query_id] = _Question(rdtype, query_id, wire)
    return questions


def _answer_to(
    data: bytes, question: _Question, qname: dns.name.Name
) -> dns.message.QueryMessage | None:
    """`data` parsed, if it is the answer to `question` (dnspython's is_response, by hand: the
    query was never a Message); None otherwise."""
    try:
        message = dns.message.from_wire(data)
    except Exception:  # dnspython raises many types for hostile bytes, not all DNSException
        return None
    if not isinstance(message, dns.message.QueryMessage):  # the opcode is not QUERY
        return None
    if message.id != question.id or not message.flags & dns.flags.QR:
        return None
    if not message.question:
        # Some servers send errors without the question: accepted for errors only.
        return message if message.rcode() not in _FINAL else None
    if len(message.question) != 1:
        return None
    asked = message.question[0]
    if asked.rdtype != question.rdtype or asked.rdclass != _IN or asked.name != qname:
        return None
    return message


class _Exchange(asyncio.DatagramProtocol):
    """The datagrams of one socket: answers to the questions still open, until all are in."""

    def __init__(
        self, questions: dict[int, _Question], qname: dns.name.Name, done: asyncio.Future[None]
    ) -> None:
        self.open = dict(questions)
        self.qname = qname
        self.done = done
        self.replies: dict[int, Reply] = {}

    def datagram_received(self, data: bytes, addr: object) -> None:
        if len(data) < _HEADER.size:
            return
        question = self.open.get(int.from_bytes(data[:2], "big"))
        if question is None:
            return
        message = _answer_to(data, question, self.qname)
        if message is None:
            return
        del self.open[question.id]
        self.replies[question.rdtype] = message
        if not self.open:
            self._finish()

    def error_received(self, exc: Exception) -> None:
        # On a connected socket: the nameserver's ICMP (port unreachable, ...), for every
        # question still open.
        for question in self.open.values():
            self.replies[question.rdtype] = Failed(f"{type(exc).__name__}: {exc}")
        self.open.clear()
        self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


async def ask(
    nameserver: tuple[str, int],
    qname: dns.name.Name,
    rdtypes: Iterable[int],
    timeout: float,
    *,
    tcp_timeout: float | None = None,
) -> dict[int, Reply]:
    """Ask `nameserver` every type of `rdtypes` about `qname`, waiting `timeout` seconds for
    the UDP answers: the replies by type (a truncated answer asked again over TCP, within
    `tcp_timeout` seconds of the start, default `timeout`); a type missing from the result got
    no answer in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (timeout if tcp_timeout is None else max(timeout, tcp_timeout))
    questions = _questions(qname, rdtypes)
    replies = await _udp(nameserver, qname, questions, timeout)
    for question in questions.values():
        reply = replies.get(question.rdtype)
        if isinstance(reply, dns.message.QueryMessage) and reply.flags & dns.flags.TC:
            del replies[question.rdtype]
            remaining = deadline - loop.time()
            if remaining > 0:
                tcp = await _tcp(nameserver, qname, question, remaining)
                if tcp is not None:
                    replies[question.rdtype] = tcp
    for rdtype, reply in list(replies.items()):
        if isinstance(reply, dns.message.QueryMessage) and reply.rcode() not in _FINAL:
            shown = f"[{nameserver[0]}]" if ":" in nameserver[0] else nameserver[0]
            rcode = dns.rcode.to_text(reply.rcode())
            replies[rdtype] = Failed(f"{shown}:{nameserver[1]} answered {rcode}")
    return replies


async def _udp(
    nameserver: tuple[str, int],
    qname: dns.name.Name,
    questions: dict[int, _Question],
    timeout: float,
) -> dict[int, Reply]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(_family(nameserver[0]), socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.connect(nameserver)  # UDP: no packet, only the kernel's filter on the source
    except OSError as exc:
        sock.close()
        return {q.rdtype: Failed(f"{type(exc).__name__}: {exc}") for q in questions.values()}
    done: asyncio.Future[None] = loop.create_future()
    exchange = _Exchange(questions, qname, done)
    try:
        transport, _ = await loop.create_datagram_endpoint(lambda: exchange, sock=sock)
    except BaseException:
        sock.close()
        raise
    timer = loop.call_later(timeout, exchange._finish)
    try:
        for question in questions.values():
            transport.sendto(question.wire)
        await done
    finally:
        timer.cancel()
        transport.close()
    return exchange.replies


async def _tcp(
    nameserver: tuple[str, int], qname: dns.name.Name, question: _Question, timeout: float
) -> Reply | None:
    """The same question over TCP; None when no answer came in time."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(_family(nameserver[0]), socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, nameserver)
            await loop.sock_sendall(sock, struct.pack("!H", len(question.wire)) + question.wire)
            (length,) = struct.unpack("!H", await _read(loop, sock, 2))
            data = await _read(loop, sock, length)
    except TimeoutError:
        return None
    except (OSError, EOFError) as exc:
        return Failed(f"TCP: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    message = _answer_to(data, question, qname)
    return message if message is not None else Failed("TCP: not an answer to the question")


async def _read(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise EOFError("connection closed by the nameserver")
        data += chunk
    return bytes(data)
