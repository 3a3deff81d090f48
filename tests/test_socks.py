"""SOCKS5 listeners (RFC 1928) on the real `egress-proxy run` process: the same policy as the
HTTP proxy, decided, resolved and dialled before the SOCKS reply (so a denial is reply 2 and
nothing is dialled), then the SNI gate and the relay of a CONNECT tunnel, all in the front door
(plane l4). Real curl where a user would use it, a raw client of our own for the reply codes
and the hostile forms.

One proxy serves the module (its start costs more than most tests); each test tells its own
audit lines apart by its client's port, and waits for its connections' close lines, so no line
of one test lands in another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
import ssl
import struct
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.dns_server import DNSServer, running_dns_server
from support.front_door import socks_door
from support.hellos import python_hello
from support.real_servers import free_port
from support.running import CURL, RunningProxy, full_listener, metric_value, tcp_server, wait_for
from support.upstreams import TLS_BODY, TLSUpstream, tls_upstream

from proxy.cli import main
from proxy.common.listeners import Listener, parse_listener
from proxy.decide.planes import Update

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [tls.test, up.test, private.test, nx.test, slow.test, v6.test]\n"
HEADER_TIMEOUT = 2  # whole seconds: the config's grain
CONNECT_TIMEOUT = 2
CONFIG_EXTRA = (
    f"limits:\n  header_timeout: {HEADER_TIMEOUT}s\n  connect_timeout: {CONNECT_TIMEOUT}s\n"
)
SOCKS_LISTENER = re.compile(r" and socks5://127\.0\.0\.1:(\d+)")


# -- the proxy ---------------------------------------------------------------------------------


@dataclass
class Session:
    """The module's proxy: its HTTP and SOCKS5 listeners, the DNS server it asks."""

    proxy: RunningProxy
    socks: int
    dns: DNSServer

    def lines(self, client: int) -> list[dict[str, Any]]:
        """The audit lines of the connection(s) from local port `client`."""
        suffix = f":{client}"
        return [x for x in self.proxy.audit() if str(x.get("client", "")).endswith(suffix)]

    def decisions(self, client: int) -> list[dict[str, Any]]:
        return [x for x in self.lines(client) if x["event"] == "decision"]

    def closed(self, client: int) -> dict[str, Any]:
        """The close line of the connection from `client`, once it is written."""
        found: list[dict[str, Any]] = []

        def written() -> bool:
            found[:] = [x for x in self.lines(client) if x["event"] == "close"]
            return bool(found)

        wait_for(written, what=f"the close line of the connection from port {client}")
        (close,) = found
        return close

    def denial(self, client: int) -> dict[str, Any]:
        """The one deny line of the connection from `client` (after its close line)."""
        self.closed(client)
        (denied,) = [x for x in self.decisions(client) if x["decision"] == "deny"]
        return denied

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.proxy.metrics(), name, **labels) or 0.0


@pytest.fixture(scope="module")
def names() -> Iterator[DNSServer]:
    with running_dns_server() as server:
        for name in ("tls.test", "up.test"):
            server.set(name, a=["127.0.0.1"])
        server.set("private.test", a=["10.0.0.1"])
        server.set("v6.test", aaaa=["::1"])
        server.nxdomain("nx.test")
        server.blackhole("slow.test")
        yield server


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory, names: DNSServer) -> Iterator[Session]:
    with RunningProxy(
        tmp_path_factory.mktemp("socks"),
        MANIFEST,
        dns=names,
        allow=("127.0.0.0/8", "'::1/128'"),  # YAML: quoted, ':' starts a mapping
        config_extra=CONFIG_EXTRA,
        args=("--listen", "socks5://127.0.0.1:0"),
    ) as proxy:
        match = SOCKS_LISTENER.search(proxy.stderr())
        assert match, proxy.stderr()
        yield Session(proxy, int(match[1]), names)


# -- clients -----------------------------------------------------------------------------------


@dataclass
class Reply:
    code: int
    bound: tuple[str, int]  # BND.ADDR, BND.PORT


class Client:
    """A SOCKS5 client of our own on a blocking socket, every read bounded by a timeout."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.port = self.sock.getsockname()[1]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            assert chunk, f"closed after {data!r}, {size} bytes expected"
            data += chunk
        return data

    def greet(self, methods: bytes = b"\x00") -> bytes:
        self.send(bytes([5, len(methods)]) + methods)
        return self.exactly(2)

    def reply(self) -> Reply:
        head = self.exactly(4)
        assert head[0] == 5 and head[2] == 0, head
        size = {1: 4, 4: 16}[head[3]]
        address = ipaddress.ip_address(self.exactly(size))
        (port,) = struct.unpack("!H", self.exactly(2))
        return Reply(head[1], (str(address), port))

    def connect(self, host: str | bytes, port: int) -> Reply:
        assert self.greet() == b"\x05\x00"
        self.send(request(host, port))
        return self.reply()

    def rest(self) -> bytes:
        """Everything until the proxy closes (a reset counts as a close)."""
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := self.sock.recv(65536):
                data += chunk
        return data


def request(host: str | bytes, port: int, *, command: int = 1, atyp: int | None = None) -> bytes:
    """A SOCKS5 request; ATYP by what `host` is (an address: 1 or 4), else a name (3)."""
    if isinstance(host, bytes):
        address = bytes([3, len(host)]) + host
    else:
        try:
            parsed = ipaddress.ip_address(host)
        except ValueError:
            address = bytes([3, len(host)]) + host.encode()
        else:
            address = bytes([1 if parsed.version == 4 else 4]) + parsed.packed
    if atyp is not None:
        address = bytes([atyp]) + address[1:]
    return bytes([5, command, 0]) + address + struct.pack("!H", port)


def curl_from(port: int, socks: int, url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """curl through the SOCKS5 listener from local port `port` (so its lines can be found)."""
    return subprocess.run(
        [CURL, "-q", "-sS", "--max-time", "5", "--local-port", str(port),
         "--socks5-hostname", f"127.0.0.1:{socks}", *args, url],
        capture_output=True, timeout=15, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@dataclass
class Recorder:
    """A raw TCP upstream: the peer address of each connection, every byte received."""

    port: int = 0
    peers: list[tuple[str, int]] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.peers.append(conn.getpeername()[:2])
        conn.settimeout(5)
        while chunk := conn.recv(65536):
            with self.lock:
                self.received += chunk


@contextlib.contextmanager
def recording(host: str = "127.0.0.1") -> Iterator[Recorder]:
    recorder = Recorder()
    with tcp_server(recorder.handle, host) as port:
        recorder.port = port
        yield recorder


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[TLSUpstream]:
    with tls_upstream(tmp_path) as server:
        yield server


# -- allowed: curl, TLS passed through ---------------------------------------------------------


def test_curl_gets_the_upstream_itself_through_the_front_door(
    session: Session, upstream: TLSUpstream
) -> None:
    before = session.metric("egress_connections_total", plane="l4", protocol="socks5")
    port = free_port()
    url = f"https://tls.test:{upstream.port}/"
    result = curl_from(port, session.socks, url, "--cacert", str(upstream.ca_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout == TLS_BODY  # verified against the upstream's own certificate
    close = session.closed(port)
    assert (close["plane"], close["protocol"], close["host"]) == ("l4", "socks5", "tls.test")
    assert close["upstream"] == f"127.0.0.1:{upstream.port}" and close["pinned"] == ["127.0.0.1"]
    assert close["bytes_up"] > 0 and close["bytes_down"] > len(TLS_BODY)
    assert close["sni"] == "tls.test" and close["reason"] == "closed"
    decisions = session.decisions(port)
    assert [(x["stage"], x["decision"], x["plane"], x["protocol"]) for x in decisions] == [
        ("sni", "allow", "l4", "socks5"),
    ]
    assert decisions[0]["sni"] == "tls.test" and decisions[0]["pinned"]
    assert session.metric("egress_connections_total", plane="l4", protocol="socks5") == before + 1


def test_the_reply_carries_the_address_the_upstream_connection_is_bound_to(
    session: Session,
) -> None:
    with recording() as upstream, Client(session.socks) as client:
        reply = client.connect("up.test", upstream.port)
        assert reply.code == 0
        wait_for(lambda: upstream.peers, what="the upstream connection")
        assert reply.bound == upstream.peers[0]  # the proxy's end of that very connection
    assert upstream.received == b""


def test_ipv6_upstream_reply_is_atyp_4(session: Session) -> None:
    with recording("::1") as upstream, Client(session.socks) as client:
        reply = client.connect("v6.test", upstream.port)
        assert reply.code == 0
        wait_for(lambda: upstream.peers, what="the upstream connection")
        assert reply.bound == upstream.peers[0] and reply.bound[0] == "::1"
    assert session.closed(client.port)["upstream"] == f"[::1]:{upstream.port}"


def test_a_request_pipelined_behind_the_greeting_is_served(
    session: Session, upstream: TLSUpstream
) -> None:
    with Client(session.socks) as client:
        client.send(b"\x05\x01\x00" + request("tls.test", upstream.port))
        assert client.exactly(2) == b"\x05\x00"
        assert client.reply().code == 0
        context = ssl.create_default_context(cafile=str(upstream.ca_file))
        with context.wrap_socket(client.sock, server_hostname="tls.test") as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: tls.test\r\n\r\n")
            answer = b""
            with contextlib.suppress(ssl.SSLError, OSError):
                while chunk := tls.recv(65536):
                    answer += chunk
    assert answer.endswith(TLS_BODY)


def test_the_method_is_chosen_from_the_whole_list(session: Session) -> None:
    with Client(session.socks) as client:
        assert client.greet(b"\x02\x80\x00") == b"\x05\x00"


# -- denials: reply 2, nothing dialled ---------------------------------------------------------


def test_denied_name_is_reply_2_and_never_resolved(session: Session) -> None:
    labels = {"decision": "deny", "reason": "not_allowed", "stage": "name", "plane": "l4"}
    before = session.metric("egress_decisions_total", **labels)
    with Client(session.socks) as client:
        assert client.connect("denied.test", 443).code == 2
    assert session.dns.count("denied.test") == 0
    denial = session.denial(client.port)
    assert (denial["reason"], denial["protocol"], denial["plane"]) == (
        "not_allowed",
        "socks5",
        "l4",
    )
    assert session.closed(client.port)["reason"] == "not_allowed"
    assert session.metric("egress_decisions_total", **labels) == before + 1


def test_curl_reports_the_refusal(session: Session) -> None:
    result = curl_from(free_port(), session.socks, "https://denied-too.test/")
    assert result.returncode == 97  # CURLE_PROXY: the SOCKS proxy refused
    assert b"not allowed" in result.stderr.lower() or b"(2)" in result.stderr
    assert session.dns.count("denied-too.test") == 0


def test_private_answer_is_reply_2_and_nothing_is_dialled(session: Session) -> None:
    with Client(session.socks) as client:
        assert client.connect("private.test", 443).code == 2
    assert session.denial(client.port)["reason"] == "private"


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "169.254.169.254"])
def test_an_address_destination_is_refused(session: Session, address: str) -> None:
    with Client(session.socks) as client:
        assert client.connect(address, 443).code == 2
    denial = session.denial(client.port)
    assert (denial["reason"], denial["stage"]) == ("ip_literal", "name")


@pytest.mark.parametrize(
    "name", ["127.0.0.1", "127.1", "0x7f.1", "2130706433", "[::1]", "::1", "fe80::1%eth0"]
)
def test_a_name_that_is_an_address_in_any_spelling_is_reply_2(session: Session, name: str) -> None:
    with Client(session.socks) as client:
        assert client.connect(name.encode(), 443).code == 2  # as a name: ATYP 3
    denial = session.denial(client.port)
    assert denial["reason"] == "ip_literal"
    assert "ATYP 1 or 4" in denial["message"]
    assert not [q for q in session.dns.queries if q[0] == name.lower()]


def test_the_proxys_own_listeners_are_never_a_destination(session: Session) -> None:
    for port in (session.socks, session.proxy.port):
        with Client(session.socks) as client:
            assert client.connect("up.test", port).code == 2
        assert session.denial(client.port)["reason"] == "proxy_loop"


# -- DNS and upstream failures -----------------------------------------------------------------


@pytest.mark.parametrize(("host", "reason"), [("nx.test", "nxdomain"), ("slow.test", "timeout")])
def test_dns_failure_is_reply_4(session: Session, host: str, reason: str) -> None:
    with Client(session.socks) as client:
        assert client.connect(host, 443).code == 4
    denial = session.denial(client.port)
    assert denial["stage"] == "dns" and reason in denial["reason"]


def test_upstream_refused_is_reply_5(session: Session) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # bound, not listening: connections are refused
        with Client(session.socks) as client:
            assert client.connect("up.test", closed_port).code == 5
    assert session.closed(client.port)["reason"] == "upstream_refused"


def test_upstream_that_never_accepts_is_reply_4(session: Session) -> None:
    with full_listener() as (listener, _), Client(session.socks) as client:
        started = time.monotonic()
        assert client.connect("up.test", listener.getsockname()[1]).code == 4
        elapsed = time.monotonic() - started
    assert CONNECT_TIMEOUT - 0.2 <= elapsed < CONNECT_TIMEOUT + 3
    assert session.denial(client.port)["reason"] == "upstream_timeout"


# -- the greeting --------------------------------------------------------------------------------


@pytest.mark.parametrize("methods", [b"\x02", b"\x01\x02\x03", b""])
def test_no_acceptable_method_is_ff_and_a_close(session: Session, methods: bytes) -> None:
    with Client(session.socks) as client:
        assert client.greet(methods) == b"\x05\xff"
        assert client.rest() == b""
    denial = session.denial(client.port)
    assert (denial["reason"], denial["stage"]) == ("socks_no_acceptable_method", "request")


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (b"\x04\x01\x01\xbb\x7f\x00\x00\x01user\x00", "SOCKS4"),
        (b"CONNECT tls.test:443 HTTP/1.1\r\nHost: tls.test:443\r\n\r\n", "HTTP"),
        (b"GET http://up.test/ HTTP/1.1\r\nHost: up.test\r\n\r\n", "HTTP"),
        (python_hello("tls.test"), "TLS"),
    ],
)
def test_other_protocols_are_closed_without_a_byte(
    session: Session, sent: bytes, said: str
) -> None:
    lookups = len(session.dns.queries)
    with Client(session.socks) as client:
        client.send(sent)
        assert client.rest() == b""  # no answer it could misread
    denial = session.denial(client.port)
    assert denial["reason"] == "not_socks5" and said in denial["message"]
    assert len(session.dns.queries) == lookups


# -- the request -------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "name"), [(2, "BIND"), (3, "UDP ASSOCIATE"), (9, "0x09")])
def test_commands_other_than_connect_are_reply_7(session: Session, command: int, name: str) -> None:
    with Client(session.socks) as client:
        assert client.greet() == b"\x05\x00"
        client.send(request("never-asked.test", 443, command=command))
        assert client.reply().code == 7
        assert client.rest() == b""
    denial = session.denial(client.port)
    assert denial["reason"] == "socks_command_unsupported" and name in denial["message"]
    assert session.dns.count("never-asked.test") == 0


def test_an_unknown_address_type_is_reply_8(session: Session) -> None:
    with Client(session.socks) as client:
        assert client.greet() == b"\x05\x00"
        client.send(request("up.test", 443, atyp=5))
        assert client.reply().code == 8
    assert session.denial(client.port)["reason"] == "socks_address_type_unsupported"


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (request(b"", 443), "length 0"),
        (request(b"up.test\x00.evil.test", 443), "NUL"),
        (request("bücher.test".encode(), 443), "non-ASCII byte 0xc3"),
        (request(b"up.test\n", 443), "control byte 0x0a"),
        (request("up.test", 0), "port 0"),
        (b"\x04\x01\x00" + request("up.test", 443)[3:], "version 0x04"),
        (b"\x05\x01\x01" + request("up.test", 443)[3:], "reserved byte 0x01"),
        (request("up.test", 443) + b"\x16\x03\x01", "3 bytes after the request"),
        (request("up.test", 443) * 2, "a second request"),
        (request("up.test", 443) + b"\x00", "1 byte after the request"),
    ],
)
def test_a_malformed_request_is_reply_1_and_nothing_is_dialled(
    session: Session, sent: bytes, said: str
) -> None:
    lookups = session.dns.count("up.test")
    with Client(session.socks) as client:
        assert client.greet() == b"\x05\x00"
        client.send(sent)
        assert client.reply().code == 1
        assert client.rest() == b""
    denial = session.denial(client.port)
    assert (denial["reason"], denial["stage"]) == ("invalid_request", "request")
    assert said in denial["message"]
    assert session.dns.count("up.test") == lookups


def test_a_name_too_long_for_dns_is_refused_by_the_policy(session: Session) -> None:
    name = ".".join(["a" * 63] * 4)  # 255 octets, the most a request can carry; DNS takes 253
    with Client(session.socks) as client:
        assert client.connect(name, 443).code == 2
    assert session.denial(client.port)["reason"] == "invalid_host"
    assert session.dns.count(name) == 0


def test_bytes_sent_while_the_proxy_dials_are_refused_before_the_reply(session: Session) -> None:
    # The upstream's accept queue is full: the dial waits for the SYN to be sent again (a second
    # on Linux), long enough to send bytes before the reply. Then a place frees up.
    with full_listener() as (listener, filler), Client(session.socks) as client:
        assert client.greet() == b"\x05\x00"
        client.send(request("up.test", listener.getsockname()[1]))
        time.sleep(0.2)
        client.send(b"\x16\x03\x01\x00")
        filler.close()
        listener.accept()[0].close()  # the filler's place
        assert client.reply().code == 1
        listener.settimeout(5)
        dialled, _ = listener.accept()
        with dialled:
            dialled.settimeout(5)
            assert dialled.recv(100) == b""  # the upstream got nothing and was closed
    denial = session.denial(client.port)
    assert denial["reason"] == "invalid_request" and "before its reply" in denial["message"]


# -- time limits -------------------------------------------------------------------------------


def drip(client: Client, data: bytes, interval: float = 0.4) -> bytes:
    """Sends `data` one byte every `interval` seconds until the proxy answers or closes;
    what it answered (b"" for a close without a byte)."""
    client.sock.settimeout(interval)
    for byte in data:
        try:
            client.send(bytes([byte]))
            answer = client.sock.recv(100)
        except TimeoutError:
            continue
        except ConnectionError:
            return b""
        client.sock.settimeout(5)
        return answer + client.rest() if answer else b""
    raise AssertionError("the proxy waited for every byte")


def test_a_greeting_dripped_one_byte_every_0_4s_is_cut_off_unanswered(session: Session) -> None:
    with Client(session.socks) as client:
        started = time.monotonic()
        answer = drip(client, b"\x05\x0c" + bytes(range(12)))  # 14 bytes: 5.6 s at this pace
        elapsed = time.monotonic() - started
    assert answer == b""  # before a method is chosen no reply exists that could not mislead
    assert HEADER_TIMEOUT - 0.1 <= elapsed < HEADER_TIMEOUT + 1.5
    assert session.denial(client.port)["reason"] == "header_timeout"


def test_a_request_dripped_one_byte_every_0_4s_is_cut_off_with_reply_1(session: Session) -> None:
    lookups = session.dns.count("up.test")
    with Client(session.socks) as client:
        started = time.monotonic()  # one limit for the greeting and the request together
        assert client.greet() == b"\x05\x00"
        answer = drip(client, request("up.test", 443))  # 14 bytes: 5.6 s at this pace
        elapsed = time.monotonic() - started
    assert answer == b"\x05\x01\x00\x01\x00\x00\x00\x00\x00\x00"
    assert HEADER_TIMEOUT - 0.1 <= elapsed < HEADER_TIMEOUT + 1.5
    denial = session.denial(client.port)
    assert (denial["reason"], denial["stage"]) == ("header_timeout", "accept")
    assert session.dns.count("up.test") == lookups  # never whole, never decided


def test_client_hello_never_sent_closes_after_the_header_timeout(session: Session) -> None:
    with recording() as upstream, Client(session.socks) as client:
        assert client.connect("up.test", upstream.port).code == 0
        started = time.monotonic()
        assert client.rest() == b""
        elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT - 0.1 <= elapsed < HEADER_TIMEOUT + 1.5
    denial = session.denial(client.port)
    assert (denial["stage"], denial["reason"]) == ("stream", "header_timeout")
    assert upstream.received == b""


# -- after the reply: the SNI gate ---------------------------------------------------------------


def test_sni_mismatch_closes_and_upstream_sees_no_hello(session: Session) -> None:
    with recording() as upstream, Client(session.socks) as client:
        assert client.connect("tls.test", upstream.port).code == 0
        client.send(python_hello("up.test"))
        assert client.rest() == b""
    denial = session.denial(client.port)
    assert (denial["reason"], denial["stage"], denial["sni"]) == ("sni_mismatch", "sni", "up.test")
    assert "SOCKS5 host" in denial["message"]
    assert upstream.received == b""


@pytest.mark.parametrize(
    ("sent", "protocol"),
    [(b"SSH-2.0-OpenSSH_9.6\r\n", "ssh"), (request("up.test", 443), "tcp")],
    ids=["ssh", "tcp"],
)
def test_bytes_neither_tls_nor_http_are_an_opaque_stream(
    session: Session, sent: bytes, protocol: str
) -> None:
    # No `ports` in this session's config: every port but 80 and 443 takes opaque streams.
    with recording() as upstream, Client(session.socks) as client:
        assert client.connect("up.test", upstream.port).code == 0
        client.send(sent)  # a second SOCKS5 request is neither TLS nor HTTP either
        wait_for(lambda: upstream.received == sent, what="the bytes relayed")
    close = session.closed(client.port)
    assert (close["protocol"], close["attribution"], close["bytes_up"]) == (
        protocol,
        "socks5",
        len(sent),
    )
    (allowed,) = [x for x in session.decisions(client.port) if x["decision"] == "allow"]
    assert (allowed["stage"], allowed["protocol"], allowed["host"]) == (
        "stream",
        protocol,
        "up.test",
    )


def test_the_http_listener_still_works_beside_it(session: Session) -> None:
    with socket.create_connection(("127.0.0.1", session.proxy.port), timeout=5) as sock:
        sock.sendall(b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 403")


# -- one process of its own --------------------------------------------------------------------


def test_over_max_connections_is_closed_without_a_byte(tmp_path: Path, names: DNSServer) -> None:
    with RunningProxy(
        tmp_path,
        MANIFEST,
        dns=names,
        config_extra="limits:\n  max_connections: 1\n",
        args=("--listen", "socks5://127.0.0.1:0"),
    ) as proxy:
        match = SOCKS_LISTENER.search(proxy.stderr())
        assert match
        socks = int(match[1])
        with Client(socks) as first:
            assert first.greet() == b"\x05\x00"  # the one connection allowed
            with Client(socks) as second:
                second.send(b"\x05\x01\x00")
                assert second.rest() == b""  # the one over the limit: closed, nothing said
            first.send(request("denied.test", 443))
            assert first.reply().code == 2  # the first is served all the same
        session = Session(proxy, socks, names)
        assert session.denial(second.port)["reason"] == "overload"
        assert session.denial(first.port)["reason"] == "not_allowed"


# -- in process: a failure on the path ---------------------------------------------------------


def boom(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("boom")


async def socks_exchange(port: int, sent: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_an_exception_before_the_reply_is_reply_1(dns: DNSServer) -> None:
    dns.set("up.test", a=["127.0.0.1"])
    with recording() as upstream:
        async with socks_door(dns, "", MANIFEST) as served:
            door, port, audit = served.door, served.port, served.audit
            exploding = types.SimpleNamespace(decide=boom, check_addresses=boom)
            door.configure(Update(policy=exploding))  # type: ignore[arg-type]
            answer = await socks_exchange(port, b"\x05\x01\x00" + request("up.test", upstream.port))
            assert answer == b"\x05\x00" + b"\x05\x01\x00\x01\x00\x00\x00\x00\x00\x00"
            assert "internal_error" in audit.getvalue()
        assert upstream.peers == []


@pytest.mark.asyncio
async def test_an_exception_after_the_reply_is_a_close(dns: DNSServer) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    with recording() as upstream:
        async with socks_door(dns, "", MANIFEST) as served:
            door, port, audit = served.door, served.port, served.audit
            door.vetter.allowed = boom  # type: ignore[method-assign]  # the SNI gate's allow line
            sent = b"\x05\x01\x00" + request("tls.test", upstream.port)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(sent)
            answer = await asyncio.wait_for(reader.readexactly(12), 5)
            assert answer[:6] == b"\x05\x00\x05\x00\x00\x01"  # greeted, then succeeded
            writer.write(python_hello("tls.test"))
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing more said
            writer.close()
            assert "internal_error" in audit.getvalue()
        assert upstream.received == b""


# -- the listener's address ---------------------------------------------------------------------


def test_listen_addresses_parse_with_their_scheme() -> None:
    assert parse_listener("127.0.0.1:3128") == Listener("http", "127.0.0.1", 3128)
    assert parse_listener("socks5://[::1]:1080") == Listener("socks5", "::1", 1080)
    assert str(parse_listener("SOCKS5://:1080")) == "socks5://127.0.0.1:1080"


@pytest.mark.parametrize(
    ("listen", "message"),
    [
        ("socks4://127.0.0.1:1080", "scheme 'socks4' is not one of http://, socks5://"),
        ("socks5://example.com:1080", "not an IP address"),
        ("http://127.0.0.1:99999", "port '99999'"),
    ],
)
def test_bad_listen_addresses_exit_2_before_anything_runs(
    listen: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "examples/agent.yaml", "--listen", listen])
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_same_address_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["run", "examples/agent.yaml", "--listen", ":4128", "--listen", "socks5://127.0.0.1:4128"]
    )
    assert code == 2
    assert "use the same address" in capsys.readouterr().err


# -- hosts whose rules need inspection -------------------------------------------------------


def test_a_host_that_needs_inspection_is_checked_before_the_reply_and_gated_after_it(
    tmp_path: Path, names: DNSServer
) -> None:
    with recording() as upstream:
        allowed = [f"https://{host}:{upstream.port}/api/" for host in ("up.test", "private.test")]
        manifest = f"schema_version: 1\nnetwork_access:\n  allowed: {allowed}\n"
        with RunningProxy(
            tmp_path,
            manifest,
            dns=names,
            config_extra=f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n",
            args=("--listen", "socks5://127.0.0.1:0"),
        ) as proxy:
            match = SOCKS_LISTENER.search(proxy.stderr())
            assert match
            session = Session(proxy, int(match[1]), names)
            # Resolved and checked before the reply: a private answer is reply 2.
            with Client(session.socks) as client:
                assert client.connect("private.test", upstream.port).code == 2
            assert session.denial(client.port)["reason"] == "private"
            # Allowed: reply 0 (no upstream connection of the front door's: 0.0.0.0:0), then the
            # SNI gate, before anything reaches the interception engine.
            with Client(session.socks) as client:
                reply = client.connect("up.test", upstream.port)
                assert (reply.code, reply.bound) == (0, ("0.0.0.0", 0))
                client.send(python_hello("tls.test"))
                assert client.rest() == b""
            denial = session.denial(client.port)
            assert (denial["stage"], denial["reason"]) == ("sni", "sni_mismatch")
            with Client(session.socks) as client:
                assert client.connect("up.test", upstream.port).code == 0
                hello = python_hello("up.test")
                client.send(hello)
                with contextlib.suppress(TimeoutError):
                    client.sock.settimeout(2)
                    client.sock.recv(65536)
            session.closed(client.port)
            gate = [x for x in session.decisions(client.port) if x["stage"] == "sni"]
            assert [(x["decision"], x["sni"]) for x in gate] == [("allow", "up.test")]
        # The client's own hello never went to the upstream as is: the tunnel was not relayed.
        assert hello not in upstream.received
