"""proxy.ops.audit: one JSON line per record, hostile values contained, failures counted."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from policy.addresses import Verdict
from policy.decisions import AddressDecision, Decision
from proxy.decide.events import MAX_FIELD, MAX_PATH, CloseEvent, DecisionEvent
from proxy.ops.audit import MAX_PENDING, AuditLog
from proxy.ops.metrics import Metrics

# 2026-01-02T03:04:05.678Z
FIXED = 1767323045.678
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def lines_of(path: Path) -> list[dict]:
    text = path.read_text(encoding="ascii")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_decision_line_fields(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path, session="sess-1", clock=lambda: FIXED) as log:
        log.decision(
            decision="allow",
            reason="allowed",
            stage="address",
            plane="l7",
            protocol="connect",
            client=("127.0.0.1", 50000),
            connection="c1",
            host="API.Example.com",
            port=443,
            sni="api.example.com",
            method="GET",
            path="/v1/x",
            rule="network.egress[2]",
            ceiling="ceiling.allow[0]",
            resolved=("93.184.216.34", "2606:2800:220:1::1"),
            pinned=("93.184.216.34",),
        )
    [line] = lines_of(path)
    assert line == {
        "time": "2026-01-02T03:04:05.678Z",
        "event": "decision",
        "session": "sess-1",
        "connection": "c1",
        "client": "127.0.0.1:50000",
        "plane": "l7",
        "protocol": "connect",
        "host": "API.Example.com",
        "port": 443,
        "sni": "api.example.com",
        "method": "GET",
        "path": "/v1/x",
        "decision": "allow",
        "reason": "allowed",
        "stage": "address",
        "rule": "network.egress[2]",
        "ceiling": "ceiling.allow[0]",
        "resolved": ["93.184.216.34", "2606:2800:220:1::1"],
        "pinned": ["93.184.216.34"],
        "message": None,
    }


def test_close_line_fields(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, session="s")
    log.closed(
        client=("::1", 4242, 0, 0),
        plane="l4",
        host="example.com",
        port=443,
        upstream="93.184.216.34",
        bytes_up=10,
        bytes_down=2000,
        duration=1.23456,
        reason="client_closed",
    )
    log.close()
    [line] = lines_of(path)
    assert TIME.fullmatch(line["time"])
    assert line["event"] == "close"
    assert line["client"] == "[::1]:4242"
    assert line["bytes_up"] == 10 and line["bytes_down"] == 2000
    assert line["duration_seconds"] == 1.235
    assert line["upstream"] == "93.184.216.34"
    assert line["reason"] == "client_closed"
    assert "truncated" not in line


def test_from_policy_objects() -> None:
    name = Decision(False, "not_allowed", "not in the manifest", "example.com", 443, "x[1]")
    event = DecisionEvent.from_policy(name, client="10.0.0.2:1", plane="l7")
    record = json.loads(event.line(session=None, now=FIXED))
    assert record["decision"] == "deny"
    assert (record["reason"], record["stage"], record["rule"]) == ("not_allowed", "name", "x[1]")
    assert record["port"] == 443 and record["client"] == "10.0.0.2:1"

    good = Verdict("93.184.216.34", True, "public", None, "", "")
    bad = Verdict("10.1.2.3", False, "private", "10.0.0.0/8", "Private-Use", "RFC1918")
    mixed = AddressDecision(False, "mixed_answer", "mixed", "example.com", (good, bad))
    record = json.loads(DecisionEvent.from_policy(mixed).line(session=None, now=FIXED))
    assert record["resolved"] == ["93.184.216.34", "10.1.2.3"]
    assert record["pinned"] == []
    allowed = AddressDecision(True, "allowed", "ok", "example.com", (good,), rule="r[0]")
    record = json.loads(DecisionEvent.from_policy(allowed, port=443).line(session=None, now=FIXED))
    assert record["pinned"] == ["93.184.216.34"] and record["port"] == 443


HOSTILE = [
    "evil\ncom",
    'evil\r\n{"decision":"allow"}',
    "line\u2028sep\u2029para\x85nel",
    "\x1b[2J\x1b]0;pwned\x07title",
    "nul\x00byte",
    "surrogate\udc80",
    "emoji\U0001f600",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_values_stay_one_ascii_line(tmp_path: Path, hostile: str) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.decision(
        decision="deny",
        reason="not_allowed",
        host=hostile,
        sni=hostile,
        path=hostile,
        method=hostile,
        message=hostile,
    )
    log.closed(host=hostile, sni=hostile)
    log.close()
    raw = path.read_bytes()
    assert raw.isascii()
    assert raw.count(b"\n") == 2
    assert b"\x1b" not in raw and b"\r" not in raw and b"\x00" not in raw
    records = [json.loads(line) for line in raw.decode().split("\n")[:-1]]
    assert records[0]["host"] == hostile and records[0]["path"] == hostile
    assert records[0]["decision"] == "deny"
    assert records[1]["sni"] == hostile


def test_long_fields_capped(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.decision(
        decision="deny",
        reason="not_allowed",
        host="a" * 10_000,
        sni=b"b" * 10_000,
        path="/" + "p" * 100_000,
        method="M" * 1000,
        resolved=[f"10.0.0.{i}" for i in range(1000)],
    )
    log.close()
    [line] = lines_of(path)
    assert len(line["host"]) == MAX_FIELD
    assert len(line["sni"]) == MAX_FIELD
    assert len(line["path"]) == MAX_PATH
    assert len(line["method"]) <= 64
    assert len(line["resolved"]) == 64
    assert set(line["truncated"]) == {"host", "sni", "path", "method", "resolved"}
    assert len(path.read_bytes()) < 10_000


def test_file_created_0600_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    old = os.umask(0)
    try:
        log = AuditLog(path)
    finally:
        os.umask(old)
    log.decision(decision="deny", reason="blocked")
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    log = AuditLog(path)
    log.decision(decision="allow", reason="allowed")
    log.close()
    assert [r["reason"] for r in lines_of(path)] == ["blocked", "allowed"]


def test_default_is_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    log = AuditLog(session="s")
    log.decision(decision="deny", reason="ip_literal", host="127.1")
    log.closed(host="127.1", bytes_up=0, bytes_down=0, duration=0.0)
    out = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["event"] for line in out] == ["decision", "close"]
    log.close()
    print("still open")
    assert capsys.readouterr().out == "still open\n"


def write_errors(metrics: Metrics) -> float:
    payload, _ = metrics.render()
    for family in text_string_to_metric_families(payload.decode()):
        if family.name == "egress_audit_write_errors":
            return family.samples[0].value
    raise AssertionError("no egress_audit_write_errors_total")


def test_write_to_dev_full_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    metrics = Metrics()
    log = AuditLog("/dev/full", metrics=metrics)
    for _ in range(3):
        log.decision(decision="deny", reason="blocked")
    log.close()
    assert log.write_errors == 3
    assert write_errors(metrics) == 3
    err = capsys.readouterr().err
    assert err.count("audit log write failed") == 1


def test_closed_stream_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    stream.close()
    log = AuditLog(stream=stream)
    log.decision(decision="deny", reason="blocked")
    log.closed()
    assert log.write_errors == 2
    assert capsys.readouterr().err.count("audit log write failed") == 1


def test_broken_pipe_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    path = f"/proc/self/fd/{write_end}"
    if not os.path.exists(path):
        os.close(write_end)
        pytest.skip("no /proc")
    log = AuditLog(path)  # a fresh fd on the same pipe, which has no reader
    os.close(write_end)
    log.decision(decision="deny", reason="blocked")  # EPIPE; SIGPIPE is ignored by Python
    log.close()
    assert log.write_errors == 1
    assert "audit log write failed" in capsys.readouterr().err


def test_write_after_close_is_counted(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.close()
    log.close()
    log.decision(decision="deny", reason="blocked")
    assert log.write_errors == 1


def test_torn_line_is_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    real_write = os.write
    calls = {"n": 0}

    def short_then_full(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, data[:10])
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", short_then_full)
    log.decision(decision="deny", reason="first")
    log.decision(decision="deny", reason="second")
    monkeypatch.undo()
    log.close()
    assert log.write_errors == 1
    text = path.read_text()
    torn, whole, end = text.split("\n")
    assert end == "" and len(torn) == 10
    assert json.loads(whole)["reason"] == "second"


def test_events_are_frozen_and_serialisable() -> None:
    event = CloseEvent(host="h", bytes_up=1, bytes_down=2, duration=0.5)
    with pytest.raises(AttributeError):
        event.host = "other"  # type: ignore[misc]
    record = json.loads(event.line(session="s", now=FIXED))
    assert record["time"] == "2026-01-02T03:04:05.678Z"


def test_an_unhashable_value_is_written_as_its_text(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as log:
        log.decision(decision="deny", reason="x", host=["a", "b"])  # type: ignore[arg-type]
    [line] = lines_of(path)
    assert line["host"] == "['a', 'b']" and line["reason"] == "x"


def _allowed(host: str) -> DecisionEvent:
    return DecisionEvent(
        decision="allow", reason="allowed", stage="name", plane="l4", protocol="connect",
        host=host, port=443,
    )  # fmt: skip


def _denied(host: str) -> DecisionEvent:
    return DecisionEvent(
        decision="deny", reason="not_allowed", stage="name", plane="l4", protocol="connect",
        host=host, port=443,
    )  # fmt: skip


def test_inside_a_loop_lines_land_once_the_iteration_ends_and_a_deny_at_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"

    def hosts() -> list[str]:
        text = path.read_text(encoding="ascii")
        return [json.loads(line)["host"] for line in text.splitlines()]

    async def main() -> None:
        with AuditLog(path) as log:
            log.decision(_allowed("a.test"))
            log.closed(CloseEvent(host="a.test", port=443, reason="client_closed"))
            log.decision(_allowed("b.test"))
            assert hosts() == []  # gathered for one write at the end of this iteration
            await asyncio.sleep(0)
            assert hosts() == ["a.test", "a.test", "b.test"]
            log.decision(_allowed("c.test"))
            # A deny is in the file before the caller sends the refusal, after what came first.
            log.decision(_denied("d.test"))
            assert hosts() == ["a.test", "a.test", "b.test", "c.test", "d.test"]
            log.decision(_allowed("e.test"))
        # Closing writes what is gathered.
        assert hosts()[-1] == "e.test"

    asyncio.run(main())


def test_a_burst_in_one_iteration_is_written_in_bounded_batches(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"

    async def main() -> None:
        with AuditLog(path) as log:
            for i in range(MAX_PENDING + 10):
                log.decision(_allowed(f"h{i}.test"))
            # The first MAX_PENDING went out without waiting for the loop.
            assert len(path.read_text().splitlines()) == MAX_PENDING
            await asyncio.sleep(0)
            assert len(path.read_text().splitlines()) == MAX_PENDING + 10

    asyncio.run(main())
