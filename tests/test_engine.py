"""The interception engine (proxy/l7/) behind the front door, over real loopback sockets: curl and
Python's ssl as clients, TLS upstreams of the test's own (trustme), the test DNS server.

In process, as `egress-proxy run` wires it: a FrontDoor (plane l4) that decides, vets and
SNI-gates each CONNECT and hands the intercepted ones to the Engine (plane l7) through
`Door.intercept`. The operator config here says `inspection.mode: all`, so every allowed TLS
connection is intercepted, hosts without path rules included. What is checked is what a user
sees: statuses and headers, what reached the upstream, the audit lines and the metrics.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import ssl
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from support.dns_server import DNSServer
from support.hellos import python_hello
from support.in_process import (
    BODY,
    MANIFEST,
    PROXY_CA,
    UPSTREAM_BUNDLE,
    UPSTREAM_CA,
    ExplodingPolicy,
    Running,
    Upstream,
    blackholed,
    closed_by_peer,
    connect,
    curl,
    exchange,
    get,
    intercepted,
    serving,
    started,
    tls_serving,
)
from support.real_servers import free_port
from support.tls import tls_context

from policy import compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener
from proxy.common.refusals import DENIED_HEADER, ERROR_HEADER
from proxy.dataplane.frontdoor import FrontDoor
from proxy.decide.interception import Destination
from proxy.decide.planes import Update
from proxy.decide.vetting import Peer, Vetter
from proxy.l7.engine import Engine
from proxy.net.resolver import Resolver
from proxy.ops.audit import AuditLog

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("up.test", "tls.test", "other.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    async with started(dns) as running:
        yield running


# -- interception of every TLS connection (inspection.mode: all) ------------------------------


@pytest.mark.asyncio
async def test_a_host_without_path_rules_is_intercepted_under_mode_all(
    proxy: Running, resolved_by_os: list[str]
) -> None:
    async with tls_serving(Upstream()) as upstream:
        url = f"https://up.test:{upstream.port}/hello?x=1"
        status, _, body = await curl(proxy, url, "--cacert", PROXY_CA)
        assert (status, body) == (200, BODY)
        # The client saw the proxy's certificate: trusting only the upstream's CA fails (the
        # last status curl saw is its CONNECT's).
        status, _, body = await curl(proxy, url, "--cacert", str(UPSTREAM_BUNDLE))
        assert (status, body) == (200, b"")
    assert upstream.requests == [("GET /hello?x=1 HTTP/1.1", f"up.test:{upstream.port}")]
    assert proxy.dns.count("up.test", "A") == 1  # at the CONNECT; each request then cached
    assert resolved_by_os == []
    # One decision, one line: the tunnel's allow at its last stage (the SNI gate), the
    # request's at its own last one (the address stage); the client that distrusts our
    # certificate sends no request, so its tunnel has the gate's line alone.
    decisions = [x for x in proxy.lines() if x["event"] == "decision"]
    shapes = [(x["plane"], x["protocol"], x["stage"], x["decision"]) for x in decisions]
    assert shapes == [
        ("l4", "connect", "sni", "allow"),
        ("l7", "https", "address", "allow"),
        ("l4", "connect", "sni", "allow"),
    ]
    tunnel, request = decisions[:2]
    assert (tunnel["rule"], tunnel["sni"]) == ("network.egress[0]", "up.test")
    assert tunnel["resolved"] == tunnel["pinned"] == ["127.0.0.1"]
    assert request["path"] == "/hello?x=1" and request["method"] == "GET"
    assert request["rule"] == "network.egress[0]" and request["pinned"] == ["127.0.0.1"]
    # One connection id across both planes: the front door's.
    assert tunnel["connection"] == request["connection"] != decisions[2]["connection"]
    close, distrusted = await proxy.wait_closes(2)
    assert distrusted["reason"] == "client_tls_failed"
    assert (close["plane"], close["protocol"], close["host"]) == ("l7", "connect", "up.test")
    assert close["upstream"] == f"127.0.0.1:{upstream.port}" and close["sni"] == "up.test"
    assert close["pinned"] == ["127.0.0.1"] and close["reason"] == "closed"
    assert close["bytes_up"] > 500 and close["bytes_down"] > 500  # TLS records, both ways
    assert proxy.metric('egress_connections_total{plane="l7",protocol="connect"} 2.0')


@pytest.mark.asyncio
async def test_a_host_header_other_than_the_sni_is_refused(proxy: Running) -> None:
    # Domain fronting: the SNI (and the CONNECT) names one host, the request inside another.
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        other = f"other.test:{upstream.port}"
        mine = f"up.test:{upstream.port}"
        for request in (
            get(other),  # another host, allowed on its own
            get("up.test:1"),  # the right host, another port
            get(mine, f"https://{other}/"),  # absolute form: an origin prefers it to Host
            get(mine, "/", f"Host: {other}"),  # two Host headers
            b"GET / HTTP/1.1\r\n\r\n",  # none
        ):
            status, headers, body = await exchange(reader, writer, request)
            assert status == 403, request
            assert headers[DENIED_HEADER.lower()] == "host_mismatch"
            assert body.count(b"\n") == 1 and f"{mine} denied: host_mismatch".encode() in body
        # The connection stays usable for a request that names its host.
        assert (await exchange(reader, writer, get(mine)))[0] == 200
        writer.close()
    assert upstream.requests == [("GET / HTTP/1.1", mine)]
    refusals = [x for x in proxy.lines() if x.get("reason") == "host_mismatch"]
    assert len(refusals) == 5 and {x["stage"] for x in refusals} == {"host"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "headers",
    [
        ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"),
        ("Connection: Upgrade", "Upgrade: TLS/1.0"),
        ("Connection: Upgrade", "Upgrade: websocket, h2c"),
        ("Connection: Upgrade", "Upgrade: h2c"),
        ("HTTP2-Settings: AAMAAABkAAQAAP__",),
        ("Connection: Upgrade", "Upgrade: "),
    ],
    ids=["h2c", "tls", "websocket_and_h2c", "h2c_without_settings", "settings_alone", "empty"],
)
async def test_upgrades_other_than_websocket_are_refused_inside(
    proxy: Running, headers: tuple[str, ...]
) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        host = f"up.test:{upstream.port}"
        status, answer, body = await exchange(reader, writer, get(host, "/", *headers))
        assert status == 403
        assert answer[DENIED_HEADER.lower()] == "upgrade_refused"
        assert b"upgrade_refused" in body
        # Nothing reached the upstream; the next plain request does, without either header.
        assert upstream.connections == 0
        assert (await exchange(reader, writer, get(host)))[0] == 200
        writer.close()
    (head,) = upstream.heads
    assert "upgrade" not in head.lower() and "http2-settings" not in head.lower()
    refusal = next(x for x in proxy.lines() if x.get("reason") == "upgrade_refused")
    assert (refusal["plane"], refusal["stage"], refusal["method"]) == ("l7", "request", "GET")


@pytest.mark.asyncio
async def test_a_101_the_request_did_not_ask_for_never_reaches_the_client(
    proxy: Running,
) -> None:
    switching = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    async with tls_serving(Upstream(answer=switching)) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        writer.write(get(f"up.test:{upstream.port}"))
        await writer.drain()
        assert await closed_by_peer(reader)  # closed, no 101 and nothing after it
        writer.close()
    refusal = next(x for x in proxy.lines() if x.get("reason") == "upgrade_refused")
    assert "h2c" in refusal["message"]


@pytest.mark.asyncio
async def test_an_http2_client_reaches_an_http1_upstream(proxy: Running) -> None:
    # ALPN h2 to the client; this upstream offers no ALPN, so it is spoken HTTP/1.1 to, with
    # the request's :authority as its Host (more: tests/test_h2_interception.py).
    async with tls_serving(Upstream()) as upstream:
        status, _, body = await curl(
            proxy, f"https://up.test:{upstream.port}/", "--http2", "--cacert", PROXY_CA
        )
    assert (status, body) == (200, BODY)
    assert upstream.requests == [("GET / HTTP/1.1", f"up.test:{upstream.port}")]


# -- upstream errors, fallback, pinning ------------------------------------------------------


@pytest.mark.asyncio
async def test_upstream_refused_is_502(proxy: Running) -> None:
    port = free_port()
    status, headers, body = await curl(proxy, f"https://up.test:{port}/", "--cacert", PROXY_CA)
    assert status == 502
    assert headers[ERROR_HEADER.lower()] == "upstream_refused"
    assert body.count(b"\n") == 1 and b"upstream_refused" in body and b"up.test" in body
    error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
    assert (error["reason"], error["host"], error["port"]) == ("upstream_refused", "up.test", port)
    assert (error["plane"], error["decision"]) == ("l7", "deny")
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0')


@pytest.mark.asyncio
async def test_upstream_connect_timeout_is_504(dns: DNSServer) -> None:
    async with started(dns, "limits:\n  connect_timeout: 1s\n") as proxy:
        with blackholed() as port:
            loop = asyncio.get_running_loop()
            started_at = loop.time()
            status, headers, body = await curl(
                proxy, f"https://up.test:{port}/", "--cacert", PROXY_CA
            )
            elapsed = loop.time() - started_at
        assert status == 504, body
        assert headers[ERROR_HEADER.lower()] == "upstream_timeout"
        assert 0.9 <= elapsed < 4
        error = next(x for x in proxy.lines() if x.get("stage") == "upstream")
        assert error["reason"] == "upstream_timeout"


@pytest.mark.asyncio
async def test_fallback_to_the_next_checked_address(proxy: Running) -> None:
    proxy.dns.set("up.test", a=["127.0.0.9", "127.0.0.1"])
    # The order of the answer is the DNS server's; learn it through the proxy's own resolver
    # (its cache is the answer both planes check and use), then listen on the second.
    answer = await proxy.engine.vetter.resolver.resolve("up.test")
    first, second = answer.addresses
    async with serving(Upstream(), tls_context(UPSTREAM_CA, "up.test"), host=second) as upstream:
        url = f"https://up.test:{upstream.port}/"
        status, _, body = await curl(proxy, url, "--cacert", PROXY_CA)  # the first refuses
        assert (status, body) == (200, BODY)
        assert upstream.connections == 1
    assert proxy.dns.count("up.test", "A") == 1  # no fresh resolution for the fallback
    address = next(x for x in proxy.lines() if x.get("stage") == "address")
    assert address["pinned"] == [first, second]
    close = next(x for x in await proxy.wait_closes(1) if x["plane"] == "l7")
    assert close["upstream"] == f"{second}:{upstream.port}"
    assert not any(x.get("stage") == "upstream" for x in proxy.lines())  # no error: it worked
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="upstream_refused"} 1.0')
    assert proxy.metric('egress_upstream_connect_seconds_count{outcome="ok"} 1.0')


@pytest.mark.asyncio
async def test_a_changed_answer_within_the_ttl_still_goes_to_the_checked_address(
    proxy: Running,
) -> None:
    async with (
        tls_serving(Upstream()) as first,
        serving(Upstream(), tls_context(UPSTREAM_CA, "up.test"), "127.0.0.2", first.port) as second,
    ):
        proxy.dns.set("up.test", a=["127.0.0.1"], ttl=300)
        url = f"https://up.test:{first.port}/"
        assert (await curl(proxy, url, "--cacert", PROXY_CA))[0] == 200
        # The DNS server now answers the other address; within the TTL the checked answer
        # is used (a new connection, new decisions), and nothing reaches the second.
        proxy.dns.set("up.test", a=["127.0.0.2"], ttl=300)
        assert (await curl(proxy, url, "--cacert", PROXY_CA))[0] == 200
        assert first.connections == 2 and len(first.requests) == 2
        assert second.connections == 0
    assert proxy.dns.count("up.test", "A") == 1
    l7 = [x for x in await proxy.wait_closes(4) if x["plane"] == "l7"]
    assert [x["upstream"] for x in l7] == [f"127.0.0.1:{first.port}"] * 2
    assert all(x["pinned"] == ["127.0.0.1"] for x in proxy.lines() if x.get("stage") == "address")


@pytest.mark.asyncio
async def test_keep_alive_reuses_the_pinned_upstream_connection(proxy: Running) -> None:
    async with tls_serving(Upstream()) as upstream:
        url = f"https://up.test:{upstream.port}/"
        # HTTP/1.1 to the proxy as to this upstream: mitmproxy gives each HTTP/2 stream bound
        # for an HTTP/1.1 upstream a connection of its own (tests/test_h2_interception.py).
        status, _, body = await curl(proxy, url + "a", url + "b", "--cacert", PROXY_CA, "--http1.1")
        assert (status, body) == (200, BODY * 2)
    assert [r[0] for r in upstream.requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1"]
    assert upstream.connections == 1  # the upstream connection is reused, by name
    # Each request is still decided on its own: one allow line each.
    requests = [x for x in proxy.lines() if x.get("protocol") == "https"]
    assert [(x["path"], x["stage"], x["decision"]) for x in requests] == [
        ("/a", "address", "allow"),
        ("/b", "address", "allow"),
    ]


# -- reload, failing closed, timeouts ---------------------------------------------------------


@pytest.mark.asyncio
async def test_reload_closes_intercepted_connections_the_new_policy_denies(
    proxy: Running,
) -> None:
    async with tls_serving(Upstream()) as upstream:
        narrowed = await intercepted(proxy, "tls.test", upstream.port)
        kept = await intercepted(proxy, "up.test", upstream.port)
        for (reader, writer), host in ((narrowed, "tls.test"), (kept, "up.test")):
            assert (await exchange(reader, writer, get(f"{host}:{upstream.port}")))[0] == 200
        operator = proxy.engine.policy.operator
        policy = compile_policy(load_manifest("network:\n  egress: [up.test]\n"), None, operator)
        closed = proxy.reload(policy)
        assert len(closed) == 1
        assert await closed_by_peer(narrowed[0])
        # The allowed one stays open and keeps serving.
        assert (await exchange(*kept, get(f"up.test:{upstream.port}")))[0] == 200
        for _, writer in (narrowed, kept):
            writer.close()
    reasons = sorted((x["host"], x["reason"]) for x in await proxy.wait_closes(2))
    assert reasons == [("tls.test", "policy_reload"), ("up.test", "closed")]


@pytest.mark.asyncio
async def test_an_exception_in_a_hook_denies(proxy: Running) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        # The decision inside raises (the policy swapped under the engine, no reload).
        proxy.engine.vetter.policy = ExplodingPolicy()  # type: ignore[assignment]
        status, headers, _ = await exchange(reader, writer, get(f"up.test:{upstream.port}"))
        assert status == 403
        assert headers[DENIED_HEADER.lower()] == "internal_error"
        # A reload whose re-decision raises closes the connection (fail closed).
        exploding = Update(policy=ExplodingPolicy())  # type: ignore[arg-type]
        assert len(proxy.engine.configure(exploding)) == 1
        assert await closed_by_peer(reader)
        writer.close()
    assert upstream.connections == 0
    refusal = next(x for x in proxy.lines() if x.get("reason") == "internal_error")
    assert (refusal["plane"], refusal["stage"]) == ("l7", "engine")
    assert "requestheaders" in refusal["message"]
    (close,) = await proxy.wait_closes(1)
    assert close["reason"] == "policy_reload"


@pytest.mark.asyncio
async def test_a_silent_client_is_closed_after_the_header_timeout(dns: DNSServer) -> None:
    async with (
        tls_serving(Upstream()) as upstream,
        started(dns, "limits:\n  header_timeout: 1s\n") as proxy,
    ):
        # TLS completes, then no request head: closed, nothing dialled.
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        assert await closed_by_peer(reader)
        writer.close()
        assert upstream.connections == 0
        # A client that asks in time keeps its connection past the timeout.
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        for _ in range(2):
            assert (await exchange(reader, writer, get(f"up.test:{upstream.port}")))[0] == 200
            await asyncio.sleep(1.3)
        writer.close()
    timeouts = [x for x in proxy.lines() if x["reason"] == "header_timeout"]
    assert [(x["event"], x["plane"]) for x in timeouts] == [("decision", "l7"), ("close", "l7")]


@pytest.mark.asyncio
async def test_a_refused_request_with_a_large_body_closes_and_sends_nothing(
    proxy: Running,
) -> None:
    async with tls_serving(Upstream()) as upstream:
        reader, writer = await intercepted(proxy, "up.test", upstream.port)
        # mitmproxy cannot answer a request whose body it streams: the refusal closes.
        head = (
            f"POST / HTTP/1.1\r\nHost: other.test:{upstream.port}\r\nContent-Length: 200000\r\n\r\n"
        )
        writer.write(head.encode() + b"x" * 200_000)
        await writer.drain()
        assert await closed_by_peer(reader)
        writer.close()
    assert upstream.connections == 0
    assert [x["reason"] for x in proxy.lines() if x.get("decision") == "deny"] == ["host_mismatch"]


# -- the hand-over itself ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_serves_a_socks5_hand_over(proxy: Running) -> None:
    """What the SOCKS5 listener does after its 0x00 reply and the SNI gate: Door.intercept with
    protocol socks5. Here the engine side directly: a real TLS client on a loopback socket."""
    async with tls_serving(Upstream()) as upstream:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        client_reader, client_writer = await asyncio.open_connection(*listener.getsockname()[:2])
        accepted, peer = await loop.sock_accept(listener)
        listener.close()
        handshake = loop.create_task(
            client_writer.start_tls(
                ssl.create_default_context(cafile=PROXY_CA), server_hostname="up.test"
            )
        )
        hello = await loop.sock_recv(accepted, 65536)  # the ClientHello, read first
        destination = Destination(
            host="up.test",
            port=upstream.port,
            sni="up.test",
            target=f"up.test:{upstream.port}",
            pinned=("127.0.0.1",),
            peer=Peer(peer[:2], "socks-1"),
            protocol="socks5",
        )
        served = loop.create_task(proxy.engine.intercept(accepted, hello, destination))
        await handshake
        status, _, body = await exchange(
            client_reader, client_writer, get(f"up.test:{upstream.port}")
        )
        assert (status, body) == (200, BODY)
        client_writer.close()
        await asyncio.wait_for(served, 5)
    (close,) = proxy.closes()
    assert (close["connection"], close["protocol"], close["plane"]) == ("socks-1", "socks5", "l7")
    # The request's one line (its allow, at the address stage) under the hand-over's id.
    decisions = [x for x in proxy.lines() if x["event"] == "decision"]
    assert [(x["protocol"], x["stage"], x["connection"]) for x in decisions] == [
        ("https", "address", "socks-1")
    ]


def test_server_connect_refuses_what_was_not_vetted() -> None:
    from mitmproxy.connection import Client, Server
    from mitmproxy.proxy.server_hooks import ServerConnectionHookData

    from proxy.l7.addons import Pinning
    from proxy.l7.state import Intercepted, Ledger

    ledger = Ledger()
    vetter = Vetter(ExplodingPolicy(), None, plane="l7")  # type: ignore[arg-type]
    pinning = Pinning(vetter, ledger, connect_timeout=1.0, metrics=None)
    client = Client(peername=("127.0.0.1", 5000), sockname=("127.0.0.1", 3128))
    destination = Destination("up.test", 443, "up.test", "up.test:443", (), Peer(None, "c"), "tls")

    class Transport:
        def abort(self) -> None:
            pass

    connection = Intercepted(destination, Transport())  # type: ignore[arg-type]
    ledger.add(client.id, connection)
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=client))
    assert server.error and "not_vetted" in server.error
    assert ledger.take_dial(server.id) is None
    # A decided request's checked addresses: allowed, and the name kept for the certificate.
    connection.vetted[("up.test", 443)] = ("192.0.2.7", "192.0.2.8")
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=client))
    assert not server.error and server.address == ("up.test", 443)
    dial = ledger.take_dial(server.id)
    assert dial is not None and dial.addresses == ("192.0.2.7", "192.0.2.8")
    # ...but only for that client connection: another one is not ours, and is refused.
    other = Client(peername=("127.0.0.1", 5001), sockname=("127.0.0.1", 3128))
    server = Server(address=("up.test", 443))
    pinning.server_connect(ServerConnectionHookData(server=server, client=other))
    assert server.error and "internal_error" in server.error
    assert ledger.take_dial(server.id) is None


@pytest.mark.asyncio
async def test_passthrough_stays_passthrough_under_mode_prefixes(dns: DNSServer) -> None:
    # The default mode: a host allowed whole is relayed, its own certificate to the client.
    async with (
        tls_serving(Upstream()) as upstream,
        started(dns, inspection="") as proxy,
    ):
        url = f"https://up.test:{upstream.port}/"
        status, _, body = await curl(proxy, url, "--cacert", str(UPSTREAM_BUNDLE))
        assert (status, body) == (200, BODY)
        assert proxy.engine.master is None  # never loaded
        (close,) = await proxy.wait_closes(1)
        assert close["plane"] == "l4"


@pytest.mark.asyncio
async def test_an_engine_that_cannot_load_refuses_the_connection(dns: DNSServer) -> None:
    # The engine is loaded on the first connection that needs it (a reload can bring the first
    # URL-prefix rule); if it cannot load, that connection is refused, nothing is relayed.
    config = load_config(
        f"dns:\n  nameservers: ['127.0.0.1:{dns.address[1]}']\n  timeout: 1s\n"
        "addresses:\n  allow: [127.0.0.0/8]\ninspection:\n  mode: all\n"
    )
    policy = compile_policy(load_manifest(MANIFEST), None, config.operator)
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="test-session")
    resolver = Resolver.from_config(config)

    async def broken() -> Engine:
        raise ProxyError("ca_error", "inspection CA in /nowhere: cannot create the directory")

    front = FrontDoor(Vetter(policy, resolver, None, audit, plane="l4"), config, None, audit,
                      engine=broken)  # fmt: skip
    async with tls_serving(Upstream(raw=True)) as upstream:
        (bound,) = await front.start([Listener("http", "127.0.0.1", 0)])
        try:
            status, _, reader, writer = await connect(bound, f"up.test:{upstream.port}")
            assert status == 200
            writer.write(python_hello("up.test"))
            await writer.drain()
            assert await closed_by_peer(reader)
            writer.close()
        finally:
            await front.drain(0)
        assert upstream.connections == 0
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    refusal = next(x for x in lines if x.get("reason") == "ca_error")
    assert (refusal["plane"], refusal["stage"], refusal["host"]) == ("l4", "engine", "up.test")
    (close,) = [x for x in lines if x["event"] == "close"]
    assert close["reason"] == "ca_error"


def test_a_hook_for_a_connection_never_handed_over_denies() -> None:
    # Every connection of this engine comes through Door.intercept; anything else is refused
    # (fail closed), with the hook's own answer.
    from mitmproxy.test import tflow

    from proxy.l7.addons import RequestGate
    from proxy.l7.state import Ledger

    gate = RequestGate(Vetter(ExplodingPolicy(), None, plane="l7"), Ledger())  # type: ignore[arg-type]
    flow = tflow.tflow()
    asyncio.run(gate.requestheaders(flow))
    assert flow.response is not None and flow.response.status_code == 403
    assert flow.response.headers[DENIED_HEADER] == "internal_error"
    assert b"proxy denied: internal_error" in (flow.response.content or b"")
