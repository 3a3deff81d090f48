"""The DNS responder of `egress-proxy run --dns-listen HOST:PORT` as a real process
(tests/support/running.py), asked with dnspython over UDP and TCP, v4 and v6, on loopback only.
The tests' DNS server (tests/support/dns_server.py) is the proxy's nameserver and logs every
query it gets: a denied name, and every type but A/AAAA, must never reach it."""

from __future__ import annotations

import re
import signal
import socket
import struct
import time
from pathlib import Path

import pytest
from dns import edns as dnsedns
from dns import flags as dnsflags
from dns import message as dnsmessage
from dns import opcode as dnsopcode
from dns import query as dnsquery
from dns import rcode as dnsrcode
from support.dns_server import DNSServer, running_dns_server
from support.running import LOOPBACK, RunningProxy, make_config, metric_value, wait_for

from proxy.cli import main

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [ok.test, priv.test, gone.test, other.test, slow.test]\n"
CEILING = "egress: [ok.test, priv.test, gone.test, other.test, slow.test]\n"
ALLOW = ("192.0.2.0/24", "2001:db8::/32")
HEADER_TIMEOUT = 1.0
IDLE_TIMEOUT = 2.0
LIMITS = f"limits:\n  header_timeout: {HEADER_TIMEOUT:g}s\n  idle_timeout: {IDLE_TIMEOUT:g}s\n"


def dns_ports(proxy: RunningProxy, host: str = LOOPBACK) -> list[int]:
    """The bound port of every DNS listener on `host`, from the "listening on" line."""
    shown = f"[{host}]" if ":" in host else host
    ports = [int(p) for p in re.findall(rf"dns://{re.escape(shown)}:(\d+)", proxy.stderr())]
    assert ports, proxy.stderr()
    return ports


def dns_port(proxy: RunningProxy, host: str = LOOPBACK) -> int:
    return dns_ports(proxy, host)[0]


def ask(
    port: int,
    name: str,
    rdtype: str | int = "A",
    *,
    tcp: bool = False,
    host: str = LOOPBACK,
    sock: socket.socket | None = None,
    **query: object,
) -> dnsmessage.Message:
    message = dnsmessage.make_query(name, rdtype, **query)  # type: ignore[arg-type]
    if tcp:
        return dnsquery.tcp(message, host, port=port, timeout=5)
    return dnsquery.udp(message, host, port=port, timeout=5, sock=sock)


def addresses(response: dnsmessage.Message) -> list[str]:
    return sorted(rdata.address for rrset in response.answer for rdata in rrset)


def rcode(response: dnsmessage.Message) -> str:
    return dnsrcode.to_text(response.rcode())


def responder(tmp_path: Path, dns: DNSServer, *args: str, extra: str = "") -> RunningProxy:
    listen = args or ("--dns-listen", f"{LOOPBACK}:0", "--dns-listen", "[::1]:0")
    return RunningProxy(
        tmp_path,
        MANIFEST,
        ceiling=CEILING,
        dns=dns,
        allow=ALLOW,
        config_extra=LIMITS + extra,
        args=listen,
    )


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    dns.set("ok.test", a=["192.0.2.10", "192.0.2.11"], aaaa=["2001:db8::10"])
    dns.set("priv.test", a=["10.0.0.1"])
    dns.set("other.test", a=["192.0.2.30"])
    dns.set("denied.test", a=["192.0.2.99"])
    dns.nxdomain("gone.test")
    dns.set("big.ok.test", a=[f"192.0.2.{n}" for n in range(100, 140)])
    dns.set("huge.ok.test", aaaa=[f"2001:db8::{n:x}" for n in range(1, 65)])
    dns.blackhole("slow.test")
    return dns


def test_the_dns_responder_answers_only_what_the_policy_allows(
    tmp_path: Path, dns: DNSServer
) -> None:
    with responder(tmp_path, dns) as proxy:
        port, port6 = dns_port(proxy), dns_port(proxy, "::1")
        assert proxy.admin_get("/readyz")[0] == 200

        # Allowed A and AAAA, UDP and TCP, v4 and v6 listeners: the checked addresses.
        first = ask(port, "ok.test")
        assert rcode(first) == "NOERROR"
        assert addresses(first) == ["192.0.2.10", "192.0.2.11"]
        assert first.answer[0].ttl <= 30
        assert addresses(ask(port, "ok.test", "AAAA", tcp=True)) == ["2001:db8::10"]
        assert addresses(ask(port6, "ok.test", host="::1")) == ["192.0.2.10", "192.0.2.11"]
        assert addresses(ask(port6, "ok.test", "AAAA", host="::1", tcp=True)) == ["2001:db8::10"]
        # The answer names the question as it was asked (case included: 0x20 randomisation).
        mixed = ask(port, "oK.TeSt")
        assert mixed.answer[0].name.to_text() == "oK.TeSt."
        # Resolved once (A and AAAA together) by the proxy's resolver, then from its cache.
        assert dns.count("ok.test", "A") == 1 and dns.count("ok.test", "AAAA") == 1

        # A name outside the policy: REFUSED, whatever the type, and never asked upstream.
        for rdtype, tcp in (("A", False), ("AAAA", True), ("TXT", False), ("MX", True)):
            assert rcode(ask(port, "denied.test", rdtype, tcp=tcp)) == "REFUSED"
        assert dns.count("denied.test") == 0
        # Other types of an allowed name: no records, nothing forwarded.
        for rdtype, tcp in (("TXT", False), ("MX", True), ("ANY", False)):
            response = ask(port, "txt.ok.test", rdtype, tcp=tcp)
            assert (rcode(response), response.answer) == ("NOERROR", [])
        assert dns.count("txt.ok.test") == 0
        # A private answer is refused; NXDOMAIN stays NXDOMAIN; a DNS timeout is SERVFAIL.
        assert rcode(ask(port, "priv.test")) == "REFUSED"
        assert rcode(ask(port, "gone.test", tcp=True)) == "NXDOMAIN"
        assert rcode(ask(port, "slow.test")) == "SERVFAIL"
        # An IP literal as a name, a class other than IN.
        assert rcode(ask(port, "192.0.2.10")) == "REFUSED"
        chaos = dnsmessage.make_query("version.bind", "TXT", "CH")
        assert rcode(dnsquery.udp(chaos, LOOPBACK, port=port, timeout=5)) == "REFUSED"

        # Audit lines (protocol dns, the query type in `method`, the data plane) and metrics.
        lines = [x for x in proxy.decisions() if x["protocol"] == "dns"]
        seen = {(x["host"], x["method"], x["decision"], x["reason"]) for x in lines}
        assert ("ok.test", "A", "allow", "allowed") in seen
        assert ("denied.test", "TXT", "deny", "not_allowed") in seen
        assert ("txt.ok.test", "MX", "deny", "dns_qtype_not_served") in seen
        assert ("priv.test", "A", "deny", "private") in seen
        assert ("gone.test", "A", "deny", "dns_nxdomain") in seen
        assert ("slow.test", "A", "deny", "dns_timeout") in seen
        assert {x["plane"] for x in lines} == {"l4"} and {x["port"] for x in lines} == {None}
        assert all(x["session"] == "test-session" and x["client"] for x in lines)
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_dns_queries_total", qtype="A", rcode="REFUSED") == 3
        assert metric_value(metrics, "egress_dns_queries_total", qtype="TXT", rcode="NOERROR") == 1
        assert metric_value(metrics, "egress_dns_queries_total", qtype="A", rcode="SERVFAIL") == 1
        # mitmproxy never served (nor was loaded for) any of it; DNS clients are not proxy
        # connections: no connection lines or metrics of their own.
        assert metric_value(metrics, "egress_engine_loaded") == 0
        assert metric_value(metrics, "egress_connections_total") is None
        assert proxy.closes() == []
    assert proxy.returncode == 0


@pytest.mark.parametrize("rdtype", ["HTTPS", "SVCB"])
def test_https_and_svcb_queries_get_no_records_allowed_or_not(
    tmp_path: Path, dns: DNSServer, rdtype: str
) -> None:
    """No ECH configuration (nor any other SVCB parameter) from our DNS, for any name."""
    with responder(tmp_path, dns) as proxy:
        port, port6 = dns_port(proxy), dns_port(proxy, "::1")
        number = {"HTTPS": 65, "SVCB": 64}[rdtype]
        for name, expected in (("ok.test", "NOERROR"), ("denied.test", "REFUSED")):
            for tcp in (False, True):
                for where, host in ((port, LOOPBACK), (port6, "::1")):
                    response = ask(where, name, number, tcp=tcp, host=host, want_dnssec=True)
                    assert rcode(response) == expected
                    assert response.answer == response.authority == response.additional == []
        assert dns.queries == []  # nothing was resolved or forwarded
        lines = [x for x in proxy.decisions() if x["method"] == rdtype]
        assert {(x["host"], x["reason"]) for x in lines} == {
            ("ok.test", "dns_qtype_not_served"),
            ("denied.test", "not_allowed"),
        }
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_dns_queries_total", qtype=rdtype, rcode="NOERROR") == 4
        assert metric_value(metrics, "egress_dns_queries_total", qtype=rdtype, rcode="REFUSED") == 4


def test_udp_answers_fit_what_the_client_takes(tmp_path: Path, dns: DNSServer) -> None:
    with responder(tmp_path, dns) as proxy:
        port = dns_port(proxy)
        # 40 addresses: too big for a classic 512-byte answer, truncated (TC, no records);
        # complete over TCP, and over UDP for a client that offers an EDNS payload of 1232.
        big = ask(port, "big.ok.test")
        assert big.flags & dnsflags.TC and big.answer == [] and rcode(big) == "NOERROR"
        assert len(addresses(ask(port, "big.ok.test", tcp=True))) == 40
        edns = ask(port, "big.ok.test", use_edns=0, payload=1232)
        assert not edns.flags & dnsflags.TC and len(addresses(edns)) == 40
        assert edns.edns == 0 and edns.payload == 1232
        # 64 AAAA records (the resolver's cap) need about 1.8 KB: truncated even for a client
        # that offers 4096 (our UDP answers stay at 1232 bytes at most), whole over TCP.
        huge = ask(port, "huge.ok.test", "AAAA", use_edns=0, payload=4096)
        assert huge.flags & dnsflags.TC and huge.answer == []
        assert len(addresses(ask(port, "huge.ok.test", "AAAA", tcp=True))) == 64


def raw_udp(port: int, data: bytes, *, wait: float = 5.0) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(wait)
        sock.sendto(data, (LOOPBACK, port))
        try:
            return sock.recv(65535)
        except TimeoutError:
            return None


def test_hostile_udp_messages(tmp_path: Path, dns: DNSServer) -> None:
    with responder(tmp_path, dns) as proxy:
        port = dns_port(proxy)
        # Garbage after a readable header: FORMERR with its id.
        formerr = dnsmessage.from_wire(raw_udp(port, b"\x12\x34\x01\x00" + b"\xff" * 40) or b"")
        assert formerr.id == 0x1234 and formerr.rcode() == dnsrcode.FORMERR
        # Longer than any query: FORMERR too, without parsing it.
        query = dnsmessage.make_query("ok.test", "A").to_wire()
        long = dnsmessage.from_wire(raw_udp(port, query + b"\x00" * 5000) or b"")
        assert long.id == struct.unpack("!H", query[:2])[0] and long.rcode() == dnsrcode.FORMERR
        # Two questions: FORMERR, nothing resolved.
        two = dnsmessage.make_query("ok.test", "A")
        two.question.append(dnsmessage.make_query("other.test", "A").question[0])
        answer = dnsmessage.from_wire(raw_udp(port, two.to_wire()) or b"")
        assert answer.rcode() == dnsrcode.FORMERR
        # Another opcode (NOTIFY, UPDATE, a number with no name): NOTIMP.
        for opcode in (dnsopcode.NOTIFY, dnsopcode.UPDATE, 3):
            other = dnsmessage.make_query("ok.test", "SOA")
            other.set_opcode(opcode)
            answer = dnsmessage.from_wire(raw_udp(port, other.to_wire()) or b"")
            assert answer.rcode() == dnsrcode.NOTIMP and answer.opcode() == opcode
        # Not even a header, and a response (QR set): never answered.
        assert raw_udp(port, b"\x00", wait=0.5) is None
        reply = dnsmessage.make_response(dnsmessage.make_query("ok.test", "A"))
        assert raw_udp(port, reply.to_wire(), wait=0.5) is None
        # An EDNS option we do not know is ignored; a name with a byte no hostname has
        # (a NUL) is not a hostname: REFUSED, never resolved.
        option = dnsedns.GenericOption(65001, b"x")
        assert addresses(ask(port, "ok.test", use_edns=0, options=[option])) == [
            "192.0.2.10", "192.0.2.11"]  # fmt: skip
        assert rcode(ask(port, "a\\000b.ok.test")) == "REFUSED"
        assert {name for name, _, _ in dns.queries} == {"ok.test"}

        # One socket that sent garbage, a response and a query in any order is answered
        # every time it asks, now and after it was quiet for longer than the idle timeout:
        # nothing is kept per UDP client.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as same:
            same.bind((LOOPBACK, 0))
            same.settimeout(5)
            same.sendto(b"\x00", (LOOPBACK, port))
            same.sendto(reply.to_wire(), (LOOPBACK, port))
            same.setblocking(False)
            assert addresses(ask(port, "ok.test", sock=same)) == ["192.0.2.10", "192.0.2.11"]
            time.sleep(IDLE_TIMEOUT + 0.5)
            assert addresses(ask(port, "ok.test", sock=same)) == ["192.0.2.10", "192.0.2.11"]

        reasons = [x["reason"] for x in proxy.decisions() if x["host"] is None]
        # garbage, too long, two questions, no header (twice)
        assert reasons.count("dns_malformed") == 5
        assert reasons.count("dns_not_a_query") == 2
        assert reasons.count("dns_opcode_not_served") == 3
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_dns_queries_total", rcode="FORMERR") == 3
        assert metric_value(metrics, "egress_dns_queries_total", rcode="NOTIMP") == 3
        assert metric_value(metrics, "egress_dns_queries_total", rcode="dropped") == 4
        assert "Traceback" not in proxy.stderr()


def tcp_query(name: str, rdtype: str = "A") -> tuple[int, bytes]:
    wire = dnsmessage.make_query(name, rdtype).to_wire()
    return struct.unpack("!H", wire[:2])[0], struct.pack("!H", len(wire)) + wire


def read_tcp_answer(conn: socket.socket) -> dnsmessage.Message:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            assert chunk, "closed before a whole answer"
            data += chunk
        return data

    (length,) = struct.unpack("!H", exactly(2))
    return dnsmessage.from_wire(exactly(length))


def closed_within(conn: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `conn` (it sends nothing first); fails past `seconds`."""
    started = time.monotonic()
    conn.settimeout(seconds)
    assert conn.recv(4096) == b""
    return time.monotonic() - started


def test_tcp_pipelining_and_hostile_connections(tmp_path: Path, dns: DNSServer) -> None:
    with responder(tmp_path, dns) as proxy:
        port = dns_port(proxy)
        address = (LOOPBACK, port)
        # Several queries in one write, answered as each is decided (a slow one last), on one
        # connection that then goes on.
        with socket.create_connection(address, timeout=5) as conn:
            queries = [tcp_query(n, t) for n, t in (("slow.test", "A"), ("ok.test", "A"),
                       ("ok.test", "AAAA"), ("denied.test", "A"))]  # fmt: skip
            conn.sendall(b"".join(wire for _, wire in queries))
            answers = {m.id: m for m in (read_tcp_answer(conn) for _ in queries)}
            assert [rcode(answers[i]) for i, _ in queries] == [
                "SERVFAIL", "NOERROR", "NOERROR", "REFUSED"]  # fmt: skip
            assert addresses(answers[queries[2][0]]) == ["2001:db8::10"]
            # Garbage inside a whole frame: FORMERR, and the connection still serves.
            conn.sendall(b"\x00\x10\x43\x21\x01\x00" + b"\xff" * 12)
            assert read_tcp_answer(conn).rcode() == dnsrcode.FORMERR
            wire = tcp_query("other.test")[1]
            conn.sendall(wire)
            assert addresses(read_tcp_answer(conn)) == ["192.0.2.30"]
        # Half a message, then nothing: closed after the header timeout.
        with socket.create_connection(address, timeout=5) as conn:
            conn.sendall(tcp_query("ok.test")[1][:9])
            assert HEADER_TIMEOUT - 0.2 < closed_within(conn, 5) < HEADER_TIMEOUT + 2
        # A message trickled a byte at a time: the timeout counts from its first byte.
        with socket.create_connection(address, timeout=5) as conn:
            started, closed = time.monotonic(), False
            for byte in tcp_query("ok.test")[1]:  # about 30 bytes: 9 s at this pace
                try:
                    conn.sendall(bytes([byte]))
                except OSError:  # the server closed (our next byte after its FIN got a reset)
                    closed = True
                    break
                time.sleep(0.3)
            assert closed and time.monotonic() - started < HEADER_TIMEOUT + 2
        # Idle (nothing begun, nothing in flight): closed after the idle timeout.
        with socket.create_connection(address, timeout=5) as conn:
            assert addresses(read_after(conn, tcp_query("ok.test")[1])) == [
                "192.0.2.10", "192.0.2.11"]  # fmt: skip
            assert IDLE_TIMEOUT - 0.2 < closed_within(conn, IDLE_TIMEOUT + 3) < IDLE_TIMEOUT + 2
        # A length prefix cut short by EOF; lengths no query has; a response: closed at once.
        for data in (b"\x00", b"\xff\xff" + b"\x00" * 100, b"\x00\x05hello",
                     b"\x00\x10" + b"\xff" * 16):  # fmt: skip
            with socket.create_connection(address, timeout=5) as conn:
                conn.sendall(data)
                if data == b"\x00":
                    conn.shutdown(socket.SHUT_WR)
                assert closed_within(conn, 2) < 1.5
        lines = [x for x in proxy.decisions() if x["protocol"] == "dns" and x["host"] is None]
        reasons = [x["reason"] for x in lines]
        assert reasons.count("header_timeout") == 2
        assert reasons.count("dns_malformed") == 4  # FORMERR, EOF mid-message, 2 lengths
        assert reasons.count("dns_not_a_query") == 1
        assert all(x["client"].startswith(f"{LOOPBACK}:") for x in lines)
        assert "Traceback" not in proxy.stderr()


def read_after(conn: socket.socket, wire: bytes) -> dnsmessage.Message:
    conn.sendall(wire)
    return read_tcp_answer(conn)


def test_reload_swaps_policy_and_resolver_and_sigterm_stops(tmp_path: Path, dns: DNSServer) -> None:
    proxy = responder(tmp_path, dns)
    with proxy, running_dns_server() as second:
        port, port6 = dns_port(proxy), dns_port(proxy, "::1")
        assert addresses(ask(port, "ok.test")) == ["192.0.2.10", "192.0.2.11"]
        # SIGHUP with a narrowed ceiling and another nameserver: the next answers follow both.
        second.set("other.test", a=["192.0.2.31"])
        proxy.files.ceiling.write_text("egress: [other.test]\n")
        config = make_config(second, allow=ALLOW, extra=LIMITS)
        proxy.files.config.write_text(config)
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in proxy.stderr())
        assert rcode(ask(port, "ok.test")) == "REFUSED"
        assert rcode(ask(port6, "ok.test", "AAAA", host="::1", tcp=True)) == "REFUSED"
        assert addresses(ask(port, "other.test")) == ["192.0.2.31"]
        assert second.count("other.test", "A") == 1 and dns.count("other.test") == 0
        wait_for(lambda: any(x["reason"] == "outside_ceiling" for x in proxy.decisions()))
        # SIGTERM: exit 0, and nothing listens on the DNS ports any more.
        idle = socket.create_connection((LOOPBACK, port), timeout=5)
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait_exit() == 0
        assert idle.recv(1) == b""
        idle.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((LOOPBACK, port), timeout=5).close()
        assert raw_udp(port, dnsmessage.make_query("other.test", "A").to_wire(), wait=0.5) is None


def test_dns_listeners_on_port_0_each_get_one_port_for_udp_and_tcp(
    tmp_path: Path, dns: DNSServer
) -> None:
    args = ("--dns-listen", f"{LOOPBACK}:0", "--dns-listen", f"{LOOPBACK}:0")
    with responder(tmp_path, dns, *args) as proxy:
        ports = dns_ports(proxy)
        assert len(set(ports)) == 2
        for port in ports:
            assert addresses(ask(port, "other.test")) == ["192.0.2.30"]
            assert addresses(ask(port, "other.test", tcp=True)) == ["192.0.2.30"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("which", ["dns", "admin"])
def test_a_nameserver_that_is_our_own_listener_is_refused(tmp_path: Path, which: str) -> None:
    port = free_port()
    config = f"dns:\n  nameservers: ['{LOOPBACK}:{port}']\n  timeout: 1s\n"
    args = ["--dns-listen", f"{LOOPBACK}:{port if which == 'dns' else 0}"]
    admin = f"{LOOPBACK}:{port if which == 'admin' else 0}"
    proxy = RunningProxy(tmp_path, MANIFEST, config=config, args=args, admin=admin, wait=False)
    with proxy:
        assert proxy.wait_exit() == 2
    assert "is this proxy's own listener" in proxy.stderr()
    assert f"{LOOPBACK}:{port}" in proxy.stderr() and "Traceback" not in proxy.stderr()


def test_dns_listen_port_in_use_exits_2_naming_it(tmp_path: Path, dns: DNSServer) -> None:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as taken:
            taken.bind((LOOPBACK, 0))
            if kind == socket.SOCK_STREAM:
                taken.listen(1)
            port = taken.getsockname()[1]
            args = ("--dns-listen", f"{LOOPBACK}:{port}")
            proxy = RunningProxy(tmp_path / str(kind), MANIFEST, dns=dns, args=args, wait=False)
            with proxy:
                assert proxy.wait_exit() == 2
            assert f"cannot listen on dns://{LOOPBACK}:{port}" in proxy.stderr()
            assert "Traceback" not in proxy.stderr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dns-listen", "dns.example:53"], "not an IP address"),
        (["--dns-listen", "udp://127.0.0.1:53"], "write HOST:PORT"),
        (["--dns-listen", "127.0.0.1:70000"], "port '70000'"),
        (["--dns-listen", ":5353", "--listen", "127.0.0.1:5353"], "use the same address"),
        (["--dns-listen", "127.0.0.1:5353", "--dns-listen", ":5353"], "use the same address"),
    ],
)
def test_bad_dns_listen_exits_2_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "examples/agent.yaml", *argv])
    assert code == 2
    assert message in capsys.readouterr().err
