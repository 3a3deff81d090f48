"""mitmproxy's DNS mode as the DNS responder (`egress-proxy run --dns-listen HOST:PORT`) uses it.

The engine serves a `dns@HOST:PORT` mode per DNS listener: UDP and TCP on the same port (what
mitmproxy's DnsMode does, its transport being "both"). What to answer is decided by
proxy/dns_answers.py; this module only translates between mitmproxy's messages and those
decisions, and hardens mitmproxy's DNS layer where it would otherwise forward, crash or go deaf:

- `DnsLayer` (in place of mitmproxy's DNSLayer while an engine runs): every query gets a flow
  of its own and the answer our hook set. There is no way to an upstream server at all
  (mitmproxy's layer forwards a query no hook answered when the flow has a server address): a
  query left without an answer (a hook that failed) is answered SERVFAIL. A UDP datagram that
  does not parse is answered FORMERR when its header can be read (dropped otherwise), and the
  client's later queries are still answered: mitmproxy's own layer would end the client's UDP
  "connection", after which mitmproxy_rs drops that address's datagrams for as long as they
  keep coming (its per-address state lives for 60 s after the last datagram, and only expires
  when it is not closed by Python first). On TCP a message that does not parse closes the
  connection (the framing is lost). A message that is not a query (QR set) is never answered:
  answering responses can start a loop between two servers. An answer too big for UDP (512
  bytes; our answers carry no EDNS record) goes out truncated (TC), and the client asks over
  TCP.
- `EgressDnsAddon.dns_request` asks DnsResponder and sets `flow.response` for every query.
  mitmproxy's DnsResolver addon is never loaded: nothing in this process resolves or forwards a
  query for mitmproxy, whatever happens in a hook.
- DNS clients are not proxy connections: no connection metrics or close lines (each query has
  its decision lines). At most `MAX_DNS_CLIENTS` live at once (a UDP client is one source
  address and port); beyond that a new one is refused (its datagram is dropped, with a line).
- `UDP_IDLE_SECONDS`: how long mitmproxy keeps a UDP client that sends nothing. Longer than
  mitmproxy_rs's own 60 s, so that mitmproxy_rs always forgets a quiet address before Python
  closes its side (see above): otherwise a client that reuses its socket after 20 s of quiet
  (mitmproxy's default) would never be answered again.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import struct
from typing import TYPE_CHECKING

from mitmproxy import dns
from mitmproxy.proxy import commands, events, layer, layers, mode_specs
from mitmproxy.proxy.layers.dns import DnsRequestHook
from mitmproxy.proxy.utils import expect

from proxy.decide.vetting import Peer
from proxy.dns.answers import (
    DNS_MALFORMED,
    DNS_NOT_A_QUERY,
    FORMERR,
    NOERROR,
    SERVFAIL,
    UDP_ANSWER_LIMIT,
    DnsAnswer,
    DnsQuery,
    DnsQuestion,
    DnsResponder,
)
from proxy.reasons import OVERLOAD

if TYPE_CHECKING:
    from mitmproxy.connection import Client
    from mitmproxy.proxy.context import Context

logger = logging.getLogger(__name__)

MAX_DNS_CLIENTS = 4096
UDP_IDLE_SECONDS = 90
_HEADER = struct.Struct("!HHHHHH")
_QR = 0x8000


def is_dns_client(client: Client) -> bool:
    return isinstance(client.proxy_mode, mode_specs.DnsMode)


def _peer(client: Client) -> Peer:
    return Peer(client.peername, client.id)


def _header_only(message_id: int, flags: int, rcode: int) -> bytes:
    """A response with no sections: the request's id, opcode and RD bit, and `rcode`."""
    opcode_and_rd = flags & 0x7900
    return _HEADER.pack(message_id, _QR | opcode_and_rd | rcode, 0, 0, 0, 0)


class DnsLayer(layers.DNSLayer):
    """mitmproxy's DNSLayer for our DNS listeners (see the module docstring)."""

    def __init__(self, context: Context, responder: DnsResponder) -> None:
        super().__init__(context)
        self.responder = responder

    def unpack_message(self, data: bytes, from_client: bool) -> list[dns.DNSMessage]:
        try:
            return super().unpack_message(data, from_client)
        except struct.error:
            raise
        except Exception as exc:  # e.g. a label the idna codec refuses: malformed all the same
            raise struct.error(f"{type(exc).__name__}: {exc}") from None

    @expect(events.DataReceived, events.ConnectionClosed)
    def state_query(self, event: events.Event) -> layer.CommandGenerator[None]:
        assert isinstance(event, events.ConnectionEvent)
        client = self.context.client
        if isinstance(event, events.ConnectionClosed):
            # Hooks run one at a time and events wait for them: nothing is pending here.
            if event.connection is client and client.transport_protocol == "tcp":
                yield commands.CloseConnection(client)
            self._handle_event = self.state_done
            return
        if event.connection is not client:
            return  # there is no server connection, ever
        assert isinstance(event, events.DataReceived)
        try:
            messages = self.unpack_message(event.data, True)
        except struct.error as exc:
            yield from self._malformed(event.data, str(exc))
            return
        for message in messages:
            yield from self._query(message)

    def _malformed(self, data: bytes, detail: str) -> layer.CommandGenerator[None]:
        client = self.context.client
        udp = client.transport_protocol == "udp"
        answer = udp and len(data) >= _HEADER.size and not data[2] & 0x80
        self.responder.refuse_message(
            _peer(client),
            DNS_MALFORMED,
            f"not a DNS message: {detail[:200]}",
            rcode=FORMERR if answer else None,
        )
        if answer:
            message_id, flags = struct.unpack_from("!HH", data)
            yield commands.SendData(client, _header_only(message_id, flags, FORMERR))
        elif not udp:
            yield commands.CloseConnection(client)
            self._handle_event = self.state_done

    def _query(self, message: dns.DNSMessage) -> layer.CommandGenerator[None]:
        client = self.context.client
        if not message.query:
            self.responder.refuse_message(
                _peer(client), DNS_NOT_A_QUERY, "a DNS response sent as a query", rcode=None
            )
            return
        flow = dns.DNSFlow(client, self.context.server, live=True)
        flow.request = message
        yield DnsRequestHook(flow)
        yield from self._send(message, flow.response)

    def _send(
        self, request: dns.DNSMessage, response: dns.DNSMessage | None
    ) -> layer.CommandGenerator[None]:
        client = self.context.client
        try:
            if response is None:
                raise ValueError("no hook answered")  # our hook always does: it failed
            wire = response.packed
            if client.transport_protocol == "udp" and len(wire) > UDP_ANSWER_LIMIT:
                response.answers, response.truncation = [], True
                wire = response.packed
        except Exception as exc:
            logger.warning("egress: DNS answer not sent as built (%s): SERVFAIL", exc)
            flags = (request.op_code << 11) | (0x100 if request.recursion_desired else 0)
            wire = _header_only(request.id, flags, SERVFAIL)
        if client.transport_protocol == "tcp":
            wire = struct.pack("!H", len(wire)) + wire
        yield commands.SendData(client, wire)


def _response(request: dns.DNSMessage, answer: DnsAnswer) -> dns.DNSMessage:
    """mitmproxy's response message for our answer: the request's question, and for NOERROR
    one record per checked address (the question's name, type and class)."""
    if answer.rcode != NOERROR:
        return request.fail(answer.rcode)
    if not answer.addresses:
        return request.succeed([])
    question = request.questions[0]
    return request.succeed(
        [
            dns.ResourceRecord(
                question.name,
                question.type,
                question.class_,
                answer.ttl,
                ipaddress.ip_address(address).packed,
            )
            for address in answer.addresses
        ]
    )


class EgressDnsAddon:
    """The DNS mode's hooks: each query to DnsResponder, its answer into `flow.response`."""

    name = "egress-dns"

    def __init__(self, responder: DnsResponder, max_clients: int = MAX_DNS_CLIENTS) -> None:
        self.responder = responder
        self.max_clients = max_clients
        self._clients: set[str] = set()

    def client_connected(self, client: Client) -> None:
        try:
            if not is_dns_client(client):
                return
            if len(self._clients) >= self.max_clients:
                client.error = "egress-proxy: overload"
                self.responder.refuse_message(
                    _peer(client), OVERLOAD, "too many DNS clients at once", rcode=None
                )
                return
            self._clients.add(client.id)
        except Exception:
            logger.exception("egress: DNS client_connected failed")
            client.error = "egress-proxy: internal error"

    def client_disconnected(self, client: Client) -> None:
        self._clients.discard(client.id)

    async def dns_request(self, flow: dns.DNSFlow) -> None:
        request = flow.request
        try:
            query = DnsQuery(
                request.op_code,
                tuple(DnsQuestion(q.name, q.type, q.class_) for q in request.questions),
            )
            answer = await self.responder.answer(query, _peer(flow.client_conn))
            flow.response = _response(request, answer)
        except Exception:
            # Never a forward: DnsLayer answers SERVFAIL when no response is set.
            logger.exception("egress: dns_request failed")
            with contextlib.suppress(Exception):
                flow.response = request.fail(SERVFAIL)
