"""The session's DNS answers as names for addresses (proxy/decide/attribution.py): what a
redirected connection that carries no name is attributed to."""

from __future__ import annotations

from proxy.decide.attribution import Attribution, canonical_address


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(grace: float = 300.0, **kwargs: int) -> tuple[Attribution, Clock]:
    clock = Clock()
    return Attribution(grace, clock=clock, **kwargs), clock


def test_an_answered_address_names_its_host_for_ttl_plus_grace() -> None:
    attribution, clock = table(grace=60)
    attribution.remember("git.test", ("192.0.2.7", "2001:db8::7"), ttl=30)
    assert attribution.names("192.0.2.7") == ("git.test",)
    assert attribution.names("2001:0db8:0::7") == ("git.test",)  # any spelling of the address
    assert attribution.names("::ffff:192.0.2.7") == ("git.test",)  # a dual-stack socket's v4
    assert attribution.names("192.0.2.8") == ()
    clock.now += 89.9
    assert attribution.names("192.0.2.7") == ("git.test",)
    clock.now += 0.2
    assert attribution.names("192.0.2.7") == ()
    assert len(attribution) == 1  # the expired v4 entry went when it was looked up


def test_an_address_answered_for_several_names_names_them_all_newest_first() -> None:
    attribution, clock = table()
    attribution.remember("a.test", ("198.51.100.1",), ttl=30)
    clock.now += 1
    attribution.remember("b.test", ("198.51.100.1",), ttl=30)
    assert attribution.names("198.51.100.1") == ("b.test", "a.test")
    clock.now += 1
    attribution.remember("a.test", ("198.51.100.1",), ttl=30)  # answered again: first now
    assert attribution.names("198.51.100.1") == ("a.test", "b.test")
    assert len(attribution) == 2


def test_the_table_is_bounded_and_forgets_the_oldest_answers_first() -> None:
    attribution, _ = table(max_entries=64)
    for i in range(200):
        attribution.remember(f"h{i}.test", (f"203.0.113.{i % 250}", f"2001:db8::{i:x}"), ttl=30)
        assert len(attribution) <= 64
    assert attribution.names("2001:db8::c7") == ("h199.test",)
    assert attribution.names("2001:db8::0") == ()


def test_one_address_keeps_a_bounded_number_of_names() -> None:
    attribution, _ = table()
    for i in range(100):
        attribution.remember(f"n{i}.cdn.test", ("192.0.2.1",), ttl=30)
    names = attribution.names("192.0.2.1")
    assert len(names) == 16 and names[0] == "n99.cdn.test"


def test_what_is_no_address_is_never_remembered_nor_found() -> None:
    attribution, _ = table()
    attribution.remember("x.test", ("not-an-address", "192.0.2.1%eth0"), ttl=30)
    assert attribution.names("not-an-address") == ()
    assert canonical_address("192.0.2.1%eth0") == "192.0.2.1"
    assert canonical_address("") is None
