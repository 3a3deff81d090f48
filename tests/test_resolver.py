"""The resolver against a DNS server of our own on loopback (tests/support/dns_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.rrset
import pytest
from support.dns_server import DNSServer, running_dns_server

from proxy.app.config import Config, Nameserver
from proxy.common.errors import ProxyError
from proxy.net.resolver import MAX_ADDRESSES, Resolver, _Family

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[DNSServer]:
    with running_dns_server() as dns_server:
        yield dns_server


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(server: DNSServer, clock: FakeClock | None = None, **kwargs: object) -> Resolver:
    kwargs.setdefault("timeout", 2.0)
    if clock is not None:
        kwargs["clock"] = clock
    return Resolver([server.address], **kwargs)  # type: ignore[arg-type]


async def refused(resolver: Resolver, host: str) -> str:
    with pytest.raises(ProxyError) as info:
        await resolver.resolve(host)
    return info.value.reason


# -- answers ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_only(server: DNSServer) -> None:
    server.set("v4.test", a=["192.0.2.1"], ttl=120)
    answer = await make(server).resolve("v4.test")
    assert answer.host == "v4.test"
    assert answer.addresses == ("192.0.2.1",)
    assert answer.cname_chain == ()
    assert answer.ttl == 120
    assert not answer.from_cache
    # Both families were asked, concurrently, over UDP.
    assert server.count("v4.test", "A", "udp") == 1
    assert server.count("v4.test", "AAAA", "udp") == 1


@pytest.mark.asyncio
async def test_aaaa_only(server: DNSServer) -> None:
    server.set("v6.test", aaaa=["2001:db8::1"], ttl=60)
    answer = await make(server).resolve("v6.test")
    assert answer.addresses == ("2001:db8::1",)


@pytest.mark.asyncio
async def test_both_families_a_first_without_duplicates(server: DNSServer) -> None:
    server.set(
        "dual.test", a=["192.0.2.1", "192.0.2.2"], aaaa=["2001:db8::1", "2001:db8::2"], ttl=60
    )
    answer = await make(server).resolve("dual.test")
    # dnspython shuffles records within an RRset when rendering: the order inside a family is
    # the server's; A always comes before AAAA.
    assert set(answer.addresses[:2]) == {"192.0.2.1", "192.0.2.2"}
    assert set(answer.addresses[2:]) == {"2001:db8::1", "2001:db8::2"}
    assert len(answer.addresses) == 4


@pytest.mark.asyncio
async def test_cname_chain_is_reported(server: DNSServer) -> None:
    server.set("www.example.test", cname="CDN.Provider.test", ttl=50)
    server.set("cdn.provider.test", cname="edge.provider.test", ttl=40)
    server.set("edge.provider.test", a=["192.0.2.7"], aaaa=["2001:db8::7"], ttl=300)
    answer = await make(server).resolve("www.example.test")
    assert answer.addresses == ("192.0.2.7", "2001:db8::7")
    assert answer.cname_chain == ("www.example.test", "cdn.provider.test", "edge.provider.test")
    assert answer.ttl == 40  # the smallest TTL of the records used, CNAMEs included


# -- failures --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_nxdomain(server: DNSServer) -> None:
    server.nxdomain("gone.test")
    assert await refused(make(server), "gone.test") == "dns_nxdomain"


@pytest.mark.asyncio
async def test_cname_to_nxdomain(server: DNSServer) -> None:
    server.set("alias.test", cname="gone.test")
    server.nxdomain("gone.test")
    assert await refused(make(server), "alias.test") == "dns_nxdomain"


@pytest.mark.asyncio
async def test_second_nameserver_is_used_when_the_first_is_silent(server: DNSServer) -> None:
    server.set("fallback.test", a=["192.0.2.1"])
    with running_dns_server() as silent:
        silent.blackhole("fallback.test")
        resolver = Resolver([silent.address, server.address], 1.0)
        answer = await resolver.resolve("fallback.test")
    assert answer.addresses == ("192.0.2.1",)
    assert silent.count("fallback.test", "A") == 1


@pytest.mark.asyncio
async def test_nodata(server: DNSServer) -> None:
    server.set("empty.test")
    assert await refused(make(server), "empty.test") == "dns_no_address"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["servfail", "refused"])
async def test_servfail_and_refused(server: DNSServer, kind: str) -> None:
    getattr(server, kind)("broken.test")
    assert await refused(make(server), "broken.test") == "dns_error"


@pytest.mark.asyncio
async def test_timeout(server: DNSServer) -> None:
    server.blackhole("slow.test")
    resolver = make(server, timeout=0.5)
    started = time.monotonic()
    assert await refused(resolver, "slow.test") == "dns_timeout"
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 1.5
    assert server.count("slow.test", "A") >= 1 and server.count("slow.test", "AAAA") >= 1


def test_one_family_failing_while_the_other_answers() -> None:
    resolver = Resolver([("127.0.0.1", 53)], 1.0)
    answered = _Family("answer", ("192.0.2.1",), (), 60)
    for failed in (_Family("timeout"), _Family("error", detail="SERVFAIL")):
        outcome = resolver._combine("h.test", [answered, failed])
        assert outcome.addresses == ("192.0.2.1",)  # type: ignore[union-attr]
    empty = _Family("nodata", ttl=30)
    assert resolver._combine("h.test", [empty, _Family("timeout")]).reason == "dns_timeout"  # type: ignore[union-attr]
    assert resolver._combine("h.test", [_Family("error"), empty]).reason == "dns_error"  # type: ignore[union-attr]
    nx = _Family("nxdomain", ttl=30)
    assert resolver._combine("h.test", [nx, nx]).reason == "dns_nxdomain"  # type: ignore[union-attr]
    assert resolver._combine("h.test", [nx, empty]).reason == "dns_no_address"  # type: ignore[union-attr]


# -- caching ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_positive_cache_honours_ttl(server: DNSServer, clock: FakeClock) -> None:
    server.set("cached.test", a=["192.0.2.1"], ttl=60)
    resolver = make(server, clock)
    first = await resolver.resolve("cached.test")
    clock.now += 59
    second = await resolver.resolve("cached.test")
    assert second.from_cache and second.addresses == first.addresses
    assert server.count("cached.test", "A") == 1
    clock.now += 1
    third = await resolver.resolve("cached.test")
    assert not third.from_cache
    assert server.count("cached.test", "A") == 2


@pytest.mark.asyncio
async def test_cache_caps_the_ttl(server: DNSServer, clock: FakeClock) -> None:
    server.set("long.test", a=["192.0.2.1"], ttl=86400)
    resolver = make(server, clock, cache_cap=10)
    assert (await resolver.resolve("long.test")).ttl == 86400  # reported as sent
    clock.now += 9
    assert (await resolver.resolve("long.test")).from_cache
    clock.now += 1
    assert not (await resolver.resolve("long.test")).from_cache
    assert server.count("long.test", "A") == 2


@pytest.mark.asyncio
async def test_ttl_zero_is_not_cached(server: DNSServer, clock: FakeClock) -> None:
    server.set("zero.test", a=["192.0.2.1"], ttl=0)
    resolver = make(server, clock)
    await resolver.resolve("zero.test")
    assert not (await resolver.resolve("zero.test")).from_cache
    assert server.count("zero.test", "A") == 2


@pytest.mark.asyncio
async def test_negative_cache_uses_the_soa_minimum(server: DNSServer, clock: FakeClock) -> None:
    server.negative_ttl = 5
    server.nxdomain("gone.test")
    server.set("empty.test")
    resolver = make(server, clock, negative_ttl=30)
    for host, reason in (("gone.test", "dns_nxdomain"), ("empty.test", "dns_no_address")):
        assert await refused(resolver, host) == reason
        clock.now += 4
        assert await refused(resolver, host) == reason
        assert server.count(host, "A") == 1  # the second answer came from the cache
        clock.now += 1
        assert await refused(resolver, host) == reason
        assert server.count(host, "A") == 2


@pytest.mark.asyncio
async def test_negative_cache_is_capped(server: DNSServer, clock: FakeClock) -> None:
    server.negative_ttl = None  # no SOA: dnspython's default, capped by ours
    server.nxdomain("gone.test")
    resolver = make(server, clock, negative_ttl=3)
    await refused(resolver, "gone.test")
    clock.now += 2.9
    await refused(resolver, "gone.test")
    assert server.count("gone.test", "A") == 1
    clock.now += 0.1
    await refused(resolver, "gone.test")
    assert server.count("gone.test", "A") == 2


@pytest.mark.asyncio
async def test_errors_and_timeouts_are_not_cached(server: DNSServer, clock: FakeClock) -> None:
    server.servfail("broken.test")
    server.blackhole("slow.test")
    resolver = make(server, clock, timeout=0.3)
    for host, reason in (("broken.test", "dns_error"), ("slow.test", "dns_timeout")):
        assert await refused(resolver, host) == reason
        before = server.count(host, "A")
        assert await refused(resolver, host) == reason
        assert server.count(host, "A") > before
    # Once the name works, the next request sees it at once.
    server.set("broken.test", a=["192.0.2.1"])
    assert (await resolver.resolve("broken.test")).addresses == ("192.0.2.1",)


@pytest.mark.asyncio
async def test_cache_is_bounded(server: DNSServer, clock: FakeClock) -> None:
    for name in ("one.test", "two.test", "three.test"):
        server.set(name, a=["192.0.2.1"])
    resolver = make(server, clock, max_entries=2)
    await resolver.resolve("one.test")
    await resolver.resolve("two.test")
    assert (await resolver.resolve("one.test")).from_cache  # one is now the most recent
    await resolver.resolve("three.test")  # evicts two, the least recently used
    assert (await resolver.resolve("one.test")).from_cache
    assert not (await resolver.resolve("two.test")).from_cache
    assert len(resolver._cache) == 2


# -- single flight ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_concurrent_resolves_share_one_lookup(server: DNSServer) -> None:
    server.set("popular.test", a=["192.0.2.1"], aaaa=["2001:db8::1"])
    resolver = make(server)
    answers = await asyncio.gather(*(resolver.resolve("popular.test") for _ in range(20)))
    assert {a.addresses for a in answers} == {("192.0.2.1", "2001:db8::1")}
    assert server.count("popular.test", "A") == 1
    assert server.count("popular.test", "AAAA") == 1
    assert resolver._inflight == {}


@pytest.mark.asyncio
async def test_concurrent_failures_share_one_lookup(server: DNSServer) -> None:
    server.servfail("broken.test")
    resolver = make(server)
    results = await asyncio.gather(
        *(resolver.resolve("broken.test") for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, ProxyError) and r.reason == "dns_error" for r in results)
    assert len({id(r) for r in results}) == 5  # each waiter raises its own exception
    assert server.count("broken.test", "A") == 1


@pytest.mark.asyncio
async def test_a_cancelled_waiter_does_not_break_the_others(server: DNSServer) -> None:
    server.set("shared.test", a=["192.0.2.1"])
    resolver = make(server)
    tasks = [asyncio.create_task(resolver.resolve("shared.test")) for _ in range(5)]
    await asyncio.sleep(0)  # every waiter has joined the one lookup
    tasks[0].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(r.addresses == ("192.0.2.1",) for r in results[1:])  # type: ignore[union-attr]
    assert server.count("shared.test", "A") == 1


@pytest.mark.asyncio
async def test_lookup_outlives_all_its_waiters(server: DNSServer) -> None:
    server.set("abandoned.test", a=["192.0.2.1"])
    resolver = make(server)
    task = asyncio.create_task(resolver.resolve("abandoned.test"))
    await asyncio.sleep(0)
    task.cancel()
    for _ in range(200):
        if not resolver._inflight:
            break
        await asyncio.sleep(0.01)
    assert resolver._inflight == {}
    assert (await resolver.resolve("abandoned.test")).from_cache
    assert server.count("abandoned.test", "A") == 1


# -- what is never resolved, and how -----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.1", "0x7f.1", "2130706433", "::1", "[::1]", "fe80::1%eth0", "a.1"]
)
async def test_ip_literals_are_refused_without_a_query(server: DNSServer, host: str) -> None:
    assert await refused(make(server), host) == "dns_ip_literal"
    assert server.queries == []


@pytest.mark.asyncio
@pytest.mark.parametrize("host", ["", "a..b", "x" * 64 + ".test", "bücher.test"])
async def test_unusable_names_are_refused_without_a_query(server: DNSServer, host: str) -> None:
    assert await refused(make(server), host) == "invalid_host"
    assert server.queries == []


@pytest.mark.asyncio
async def test_names_are_absolute(server: DNSServer) -> None:
    # A single-label name is asked as is, never with a search domain appended.
    server.set("intranet", a=["192.0.2.9"])
    assert (await make(server).resolve("intranet")).addresses == ("192.0.2.9",)
    assert {name for name, _, _ in server.queries} == {"intranet"}


@pytest.mark.asyncio
async def test_truncated_udp_answer_is_retried_over_tcp(server: DNSServer) -> None:
    many = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(200)]
    server.set("many.test", a=many)
    answer = await make(server).resolve("many.test")
    assert server.count("many.test", "A", "udp") == 1
    assert server.count("many.test", "A", "tcp") == 1
    # The answer is bounded: the first MAX_ADDRESSES of what the server sent.
    assert len(answer.addresses) == MAX_ADDRESSES
    assert set(answer.addresses) <= set(many)


@pytest.mark.asyncio
async def test_nothing_hands_a_name_to_the_os(
    server: DNSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the OS resolver was asked: {args!r}")

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        monkeypatch.setattr(socket, name, refuse)
    server.set("direct.test", a=["192.0.2.1"], aaaa=["2001:db8::1"])
    many = [f"10.0.0.{i}" for i in range(1, 200)]
    server.set("many.test", a=many)  # the TCP path too
    resolver = make(server)
    assert (await resolver.resolve("direct.test")).addresses == ("192.0.2.1", "2001:db8::1")
    assert len((await resolver.resolve("many.test")).addresses) == MAX_ADDRESSES
    assert server.count("many.test", "A", "tcp") == 1


# -- hostile nameservers -----------------------------------------------------------------------


@contextlib.contextmanager
def udp_nameserver(reply: Callable[[dns.message.Message], list[bytes]]) -> Iterator[int]:
    """A UDP nameserver on 127.0.0.1 that sends `reply(query)`'s datagrams for each query (no
    TCP listener on its port); yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            for datagram in reply(dns.message.from_wire(data)):
                sock.sendto(datagram, peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def answer_to(query: dns.message.Message, address: str = "192.0.2.1") -> dns.message.Message:
    response = dns.message.make_response(query)
    question = query.question[0]
    value = address if question.rdtype == 1 else "2001:db8::1"
    response.answer.append(dns.rrset.from_text(question.name, 60, "IN", question.rdtype, value))
    return response


@pytest.mark.asyncio
async def test_datagrams_that_are_not_the_answer_are_ignored() -> None:
    """Before each real answer: bytes that are no message, a message with another id, one for
    another name, one for another type, a query (QR clear): none of them is taken."""

    def reply(query: dns.message.Message) -> list[bytes]:
        wrong_id = answer_to(query, "192.0.2.66")
        wrong_id.id = (query.id + 1) % 65536
        other_name = answer_to(
            dns.message.make_query("evil.test", query.question[0].rdtype), "192.0.2.68"
        )
        other_name.id = query.id
        other_type = dns.message.make_response(dns.message.make_query(query.question[0].name, "MX"))
        other_type.id = query.id
        not_a_response = answer_to(query, "192.0.2.67")
        not_a_response.flags &= ~dns.flags.QR
        noise = [query.id.to_bytes(2, "big") + b"\xff" * 30, wrong_id.to_wire()]
        noise += [other_name.to_wire(), other_type.to_wire(), not_a_response.to_wire()]
        return [*noise, answer_to(query).to_wire()]

    with udp_nameserver(reply) as port:
        answer = await Resolver([("127.0.0.1", port)], 1.0).resolve("real.test")
    assert answer.addresses == ("192.0.2.1", "2001:db8::1")


@pytest.mark.asyncio
async def test_a_truncated_answer_from_a_nameserver_without_tcp_is_a_dns_error() -> None:
    def reply(query: dns.message.Message) -> list[bytes]:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.TC
        return [response.to_wire()]

    with udp_nameserver(reply) as port:
        resolver = Resolver([("127.0.0.1", port)], 2.0)
        started = time.monotonic()
        assert await refused(resolver, "big.test") == "dns_error"
    assert time.monotonic() - started < 1.0  # refused at once, not a timeout


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_from_config_with_nameservers(server: DNSServer) -> None:
    server.set("configured.test", a=["192.0.2.1"])
    config = Config(nameservers=(Nameserver(*server.address),), dns_timeout=1.5)
    resolver = Resolver.from_config(config)
    assert resolver.nameservers == (server.address,)
    assert resolver.timeout == 1.5
    assert (await resolver.resolve("configured.test")).addresses == ("192.0.2.1",)


def test_from_config_reads_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("search corp.example\nnameserver 192.0.2.53\nnameserver 2001:db8::53\n")
    resolver = Resolver.from_config(Config(), resolv_conf=str(conf))
    assert resolver.nameservers == (("192.0.2.53", 53), ("2001:db8::53", 53))


def test_resolv_conf_as_the_c_library_reads_it(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# nameserver 192.0.2.1\n; nameserver 192.0.2.2\n  nameserver   192.0.2.3  # note\n"
        "options ndots:5 rotate\nnameserver\nnameservers 192.0.2.4\nnameserver fe80::1%eth0\n"
    )
    resolver = Resolver.from_config(Config(), resolv_conf=str(conf))
    assert resolver.nameservers == (("192.0.2.3", 53), ("fe80::1%eth0", 53))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("search corp.example\n", "names no nameserver"),
        ("nameserver 192.0.2.1\nnameserver dns.example\n", "resolv.conf:2: nameserver"),
        ("# big\n" * 20_000, "larger than"),
        (b"nameserver 192.0.2.1\xff\n", "resolv.conf:1: nameserver"),
    ],
)
def test_unusable_resolv_conf_is_a_config_error_naming_the_line(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    conf = tmp_path / "resolv.conf"
    if isinstance(content, bytes):
        conf.write_bytes(content)
    elif content is not None:
        conf.write_text(content)
    with pytest.raises(ProxyError) as info:
        Resolver.from_config(Config(), resolv_conf=str(conf))
    assert info.value.reason == "dns_config" and message in info.value.message


@pytest.mark.parametrize("content", [None, "search corp.example\n"])
def test_unusable_resolv_conf_is_a_config_error(tmp_path: Path, content: str | None) -> None:
    conf = tmp_path / "resolv.conf"
    if content is not None:
        conf.write_text(content)
    with pytest.raises(ProxyError) as info:
        Resolver.from_config(Config(), resolv_conf=str(conf))
    assert info.value.reason == "dns_config"


@pytest.mark.parametrize(
    "nameservers", [[], [("dns.example", 53)], [("192.0.2.1", 0)], [("192.0.2.1", 70000)]]
)
def test_bad_nameservers_are_refused(nameservers: list[tuple[str, int]]) -> None:
    with pytest.raises(ProxyError) as info:
        Resolver(nameservers, 1.0)
    assert info.value.reason == "dns_config"
