"""proxy.decide.vetting: the Vetter's memo of name-stage and address-stage answers is the
policy's own answer, per policy (a reload starts afresh), and bounded against hostile keys."""

from __future__ import annotations

from policy import compile_policy, load_manifest
from proxy.decide import vetting
from proxy.decide.vetting import Vetter

WIDE = "network:\n  egress: [a.test, b.test]\n"
NARROW = "network:\n  egress: [b.test]\n"


def vetter(manifest: str = WIDE) -> Vetter:
    return Vetter(compile_policy(load_manifest(manifest)), None, plane="l4")  # type: ignore[arg-type]


def test_memo_answers_as_the_policy_does() -> None:
    v = vetter()
    for target in ("a.test:443", "A.TEST:443", "c.test:443", "b.test:80", "[::1]:443", "a.test"):
        first = v.decide(target)
        assert first == v.policy.decide(target)
        assert v.decide(target) is first  # remembered
    checked = v._check_addresses(v.policy, "a.test", ("93.184.216.34",), ())
    assert checked == v.policy.check_addresses("a.test", ("93.184.216.34",))
    assert v._check_addresses(v.policy, "a.test", ("93.184.216.34",), ()) is checked
    private = v._check_addresses(v.policy, "a.test", ("10.0.0.1",), ())
    assert not private.allowed and private == v.policy.check_addresses("a.test", ("10.0.0.1",))


def test_a_reload_starts_a_new_memo() -> None:
    v = vetter()
    assert v.decide("a.test:443").allowed
    old = v.policy
    v.policy = compile_policy(load_manifest(NARROW))
    assert not v.decide("a.test:443").allowed
    # A decision begun on the old policy still gets the old policy's answer...
    assert v.decide("a.test:443", old).allowed
    # ... without displacing the memo of the policy in force.
    assert v._memo.policy is v.policy
    assert not v.decide("a.test:443").allowed


def test_memo_is_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(vetting, "MEMO_ENTRIES", 8)
    v = vetter()
    for n in range(50):
        v.decide(f"h{n}.test:443")
        v._check_addresses(v.policy, "a.test", (f"93.184.216.{n}",), ())
        assert len(v._memo.decisions) <= 8 and len(v._memo.addresses) <= 8
    long_target = "https://a.test/" + "p" * 300
    assert len(long_target) > vetting.MEMO_TARGET
    v._memo.decisions.clear()
    v.decide(long_target)
    assert len(v._memo.decisions) == 0  # long keys (from clients) are answered, not kept
    many = tuple(f"93.184.216.{n}" for n in range(vetting.MEMO_ADDRESSES + 1))
    v._memo.addresses.clear()
    assert v._check_addresses(v.policy, "a.test", many, ()).allowed
    assert len(v._memo.addresses) == 0
