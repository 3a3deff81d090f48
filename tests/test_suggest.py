"""`egress-proxy suggest`: audit logs in, the manifest entries that would have allowed every
connection out. The commands run as processes (`python -m proxy suggest`, `check`, `run`); a
recorded learning session is turned into a manifest that `check` accepts and that, run again
without --learn, allows the same connections (loopback only, the tests' own DNS server)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.dns_server import DNSServer
from support.running import ROOT, RunningProxy, curl, http_upstream, make_config

from policy import compile_policy, load_manifest
from policy.suggest import Collector

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

HOSTS = ("up.test", "new.test", "api.new.test", "one.other.test", "two.other.test")


def suggest(*args: str, stdin: str | bytes | None = None) -> subprocess.CompletedProcess[str]:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "suggest", *args],
        cwd=ROOT,
        input=data,
        capture_output=True,
        timeout=60,
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def check(manifest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(manifest)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def line(host: str | None, decision: str = "allow", reason: str = "allowed", **more: Any) -> str:
    record = {
        "time": more.pop("time", "2026-12-01T10:00:00.000Z"),
        "event": "decision",
        "session": "s",
        "connection": "c-1",
        "client": "127.0.0.1:5000",
        "plane": "l4",
        "protocol": more.pop("protocol", "connect"),
        "host": host,
        "port": more.pop("port", 443),
        "sni": host,
        "method": None,
        "path": None,
        "decision": decision,
        "reason": reason,
        "stage": "sni",
        "rule": None,
        "ceiling": None,
        "resolved": ["192.0.2.1"],
        "pinned": ["192.0.2.1"],
        "message": "m",
    }
    record.update(more)
    return json.dumps(record)


def as_json(*args: str, stdin: str) -> dict[str, Any]:
    result = suggest("-", "--json", *args, stdin=stdin)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def entries(found: dict[str, Any]) -> list[str]:
    return [entry["entry"] for entry in found["entries"]]


# -- a recorded session, round trip --------------------------------------------------------


@pytest.fixture
def names(dns: DNSServer) -> DNSServer:
    for name in (*HOSTS, "private.test"):
        dns.set(name, a=["127.0.0.1"])
    dns.set("private.test", a=["127.0.0.2"])
    return dns


def visit(proxy: RunningProxy, port: int) -> list[int]:
    """One request (curl) to each of HOSTS through the proxy: their statuses."""
    return [curl(proxy.port, f"http://{host}:{port}/{host}").status for host in HOSTS]


@pytest.mark.parametrize("fmt", ["agent.yaml", "agent.toml"])
def test_a_learning_session_becomes_a_manifest_that_allows_it_again(
    tmp_path: Path, names: DNSServer, fmt: str
) -> None:
    config = make_config(names, allow=("127.0.0.0/8",)) + "  deny: [127.0.0.2/32]\n"
    with http_upstream() as upstream:
        learning = RunningProxy(
            tmp_path / "learn", "network:\n  egress: [up.test]\n", config=config, args=("--learn",)
        )
        with learning:
            assert visit(learning, upstream.port) == [200] * len(HOSTS)
            private = curl(learning.port, f"http://private.test:{upstream.port}/")
            assert private.status == 403
        log = learning.files.audit
        # Stopped mid-write: a torn last line is skipped, and said so.
        with open(log, "a") as handle:
            handle.write('{"time": "2026-12-01T10:00:00.000Z", "event": "deci')

        result = suggest(str(log), "--format", fmt)
        assert result.returncode == 0, result.stderr
        assert "skipped 1 line(s)" in result.stderr
        manifest = tmp_path / ("suggested.toml" if fmt == "agent.toml" else "suggested.yaml")
        manifest.write_text(result.stdout)
        if fmt == "agent.toml":
            allowed = tomllib.loads(result.stdout)["network_access"]["allowed"]
            assert sorted(allowed) == sorted(HOSTS)
        else:
            egress = yaml.safe_load(result.stdout)["network"]["egress"]
            # api.new.test is covered by new.test (an agent.yaml entry covers subdomains).
            assert egress == ["new.test", "one.other.test", "two.other.test", "up.test"]
        # The refused private address is no suggestion; it is listed apart.
        assert "private.test  deny  operator_deny  (1)" in result.stdout
        checked = check(manifest)
        assert checked.returncode == 0, checked.stdout + checked.stderr

        again = RunningProxy(tmp_path / "again", manifest.read_text(), config=config)
        again.files.manifest = manifest  # its own name, so TOML is read as TOML
        with again:
            assert visit(again, upstream.port) == [200] * len(HOSTS)
            result = curl(again.port, f"http://elsewhere.test:{upstream.port}/")
            assert result.headers["x-egress-denied"] == "not_allowed"
            assert {line["decision"] for line in again.decisions()} == {"allow", "deny"}


# -- grouping, the ceiling, the JSON shape ---------------------------------------------------


GROUPED = [
    line("a.github.io"),
    line("b.github.io", "would_deny", "not_allowed"),
    line("x.example.co.uk", "would_deny", "not_allowed", time="2026-12-01T10:00:05.000Z"),
    line("y.example.co.uk", port=80, time="2026-12-01T09:59:00.000Z"),
    line("solo.single.test"),
    line("co.uk"),
]


def test_group_folds_registrable_domains_never_public_suffixes() -> None:
    stdin = "\n".join(GROUPED[:-1]) + "\n"
    plain = as_json(stdin=stdin)
    # Side by side by domain, from the right (io, test, uk).
    assert entries(plain) == [
        "a.github.io",
        "b.github.io",
        "solo.single.test",
        "x.example.co.uk",
        "y.example.co.uk",
    ]
    grouped = as_json("--group", stdin=stdin)
    # github.io is a public suffix (the list's private section): its names stay apart; one
    # name alone under its domain (solo.single.test) stays as it is.
    assert entries(grouped) == ["a.github.io", "b.github.io", "solo.single.test", "example.co.uk"]
    folded = grouped["entries"][-1]
    assert folded == {
        "entry": "example.co.uk",
        "connections": 2,
        "first": "2026-12-01T09:59:00.000Z",
        "last": "2026-12-01T10:00:05.000Z",
        "ports": [80, 443],
    }
    toml = as_json("--group", "--format", "agent.toml", stdin=stdin)
    assert entries(toml) == ["a.github.io", "b.github.io", "solo.single.test", "*.example.co.uk"]
    # A name that is itself a public suffix is never folded into, nor folded: `co.uk` as seen.
    with_suffix = as_json("--group", "--format", "agent.toml", stdin="\n".join(GROUPED))
    assert entries(with_suffix) == [*entries(toml)[:3], "co.uk", "*.example.co.uk"]
    # The entries pass the manifest grammar as they are.
    for found, text in (
        (grouped, "network:\n  egress: " + json.dumps(entries(grouped))),
        (toml, "network_access:\n  allowed: " + json.dumps(entries(toml))),
    ):
        manifest = load_manifest(text)
        assert manifest.ok, manifest.findings
        policy = compile_policy(manifest)
        for host in ("x.example.co.uk", "y.example.co.uk", "a.github.io", "b.github.io"):
            assert policy.decide(f"{host}:443").allowed, (found["format"], host)
        assert not policy.decide("c.github.io:443").allowed


def test_ceiling_lists_apart_what_it_would_refuse(tmp_path: Path) -> None:
    ceiling = tmp_path / "ceiling.yaml"
    ceiling.write_text(
        "tenant: acme\negress: [example.co.uk, a.github.io, api.big.test, api.wide.test]\n"
    )
    more = [line(h) for h in ("x.big.test", "y.big.test", "api.wide.test", "www.wide.test")]
    stdin = "\n".join([*GROUPED[:-1], *more])
    found = as_json("--group", "--ceiling", str(ceiling), stdin=stdin + "\n")
    # wide.test would be outside the ceiling while api.wide.test is inside: not folded.
    assert entries(found) == ["a.github.io", "api.wide.test", "example.co.uk"]
    outside = {item["entry"]: item for item in found["outside_ceiling"]}
    assert set(outside) == {"big.test", "b.github.io", "solo.single.test", "www.wide.test"}
    assert outside["big.test"]["ceiling"] == ["ceiling.egress[2] 'api.big.test'"]
    assert "admits only ceiling.egress[2] 'api.big.test'" in outside["big.test"]["message"]
    assert outside["b.github.io"]["ceiling"] == []
    assert "no entry of the ceiling of tenant 'acme'" in outside["b.github.io"]["message"]
    assert outside["b.github.io"]["connections"] == 1
    # In text, they are comments after the block: the block itself stays pasteable.
    text = suggest("-", "--group", "--ceiling", str(ceiling), stdin=stdin).stdout
    document = yaml.safe_load(text)
    assert document == {"network": {"egress": ["a.github.io", "api.wide.test", "example.co.uk"]}}
    assert "#   b.github.io: no entry of the ceiling" in text
    suggested = tmp_path / "agent.yaml"
    suggested.write_text(text)
    checked = subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(suggested), "--ceiling", str(ceiling)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_json_shape_lifted_denials_in_others_apart_dns_left_out_and_corrupt_lines_counted() -> None:
    stdin = "\n".join(
        [
            line("api.good.test", "would_deny", "outside_ceiling"),
            line("evil.test", "deny", "not_allowed"),  # refused in a normal run: an entry lifts it
            line("nope.test", "deny", "ask_denied"),  # a person said no: apart
            line("private.test", "deny", "private"),
            line(None, "deny", "invalid_request"),
            line("gateway.svc.cluster.local", reason="platform_destination"),
            line("dns.good.test", "would_deny", "not_allowed", protocol="dns", port=None),
            json.dumps({"time": "2026-12-01T10:00:00.000Z", "event": "close", "host": "x.test"}),
            '{"event": "decision", "decision": "allow"',  # truncated
            "not json at all",
            line("api.good.test", "maybe", "allowed"),  # not a decision we write
            line("api.good.test", port="443"),  # a port that is not a number
            line("api.good.test", time="yesterday"),
            "",
        ]
    )
    data = stdin.encode() + b"\xff\xfe garbage\n" + b"x" * (300 * 1024) + b"\n"
    result = suggest("-", "--json", stdin=data)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "skipped 7 line(s)" in result.stderr
    found = json.loads(result.stdout)
    assert set(found) == {"format", "entries", "outside_ceiling", "not_suggested", "connections",
                          "skipped_lines", "dns_lines"}  # fmt: skip
    assert found["format"] == "agent.yaml"
    assert found["entries"] == [
        {
            "entry": entry,
            "connections": 1,
            "first": "2026-12-01T10:00:00.000Z",
            "last": "2026-12-01T10:00:00.000Z",
            "ports": [443],
        }
        for entry in ("evil.test", "api.good.test")
    ]
    assert found["outside_ceiling"] == []
    assert found["skipped_lines"] == 7 and found["dns_lines"] == 1 and found["connections"] == 3
    unsuggested = {(u["host"], u["decision"], u["reason"]) for u in found["not_suggested"]}
    assert unsuggested == {
        ("nope.test", "deny", "ask_denied"),
        ("private.test", "deny", "private"),
        (None, "deny", "invalid_request"),
        ("gateway.svc.cluster.local", "allow", "platform_destination"),
    }


def test_empty_logs_missing_files_and_stdin_twice() -> None:
    found = as_json(stdin="")
    assert found["entries"] == [] and found["connections"] == 0
    assert yaml.safe_load(suggest("-", stdin="").stdout) == {"network": {"egress": []}}
    toml = suggest("-", "--format", "agent.toml", stdin="").stdout
    assert tomllib.loads(toml) == {"network_access": {"allowed": []}}
    result = suggest("/nonexistent/audit.jsonl")
    assert result.returncode == 2
    assert "/nonexistent/audit.jsonl" in result.stderr and "cannot read" in result.stderr
    assert "Traceback" not in result.stderr
    result = suggest("-", "-", stdin="")
    assert result.returncode == 2 and "once" in result.stderr


def test_the_collector_is_pure_and_minimises_by_subdomain() -> None:
    collector = Collector()
    for host in ("a.b.example.test", "b.example.test", "example.test", "other.test"):
        collector.add(line(host))
    yaml_found = collector.suggest("agent.yaml")
    assert [e.entry for e in yaml_found.entries] == ["example.test", "other.test"]
    assert yaml_found.entries[0].connections == 3
    toml_found = collector.suggest("agent.toml")
    assert [e.entry for e in toml_found.entries] == [
        "example.test",
        "b.example.test",
        "a.b.example.test",
        "other.test",
    ]
    # A registrable lookup that says "public suffix" (None) never folds.
    assert collector.suggest("agent.toml", registrable=lambda host: None) == toml_found
