"""DNS messages of the responder in wire form, read and written with dnspython: a query's bytes
into the `DnsQuery` that proxy/dns_responder/responder.py decides, and its `DnsAnswer` back
into the bytes of a response.

    try:
        message, query = read_query(data)
    except Unanswerable as refused:
        send(refused.reply)                   # FORMERR, or None: send nothing
    wire = render(message, answer, limit=udp_limit(message))

A message we do not answer at all: fewer bytes than a header (no id to answer with), or a
response (QR set: answering responses can start a loop between two servers, or with a spoofed
source between us and ourselves). A message whose header reads but whose rest does not parse
(or that is longer than any query needs) gets FORMERR with its id. An answer too big for UDP goes
out truncated (TC set, no records) and the client asks again over TCP.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rrset

from policy.reasons import Reason
from proxy.dns_responder.responder import (
    FORMERR,
    NOERROR,
    SERVFAIL,
    UDP_ANSWER_LIMIT,
    DnsAnswer,
    DnsQuery,
    DnsQuestion,
)

HEADER = struct.Struct("!HHHHHH")
# A query is a header, one question (a name is at most 255 bytes) and perhaps an OPT record
# with a cookie or padding: far below this. Anything longer is not a query we would answer.
MAX_QUERY = 4096
# The largest UDP answer, whatever payload size a client's EDNS record offers: the commonly
# recommended 1232 bytes, which crosses no link unfragmented.
MAX_UDP_ANSWER = 1232
TCP_ANSWER_LIMIT = 65535
_QR = 0x8000
_OPCODE_AND_RD = 0x7900


class Unanswerable(Exception):
    """A message the responder does not decide: its reason code and message for the audit
    line, and the reply to send (FORMERR), or None to send nothing."""

    def __init__(self, reason: str, message: str, reply: bytes | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.reply = reply


@dataclass(frozen=True, slots=True)
class Header:
    id: int
    flags: int

    @property
    def is_response(self) -> bool:
        return bool(self.flags & _QR)


def read_header(data: bytes) -> Header | None:
    if len(data) < HEADER.size:
        return None
    message_id, flags = struct.unpack_from("!HH", data)
    return Header(message_id, flags)


def header_only(header: Header, rcode: int) -> bytes:
    """A response without sections: the request's id, opcode and RD bit, and `rcode`."""
    return HEADER.pack(header.id, _QR | (header.flags & _OPCODE_AND_RD) | rcode, 0, 0, 0, 0)


def read_query(data: bytes) -> tuple[dns.message.Message, DnsQuery]:
    """The message and the query the responder decides; raises Unanswerable."""
    header = read_header(data)
    if header is None:
        raise Unanswerable(Reason.DNS_MALFORMED, f"not a DNS message: {len(data)} bytes", None)
    if header.is_response:
        raise Unanswerable(Reason.DNS_NOT_A_QUERY, "a DNS response sent as a query", None)
    if len(data) > MAX_QUERY:
        raise Unanswerable(
            Reason.DNS_MALFORMED,
            f"a DNS message of {len(data)} bytes (a query has at most {MAX_QUERY})",
            header_only(header, FORMERR),
        )
    try:
        message = dns.message.from_wire(data)
    except Exception as exc:  # hostile bytes raise many types, not only DNSException
        detail = f"{type(exc).__name__}: {exc}"[:200]
        raise Unanswerable(
            Reason.DNS_MALFORMED, f"not a DNS message: {detail}", header_only(header, FORMERR)
        ) from None
    questions = tuple(
        DnsQuestion(name_text(q.name), int(q.rdtype), int(q.rdclass)) for q in message.question
    )
    return message, DnsQuery(int(message.opcode()), questions)


def name_text(name: dns.name.Name) -> str:
    """A question's name as the policy reads names: no trailing dot, the root as "", and any
    byte that is not plain text escaped (`\\000`), so that it can never pass as a hostname."""
    if name == dns.name.root:
        return ""
    return name.to_text(omit_final_dot=True)


def udp_limit(message: dns.message.Message) -> int:
    """The largest UDP answer `message`'s sender takes: 512 bytes, or what its EDNS record
    offers, at most MAX_UDP_ANSWER."""
    if message.edns < 0:
        return UDP_ANSWER_LIMIT
    return max(UDP_ANSWER_LIMIT, min(int(message.payload), MAX_UDP_ANSWER))


def render(message: dns.message.Message, answer: DnsAnswer, limit: int) -> bytes:
    """The response to `message` with `answer`'s rcode (and for NOERROR one record per address,
    named as the question was, case included), at most `limit` bytes: truncated (TC, no
    records) when the records do not fit. Never raises: SERVFAIL if it cannot be built."""
    try:
        response = _response(message, answer)
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            response = _response(message, DnsAnswer(answer.rcode, answer.reason))
            response.flags |= dns.flags.TC
            return response.to_wire(max_size=limit)
    except Exception:
        header = Header(message.id, message.flags)
        return header_only(header, SERVFAIL)


def _response(message: dns.message.Message, answer: DnsAnswer) -> dns.message.Message:
    response = dns.message.make_response(message, our_payload=MAX_UDP_ANSWER)
    response.set_rcode(dns.rcode.Rcode.make(answer.rcode))
    if answer.rcode == NOERROR and answer.addresses:
        question = message.question[0]
        response.answer.append(
            dns.rrset.from_text_list(
                question.name,
                answer.ttl,
                dns.rdataclass.IN,
                question.rdtype,
                list(answer.addresses),
            )
        )
    return response
