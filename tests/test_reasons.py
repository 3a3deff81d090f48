"""The one catalog of reason codes (policy/reasons.py): no duplicate values, every reason the
source hands to a refusal or a decision comes from it (never a literal, never a second constant
of the same code), and what reaches an audit line or a metric label is the bare value."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

from policy import Reason, compile_policy, load_manifest
from proxy.decide.events import CloseEvent, DecisionEvent
from proxy.decide.sni_gate import check_hello, read_hello
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "policy").rglob("*.py"), *(ROOT / "proxy").rglob("*.py")])
VALUES = {member.value for member in Reason}

# The constructors that carry a reason code, and where: (positional index, keyword).
CARRIERS = {
    "Refused": (1, "reason"),
    "Decision": (1, "reason"),
    "AddressDecision": (1, "reason"),
    "Verdict": (2, "reason"),
    "Block": (4, "reason"),
    "DnsAnswer": (1, "reason"),
    "DecisionEvent": (1, "reason"),
    "_Failure": (0, "reason"),
    "Unanswerable": (0, "reason"),
    "UpstreamError": (0, "reason"),
}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _reason_args(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := _name(node.func)) not in CARRIERS:
            continue
        index, keyword = CARRIERS[name]
        if len(node.args) > index and not isinstance(node.args[index], ast.Starred):
            found.append((node.lineno, node.args[index]))
        found += [(node.lineno, k.value) for k in node.keywords if k.arg == keyword]
    return found


def test_the_catalog_has_one_value_per_member_and_code_shaped_values() -> None:
    values = [member.value for member in Reason]
    assert len(values) == len(set(values))
    assert all(isinstance(v, str) and v == v.lower() and " " not in v for v in values)
    assert Reason.NOT_ALLOWED == "not_allowed" and str(Reason.NOT_ALLOWED) == "not_allowed"
    assert f"{Reason.SNI_INVALID}" == "sni_invalid"


def test_every_reason_in_the_source_is_a_catalog_member() -> None:
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for lineno, arg in _reason_args(tree):
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                problems.append(f"{where}:{lineno}: literal reason {arg.value!r}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Reason"
                and node.attr not in Reason.__members__
            ):
                problems.append(f"{where}:{node.lineno}: Reason.{node.attr} is not a member")
    assert problems == []


def test_no_second_name_for_a_catalog_code() -> None:
    """No module-level constant spells a catalog code again (the old policy/decisions.py and
    proxy/common/refusals.py constants, the DNS responder's, the relay's close reasons)."""
    problems = []
    for path in SOURCES:
        if path.name == "reasons.py" and path.parent.name == "policy":
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else None
            if isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            else:
                value = getattr(node, "value", None)
            if (
                isinstance(target, ast.Name)
                and isinstance(value, ast.Constant)
                and value.value in VALUES
            ):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target.id}")
    assert problems == []


def test_an_sni_that_is_no_host_name_has_its_own_code() -> None:
    from tests.test_clienthello import sni_ext, tls

    bad = tls([sni_ext(b"xn--zz.test")])  # a DNS name to the parser, but no valid A-label
    outcome = read_hello(bad)
    assert outcome is not None and outcome.refused is not None
    assert outcome.refused.reason is Reason.SNI_INVALID
    connect = check_hello(bad, "other.test")
    assert connect is not None and connect.refused is not None
    assert connect.refused.reason is Reason.SNI_INVALID
    good = tls([sni_ext(b"Up.Test.")])
    assert (passed := read_hello(good)) is not None and passed.refused is None
    assert passed.host == "up.test"
    mismatch = check_hello(good, "other.test")
    assert mismatch is not None and mismatch.refused is not None
    assert mismatch.refused.reason is Reason.SNI_MISMATCH
    assert check_hello(good, "up.test") == passed


def test_audit_lines_carry_the_bare_code() -> None:
    policy = compile_policy(load_manifest("network:\n  egress: [github.com]\n"))
    decision = policy.decide("example.com:443")
    assert decision.reason is Reason.NOT_ALLOWED
    stream = io.StringIO()
    log = AuditLog(stream=stream, session="s")
    for _ in range(2):  # the second line takes the remembered encoding
        log.decision(DecisionEvent.from_policy(decision, plane="l4"))
    log.decision(DecisionEvent("deny", Reason.SNI_INVALID, plane="l4", stage="sni"))
    log.closed(CloseEvent(plane="l4", reason=Reason.IDLE_TIMEOUT))
    text = stream.getvalue()
    assert "Reason." not in text
    lines = [json.loads(line) for line in text.splitlines()]
    reasons = [line["reason"] for line in lines]
    assert reasons == ["not_allowed", "not_allowed", "sni_invalid", "idle_timeout"]
    assert all(type(reason) is str for reason in reasons)
    assert '"reason":"not_allowed"' in text


def test_metric_labels_carry_the_bare_code() -> None:
    metrics = Metrics()
    metrics.decision(False, Reason.NOT_ALLOWED, "name", "l4")
    metrics.decision(False, "not_allowed", "name", "l4")  # the same series
    metrics.dns_lookup(0.01, Reason.DNS_TIMEOUT)
    body, _ = metrics.render()
    text = body.decode()
    assert "Reason." not in text
    line = 'egress_decisions_total{decision="deny",plane="l4",reason="not_allowed",stage="name"}'
    assert f"{line} 2.0" in text
    assert 'outcome="dns_timeout"' in text
    for series in metrics._counters.values():
        for labels in series:
            assert all(type(label) is str for label in labels)
