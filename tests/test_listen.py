"""Listener spellings (`--listen [SCHEME://]HOST:PORT`, `--dns-listen HOST:PORT`, `--mode
transparent` as sugar) and one `egress-proxy run` serving explicit and transparent listeners
side by side, on loopback. (The redirect itself needs root: tests/test_transparent.py.)"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from support.dns_server import DNSServer
from support.running import LOOPBACK, RunningProxy, curl, http_upstream, wait_for

from proxy.cli import main
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener, check_listeners, parse_dns_listener, parse_listener

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


def answer(conn: socket.socket) -> bytes:
    """What the proxy answered before it closed (a close with unread bytes is a reset)."""
    try:
        return conn.recv(4096)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize(
    ("text", "bare", "expected"),
    [
        ("transparent://10.0.0.1:15001", "http", Listener("transparent", "10.0.0.1", 15001)),
        ("TRANSPARENT://[::1]:15001", "http", Listener("transparent", "::1", 15001)),
        ("127.0.0.1:3128", "http", Listener("http", "127.0.0.1", 3128)),
        # `--mode transparent`: only a listener without a scheme becomes transparent.
        ("127.0.0.1:15001", "transparent", Listener("transparent", "127.0.0.1", 15001)),
        ("http://127.0.0.1:3128", "transparent", Listener("http", "127.0.0.1", 3128)),
        ("socks5://[::1]:1080", "transparent", Listener("socks5", "::1", 1080)),
    ],
)
def test_listeners_parse_with_their_scheme(text: str, bare: str, expected: Listener) -> None:
    assert parse_listener(text, bare=bare) == expected


def test_listeners_print_with_their_scheme() -> None:
    assert str(parse_listener("transparent://[::1]:0")) == "transparent://[::1]:0"
    assert str(parse_dns_listener("[::1]:53")) == "dns://[::1]:53"
    assert parse_dns_listener("localhost:5353") == Listener("dns", "127.0.0.1", 5353)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dns://127.0.0.1:53", "scheme 'dns' is not one of http://, socks5://, transparent://"),
        ("tproxy://127.0.0.1:1", "scheme 'tproxy' is not one of"),
        ("transparent://example.com:1", "not an IP address"),
        ("transparent://127.0.0.1", "expected HOST:PORT"),
    ],
)
def test_bad_listeners_are_refused(text: str, message: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_listener(text)
    assert caught.value.reason == "invalid_listen" and message in caught.value.message


@pytest.mark.parametrize(
    ("listeners", "clash"),
    [
        # A DNS listener binds TCP on its port too.
        (["http://127.0.0.1:53", "dns:127.0.0.1:53"], True),
        (["transparent://[::1]:15001", "dns:[::1]:15001"], True),
        (["transparent://127.0.0.1:15001", "http://127.0.0.1:15001"], True),
        (["transparent://127.0.0.1:15001", "transparent://[::1]:15001"], False),
        # Port 0: a free port each (a DNS listener one free for UDP and TCP both).
        (["http://127.0.0.1:0", "transparent://127.0.0.1:0", "dns:127.0.0.1:0"], False),
        (["dns:127.0.0.1:0", "dns:127.0.0.1:0", "http://127.0.0.1:0"], False),
        (["http://127.0.0.1:0", "socks5://127.0.0.1:0"], False),
        (["dns:127.0.0.1:0", "dns:[::1]:0"], False),
        (["dns:127.0.0.1:5353", "dns:127.0.0.1:5353"], True),
    ],
)
def test_listeners_that_would_clash_are_refused(listeners: list[str], clash: bool) -> None:
    parsed = [
        parse_dns_listener(x[4:]) if x.startswith("dns:") else parse_listener(x) for x in listeners
    ]
    if clash:
        with pytest.raises(ProxyError, match="use the same address"):
            check_listeners(parsed)
    else:
        check_listeners(parsed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # The engine serves only what the front door hands it: no option runs it alone.
        (["--engine-only"], "unrecognized arguments: --engine-only"),
        (["--listen", ":4129", "--listen", "transparent://127.0.0.1:4129"], "same address"),
    ],
)
def test_run_refuses_listener_combinations_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "examples/agent.yaml", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_one_process_serves_explicit_and_transparent_listeners(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("up.test", a=["127.0.0.1"])
    args = ("--listen", f"transparent://{LOOPBACK}:0", "--listen", "transparent://[::1]:0")
    with (
        http_upstream() as upstream,
        RunningProxy(tmp_path, "network:\n  egress: [up.test]\n", dns=dns, args=args) as proxy,
    ):
        stderr = proxy.stderr()
        v4 = re.search(
            r" and transparent://127\.0\.0\.1:(\d+) and transparent://\[::1\]:(\d+) ", stderr
        )
        assert v4, stderr
        transparent = [(LOOPBACK, int(v4[1])), ("::1", int(v4[2]))]
        # The explicit listener: an HTTP proxy as always.
        assert curl(proxy.port, f"http://up.test:{upstream.port}/").status == 200
        # The transparent ones take only redirected connections: one that reached the port
        # directly (v4 or v6) has no original destination and is closed unanswered.
        for address in transparent:
            with socket.create_connection(address, timeout=5) as conn:
                conn.sendall(b"GET / HTTP/1.1\r\nHost: up.test\r\n\r\n")
                assert answer(conn) == b""
        wait_for(
            lambda: sum(x["reason"] == "no_original_destination" for x in proxy.decisions()) == 2
        )
        assert upstream.connections == 1
        assert proxy.admin_get("/readyz")[0] == 200
