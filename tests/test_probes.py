"""proxy/boundary/probes/ against real sockets on loopback: a TCP server that answers as the
proxy (or not), a UDP echo server, the tests' DNS server, and the spec and command-line checks.
The probes in a real boundary (nftables, namespaces) are in tests/test_boundary.py."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dns_server import DNSServer
from support.running import tcp_server

from proxy.boundary.probes.dns_query import dns_refused
from proxy.boundary.probes.privileges import parse_user
from proxy.boundary.probes.runner import run_probes
from proxy.boundary.probes.spec import DnsProbe, ProbeSpec, TcpProbe, parse_spec
from proxy.boundary.probes.tcp import tcp_answered_by_proxy
from proxy.boundary.probes.udp import udp_blocked
from proxy.common.errors import ProxyError

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def tcp_answering(answer: bytes) -> Iterator[int]:
    """A loopback TCP server that reads a request head and sends `answer` to each connection."""

    def answer_head(conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        conn.sendall(answer)

    with tcp_server(answer_head, LOOPBACK) as port:
        yield port


@contextlib.contextmanager
def udp_echo() -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOOPBACK, 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            sock.sendto(data, peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


PROXY_ANSWER = (
    b"HTTP/1.1 403 Forbidden\r\nX-Egress-Denied: not_allowed\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


def test_tcp_probe_passes_only_when_the_proxy_answers() -> None:
    with tcp_answering(PROXY_ANSWER) as port:
        result = tcp_answered_by_proxy("t", LOOPBACK, port)
    assert result.passed, result.detail
    assert "X-Egress-Denied: not_allowed" in result.detail

    error = PROXY_ANSWER.replace(b"X-Egress-Denied", b"x-egress-error")  # any header case
    with tcp_answering(error) as port:
        assert tcp_answered_by_proxy("t", LOOPBACK, port).passed

    # A server that is not the proxy answered: a direct connection, the boundary failed.
    direct = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    with tcp_answering(direct) as port:
        result = tcp_answered_by_proxy("t", LOOPBACK, port)
    assert not result.passed
    assert "direct connection" in result.detail

    with tcp_answering(b"SSH-2.0-OpenSSH\r\n") as port:
        result = tcp_answered_by_proxy("t", LOOPBACK, port, timeout=1)
    assert not result.passed and "no HTTP answer" in result.detail

    # Nothing listening: the redirect is broken, which is not a pass.
    result = tcp_answered_by_proxy("t", LOOPBACK, closed_port())
    assert not result.passed and "refused" in result.detail


def test_udp_probe_sees_an_echo_and_its_absence() -> None:
    with udp_echo() as port:
        echoed = udp_blocked("u", LOOPBACK, port, expect="no_echo", timeout=2)
        sent = udp_blocked("u", LOOPBACK, port, expect="local_refusal")
    assert not echoed.passed and "got out" in echoed.detail
    # Without a drop rule nothing refuses the datagram locally.
    assert not sent.passed and "nothing refused" in sent.detail
    # An ICMP port unreachable coming back is an answer too: the datagram left.
    assert not udp_blocked("u", LOOPBACK, closed_port(), expect="no_echo", timeout=1).passed


def test_dns_probe_accepts_only_refusals(dns: DNSServer) -> None:
    host, port = dns.address
    dns.refused("refused.test")
    dns.nxdomain("missing.test")
    dns.set("leak.test", a=["192.0.2.7"])
    dns.set("empty.test")
    assert dns_refused("d", host, port, "refused.test").passed
    assert dns_refused("d", host, port, "missing.test").passed
    leak = dns_refused("d", host, port, "leak.test")
    assert not leak.passed and "192.0.2.7" in leak.detail
    assert not dns_refused("d", host, port, "empty.test").passed
    dns.blackhole("silent.test")
    silent = dns_refused("d", host, port, "silent.test", timeout=0.5)
    assert not silent.passed and "no DNS answer" in silent.detail


def test_run_probes_keeps_the_order_and_names() -> None:
    with tcp_answering(PROXY_ANSWER) as port:
        spec = ProbeSpec(
            tcp=(TcpProbe("first", LOOPBACK, port), TcpProbe("second", LOOPBACK, closed_port())),
            dns=(DnsProbe("third", LOOPBACK, closed_port(), "x.test"),),
            timeout=0.5,
        )
        results = run_probes(spec)
    assert [(r.name, r.passed) for r in results] == [
        ("first", True),
        ("second", False),
        ("third", False),
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], "must be a JSON object"),
        ({}, "lists no probes"),
        ({"tcp": []}, "lists no probes"),
        ({"tcpp": []}, "unknown key 'tcpp'"),
        ({"tcp": [{"name": "a", "address": "example.com", "port": 80}]}, "not an IP address"),
        ({"tcp": [{"name": "a", "address": "127.0.0.1", "port": 0}]}, "port number"),
        ({"tcp": [{"name": "a", "address": "127.0.0.1", "port": True}]}, "port number"),
        ({"tcp": [{"name": "a", "address": "127.0.0.1"}]}, "missing port"),
        ({"tcp": [{"name": "a", "address": "::1", "port": 1, "x": 1}]}, "unknown key 'x'"),
        (
            {"udp": [{"name": "a", "address": "::1", "port": 1, "expect": "maybe"}]},
            "local_refusal, no_echo",
        ),
        (
            {"dns": [{"name": "a", "server": "::1", "port": 53, "qname": "a..b"}]},
            "not a DNS name",
        ),
        (
            {"icmp": [{"name": "a", "address": "::1"}, {"name": "a", "address": "::1"}]},
            "used twice",
        ),
        ({"icmp": [{"name": "a", "address": "::1"}], "timeout": 0}, "timeout"),
        ({"icmp": [{"name": "\x1b[2J", "address": "::1"}]}, "printable"),
    ],
)
def test_bad_specs_are_refused_with_the_place(spec: object, message: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_spec(spec)
    assert caught.value.reason == "invalid_probe_spec"
    assert message in caught.value.message


def test_spec_round_trip() -> None:
    spec = parse_spec(
        {
            "tcp": [{"name": "t", "address": "0:0::1", "port": 80}],
            "udp": [{"name": "u", "address": "127.0.0.1", "port": 9, "expect": "no_echo"}],
            "icmp": [{"name": "i", "address": "127.0.0.1"}],
            "dns": [{"name": "d", "server": "127.0.0.1", "port": 53, "qname": "a.test"}],
            "timeout": 2,
        }
    )
    assert spec.tcp[0].address == "::1"  # canonical spelling
    assert spec.udp[0].expect == "no_echo"
    assert spec.icmp[0].expect == "local_refusal"  # the default
    assert spec.timeout == 2.0 and spec.count() == 4


@pytest.mark.parametrize(
    "text", ["0:0", "65534", "a:b", "1:", "4294967295:1", "-1:1", "²:1", "1:١", "1" * 5000 + ":1"]
)
def test_as_user_refuses_root_and_malformed(text: str) -> None:
    # '²' and '١' are digits to str.isdigit, not to int(); 5,000 digits are more than int()
    # reads from text: each is the usage error, never another exception.
    with pytest.raises(ProxyError) as caught:
        parse_user(text)
    assert caught.value.reason == "usage"


def probes_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.probes", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_cli_exit_codes_and_json() -> None:
    with tcp_answering(PROXY_ANSWER) as port:
        spec = {"tcp": [{"name": "t", "address": LOOPBACK, "port": port}]}
        held = probes_cli("--spec", json.dumps(spec))
    assert held.returncode == 0, held.stderr
    report = json.loads(held.stdout)
    assert report["passed"] is True
    assert [(r["name"], r["passed"]) for r in report["results"]] == [("t", True)]
    assert "answered by the proxy" in report["results"][0]["detail"]
    spec = {"tcp": [{"name": "t", "address": LOOPBACK, "port": closed_port()}]}
    broken = probes_cli("--spec", json.dumps(spec))
    assert broken.returncode == 1
    assert json.loads(broken.stdout)["passed"] is False

    for args in (
        ["--spec", "{"],
        ["--spec", "{}"],
        [],
        ["--spec", "{}", "--as-user", "0:0"],
        ["--spec", "{}", "--as-user", "²:1"],
    ):
        done = probes_cli(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        assert "Traceback" not in done.stderr
        assert done.stdout == ""
