"""proxy.ops.metrics: names, labels and values as the admin endpoint renders them."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from policy.addresses import Verdict
from policy.decisions import AddressDecision, Decision
from proxy.ops.metrics import LATENCY_BUCKETS, MAX_LABEL_VALUES, OTHER, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    payload, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    found = {}
    for family in text_string_to_metric_families(payload.decode()):
        assert family.name.startswith("egress_"), family.name
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


def label_values(metrics: Metrics, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for (n, labels) in samples(metrics) if n == name}


def test_decisions_by_decision_reason_stage_plane() -> None:
    m = Metrics()
    m.decision("deny", "not_allowed", "name")
    m.decision("deny", "not_allowed", "name")
    m.decision("allow", "allowed", "name", plane="l4")
    m.decision(False, "mixed_answer", "address")
    key = {"decision": "deny", "reason": "not_allowed", "stage": "name", "plane": "l7"}
    assert value(m, "egress_decisions_total", **key) == 2
    key = {"decision": "allow", "reason": "allowed", "stage": "name", "plane": "l4"}
    assert value(m, "egress_decisions_total", **key) == 1
    key = {"decision": "deny", "reason": "mixed_answer", "stage": "address", "plane": "l7"}
    assert value(m, "egress_decisions_total", **key) == 1


def test_record_policy_objects() -> None:
    m = Metrics()
    m.record(Decision(False, "outside_ceiling", "no", "example.com", 443))
    verdict = Verdict("10.0.0.1", False, "private", "10.0.0.0/8", "Private-Use", "RFC1918")
    m.record(AddressDecision(False, "private", "no", "example.com", (verdict,)), plane="l4")
    key = {"decision": "deny", "reason": "outside_ceiling", "stage": "name", "plane": "l7"}
    assert value(m, "egress_decisions_total", **key) == 1
    key = {"decision": "deny", "reason": "private", "stage": "address", "plane": "l4"}
    assert value(m, "egress_decisions_total", **key) == 1


def test_dns_and_connect_histograms() -> None:
    m = Metrics()
    m.dns_lookup(0.0002, "ok")
    m.dns_lookup(0.03, "ok")
    m.dns_lookup(5.0, "dns_timeout")
    m.upstream_connect(0.004, "ok")
    name = "egress_dns_lookup_seconds"
    assert value(m, f"{name}_count", outcome="ok") == 2
    assert value(m, f"{name}_sum", outcome="ok") == pytest.approx(0.0302)
    assert value(m, f"{name}_bucket", outcome="ok", le="0.0005") == 1
    assert value(m, f"{name}_bucket", outcome="ok", le="0.05") == 2
    assert value(m, f"{name}_bucket", outcome="dns_timeout", le="5.0") == 1
    assert value(m, f"{name}_bucket", outcome="dns_timeout", le="2.5") == 0
    assert value(m, "egress_upstream_connect_seconds_count", outcome="ok") == 1
    buckets = {
        float(dict(labels)["le"])
        for (n, labels) in samples(m)
        if n == f"{name}_bucket" and dict(labels)["outcome"] == "ok"
    }
    assert buckets == {*LATENCY_BUCKETS, math.inf}
    assert min(buckets) < 0.001 and max(LATENCY_BUCKETS) >= 10


def test_connections_and_bytes() -> None:
    m = Metrics()
    assert value(m, "egress_active_connections", plane="l7") == 0
    assert value(m, "egress_bytes_total", direction="up", plane="l4") == 0
    m.connection_opened("l7", "connect")
    m.connection_opened("l7", "http")
    m.connection_opened("l4")
    assert value(m, "egress_active_connections", plane="l7") == 2
    assert value(m, "egress_connections_total", plane="l7", protocol="connect") == 1
    m.connection_closed("l7", bytes_up=100, bytes_down=2000, seconds=1.5)
    m.connection_closed("l4", bytes_up=7, bytes_down=9, seconds=0.2)
    assert value(m, "egress_active_connections", plane="l7") == 1
    assert value(m, "egress_active_connections", plane="l4") == 0
    assert value(m, "egress_bytes_total", direction="up", plane="l7") == 100
    assert value(m, "egress_bytes_total", direction="down", plane="l7") == 2000
    assert value(m, "egress_bytes_total", direction="down", plane="l4") == 9
    assert value(m, "egress_connection_duration_seconds_sum", plane="l7") == 1.5


def test_bad_amounts_do_not_raise() -> None:
    m = Metrics()
    m.connection_opened("l7")
    m.connection_closed("l7", bytes_up=-5, bytes_down=math.nan, seconds=math.inf)  # type: ignore[arg-type]
    m.dns_lookup(-1.0, "ok")
    assert value(m, "egress_bytes_total", direction="up", plane="l7") == 0
    assert value(m, "egress_bytes_total", direction="down", plane="l7") == 0
    assert value(m, "egress_dns_lookup_seconds_sum", outcome="ok") == 0


def test_reloads_and_build_info() -> None:
    m = Metrics()
    assert value(m, "egress_reloads_total", result="failure") == 0
    m.reload(True)
    m.reload(False)
    m.reload(False)
    assert value(m, "egress_reloads_total", result="success") == 1
    assert value(m, "egress_reloads_total", result="failure") == 2
    assert value(m, "egress_last_reload_success_timestamp_seconds") > 0  # type: ignore[operator]
    m.set_build_info("0.1.0", "3.12.1")
    m.set_build_info("0.2.0", "3.13.0")
    assert label_values(m, "egress_build_info", "version") == {"0.2.0"}
    assert value(m, "egress_build_info", version="0.2.0", python="3.13.0") == 1


def test_audit_write_errors_counter() -> None:
    m = Metrics()
    assert value(m, "egress_audit_write_errors_total") == 0
    m.audit_write_error()
    assert value(m, "egress_audit_write_errors_total") == 1


@pytest.mark.parametrize(
    "hostile",
    [
        "evil.example.com",
        "Not_Allowed",
        "x" * 65,
        "reason\nwith newline",
        'quote"}',
        "",
        "\x1b[31m",
        "ünïcode",
        None,
        42,
    ],
)
def test_hostile_reason_becomes_other(hostile: object) -> None:
    m = Metrics()
    m.decision("deny", hostile, "name")  # type: ignore[arg-type]
    m.dns_lookup(0.1, hostile)  # type: ignore[arg-type]
    assert label_values(m, "egress_decisions_total", "reason") == {OTHER}
    assert label_values(m, "egress_dns_lookup_seconds_count", "outcome") == {OTHER}


def test_closed_sets_become_other() -> None:
    m = Metrics()
    m.decision("maybe", "allowed", "name", plane="l9")
    m.connection_opened("203.0.113.7:4242")
    key = {"decision": OTHER, "reason": "allowed", "stage": "name", "plane": OTHER}
    assert value(m, "egress_decisions_total", **key) == 1
    assert value(m, "egress_active_connections", plane=OTHER) == 1


def test_distinct_label_values_are_capped() -> None:
    m = Metrics()
    for i in range(MAX_LABEL_VALUES + 50):
        m.decision("deny", f"code_{i}", "name")
    reasons = label_values(m, "egress_decisions_total", "reason")
    assert len(reasons) == MAX_LABEL_VALUES + 1
    assert OTHER in reasons
    # A value seen before the cap keeps its own series afterwards.
    m.decision("deny", "code_0", "name")
    key = {"decision": "deny", "reason": "code_0", "stage": "name", "plane": "l7"}
    assert value(m, "egress_decisions_total", **key) == 2


def test_instances_do_not_collide() -> None:
    a = Metrics()
    b = Metrics()
    a.decision("deny", "blocked", "name")
    a.connection_opened("l7")
    key = {"decision": "deny", "reason": "blocked", "stage": "name", "plane": "l7"}
    assert value(a, "egress_decisions_total", **key) == 1
    assert value(b, "egress_decisions_total", **key) is None
    assert value(b, "egress_active_connections", plane="l7") == 0
    assert a.registry is not b.registry
    # Nothing leaks into the process-wide default registry.
    assert REGISTRY.get_sample_value("egress_decisions_total", key) is None


def test_repeated_decisions_count_under_the_labels_of_the_first() -> None:
    """The per-call label cache: repeated calls count on the same series, True (not 1) is an
    allow, and values the guards map to `other` keep being mapped so."""
    m = Metrics()
    for _ in range(3):
        m.decision(True, "allowed", "sni", plane="l4")
        m.decision(1, "allowed", "sni", plane="l4")  # type: ignore[arg-type]
        m.decision("deny", "Not A Code", "name", plane="l4")
    key = {"decision": "allow", "reason": "allowed", "stage": "sni", "plane": "l4"}
    assert value(m, "egress_decisions_total", **key) == 3
    key = {"decision": OTHER, "reason": "allowed", "stage": "sni", "plane": "l4"}
    assert value(m, "egress_decisions_total", **key) == 3
    key = {"decision": "deny", "reason": OTHER, "stage": "name", "plane": "l4"}
    assert value(m, "egress_decisions_total", **key) == 3
