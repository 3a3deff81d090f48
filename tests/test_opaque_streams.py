"""Every TCP protocol through the explicit listeners (issue 18, docs/protocols.md): real clients
against real servers through `egress-proxy run`'s HTTP CONNECT and SOCKS5 listeners. OpenSSH's
`ssh` and `git clone ssh://` with a ProxyCommand (socat for CONNECT, OpenBSD netcat for
SOCKS5), psql, redis-cli and smtplib through a local forwarder that opens the tunnel (they have
no proxy support), and a server that speaks first. Then each refusal through each shape, with
what the client prints: a CONNECT refused at its head is a 403, SOCKS5 reply 2, an SSH stream
refused after its first bytes gets our SSH_MSG_DISCONNECT naming the reason, any other opaque
stream a reset.

The servers (tests/support/real_servers.py) listen on 127.0.0.1; the test DNS server answers
their names with it and the operator config allows loopback (`addresses.allow`). Three
proxies serve the module: `open_proxy` with the default opaque_ports (no `ports`: every port
but 80 and 443), `closed_proxy` with `opaque_ports: []`, `narrow_proxy` with `ports` listing
the servers' ports and `opaque_ports` only the banner server's. Each test finds its own audit
lines as those written after its start (tests run one after another and each waits for the
lines of its connections).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import smtplib
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import pytest
from support.dns_server import DNSServer, running_dns_server
from support.hellos import python_hello
from support.real_servers import (
    BANNER,
    GIT,
    NC_OPENBSD,
    REPO_README,
    SOCAT,
    BannerServer,
    PostgresServer,
    RedisServer,
    SMTPServer,
    SSHServer,
    banner_server,
    need,
    postgres,
    recv_until,
    redis,
    run_client,
    smtp_banner,
    sshd,
)
from support.running import HTTPUpstream, RunningProxy, http_upstream, tcp_server, wait_for
from support.tunnels import (
    Forwarder,
    Refused,
    connect_tunnel,
    direct,
    forwarding,
    nc_socks_proxy_command,
    socat_proxy_command,
    socks5_tunnel,
)

from proxy.cli import main

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

NAMES = ("git.test", "db.test", "cache.test", "mail.test", "banner.test", "tls.test", "web.test")
MANIFEST = "network:\n  egress: [" + ", ".join((*NAMES, "git443.test")) + "]\n"
SOCKS_LISTENER = re.compile(r" and socks5://127\.0\.0\.1:(\d+)")
DNS_LISTENER = re.compile(r" and dns://127\.0\.0\.1:(\d+)")
SHAPES = ("connect", "socks5")
HEADER_TIMEOUT = 2  # the closed proxy's: how long a silent client holds a tunnel


# -- the servers and the proxies ------------------------------------------------------------------


@dataclass
class World:
    ssh: SSHServer
    db: PostgresServer
    cache: RedisServer
    mail: SMTPServer
    banner: BannerServer
    web: HTTPUpstream
    silent: int  # a TCP server that reads and never writes (the TLS checks' upstream)
    received: bytearray  # what it read


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    need(SOCAT, "socat (ssh's ProxyCommand through CONNECT)")
    need(NC_OPENBSD, "OpenBSD netcat (netcat-openbsd: ssh's ProxyCommand through SOCKS5)")
    tmp = tmp_path_factory.mktemp("servers")
    received = bytearray()

    def keep(conn: socket.socket) -> None:
        conn.settimeout(10)
        while chunk := conn.recv(65536):
            received.extend(chunk)

    with contextlib.ExitStack() as stack:
        yield World(
            ssh=stack.enter_context(sshd(tmp)),
            db=stack.enter_context(postgres(tmp)),
            cache=stack.enter_context(redis(tmp)),
            mail=stack.enter_context(smtp_banner()),
            banner=stack.enter_context(banner_server()),
            web=stack.enter_context(http_upstream()),
            silent=stack.enter_context(tcp_server(keep)),
            received=received,
        )


@pytest.fixture(scope="module")
def names() -> Iterator[DNSServer]:
    with running_dns_server() as server:
        for name in NAMES:
            server.set(name, a=["127.0.0.1"])
        server.set("git443.test", a=["127.0.0.2"])
        yield server


@dataclass
class Proxy:
    """One `egress-proxy run` with an HTTP, a SOCKS5 and a DNS listener."""

    run: RunningProxy
    socks: int
    dns: int

    @property
    def port(self) -> int:
        return self.run.port

    def mark(self) -> int:
        return self.run.audit_count()

    def since(self, mark: int) -> list[dict[str, Any]]:
        return self.run.audit()[mark:]

    def show(self, mark: int) -> str:
        """The audit lines after `mark`, one JSON a line (for failure messages)."""
        return "\n".join(json.dumps(x) for x in self.since(mark))

    def line(self, mark: int, timeout: float = 10.0, **match: Any) -> dict[str, Any]:
        """The first audit line after `mark` with every key of `match` equal, once written."""
        found: list[dict[str, Any]] = []

        def written() -> bool:
            found[:] = [x for x in self.since(mark) if all(x.get(k) == v for k, v in match.items())]
            return bool(found)

        try:
            wait_for(written, timeout, what=f"an audit line with {match}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the lines since:\n{self.show(mark)}") from None
        return found[0]

    def close(self, mark: int, **match: Any) -> dict[str, Any]:
        return self.line(mark, event="close", **match)

    def denial(self, mark: int, **match: Any) -> dict[str, Any]:
        return self.line(mark, event="decision", decision="deny", **match)

    def resolve(self, name: str) -> list[str]:
        """Ask the proxy's own DNS responder (what a client in a session does)."""
        response = dns.query.udp(dns.message.make_query(name, "A"), "127.0.0.1", 5, self.dns)
        return sorted(r.address for rrset in response.answer for r in rrset)

    def tunnel(self, shape: str, host: str, port: int) -> socket.socket:
        if shape == "connect":
            return connect_tunnel(self.port, host, port)
        return socks5_tunnel(self.socks, host, port)

    def proxy_command(self, shape: str) -> str:
        if shape == "connect":
            return socat_proxy_command(self.port)
        return nc_socks_proxy_command(self.socks)


@contextlib.contextmanager
def running(directory: Path, names: DNSServer, extra: str = "") -> Iterator[Proxy]:
    with RunningProxy(
        directory,
        MANIFEST,
        dns=names,
        config_extra=extra,
        args=("--listen", "socks5://127.0.0.1:0", "--dns-listen", "127.0.0.1:0"),
    ) as proxy:
        socks, dns_port = SOCKS_LISTENER.search(proxy.stderr()), DNS_LISTENER.search(proxy.stderr())
        assert socks and dns_port, proxy.stderr()
        yield Proxy(proxy, int(socks[1]), int(dns_port[1]))


@pytest.fixture(scope="module")
def open_proxy(
    tmp_path_factory: pytest.TempPathFactory, names: DNSServer, world: World
) -> Iterator[Proxy]:
    """The default: no `ports`, no `opaque_ports` (every port but 80 and 443 takes them)."""
    with running(tmp_path_factory.mktemp("open"), names) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def closed_proxy(
    tmp_path_factory: pytest.TempPathFactory, names: DNSServer, world: World
) -> Iterator[Proxy]:
    """`opaque_ports: []`: TLS and HTTP only, on every port."""
    extra = f"opaque_ports: []\nlimits:\n  header_timeout: {HEADER_TIMEOUT}s\n"
    with running(tmp_path_factory.mktemp("closed"), names, extra) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def narrow_proxy(
    tmp_path_factory: pytest.TempPathFactory, names: DNSServer, world: World
) -> Iterator[Proxy]:
    """The servers' ports allowed, opaque streams on the banner server's alone."""
    ports = [443, world.ssh.port, world.db.port, world.cache.port, world.banner.port]
    extra = f"ports: {ports}\nopaque_ports: [{world.banner.port}]\n"
    with running(tmp_path_factory.mktemp("narrow"), names, extra) as proxy:
        yield proxy


def assert_stream(line: dict[str, Any], host: str, protocol: str, attribution: str) -> None:
    got = {k: line.get(k) for k in ("host", "protocol", "attribution")}
    assert got == {"host": host, "protocol": protocol, "attribution": attribution}, line


def attribution_of(shape: str) -> str:
    return "connect" if shape == "connect" else "socks5"


# -- allowed: OpenSSH and git --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_ssh_runs_a_command_through_the_proxy(shape: str, open_proxy: Proxy, world: World) -> None:
    mark = open_proxy.mark()
    done = run_client(
        world.ssh.ssh("echo", "ok", host="git.test", proxy_command=open_proxy.proxy_command(shape))
    )
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    close = open_proxy.close(mark, host="git.test")
    assert_stream(close, "git.test", "ssh", attribution_of(shape))
    assert close["upstream"] == f"127.0.0.1:{world.ssh.port}"
    assert close["bytes_up"] > 0 and close["bytes_down"] > 0
    allowed = [x for x in open_proxy.since(mark) if x.get("decision") == "allow"]
    assert allowed and all(x["host"] == "git.test" for x in allowed)
    assert allowed[-1]["protocol"] == "ssh", allowed
    assert allowed[-1]["attribution"] == attribution_of(shape), allowed


@pytest.mark.parametrize("shape", SHAPES)
def test_git_clones_over_ssh_through_the_proxy(
    shape: str, open_proxy: Proxy, world: World, tmp_path: Path
) -> None:
    mark = open_proxy.mark()
    clone = tmp_path / "clone"
    env = world.ssh.git_env(open_proxy.proxy_command(shape))
    url = world.ssh.repo_url(host="git.test")
    done = run_client([GIT, "clone", "-q", url, str(clone)], env=env)
    assert done.returncode == 0, done.stderr
    assert (clone / "README").read_text() == REPO_README
    assert_stream(open_proxy.close(mark, host="git.test"), "git.test", "ssh", attribution_of(shape))


# -- allowed: databases, through a forwarder that opens the tunnel ---------------------------------


def opener(proxy: Proxy, shape: str, host: str, port: int) -> Callable[[], socket.socket]:
    return lambda: proxy.tunnel(shape, host, port)


@pytest.mark.parametrize("shape", SHAPES)
def test_psql_selects_through_the_proxy(shape: str, open_proxy: Proxy, world: World) -> None:
    mark = open_proxy.mark()
    with forwarding(opener(open_proxy, shape, "db.test", world.db.port)) as local:
        done = world.db.psql("select 40 + 2", port=local.port)
    assert (done.returncode, done.stdout.strip()) == (0, "42"), (done.stderr, local.refusals)
    close = open_proxy.close(mark, host="db.test")
    assert_stream(close, "db.test", "tcp", attribution_of(shape))
    assert close["upstream"] == f"127.0.0.1:{world.db.port}"


@pytest.mark.parametrize("shape", SHAPES)
def test_redis_cli_pings_through_the_proxy(shape: str, open_proxy: Proxy, world: World) -> None:
    mark = open_proxy.mark()
    with forwarding(opener(open_proxy, shape, "cache.test", world.cache.port)) as local:
        done = world.cache.cli("PING", port=local.port)
    assert (done.returncode, done.stdout.strip()) == (0, "PONG"), (done.stderr, local.refusals)
    assert_stream(
        open_proxy.close(mark, host="cache.test"), "cache.test", "tcp", attribution_of(shape)
    )


# -- allowed: servers that speak first ------------------------------------------------------------


class TunnelledSMTP(smtplib.SMTP):
    """smtplib.SMTP whose connection is a tunnel through the proxy."""

    def __init__(self, open_tunnel: Callable[[str, int], socket.socket], *args: Any) -> None:
        self.open_tunnel = open_tunnel
        super().__init__(*args, timeout=15)

    def _get_socket(self, host: str, port: int, timeout: float) -> socket.socket:
        sock = self.open_tunnel(host, port)
        sock.settimeout(timeout)
        return sock


def message() -> EmailMessage:
    mail = EmailMessage()
    mail["From"], mail["To"], mail["Subject"] = "agent@smtp.test", "you@smtp.test", "through"
    mail.set_content("sent through the proxy\n")
    return mail


@pytest.mark.parametrize("shape", SHAPES)
def test_smtplib_sends_through_the_proxy(shape: str, open_proxy: Proxy, world: World) -> None:
    mark = open_proxy.mark()
    before = len(world.mail.messages)

    def tunnel(host: str, port: int) -> socket.socket:
        return open_proxy.tunnel(shape, host, port)

    with TunnelledSMTP(tunnel, "mail.test", world.mail.port) as client:
        client.send_message(message())
    assert len(world.mail.messages) == before + 1
    assert world.mail.messages[-1]["to"] == ["you@smtp.test"]
    assert_stream(
        open_proxy.close(mark, host="mail.test"), "mail.test", "tcp", attribution_of(shape)
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_the_servers_banner_arrives_before_the_client_sends_a_byte(
    shape: str, open_proxy: Proxy, world: World
) -> None:
    mark = open_proxy.mark()
    with open_proxy.tunnel(shape, "banner.test", world.banner.port) as sock:
        assert recv_until(sock, b"\r\n", timeout=5) == BANNER  # nothing sent yet
        sock.sendall(b"echo me\n")
        assert recv_until(sock, b"echo me\n", timeout=5) == b"echo me\n"
    assert_stream(
        open_proxy.close(mark, host="banner.test"), "banner.test", "tcp", attribution_of(shape)
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_sshs_own_identification_arrives_before_the_client_speaks(
    shape: str, open_proxy: Proxy, world: World
) -> None:
    with open_proxy.tunnel(shape, "git.test", world.ssh.port) as sock:
        assert recv_until(sock, b"\r\n", timeout=5).startswith(b"SSH-2.0-OpenSSH")


# -- SOCKS5 with an address: attributed by the proxy's DNS answers ---------------------------------


def test_a_socks5_address_the_proxys_dns_answered_is_attributed_to_the_name(
    open_proxy: Proxy, world: World
) -> None:
    assert open_proxy.resolve("banner.test") == ["127.0.0.1"]
    mark = open_proxy.mark()
    with socks5_tunnel(open_proxy.socks, "127.0.0.1", world.banner.port) as sock:  # ATYP 1
        host, port = sock.getsockname()[:2]
        client = f"{host}:{port}"
        assert recv_until(sock, b"\r\n", timeout=5) == BANNER
        sock.sendall(b"x\n")
        assert recv_until(sock, b"x\n", timeout=5) == b"x\n"
    # This connection's line (a connection of an earlier test may close after the mark).
    close = open_proxy.close(mark, client=client)
    assert close["protocol"] == "tcp" and close["attribution"] == "dns", close
    # 127.0.0.1 was answered for every name of the module: each is a candidate.
    assert close["host"] in NAMES, close


def test_ssh_through_socks5_by_address_is_attributed_by_dns(
    open_proxy: Proxy, world: World
) -> None:
    assert open_proxy.resolve("git.test") == ["127.0.0.1"]
    mark = open_proxy.mark()
    # %h is the address: OpenBSD netcat sends it as ATYP 1.
    done = run_client(
        world.ssh.ssh("echo", "ok", host="127.0.0.1", proxy_command=nc_socks_proxy_command(
            open_proxy.socks
        ))
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    # The SSH connection's line (a connection of an earlier test may close after the mark).
    close = open_proxy.close(mark, protocol="ssh")
    assert close["protocol"] == "ssh" and close["attribution"] == "dns", close


def test_a_socks5_address_never_answered_is_reply_2(open_proxy: Proxy) -> None:
    mark = open_proxy.mark()
    with pytest.raises(Refused) as refused:
        socks5_tunnel(open_proxy.socks, "127.0.0.9", 2222)  # no name of ours answers it
    assert refused.value.status == 2
    denial = open_proxy.denial(mark)
    assert denial["reason"] in ("unattributed", "ip_literal"), denial


# -- the first bytes decide: TLS and HTTP inside a tunnel on an opaque port ------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_tls_with_another_sni_is_refused_on_an_opaque_port(
    shape: str, open_proxy: Proxy, world: World
) -> None:
    mark = open_proxy.mark()
    before = len(world.received)
    with open_proxy.tunnel(shape, "tls.test", world.silent) as sock:
        sock.sendall(python_hello("web.test"))  # allowed too, but not the tunnel's name
        sock.settimeout(5)
        with contextlib.suppress(ConnectionError):
            assert sock.recv(65536) == b""
    denial = open_proxy.denial(mark, host="tls.test")
    assert (denial["reason"], denial["sni"]) == ("sni_mismatch", "web.test"), denial
    assert len(world.received) == before  # the hello never left


def test_http_inside_a_connect_tunnel_must_name_the_tunnels_host(
    open_proxy: Proxy, world: World
) -> None:
    port = world.web.port
    mark = open_proxy.mark()
    with connect_tunnel(open_proxy.port, "web.test", port) as sock:
        sock.sendall(f"GET /inside HTTP/1.1\r\nHost: web.test:{port}\r\n\r\n".encode())
        answer = recv_until(sock, b"hello from upstream\n")
    assert answer.startswith(b"HTTP/1.1 200"), f"{answer!r}\n{open_proxy.show(mark)}"
    assert "/inside" in world.web.requests
    mark = open_proxy.mark()
    with connect_tunnel(open_proxy.port, "web.test", port) as sock:
        sock.sendall(f"GET /other HTTP/1.1\r\nHost: db.test:{port}\r\n\r\n".encode())
        answer = recv_until(sock, b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403"), answer
    assert b"host_mismatch" in answer.lower()
    assert open_proxy.denial(mark)["reason"] == "host_mismatch"
    assert "/other" not in world.web.requests


# -- refusals at the head: 403 and SOCKS5 reply 2, as the ProxyCommand helpers print them ----------


def test_ssh_to_a_name_not_allowed_prints_socats_403(open_proxy: Proxy, world: World) -> None:
    mark = open_proxy.mark()
    done = run_client(
        world.ssh.ssh("true", host="denied.test", proxy_command=socat_proxy_command(
            open_proxy.port
        ))
    )  # fmt: skip
    assert done.returncode == 255
    # socat prints the CONNECT response's reason phrase: "E CONNECT denied.test:PORT: Forbidden".
    assert f"CONNECT denied.test:{world.ssh.port}: Forbidden" in done.stderr, done.stderr
    assert open_proxy.denial(mark, host="denied.test")["reason"] == "not_allowed"


def test_ssh_to_a_name_not_allowed_through_socks5_is_reply_2(
    open_proxy: Proxy, world: World
) -> None:
    mark = open_proxy.mark()
    done = run_client(
        world.ssh.ssh("true", host="denied.test", proxy_command=nc_socks_proxy_command(
            open_proxy.socks
        ))
    )  # fmt: skip
    assert done.returncode == 255
    # OpenBSD netcat: "connection failed, SOCKSv5 error: connection not allowed by ruleset".
    assert "not allowed by ruleset" in done.stderr, done.stderr
    assert open_proxy.denial(mark, host="denied.test")["reason"] == "not_allowed"


@pytest.mark.parametrize("shape", SHAPES)
def test_psql_to_a_name_not_allowed_is_refused_at_the_head(
    shape: str, open_proxy: Proxy, world: World
) -> None:
    mark = open_proxy.mark()
    with forwarding(opener(open_proxy, shape, "denied.test", world.db.port)) as local:
        done = world.db.psql(port=local.port)
    assert done.returncode != 0
    (refusal,) = local.refusals
    assert isinstance(refusal, Refused)
    assert refusal.status == (403 if shape == "connect" else 2)
    assert open_proxy.denial(mark, host="denied.test")["reason"] == "not_allowed"


# -- refusals after the first bytes: SSH_MSG_DISCONNECT for OpenSSH, a reset for the rest ----------


@pytest.mark.parametrize("shape", SHAPES)
def test_ssh_where_opaque_streams_are_off_prints_the_reason(
    shape: str, closed_proxy: Proxy, world: World
) -> None:
    mark = closed_proxy.mark()
    done = run_client(
        world.ssh.ssh(
            "echo", "ok", host="git.test", proxy_command=closed_proxy.proxy_command(shape)
        )
    )
    assert done.returncode == 255 and done.stdout == ""
    assert "opaque_not_allowed" in done.stderr, done.stderr
    assert "Received disconnect" in done.stderr, done.stderr  # our SSH_MSG_DISCONNECT
    denial = closed_proxy.denial(mark, host="git.test")
    assert denial["reason"] == "opaque_not_allowed"
    assert_stream(denial, "git.test", "ssh", attribution_of(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_git_clone_where_opaque_streams_are_off_prints_the_reason(
    shape: str, closed_proxy: Proxy, world: World, tmp_path: Path
) -> None:
    env = world.ssh.git_env(closed_proxy.proxy_command(shape))
    url = world.ssh.repo_url(host="git.test")
    done = run_client([GIT, "clone", "-q", url, str(tmp_path / "clone")], env=env)
    assert done.returncode != 0
    assert "opaque_not_allowed" in done.stderr, done.stderr


@pytest.mark.parametrize("shape", SHAPES)
def test_ssh_on_an_allowed_port_that_is_not_opaque_prints_the_reason(
    shape: str, narrow_proxy: Proxy, world: World
) -> None:
    mark = narrow_proxy.mark()
    done = run_client(
        world.ssh.ssh(
            "echo", "ok", host="git.test", proxy_command=narrow_proxy.proxy_command(shape)
        )
    )
    assert done.returncode == 255
    assert "opaque_not_allowed" in done.stderr, done.stderr
    assert narrow_proxy.denial(mark, host="git.test")["reason"] == "opaque_not_allowed"


def test_the_narrow_proxy_still_relays_its_one_opaque_port(
    narrow_proxy: Proxy, world: World
) -> None:
    with narrow_proxy.tunnel("connect", "banner.test", world.banner.port) as sock:
        assert recv_until(sock, b"\r\n", timeout=5) == BANNER


def test_ssh_to_port_443_is_refused_by_default(open_proxy: Proxy, world: World) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to listen on port 443")
    relay = Forwarder(direct(world.ssh.host, world.ssh.port), "127.0.0.2", port=443)
    try:
        relay.start()
    except OSError as exc:
        relay.close()
        pytest.skip(f"cannot listen on 127.0.0.2:443: {exc}")
    try:
        mark = open_proxy.mark()
        done = run_client(
            world.ssh.ssh("echo", "ok", host="git443.test", port=443,
                          proxy_command=socat_proxy_command(open_proxy.port))
        )  # fmt: skip
    finally:
        relay.close()
    assert done.returncode == 255
    assert "opaque_not_allowed" in done.stderr, done.stderr
    assert open_proxy.denial(mark, host="git443.test")["reason"] == "opaque_not_allowed"


@pytest.mark.parametrize("shape", SHAPES)
def test_a_banner_is_not_relayed_where_the_stream_may_still_be_refused(
    shape: str, closed_proxy: Proxy, world: World
) -> None:
    mark = closed_proxy.mark()
    received = b""
    with closed_proxy.tunnel(shape, "banner.test", world.banner.port) as sock:
        sock.settimeout(1)
        with contextlib.suppress(TimeoutError):
            received = sock.recv(65536)
        assert received == b""  # the server's banner waits for the decision
        sock.settimeout(5)
        sock.sendall(b"hello\n")
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                received += chunk
    assert BANNER not in received and b"hello" not in received
    denial = closed_proxy.denial(mark, host="banner.test")
    assert denial["reason"] == "opaque_not_allowed"
    assert_stream(denial, "banner.test", "tcp", attribution_of(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_psql_where_opaque_streams_are_off_is_refused(
    shape: str, closed_proxy: Proxy, world: World
) -> None:
    mark = closed_proxy.mark()
    with forwarding(opener(closed_proxy, shape, "db.test", world.db.port)) as local:
        done = world.db.psql(port=local.port)
    assert done.returncode != 0
    assert "server closed the connection unexpectedly" in done.stderr, done.stderr
    denial = closed_proxy.denial(mark, host="db.test")
    assert denial["reason"] == "opaque_not_allowed"
    assert_stream(denial, "db.test", "tcp", attribution_of(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_redis_cli_where_opaque_streams_are_off_is_refused(
    shape: str, closed_proxy: Proxy, world: World
) -> None:
    mark = closed_proxy.mark()
    with forwarding(opener(closed_proxy, shape, "cache.test", world.cache.port)) as local:
        done = world.cache.cli("PING", port=local.port)
    assert "PONG" not in done.stdout
    assert closed_proxy.denial(mark, host="cache.test")["reason"] == "opaque_not_allowed"


@pytest.mark.parametrize("shape", SHAPES)
def test_smtp_where_opaque_streams_are_off_never_gets_the_banner(
    shape: str, closed_proxy: Proxy, world: World
) -> None:
    mark = closed_proxy.mark()

    def tunnel(host: str, port: int) -> socket.socket:
        return closed_proxy.tunnel(shape, host, port)

    with pytest.raises(smtplib.SMTPServerDisconnected):
        # The client waits for the 220, which waits for the client's first bytes (a refusal is
        # still possible on this port): nothing happens until the header timeout closes it.
        TunnelledSMTP(tunnel, "mail.test", world.mail.port)
    close = closed_proxy.close(mark, host="mail.test")
    assert (close["reason"], close["bytes_down"]) == ("header_timeout", 0), close


# -- explain ---------------------------------------------------------------------------------------


def explain(tmp_path: Path, config: str, *targets: str) -> dict[str, dict[str, Any]]:
    (tmp_path / "agent.yaml").write_text(MANIFEST)
    (tmp_path / "config.yaml").write_text(config)
    out, err = io.StringIO(), io.StringIO()
    code = main(
        ["explain", "--json", "--config", str(tmp_path / "config.yaml"),
         str(tmp_path / "agent.yaml"), *targets],
        out=out, err=err,
    )  # fmt: skip
    assert code == 0, err.getvalue()
    return {row["target"]: row for row in json.loads(out.getvalue())}


def test_explain_ssh_and_tcp_targets_with_the_default_opaque_ports(tmp_path: Path) -> None:
    rows = explain(
        tmp_path, "addresses:\n  allow: [127.0.0.0/8]\n",
        "ssh://git.test", "ssh://git.test:2222", "tcp://db.test:5432", "tcp://db.test:443",
        "ssh://git.test:80", "ssh://denied.test", "tcp://denied.test:5432",
    )  # fmt: skip
    for target in ("ssh://git.test", "ssh://git.test:2222", "tcp://db.test:5432"):
        assert rows[target]["allowed"] is True, rows[target]
    for target in ("tcp://db.test:443", "ssh://git.test:80"):
        assert rows[target]["allowed"] is False, rows[target]
        assert rows[target]["reason"] == "opaque_not_allowed", rows[target]
    for target in ("ssh://denied.test", "tcp://denied.test:5432"):
        assert rows[target]["allowed"] is False, rows[target]
        assert rows[target]["reason"] == "not_allowed", rows[target]


def test_explain_with_opaque_streams_off_and_a_port_list(tmp_path: Path) -> None:
    rows = explain(tmp_path, "opaque_ports: []\n", "ssh://git.test", "tcp://db.test:5432")
    assert {r["reason"] for r in rows.values()} == {"opaque_not_allowed"}, rows
    (tmp_path / "ports").mkdir()
    rows = explain(
        tmp_path / "ports",
        "ports: [22, 443, 5432]\nopaque_ports: [22]\n",
        "ssh://git.test", "tcp://db.test:5432", "tcp://db.test:6379",
    )  # fmt: skip
    assert rows["ssh://git.test"]["allowed"] is True, rows["ssh://git.test"]
    assert rows["tcp://db.test:5432"]["reason"] == "opaque_not_allowed"
    assert rows["tcp://db.test:6379"]["allowed"] is False  # `ports` refuses it first
    assert rows["tcp://db.test:6379"]["reason"] != "opaque_not_allowed"


# -- metrics, learning and suggest -------------------------------------------------------------


def test_opaque_streams_are_counted_by_protocol(open_proxy: Proxy, world: World) -> None:
    def count(protocol: str) -> float:
        text = open_proxy.run.metrics()
        key = f'egress_connections_total{{plane="l4",protocol="{protocol}"}} '
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))

    before = count("ssh")
    result = subprocess.run(
        world.ssh.ssh(
            "echo", "counted", host="git.test", proxy_command=open_proxy.proxy_command("connect")
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    wait_for(lambda: count("ssh") == before + 1, what="the ssh connection counted")


def test_learning_lets_an_undeclared_ssh_host_through_and_suggest_declares_it(
    tmp_path: Path, names: DNSServer, world: World
) -> None:
    manifest = "network:\n  egress: [web.test]\n"
    with RunningProxy(tmp_path / "learn", manifest, dns=names, args=("--learn",)) as proxy:
        command = world.ssh.ssh(
            "echo", "learned", host="git.test", proxy_command=socat_proxy_command(proxy.port)
        )
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "learned" in result.stdout, result.stderr
        wait_for(lambda: any(x["event"] == "close" for x in proxy.audit()), what="its close")
        (line,) = [x for x in proxy.decisions() if x["decision"] == "would_deny"]
        assert (line["host"], line["protocol"], line["stage"], line["reason"]) == (
            "git.test",
            "ssh",
            "stream",
            "not_allowed",
        )
        audit = tmp_path / "audit.jsonl"
        audit.write_text("".join(json.dumps(x) + "\n" for x in proxy.audit()))
    suggested = subprocess.run(
        [sys.executable, "-m", "proxy", "suggest", str(audit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert suggested.returncode == 0, suggested.stderr
    assert "git.test" in suggested.stdout
    (tmp_path / "agent.yaml").write_text(suggested.stdout)
    checked = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(tmp_path / "agent.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def answer_the_ask(proxy: RunningProxy, token: Path, decision: str) -> dict[str, Any]:
    """Waits for the one pending ask, answers it with the token as a harness would; the ask."""
    asks: list[dict[str, Any]] = []

    def asked() -> bool:
        asks[:] = json.loads(proxy.admin_get("/asks")[1])["asks"]
        return bool(asks)

    wait_for(asked, what="an ask")
    (ask,) = asks
    request = urllib.request.Request(
        f"http://127.0.0.1:{proxy.admin_port}/asks/{ask['id']}",
        data=json.dumps({"decision": decision}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token.read_text().strip()}"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    return ask


@pytest.mark.parametrize("client", ["ssh", "git"])
def test_a_person_allows_an_undeclared_ssh_host_and_the_stream_passes(
    client: str, tmp_path: Path, names: DNSServer, world: World
) -> None:
    """ssh, allowed once; git clone, allowed for the session: a second clone is not asked."""
    token = tmp_path / "ask-token"
    args = ("--ask", "--ask-token", str(token))
    with RunningProxy(tmp_path / "ask", "network:\n  egress: [web.test]\n", dns=names,
                      args=args) as proxy:  # fmt: skip
        proxy_command = socat_proxy_command(proxy.port)
        env = world.ssh.git_env(proxy_command)
        url = world.ssh.repo_url(host="git.test")

        def command(n: int) -> list[str]:
            if client == "ssh":
                return world.ssh.ssh("echo", "asked", host="git.test", proxy_command=proxy_command)
            return [GIT, "clone", "-q", url, str(tmp_path / f"clone{n}")]

        process = subprocess.Popen(
            command(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        try:
            answer = "allow-once" if client == "ssh" else "allow-session"
            ask = answer_the_ask(proxy, token, answer)
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
            process.wait()
        assert process.returncode == 0, err
        assert (ask["host"], ask["port"], ask["entry"]) == ("git.test", world.ssh.port,
                                                            "git.test")  # fmt: skip
        (stream,) = [x for x in proxy.decisions() if x.get("stage") == "stream"]
        assert (stream["decision"], stream["protocol"]) == ("allow", "ssh")
        if client == "ssh":
            assert b"asked" in out and stream["rule"] == f"ask:{ask['id']}"
            return
        assert (tmp_path / "clone1" / "README").read_text() == REPO_README
        again = run_client(command(2), env=env)  # the session's grant: nobody is asked
        assert again.returncode == 0, again.stderr
        grants = json.loads(proxy.admin_get("/grants")[1])["grants"]
        assert [(g["host"], g["decision"]) for g in grants] == [("git.test", "allow-session")]
