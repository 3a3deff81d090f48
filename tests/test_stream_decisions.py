"""The policy core's decisions on streams that are neither TLS nor HTTP (`ssh://host[:port]`,
`tcp://host:port`): the manifest's host rules on any port, then the operator's `opaque_ports`."""

from __future__ import annotations

import pytest

from policy import OperatorRules, PolicyError, compile_policy, load_manifest, parse_target
from policy.reasons import Reason

YAML = "network:\n  egress: [git.test]\n"
TOML = (
    'name = "a"\n[network_access]\nallowed = ["db.test", "https://api.test/v1/"]\n'
    'blocked = ["bad.db.test"]\n'
)


def policy(text: str = YAML, **operator: object):  # type: ignore[no-untyped-def]
    source = "agent.toml" if text.startswith("name") else "agent.yaml"
    return compile_policy(load_manifest(text, source=source), operator=OperatorRules(**operator))


def test_ssh_defaults_to_port_22_and_tcp_names_its_port() -> None:
    assert parse_target("ssh://git.test").effective_port == 22
    assert parse_target("tcp://db.test:5432").port == 5432
    for bad, says in (
        ("tcp://db.test", "names its port"),
        ("ssh://git.test/repo.git", "has no path"),
        ("gopher://x.test", "ssh, tcp"),
    ):
        with pytest.raises(PolicyError) as info:
            parse_target(bad)
        assert says in info.value.message


def test_an_allowed_host_takes_opaque_streams_on_every_port_but_80_and_443() -> None:
    p = policy()
    decision = p.decide("ssh://git.test:2222")
    assert decision.allowed and decision.rule == "network.egress[0]" and decision.port == 2222
    assert p.decide("tcp://a.git.test:5432").allowed
    for target in ("ssh://git.test:443", "tcp://git.test:80"):
        refused = p.decide(target)
        assert (refused.allowed, refused.reason, refused.rule) == (
            False,
            Reason.OPAQUE_NOT_ALLOWED,
            "opaque_ports",
        )
        assert p.remedy(refused, target) == (
            f"no manifest entry can allow it: the operator must add port {refused.port} "
            "to opaque_ports"
        )
    # The same host and port over TLS or HTTP is as allowed as ever.
    assert p.decide("git.test:443").allowed


def test_the_operator_lists_the_opaque_ports_or_turns_them_off() -> None:
    listed = policy(ports=frozenset({443, 2222, 22}), opaque_ports=frozenset({2222}))
    assert listed.decide("ssh://git.test:2222").allowed
    assert listed.decide("ssh://git.test").reason == Reason.OPAQUE_NOT_ALLOWED
    assert listed.decide("ssh://git.test:5432").reason == Reason.PORT_NOT_ALLOWED
    off = policy(opaque_ports=frozenset())
    assert off.decide("ssh://git.test:22").reason == Reason.OPAQUE_NOT_ALLOWED


def test_refusals_before_the_port_keep_their_own_reason() -> None:
    p = policy(TOML)
    assert p.decide("tcp://db.test:5432").allowed
    assert p.decide("tcp://x.db.test:5432").reason == Reason.NOT_ALLOWED  # exact entry
    assert p.decide("tcp://bad.db.test:443").reason == Reason.BLOCKED  # before the port
    assert p.decide("tcp://other.test:5432").reason == Reason.NOT_ALLOWED
    assert p.decide("ssh://localhost").reason == Reason.LOOPBACK_NAME
    assert p.decide("tcp://127.0.0.1:22").reason == Reason.IP_LITERAL


def test_a_host_admitted_only_for_url_paths_takes_no_opaque_stream() -> None:
    refused = policy(TOML).decide("tcp://api.test:8443")
    assert (refused.allowed, refused.reason) == (False, Reason.INSPECTION_UNSUPPORTED)
    assert "has no path" in refused.message


def test_learning_lifts_the_missing_entry_never_the_operators_ports() -> None:
    p = policy()
    target = "ssh://new.test:22"
    let = p.learn(p.decide(target), target)
    assert let.allowed and let.would_deny and let.reason == Reason.NOT_ALLOWED
    target = "ssh://new.test:443"
    held = p.learn(p.decide(target), target)
    assert not held.allowed and held.reason == Reason.OPAQUE_NOT_ALLOWED
