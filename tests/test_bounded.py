"""proxy.common.bounded: the hot path's one bounded cache never grows past its bound, whatever
distinct keys a client sends, and the caches built on it (audit encodings and clients, metric
label sets, the Vetter's memo in test_vetting.py) still answer as before under such a flood."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.common.bounded import Bounded
from proxy.decide import events
from proxy.ops.audit import AuditLog
from proxy.ops.metrics import Metrics


def test_never_past_its_bound_under_distinct_keys() -> None:
    cache: Bounded[str, int] = Bounded(64)
    for n in range(10_000):
        assert cache.put(f"host-{n}.test", n) == n
        assert len(cache) <= 64
        assert cache.get(f"host-{n}.test") == n  # what was just stored is there
    assert cache.get("never.test") is None


def test_a_full_cache_starts_over_for_a_new_key_only() -> None:
    cache: Bounded[str, int] = Bounded(3)
    for n, key in enumerate("abc"):
        cache.put(key, n)
    cache.put("a", 10)  # a key it holds: replaced, nothing dropped
    assert (len(cache), cache.get("a"), cache.get("c")) == (3, 10, 2)
    cache.put("d", 3)  # full: emptied, then stored
    assert (len(cache), cache.get("a"), cache.get("d")) == (1, None, 3)


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one entry"):
        Bounded(0)


def test_audit_lines_under_a_flood_of_distinct_hosts_and_clients(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    flood = 3 * events._ENCODED_ENTRIES
    with AuditLog(path, session="s") as log:
        for n in range(flood):
            log.decision(
                decision="deny",
                reason="not_allowed",
                stage="name",
                host=f"h{n}.test",
                client=("192.0.2.1", 1024 + n),
                connection=f"c{n}",
            )
            assert len(events._ENCODED) <= events._ENCODED_ENTRIES
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == flood
    # Every line names its own host and client, cached, evicted or not.
    assert all(x["host"] == f"h{n}.test" for n, x in enumerate(lines))
    assert all(x["client"] == f"192.0.2.1:{1024 + n}" for n, x in enumerate(lines))


def test_what_only_one_connection_names_is_never_remembered(tmp_path: Path) -> None:
    # A connection's id and client port are new on every connection: remembering their
    # encodings would fill the table (and the idle proxy's memory) with values never seen again.
    events._ENCODED.clear()
    with AuditLog(tmp_path / "audit.jsonl", session="s") as log:
        for n in range(2000):
            log.decision(
                decision="allow",
                reason="allowed",
                stage="address",
                host="same.test",
                client=("192.0.2.1", 1024 + n),
                connection=f"c{n}",
            )
    assert len(events._ENCODED) < 20
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["connection"] for x in lines[-2:]] == ["c1998", "c1999"]
    assert lines[-1]["client"] == "192.0.2.1:3023"


def test_metric_label_sets_under_a_flood_of_distinct_keys() -> None:
    m = Metrics()
    bound = m._decision_labels.limit
    for n in range(3 * bound):
        m.decision("deny", "not_allowed", f"stage-{n}", plane="l4")
        assert len(m._decision_labels) <= bound
    # The label set of a repeat is the same after the cache started over.
    m.decision("deny", "not_allowed", "stage-0", plane="l4")
    assert m._decision_labels.get(("deny", "not_allowed", "stage-0", "l4")) is not None
