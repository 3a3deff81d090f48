"""The pure core of asking a person (policy/asking.py, Policy.question / answered / granted):
which refusals are asked about, the question, the entry that would allow it, and the session
grants, with the ceiling and every other rule out of a person's reach."""

from __future__ import annotations

import pytest

from policy import Reason, compile_policy, load_ceiling, load_manifest
from policy.asking import (
    ALLOW_SESSION,
    DENY_SESSION,
    Question,
    SessionGrants,
    is_askable,
)
from policy.operator import OperatorRules
from policy.remedies import entry, remedy

YAML = "network:\n  egress: [allowed.test]\n"
TOML = (
    '[network_access]\nallowed = ["https://api.test/v1/", "ok.test"]\n'
    'blocked = ["bad.test", "https://ok.test/admin/"]\n'
)


def yaml_policy(ceiling: str | None = None):  # type: ignore[no-untyped-def]
    return compile_policy(
        load_manifest(YAML), load_ceiling(ceiling) if ceiling is not None else None
    )


def toml_policy():  # type: ignore[no-untyped-def]
    return compile_policy(load_manifest(TOML, source="agent.toml"))


def test_only_not_allowed_and_path_not_allowed_are_askable() -> None:
    assert is_askable(Reason.NOT_ALLOWED) and is_askable(Reason.PATH_NOT_ALLOWED)
    for reason in (Reason.BLOCKED, Reason.OUTSIDE_CEILING, Reason.IP_LITERAL, Reason.PRIVATE):
        assert not is_askable(reason)


@pytest.mark.parametrize(
    "target",
    [
        "bad.test:443",  # blocked
        "10.0.0.1:443",  # IP literal
        "printer.local:443",  # internal name
        "localhost:80",
        "allowed.test:443",  # allowed: nothing to ask
    ],
)
def test_never_asked(target: str) -> None:
    policy = toml_policy() if target.startswith("bad") else yaml_policy()
    decision = policy.decide(target)
    assert policy.question(decision, target) is None


def test_operator_ports_are_never_asked() -> None:
    policy = compile_policy(load_manifest(YAML), None, OperatorRules(ports=frozenset({443})))
    decision = policy.decide("new.test:22")
    assert decision.reason == Reason.PORT_NOT_ALLOWED
    assert policy.question(decision, "new.test:22") is None


def test_the_ceiling_is_never_asked_declared_or_not() -> None:
    policy = compile_policy(
        load_manifest("network:\n  egress: [allowed.test, cut.test]\n"),
        load_ceiling("egress: [allowed.test, inside.test]\n"),
    )
    assert policy.ceiling_admits("a.inside.test") and not policy.ceiling_admits("cut.test")
    declared = policy.decide("cut.test:443")
    assert declared.reason == Reason.OUTSIDE_CEILING
    assert policy.question(declared, "cut.test:443") is None
    undeclared = policy.decide("elsewhere.test:443")
    assert undeclared.reason == Reason.NOT_ALLOWED
    assert policy.question(undeclared, "elsewhere.test:443") is None
    inside = policy.decide("x.inside.test:443")
    assert policy.question(inside, "x.inside.test:443") == Question("x.inside.test", 443)


def test_no_ceiling_admits_every_name() -> None:
    assert yaml_policy().ceiling_admits("anything.test")
    assert not yaml_policy("egress: []\n").ceiling_admits("anything.test")


def test_the_question_and_entry_of_a_host_and_of_a_path() -> None:
    policy = toml_policy()
    host = policy.decide("new.test:8443")
    assert policy.question(host, "new.test:8443") == Question("new.test", 8443)
    assert policy.entry(host, "new.test:8443") == "new.test"
    url = "https://api.test/v2/users?x=1"
    path = policy.decide(url)
    assert path.reason == Reason.PATH_NOT_ALLOWED
    assert policy.question(path, url) == Question("api.test", 443, "/v2/", "https")
    assert policy.entry(path, url) == "https://api.test/v2/"
    # The remedy names the same entry: one implementation.
    assert policy.remedy(path, url) == "add 'https://api.test/v2/' to network_access.allowed"


def test_entry_in_agent_yaml_is_the_host() -> None:
    assert entry(Reason.NOT_ALLOWED, "h.test") == "h.test"
    assert entry(Reason.PATH_NOT_ALLOWED, "h.test", path="/x/y") == "h.test"
    assert entry(Reason.BLOCKED, "h.test") is None
    assert remedy(Reason.NOT_ALLOWED, "h.test") == "add 'h.test' to network.egress"


def test_answers_allow_inspected_where_paths_decide_and_deny_as_ask_denied() -> None:
    policy = toml_policy()
    url = "https://api.test/v2/x"
    refused = policy.decide(url)
    allowed = policy.answered(refused, url, "ask:1", allow=True)
    assert allowed.allowed and allowed.rule == "ask:1" and allowed.needs_inspection
    assert allowed.reason == Reason.ALLOWED and not allowed.would_deny
    denied = policy.answered(refused, url, "ask:1", allow=False)
    assert not denied.allowed and denied.reason == Reason.ASK_DENIED and denied.rule == "ask:1"
    blocked = policy.decide("bad.test:443")
    assert policy.answered(blocked, "bad.test:443", "ask:1", allow=True) == blocked


def test_inspection_disabled_refuses_a_path_answer() -> None:
    policy = compile_policy(
        load_manifest(TOML, source="agent.toml"), None, OperatorRules(inspection_enabled=False)
    )
    url = "https://api.test/v2/x"
    refused = policy.decide(url)
    answered = policy.answered(refused, url, "ask:1", allow=True)
    assert not answered.allowed and answered.reason == Reason.INSPECTION_DISABLED


def test_a_host_grant_admits_the_host_on_every_port_and_nothing_else() -> None:
    policy = yaml_policy()
    grants = SessionGrants()
    decision = policy.decide("new.test:443")
    question = policy.question(decision, "new.test:443")
    assert question is not None
    grant = grants.add(question, "new.test", ALLOW_SESSION, ask="a1", time="t")
    assert grant is not None and grant.rule == "session.grants[0]"
    for target in ("new.test:443", "new.test:22", "new.test"):
        granted = policy.granted(policy.decide(target), target, grants)
        assert granted.allowed and granted.rule == "session.grants[0]", target
    for target in ("sub.new.test:443", "other.test:443"):
        assert not policy.granted(policy.decide(target), target, grants).allowed
    assert grants.to_json() == [
        {
            "entry": "new.test",
            "host": "new.test",
            "port": 443,
            "path": None,
            "decision": "allow-session",
            "ask": "a1",
            "time": "t",
        }
    ]


def test_a_prefix_grant_admits_requests_inside_it_only() -> None:
    policy = toml_policy()
    grants = SessionGrants()
    url = "https://api.test/v2/a"
    question = policy.question(policy.decide(url), url)
    assert question is not None
    grants.add(question, "https://api.test/v2/", ALLOW_SESSION, ask="a", time="t")
    for inside in ("https://api.test/v2/b/c", "https://api.test/v2/"):
        assert policy.granted(policy.decide(inside), inside, grants).allowed, inside
    for outside in (
        "https://api.test/v3/x",
        "https://api.test/v2/../v3/x",
        "http://api.test/v2/x",
        "https://api.test:8443/v2/x",
    ):
        assert not policy.granted(policy.decide(outside), outside, grants).allowed, outside


def test_a_deny_grant_refuses_the_identical_question_and_wins_over_an_allow() -> None:
    policy = yaml_policy()
    grants = SessionGrants()
    q443 = Question("new.test", 443)
    grants.add(q443, "new.test", DENY_SESSION, ask="d", time="t")
    denied = policy.granted(policy.decide("new.test:443"), "new.test:443", grants)
    assert denied.reason == Reason.ASK_DENIED and denied.rule == "session.grants[0]"
    # Another port is another question: still asked.
    other = policy.decide("new.test:80")
    assert policy.granted(other, "new.test:80", grants) == other
    grants.add(Question("new.test", 80), "new.test", ALLOW_SESSION, ask="a", time="t")
    again = policy.granted(policy.decide("new.test:443"), "new.test:443", grants)
    assert again.reason == Reason.ASK_DENIED


def test_grants_never_pass_the_ceiling() -> None:
    wide = yaml_policy()
    grants = SessionGrants()
    question = wide.question(wide.decide("new.test:443"), "new.test:443")
    assert question is not None
    grants.add(question, "new.test", ALLOW_SESSION, ask="a", time="t")
    narrowed = yaml_policy("egress: [allowed.test]\n")  # a reload lowers the ceiling
    decision = narrowed.decide("new.test:443")
    assert narrowed.granted(decision, "new.test:443", grants) == decision


def test_grants_are_bounded() -> None:
    grants = SessionGrants(limit=1)
    assert grants.add(Question("a.test", 1), "a.test", ALLOW_SESSION, ask="1", time="t")
    assert grants.add(Question("b.test", 1), "b.test", ALLOW_SESSION, ask="2", time="t") is None
    assert len(grants) == 1
    with pytest.raises(ValueError):
        grants.add(Question("c.test", 1), "c.test", "allow-once", ask="3", time="t")
