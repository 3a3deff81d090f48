"""WebSocket through the proxy: an upgrade follows the rules of the request that opens it.

The proxy runs in-process on loopback against the test DNS server (tests/support/in_process.py's
harness: the front door, and the interception engine behind it); the upstream is a wsproto echo
server of the tests' own and the client is wsproto over a raw connection to the proxy: ws://
as a client of an explicit HTTP proxy sends it (absolute form), and wss:// inside an intercepted
CONNECT tunnel, where the engine decides the upgrade and then relays the bytes keeping none."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
import tracemalloc
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from mitmproxy import tcp
from mitmproxy.tcp import TCPMessage
from mitmproxy.websocket import WebSocketMessage
from support.dns_server import DNSServer
from support.in_process import PROXY_CA, UPSTREAM_CA, Running, started
from support.ws_server import EchoServer, WSClient, serving_echo
from wsproto.events import BytesMessage, Ping, Pong, TextMessage

from policy import compile_policy, load_manifest
from proxy.common.refusals import DENIED_HEADER

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [ws.test, private.test]\n"


@pytest_asyncio.fixture
async def proxy(dns: DNSServer) -> AsyncIterator[Running]:
    async with started(dns, manifest=MANIFEST) as running:
        yield running


@pytest_asyncio.fixture
async def echo() -> AsyncIterator[EchoServer]:
    async with serving_echo() as server:
        yield server


def decisions(proxy: Running) -> list[dict]:
    return [x for x in proxy.lines() if x["event"] == "decision"]


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(250):  # 5 s
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- allowed ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_allowed_upgrade_relays_messages_both_ways_and_closes(
    proxy: Running, echo: EchoServer
) -> None:
    proxy.dns.set("ws.test", a=["127.0.0.1"])
    authority = f"ws.test:{echo.port}"
    client, answer = await WSClient.through_proxy(proxy.port, authority, "/chat")
    # 101 (wsproto also checked Sec-WebSocket-Accept), and the upstream saw the name, not the
    # pinned address, in Host, and the request in origin form.
    assert answer.status == 101, answer
    assert answer.status_line.startswith(b"HTTP/1.1 101")
    assert [(h.host, h.target) for h in echo.handshakes] == [(authority, "/chat")]

    await client.send(TextMessage("hello, wörld ✓"))
    assert await client.message() == "hello, wörld ✓"
    binary = bytes(range(256)) * 4
    await client.send(BytesMessage(binary))
    assert await client.message() == binary
    # A message in three fragments arrives whole, as text; a large one too.
    await client.send(TextMessage("one ", message_finished=False))
    await client.send(TextMessage("two ", message_finished=False))
    await client.send(TextMessage("three", message_finished=True))
    assert await client.message() == "one two three"
    large = b"\x00\xff" * 100_000
    await client.send(BytesMessage(large))
    assert await client.message() == large
    await client.send(Ping(b"are you there"))
    pong = await client.event()
    assert isinstance(pong, Pong) and pong.payload == b"are you there"
    assert echo.messages == 4

    # The close handshake goes through both ways, then the proxy closes the connection.
    assert await client.close(1000, "bye") == 1000
    assert echo.close_codes == [1000]
    assert echo.connections == 1
    assert proxy.dns.count("ws.test", "A") == 1


# -- denied upgrades -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_upgrade_to_an_undeclared_name_is_403_and_never_resolved(
    proxy: Running, echo: EchoServer
) -> None:
    proxy.dns.set("denied.test", a=["127.0.0.1"])
    client, answer = await WSClient.through_proxy(proxy.port, f"denied.test:{echo.port}", "/chat")
    client.abort()
    assert answer.status == 403
    assert answer.headers[DENIED_HEADER.lower()] == "not_allowed"
    assert answer.body.count(b"\n") == 1 and f"denied.test:{echo.port}".encode() in answer.body
    assert echo.connections == 0 and echo.handshakes == []
    assert proxy.dns.queries == []
    (line,) = decisions(proxy)
    assert (line["decision"], line["reason"], line["stage"]) == ("deny", "not_allowed", "name")
    assert (line["method"], line["path"]) == ("GET", "/chat")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "host",
    [
        pytest.param("private.test:{port}", id="another-allowed-name"),
        pytest.param("evil.test:{port}", id="undeclared-name"),
        pytest.param("ws.test", id="default-port"),  # port 80, not the request line's
        pytest.param("ws.test:{port}, evil.test", id="list"),
    ],
)
async def test_upgrade_with_a_mismatched_host_header_is_403(
    proxy: Running, echo: EchoServer, host: str
) -> None:
    proxy.dns.set("ws.test", a=["127.0.0.1"])
    client, answer = await WSClient.through_proxy(
        proxy.port, f"ws.test:{echo.port}", "/chat", host=host.format(port=echo.port)
    )
    client.abort()
    assert answer.status == 403
    assert answer.headers[DENIED_HEADER.lower()] == "host_mismatch"
    assert echo.connections == 0
    assert proxy.dns.queries == []  # refused before the name stage
    (line,) = decisions(proxy)
    assert (line["stage"], line["reason"], line["path"]) == ("host", "host_mismatch", "/chat")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer_a", "reason"),
    [(["10.0.0.1"], "private"), (["127.0.0.1", "10.0.0.1"], "mixed_answer")],
)
async def test_upgrade_to_a_name_with_a_private_answer_is_403(
    proxy: Running, echo: EchoServer, answer_a: list[str], reason: str
) -> None:
    proxy.dns.set("private.test", a=answer_a)
    client, answer = await WSClient.through_proxy(proxy.port, f"private.test:{echo.port}", "/")
    client.abort()
    assert answer.status == 403
    assert answer.headers[DENIED_HEADER.lower()] == reason
    assert echo.connections == 0
    address = next(x for x in decisions(proxy) if x["stage"] == "address")
    assert (address["decision"], sorted(address["resolved"]), address["pinned"]) == (
        "deny",
        sorted(answer_a),
        [],
    )


# -- URL-prefix rules (agent.toml) -----------------------------------------------------------


@pytest.mark.asyncio
async def test_path_rules_decide_the_upgrade(dns: DNSServer, echo: EchoServer) -> None:
    # A URL-prefix rule with a port matches that port only, so the pattern names the echo's.
    manifest = f'[network_access]\nallowed = ["http://ws.test:{echo.port}/chat"]\n'
    async with started(dns, manifest=manifest, source="agent.toml") as proxy:
        proxy.dns.set("ws.test", a=["127.0.0.1"])
        authority = f"ws.test:{echo.port}"
        for path in ("/admin", "/chat/../admin", "/chatroom"):
            client, answer = await WSClient.through_proxy(proxy.port, authority, path)
            client.abort()
            assert (answer.status, answer.headers.get(DENIED_HEADER.lower())) == (
                403,
                "path_not_allowed",
            ), path
        assert echo.connections == 0
        assert proxy.dns.queries == []

        client, answer = await WSClient.through_proxy(proxy.port, authority, "/chat/room?x=1")
        assert answer.status == 101, answer
        await client.send(TextMessage("in the room"))
        assert await client.message() == "in the room"
        assert await client.close() == 1000
        assert [h.target for h in echo.handshakes] == ["/chat/room?x=1"]
        allowed = [x for x in decisions(proxy) if x["decision"] == "allow"]
        # One decision, one line: the allow is written at its last stage, naming the rule.
        assert [(x["stage"], x["rule"]) for x in allowed] == [
            ("address", "network_access.allowed[0]"),
        ]


def wss_tls() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    UPSTREAM_CA.issue_cert("wss.test", "gone.test").configure_cert(context)
    return context


def trusting_the_proxy() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=PROXY_CA)


@contextlib.asynccontextmanager
async def wss(
    dns: DNSServer, manifest: str = "network:\n  egress: [wss.test, gone.test]\n", **kw: str
) -> AsyncIterator[tuple[Running, EchoServer]]:
    """A wss echo server and the proxy intercepting its tunnels (inspection.mode: all unless
    the manifest's path rules make it needless)."""
    dns.set("wss.test", a=["127.0.0.1"])
    dns.set("gone.test", a=["127.0.0.1"])
    async with (
        serving_echo(tls=wss_tls()) as echo,
        started(dns, manifest=manifest.format(port=echo.port), **kw) as proxy,
    ):
        yield proxy, echo


@pytest.mark.asyncio
async def test_wss_upgrades_inside_interception_are_decided_by_path(dns: DNSServer) -> None:
    # An https:// prefix rule makes the proxy intercept the tunnel and decide each request in
    # it, the upgrade included; the upstream's certificate comes from a test CA it trusts.
    manifest = '[network_access]\nallowed = ["https://wss.test:{port}/chat"]\n'
    async with wss(dns, manifest, source="agent.toml", inspection="") as (proxy, echo):
        client, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", echo.port, "/admin", trusting_the_proxy()
        )
        client.abort()
        assert (answer.status, answer.headers.get(DENIED_HEADER.lower())) == (
            403,
            "path_not_allowed",
        )
        assert echo.handshakes == []

        client, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", echo.port, "/chat", trusting_the_proxy()
        )
        assert answer.status == 101, answer
        await client.send(TextMessage("over wss"))
        assert await client.message() == "over wss"
        assert await client.close() == 1000
        assert [(h.host, h.target) for h in echo.handshakes] == [(f"wss.test:{echo.port}", "/chat")]
        # One line per request: the denial at the name stage (its path), the allow at the last.
        inside = [
            (x["stage"], x["decision"], x["reason"], x["method"], x["path"])
            for x in decisions(proxy)
            if x["protocol"] == "https"
        ]
        assert inside == [
            ("name", "deny", "path_not_allowed", "GET", "/admin"),
            ("address", "allow", "allowed", "GET", "/chat"),
        ]


@pytest.mark.asyncio
async def test_a_wss_close_line_says_wss_and_counts_its_bytes(dns: DNSServer) -> None:
    async with wss(dns) as (proxy, echo):
        client, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", echo.port, "/chat", trusting_the_proxy()
        )
        assert answer.status == 101, answer
        await fifty_kilobytes_each_way_then_close(client, proxy)
    (close,) = [x for x in proxy.lines() if x["event"] == "close"]
    assert (close["plane"], close["protocol"], close["host"]) == ("l7", "wss", "wss.test")
    assert close["upstream"] == f"127.0.0.1:{echo.port}"
    # 50 KB each way, in TLS records, plus the handshakes.
    assert 50_000 < close["bytes_up"] < 60_000
    assert 50_000 < close["bytes_down"] < 60_000


@pytest.mark.asyncio
async def test_reload_closes_a_live_wss_whose_path_the_new_policy_denies(dns: DNSServer) -> None:
    # The upgrade's own URL is decided again: the host is still allowed, its path no longer.
    manifest = '[network_access]\nallowed = ["https://wss.test:{port}/chat", "gone.test"]\n'
    async with wss(dns, manifest, source="agent.toml") as (proxy, echo):
        dropped, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", echo.port, "/chat", trusting_the_proxy()
        )
        assert answer.status == 101
        kept, answer = await WSClient.through_tunnel(
            proxy.port, "gone.test", echo.port, "/", trusting_the_proxy()
        )
        assert answer.status == 101
        operator = proxy.engine.policy.operator
        narrower = compile_policy(
            load_manifest(
                "[network_access]\n"
                f'allowed = ["https://wss.test:{echo.port}/other", "gone.test"]\n',
                source="agent.toml",
            ),
            None,
            operator,
        )
        assert len(proxy.reload(narrower)) == 1
        await closed_but_the_other_serves(dropped, kept)
        closes = lambda: [x for x in proxy.lines() if x["event"] == "close"]  # noqa: E731
        await eventually(lambda: len(closes()) == 2, "two close lines")
    assert sorted((x["host"], x["reason"]) for x in closes()) == [
        ("gone.test", "closed"),
        ("wss.test", "policy_reload"),
    ]


# -- memory ----------------------------------------------------------------------------------


async def held_for_an_unfinished_message(client: WSClient, sink: EchoServer) -> int:
    """Bytes of memory the process holds after `client` sent one 32 MiB message whose end never
    comes, to a `sink` that discards what it gets; the client is aborted after."""
    chunk, total = b"z" * 65536, 32 * 2**20
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(ConnectionError):  # closing such a client is a fix too
            for _ in range(total // len(chunk)):
                await client.send(BytesMessage(chunk, message_finished=False))
        for _ in range(100):  # until the proxy has read it all (relayed or held)
            held = tracemalloc.get_traced_memory()[0] - baseline
            if sink.received >= total or held >= total or client.reader.at_eof():
                break
            await asyncio.sleep(0.02)
        return tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
        client.abort()


class FlowRecorder:
    """A test addon, added after the engine's: it keeps the flows of upgraded connections
    (relayed as bytes after the 101) and counts their message hooks, so the test can look at
    what mitmproxy holds for them."""

    name = "test-flow-recorder"

    def __init__(self) -> None:
        self.flows: list[tcp.TCPFlow] = []
        self.hooks = 0
        self.most_held = 0  # the longest messages list seen at a message hook

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        self.flows.append(flow)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        self.hooks += 1
        self.most_held = max(self.most_held, len(flow.messages))


def live_messages() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, (TCPMessage, WebSocketMessage)))


@pytest.mark.asyncio
async def test_a_long_lived_wss_keeps_no_messages(dns: DNSServer) -> None:
    async with wss(dns) as (proxy, echo):
        recorder = FlowRecorder()
        assert proxy.engine.master is not None
        proxy.engine.master.addons.add(recorder)
        client, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", echo.port, "/chat", trusting_the_proxy()
        )
        assert answer.status == 101, answer
        before = live_messages()
        batches, batch = 20, 50  # 1,000 messages up and 1,000 echoed down
        payload = b"m" * 512
        for n in range(batches):
            for i in range(batch):
                await client.send(BytesMessage(payload + b"%d.%d" % (n, i)))
            for i in range(batch):
                assert await client.message() == payload + b"%d.%d" % (n, i)
        assert echo.messages == batches * batch
        # The socket is still open: mitmproxy's flow for it holds no message, nothing else does.
        (flow,) = recorder.flows
        assert flow.live
        assert recorder.hooks >= 2 * batches  # at least one chunk per batch each way
        assert len(flow.messages) == 0
        assert recorder.most_held == 0
        assert live_messages() - before < 10
        assert await client.close() == 1000


@pytest.mark.asyncio
async def test_an_unfinished_wss_message_is_not_held_without_bound(dns: DNSServer) -> None:
    dns.set("wss.test", a=["127.0.0.1"])
    manifest = "network:\n  egress: [wss.test]\n"
    async with (
        serving_echo(discard=True, tls=wss_tls()) as sink,
        started(dns, manifest=manifest) as proxy,
    ):
        client, answer = await WSClient.through_tunnel(
            proxy.port, "wss.test", sink.port, "/", trusting_the_proxy()
        )
        assert answer.status == 101, answer
        held = await held_for_an_unfinished_message(client, sink)
        assert held < 8 * 2**20, f"{held / 2**20:.1f} MiB held for an unfinished message"


@pytest.mark.asyncio
async def test_an_unfinished_message_is_not_held_without_bound(proxy: Running) -> None:
    async with serving_echo(discard=True) as sink:
        proxy.dns.set("ws.test", a=["127.0.0.1"])
        client, answer = await WSClient.through_proxy(proxy.port, f"ws.test:{sink.port}", "/")
        assert answer.status == 101, answer
        held = await held_for_an_unfinished_message(client, sink)
        assert held < 8 * 2**20, f"{held / 2**20:.1f} MiB held for an unfinished message"


# -- audit and metrics -----------------------------------------------------------------------


async def fifty_kilobytes_each_way_then_close(client: WSClient, proxy: Running) -> None:
    """Five 10 KB messages echoed, the close handshake, then the connection's close line."""
    payload = b"x" * 10_000
    for _ in range(5):
        await client.send(BytesMessage(payload))
        assert await client.message() == payload
    assert await client.close() == 1000
    await eventually(lambda: any(x["event"] == "close" for x in proxy.lines()), "the close line")


@pytest.mark.asyncio
async def test_the_upgrade_is_audited_with_method_and_path(
    proxy: Running, echo: EchoServer
) -> None:
    proxy.dns.set("ws.test", a=["127.0.0.1"])
    client, answer = await WSClient.through_proxy(proxy.port, f"ws.test:{echo.port}", "/chat?v=2")
    assert answer.status == 101
    await fifty_kilobytes_each_way_then_close(client, proxy)

    lines = decisions(proxy)
    assert [(x["stage"], x["decision"], x["method"], x["path"]) for x in lines] == [
        ("address", "allow", "GET", "/chat?v=2"),
    ]
    assert lines[0]["rule"] == "network.egress[0]" and lines[0]["pinned"] == ["127.0.0.1"]
    assert {x["protocol"] for x in lines} == {"http"}
    (close,) = [x for x in proxy.lines() if x["event"] == "close"]
    assert close["upstream"] == f"127.0.0.1:{echo.port}"
    assert (close["protocol"], close["host"]) == ("ws", "ws.test")  # what it upgraded to
    # The WebSocket traffic is counted: 50 KB each way plus the handshake and frame heads.
    assert 50_000 < close["bytes_up"] < 52_000
    assert 50_000 < close["bytes_down"] < 52_000
    text = proxy.metrics.render()[0].decode()
    # Plain HTTP is the front door's (plane l4): one allow, at the address stage.
    labels = 'decision="allow",plane="l4",reason="allowed",stage="address"'
    assert f"egress_decisions_total{{{labels}}} 1.0" in text, text
    assert 'egress_decisions_total{decision="allow",plane="l7"' not in text


# -- reload ----------------------------------------------------------------------------------


async def closed_but_the_other_serves(dropped: WSClient, kept: WSClient) -> None:
    """After a reload: `dropped` was closed under its client, `kept` still echoes."""
    with pytest.raises((ConnectionError, ssl.SSLError)):
        for _ in range(10):  # at most an unclean close event before the EOF
            await dropped.event()
    dropped.abort()
    await kept.send(TextMessage("still here"))
    assert await kept.message() == "still here"
    assert await kept.close() == 1000


@pytest.mark.asyncio
async def test_reload_closes_a_live_websocket_the_new_policy_denies(
    proxy: Running, echo: EchoServer
) -> None:
    proxy.dns.set("ws.test", a=["127.0.0.1"])
    proxy.dns.set("private.test", a=["127.0.0.1"])
    kept, answer = await WSClient.through_proxy(proxy.port, f"ws.test:{echo.port}", "/chat")
    assert answer.status == 101
    dropped, answer = await WSClient.through_proxy(proxy.port, f"private.test:{echo.port}", "/")
    assert answer.status == 101
    operator = proxy.engine.policy.operator
    narrower = compile_policy(load_manifest("network:\n  egress: [ws.test]\n"), None, operator)
    assert len(proxy.reload(narrower)) == 1
    await closed_but_the_other_serves(dropped, kept)
    await eventually(lambda: len([x for x in proxy.lines() if x["event"] == "close"]) == 2, "2")
    reasons = sorted((x["host"], x["reason"]) for x in proxy.lines() if x["event"] == "close")
    assert reasons == [("private.test", "policy_reload"), ("ws.test", "closed")]
