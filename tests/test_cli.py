"""The `egress-proxy` CLI contract (issue 2): exit codes, `--json` shapes, format detection,
targets, `--resolve`, `--config`, and the human tables. Scripts outside this repo rely on these,
so the assertions are on what a user sees: exit status, stdout, stderr.

Most cases run `proxy.cli.main` in-process (fast); a representative few run the installed
console script, so packaging and the real process boundary are covered too.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_SCRIPT = shutil.which("egress-proxy", path=str(Path(sys.executable).parent))
COMMAND = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "proxy"]

CHECK_KEYS = {"ok", "format", "findings", "rules"}
FINDING_KEYS = {"path", "value", "reason", "message", "severity"}
EXPLAIN_KEYS = {"target", "allowed", "stage", "reason", "rule", "addresses"}
CLASSIFY_KEYS = {"address", "public", "reason", "range"}


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def cli(*args: str | Path) -> Run:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], out=out, err=err)
    return Run(code, out.getvalue(), err.getvalue())


def run(*args: str | Path, stdin: str | None = None, timeout: float = 60) -> Run:
    done = subprocess.run(
        [*COMMAND, *(str(a) for a in args)],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert "Traceback" not in done.stdout + done.stderr
    return Run(done.returncode, done.stdout, done.stderr)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def explain(*args: str | Path) -> list[dict[str, Any]]:
    result = cli("explain", "--json", *args)
    assert result.code == 0, result.err
    rows = result.json()
    assert isinstance(rows, list)
    for row in rows:
        assert row.keys() >= EXPLAIN_KEYS
    return rows


def by_target(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["target"]: row for row in rows}


@pytest.fixture
def github(tmp_path: Path) -> Path:
    return write(tmp_path, "agent.yaml", "network:\n  egress:\n    - github.com\n")


@pytest.fixture
def url_rules(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        "agent.toml",
        "schema_version = 1\n"
        "[network_access]\n"
        'allowed = ["https://api.example.com/api/", "pypi.org", "*.example.org",'
        ' "2606:4700:4700::1111"]\n'
        'blocked = ["https://api.example.com/api/secret/", "93.184.216.34"]\n',
    )


# -- check -----------------------------------------------------------------------------------------


def test_check_valid_manifest_exits_0_with_the_json_shape(github: Path) -> None:
    result = cli("check", github, "--json")
    assert result.code == 0
    doc = result.json()
    assert doc.keys() >= CHECK_KEYS
    assert doc["ok"] is True and doc["format"] == "agent.yaml" and doc["findings"] == []
    assert [r["host"] for r in doc["rules"]] == ["github.com"]
    assert doc["rules"][0]["rule"] == "network.egress[0]"


def test_check_findings_exit_1_each_with_path_value_reason_message_severity(
    tmp_path: Path,
) -> None:
    manifest = write(
        tmp_path,
        "agent.yaml",
        "network:\n  egress:\n    - '*.github.com'\n    - pypi.org\n    - GitHub.com\n",
    )
    result = cli("check", manifest, "--json")
    assert result.code == 1
    doc = result.json()
    assert doc["ok"] is False and doc["rules"] == []
    for finding in doc["findings"]:
        assert finding.keys() >= FINDING_KEYS
    found = {f["path"]: f for f in doc["findings"]}
    assert found["network.egress[0]"]["value"] == "*.github.com"
    assert found["network.egress[0]"]["reason"] == "wildcard"
    assert found["network.egress[0]"]["severity"] == "error"
    assert "write 'github.com'" in found["network.egress[0]"]["message"]
    assert found["network.egress[2]"]["reason"] == "not_canonical"
    assert "network.egress[1]" not in found


def test_check_warnings_alone_still_exit_0(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress: [pypi.org, pypi.org]\n")
    result = cli("check", manifest, "--json")
    assert result.code == 0
    doc = result.json()
    assert doc["ok"] is True
    assert [(f["reason"], f["severity"]) for f in doc["findings"]] == [("duplicate", "warning")]


def test_check_unreadable_or_unparsable_exit_2(tmp_path: Path) -> None:
    missing = cli("check", tmp_path / "absent.yaml")
    assert missing.code == 2
    assert "egress-proxy:" in missing.err and "absent.yaml" in missing.err
    broken = write(tmp_path, "broken.yaml", "network:\n  egress: [a.com\n")
    result = cli("check", broken)
    assert result.code == 2
    assert f"{broken}:3:" in result.err


def test_check_json_on_unusable_input_prints_an_error_object(tmp_path: Path) -> None:
    result = cli("check", tmp_path / "absent.yaml", "--json")
    assert result.code == 2
    doc = result.json()
    assert doc["ok"] is False
    assert doc["error"]["reason"] == "unreadable"
    assert doc["error"]["file"] == str(tmp_path / "absent.yaml")


def test_check_human_output_is_a_readable_table(tmp_path: Path) -> None:
    manifest = write(
        tmp_path, "agent.yaml", "network:\n  egress: [github.com, 'https://pypi.org']\n"
    )
    result = cli("check", manifest)
    assert result.code == 1
    first = result.out.splitlines()[0]
    assert str(manifest) in first and "INVALID" in first and "1 error(s)" in first
    assert "SEVERITY" in result.out and "REASON" in result.out
    row = next(line for line in result.out.splitlines() if "network.egress[1]" in line)
    assert "scheme" in row and "write 'pypi.org'" in row

    valid = cli("check", EXAMPLES / "agent.yaml", "--ceiling", EXAMPLES / "ceiling.yaml")
    assert valid.code == 0
    assert "valid, 0 error(s)" in valid.out
    assert "effective rules:" in valid.out
    rule = next(line for line in valid.out.splitlines() if "api.zendesk.com" in line)
    assert "network.egress[0]" in rule and "ceiling.egress[0]" in rule


def test_check_findings_are_listed_in_document_order(tmp_path: Path) -> None:
    entries = "".join(f"    - h{i}.example.com\n" for i in range(10))
    manifest = write(
        tmp_path, "agent.yaml", f"network:\n  egress:\n{entries}    - h3.example.com\n    - bad\n"
    )
    ceiling = write(tmp_path, "ceiling.yaml", "egress: [h1.example.com]\n")
    paths = [
        f["path"] for f in cli("check", manifest, "--ceiling", ceiling, "--json").json()["findings"]
    ]
    indexes = [int(p.split("[")[1].rstrip("]")) for p in paths]
    assert indexes == sorted(indexes)


def test_the_broken_example_reports_each_mistake(tmp_path: Path) -> None:
    result = cli(
        "check", EXAMPLES / "broken-agent.yaml", "--ceiling", EXAMPLES / "ceiling.yaml", "--json"
    )
    assert result.code == 1
    reasons = {f["reason"] for f in result.json()["findings"]}
    assert {
        "wildcard",
        "scheme",
        "port",
        "not_canonical",
        "ip_address",
        "loopback_name",
        "internal_name",
        "single_label",
        "duplicate",
        "unknown_key",
        "outside_ceiling",
    } <= reasons


# -- format detection ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("agent.toml", '[network_access]\nallowed = ["pypi.org"]\n', "agent.toml"),
        ("agent.yaml", "network_access:\n  allowed: [pypi.org]\n", "agent.toml"),
        ("agent.yaml", "schema_version: 1\n", "agent.toml"),
        ("agent.json", '{"network_access": {"allowed": ["pypi.org"]}}', "agent.toml"),
        ("agent.json", '{"schema_version": 1}', "agent.toml"),
        ("agent.json", '{"network": {"egress": ["pypi.org"]}}', "agent.yaml"),
        ("agent.yaml", "network:\n  egress: [pypi.org]\n", "agent.yaml"),
        ("manifest", "name: x\n", "agent.yaml"),
    ],
)
def test_format_detection(tmp_path: Path, name: str, text: str, expected: str) -> None:
    result = cli("check", write(tmp_path, name, text), "--json")
    assert result.code == 0, result.err
    assert result.json()["format"] == expected


def test_format_override(tmp_path: Path) -> None:
    # The manifest says agent.toml by its key; the override reads it as agent.yaml, where
    # `network_access` is not ours and nothing is declared.
    manifest = write(tmp_path, "agent.yaml", "network_access:\n  allowed: [pypi.org]\n")
    doc = cli("check", manifest, "--format", "agent.yaml", "--json").json()
    assert doc["format"] == "agent.yaml" and doc["rules"] == []
    plain = write(tmp_path, "plain.yaml", "name: x\n")
    assert cli("check", plain, "--format", "agent.toml", "--json").json()["format"] == "agent.toml"


def test_format_override_refuses_an_unknown_format(
    github: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("check", github, "--format", "agent.json").code == 2
    assert "agent.json" in capsys.readouterr().err


def test_stdin_manifest(github: Path) -> None:
    result = run("check", "-", "--json", stdin=github.read_text())
    assert result.code == 0
    assert result.json()["format"] == "agent.yaml"
    # Detection by key works on stdin too, where no file name can say the format.
    toml_like = run("check", "-", "--json", stdin="network_access:\n  allowed: [pypi.org]\n")
    assert toml_like.code == 0 and toml_like.json()["format"] == "agent.toml"
    human = run("check", "-", stdin="network:\n  egress: [GitHub.com]\n")
    assert human.code == 1 and "<stdin>" in human.out


def test_only_one_input_may_come_from_stdin() -> None:
    result = run("check", "-", "--config", "-", stdin="network: {}\n")
    assert result.code == 2
    assert "stdin" in result.err


# -- usage -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["check"],
        ["explain", "m.yaml"],
        ["classify"],
        ["check", "m.yaml", "--no-such-option"],
        ["explain", "m.yaml", "-foo.example.com"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(*argv).code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("--help").code == 0
    assert "check" in capsys.readouterr().out


def test_usage_error_through_the_installed_command() -> None:
    result = run("explain")
    assert result.code == 2
    assert "usage:" in result.err


# -- explain: names --------------------------------------------------------------------------------


def test_an_entry_covers_its_subdomains_on_label_boundaries(github: Path) -> None:
    targets = ["github.com", "api.github.com", "a.b.github.com", "notgithub.com"]
    rows = by_target(explain(github, *targets, "github.com.example"))
    for allowed in ("github.com", "api.github.com", "a.b.github.com"):
        assert rows[allowed]["allowed"] is True
        assert rows[allowed]["stage"] == "name"
        assert rows[allowed]["rule"] == "network.egress[0]"
        assert rows[allowed]["addresses"] is None
    for denied in ("notgithub.com", "github.com.example"):
        assert rows[denied]["allowed"] is False
        assert rows[denied]["reason"] == "not_allowed"


def test_explain_exits_0_when_every_target_is_denied(github: Path) -> None:
    assert cli("explain", github, "example.org", "localhost", "127.1").code == 0


def test_explain_refuses_names_the_sandbox_owns(github: Path) -> None:
    rows = by_target(
        explain(github, "localhost:8080", "vault.internal", "svc.cluster.local", "127.1")
    )
    assert rows["localhost:8080"]["reason"] == "loopback_name"
    assert rows["vault.internal"]["reason"] == "internal_name"
    assert rows["svc.cluster.local"]["reason"] == "internal_name"
    assert rows["127.1"]["reason"] == "ip_literal"


def test_a_target_starting_with_a_dash_after_double_dash(github: Path) -> None:
    rows = explain(github, "--", "-x.github.com", "github.com")
    assert [r["target"] for r in rows] == ["-x.github.com", "github.com"]
    assert rows[1]["allowed"] is True


def test_explain_host_port_and_bracketed_v6_targets(github: Path, url_rules: Path) -> None:
    rows = by_target(explain(github, "api.github.com:443", "[2606:4700::1111]:443", "[::1]:80"))
    assert rows["api.github.com:443"]["allowed"] is True
    for literal in ("[2606:4700::1111]:443", "[::1]:80"):
        assert rows[literal]["allowed"] is False
        assert rows[literal]["reason"] == "ip_literal"
        assert rows[literal]["stage"] == "name"
    # agent.toml may allow an exact public literal: its address is its own DNS answer.
    (row,) = explain(url_rules, "[2606:4700:4700::1111]:443")
    assert row["allowed"] is True and row["stage"] == "address"
    assert [a["address"] for a in row["addresses"]] == ["2606:4700:4700::1111"]


def test_explain_rejects_malformed_targets_without_stopping(github: Path) -> None:
    rows = by_target(explain(github, "[::1", "github.com:99999", "ftp://github.com/", "github.com"))
    assert rows["[::1"]["allowed"] is False
    assert rows["github.com:99999"]["reason"] == "invalid_port"
    assert rows["ftp://github.com/"]["reason"] == "unsupported_scheme"
    assert rows["github.com"]["allowed"] is True


def test_explain_human_table(github: Path) -> None:
    result = cli("explain", github, "api.github.com", "notgithub.com")
    assert result.code == 0
    lines = result.out.splitlines()
    assert lines[0].split() == ["DECISION", "TARGET", "STAGE", "REASON", "RULE", "WHY"]
    allow = next(line for line in lines if "api.github.com" in line)
    deny = next(line for line in lines if "notgithub.com" in line)
    assert allow.startswith("allow") and "network.egress[0]" in allow
    assert deny.startswith("DENY") and "not_allowed" in deny


# -- explain: URL targets against agent.toml URL prefixes ------------------------------------------


def test_url_prefix_rules_normalise_the_path(url_rules: Path) -> None:
    inside = "https://api.example.com/api/v1/items"
    escapes = [
        "https://api.example.com/api/../admin",
        "https://api.example.com/api/%2e%2e/admin",
        "https://api.example.com/api/./../admin",
        "https://api.example.com/api",
    ]
    rows = by_target(explain(url_rules, inside, *escapes))
    assert rows[inside]["allowed"] is True
    assert rows[inside]["rule"] == "network_access.allowed[0]"
    for target in escapes:
        assert rows[target]["allowed"] is False, target
        assert rows[target]["reason"] == "path_not_allowed", target


def test_url_prefix_rules_bind_scheme_and_port(url_rules: Path) -> None:
    rows = by_target(
        explain(
            url_rules,
            "https://api.example.com:443/api/x",
            "http://api.example.com/api/x",
            "https://api.example.com:8443/api/x",
        )
    )
    assert rows["https://api.example.com:443/api/x"]["allowed"] is True
    assert rows["http://api.example.com/api/x"]["allowed"] is False
    assert rows["https://api.example.com:8443/api/x"]["allowed"] is False


def test_blocked_url_prefix_wins_over_allowed(url_rules: Path) -> None:
    for target in (
        "https://api.example.com/api/secret/x",
        "https://api.example.com/api/Secret/x",
        "https://api.example.com/api/./secret/x",
        "https://api.example.com/api//secret/x",
    ):
        (row,) = explain(url_rules, target)
        assert row["allowed"] is False and row["reason"] == "blocked", target
        assert row["rule"] == "network_access.blocked[0]"


def test_a_parameter_only_segment_cannot_climb_out_of_a_prefix(url_rules: Path) -> None:
    # Servers that drop path parameters (Tomcat, Spring) read /api/;/../admin as /api//../admin,
    # fold the '//' and serve /admin.
    (row,) = explain(url_rules, "https://api.example.com/api/;/../admin")
    assert row["allowed"] is False


def test_path_parameters_do_not_slip_past_a_blocked_prefix(url_rules: Path) -> None:
    # The same servers serve /api/secret;jsessionid=1/data as /api/secret/data.
    (row,) = explain(url_rules, "https://api.example.com/api/secret;jsessionid=1/data")
    assert row["allowed"] is False


def test_url_only_host_needs_inspection_and_fails_closed_without_it(
    url_rules: Path, tmp_path: Path
) -> None:
    (row,) = explain(url_rules, "api.example.com:443")
    assert row["allowed"] is True and row["needs_inspection"] is True
    config = write(tmp_path, "config.yaml", "inspection:\n  enabled: false\n")
    (row,) = explain(url_rules, "--config", config, "api.example.com:443")
    assert row["allowed"] is False and row["reason"] == "inspection_disabled"


def test_agent_toml_exact_and_wildcard_patterns(url_rules: Path) -> None:
    rows = by_target(explain(url_rules, "pypi.org", "www.pypi.org", "example.org", "a.example.org"))
    assert rows["pypi.org"]["allowed"] is True
    assert rows["www.pypi.org"]["allowed"] is False  # `pypi.org` is that host only
    assert rows["example.org"]["allowed"] is True
    assert rows["a.example.org"]["allowed"] is True


# -- explain: the address stage --------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt at DNS or a connection fails the test: `--resolve` must send nothing."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("explain tried to use the network")

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "create_connection"):
        monkeypatch.setattr(socket, name, refuse)
    monkeypatch.setattr(socket, "socket", refuse)


@pytest.mark.usefixtures("no_network")
def test_resolve_runs_the_address_stage_without_dns(github: Path) -> None:
    rows = by_target(
        explain(
            github,
            "--resolve",
            "api.github.com=140.82.121.6",
            "--resolve",
            "a.github.com=140.82.121.6,10.0.0.7",
            "--resolve",
            "b.github.com=127.0.0.1",
            "--resolve",
            "notgithub.com=140.82.121.6",
            "api.github.com",
            "a.github.com",
            "b.github.com",
            "notgithub.com",
            "c.github.com",
        )
    )
    public = rows["api.github.com"]
    assert public["allowed"] is True and public["stage"] == "address"
    assert public["addresses"] == [
        {"address": "140.82.121.6", "public": True, "reason": "global", "range": "0.0.0.0/0"}
    ]
    mixed = rows["a.github.com"]
    assert mixed["allowed"] is False and mixed["stage"] == "address"
    assert mixed["reason"] == "mixed_answer"
    assert [(a["address"], a["public"]) for a in mixed["addresses"]] == [
        ("140.82.121.6", True),
        ("10.0.0.7", False),
    ]
    loopback = rows["b.github.com"]
    assert loopback["allowed"] is False and loopback["reason"] == "loopback"
    # A name denied by the name stage is never resolved, even when an answer is supplied.
    assert rows["notgithub.com"]["stage"] == "name" and rows["notgithub.com"]["addresses"] is None
    # No answer supplied: the name stage is all that can be said.
    assert rows["c.github.com"]["stage"] == "name" and rows["c.github.com"]["allowed"] is True


def test_resolve_matches_any_spelling_of_the_host(github: Path) -> None:
    (row,) = explain(github, "--resolve", "API.GitHub.com.=10.1.2.3", "https://api.github.com/x")
    assert row["stage"] == "address" and row["reason"] == "private"


def test_resolve_blocked_literal_blocks_names_resolving_to_it(url_rules: Path) -> None:
    (row,) = explain(url_rules, "--resolve", "pypi.org=93.184.216.34", "pypi.org")
    assert row["allowed"] is False and row["reason"] == "blocked_address"
    assert row["rule"] == "network_access.blocked[1]"


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["api.github.com"], "HOST=ADDR"),
        (["=1.1.1.1"], "no host"),
        (["=1.2.3.4"], "no host"),
        (["api.github.com=nope"], "'nope' is not an IP address"),
        (["a:b=1.1.1.1"], "--resolve"),
        (["x.github.com=1.1.1.1,"], "empty address"),
        (["x.github.com=,"], "empty address"),
        (["x.github.com=1.2.3.4,,"], "empty address"),
        (["x.github.com=,1.2.3.4"], "empty address"),
        (["x.github.com= "], "empty address"),
        (["x.github.com=1.1.1.1", "x.github.com=2.2.2.2"], "given twice"),
        (["X.GitHub.com.=1.1.1.1", "x.github.com="], "given twice"),
        (["1.2.3.4=5.6.7.8"], "is an IP address"),
        (["[::1]=::1"], "is an IP address"),
    ],
)
def test_malformed_resolve_is_a_usage_error(github: Path, values: list[str], says: str) -> None:
    args = [arg for value in values for arg in ("--resolve", value)]
    result = cli("explain", github, *args, "api.github.com")
    assert result.code == 2
    assert "--resolve" in result.err and says in result.err and result.out == ""


def test_platform_destinations_from_the_example_config() -> None:
    gateway = "gateway.platform.svc.cluster.local"
    rows = by_target(
        explain(
            EXAMPLES / "agent.yaml",
            "--config",
            EXAMPLES / "config.yaml",
            "--resolve",
            f"{gateway}=10.96.0.10",
            "--resolve",
            "pypi.org=10.96.0.10",
            f"{gateway}:443",
            f"{gateway}:80",
            "pypi.org:443",
            "pypi.org:8080",
            "www.corp.example",
        )
    )
    assert rows[f"{gateway}:443"]["allowed"] is True
    assert rows[f"{gateway}:443"]["reason"] == "platform_destination"
    assert rows[f"{gateway}:443"]["stage"] == "address"
    assert rows[f"{gateway}:80"]["reason"] == "port_not_allowed"
    assert rows["pypi.org:443"]["reason"] == "in_cluster"  # only the platform may go private
    assert rows["pypi.org:8080"]["reason"] == "port_not_allowed"
    assert rows["www.corp.example"]["reason"] == "internal_name"


def test_explain_with_a_manifest_that_does_not_compile_exits_1() -> None:
    result = cli("explain", EXAMPLES / "broken-agent.yaml", "github.com")
    assert result.code == 1
    assert "invalid manifest" in result.err
    assert "network.egress[0]" in result.err and "network.egress[9]" in result.err


def test_explain_json_through_the_installed_command(github: Path) -> None:
    result = run(
        "explain", github, "--resolve", "api.github.com=140.82.121.6", "api.github.com", "--json"
    )
    assert result.code == 0
    (row,) = result.json()
    assert row.keys() >= EXPLAIN_KEYS
    assert row["allowed"] is True and row["stage"] == "address"


# -- issue 11: path readings, blocked prefixes, brackets, empty answers ---------------------------


@pytest.fixture
def hardened(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        "agent.toml",
        "schema_version = 1\n"
        "[network_access]\n"
        'allowed = ["https://ok.test/api/", "*.acme.com", "github.com"]\n'
        'blocked = ["https://h.acme.com/admin/"]\n',
    )


def test_explain_decides_a_path_on_every_reading(hardened: Path) -> None:
    targets = {
        "https://ok.test/api/items": ("allowed", "allow+inspect"),
        "https://ok.test/x//../api/": ("path_not_allowed", "DENY"),
        "https://ok.test/api//../x": ("ambiguous_path", "DENY"),
        "https://ok.test/api/%2e%2e/x": ("path_not_allowed", "DENY"),
        "https://ok.test/api/%252e%252e/x": ("ambiguous_path", "DENY"),
        "https://ok.test/api/x/..": ("ambiguous_path", "DENY"),
    }
    rows = by_target(explain(hardened, *targets))
    for target, (reason, _) in targets.items():
        assert rows[target]["reason"] == reason, rows[target]
    ambiguous = rows["https://ok.test/api//../x"]["message"]
    assert "nginx" in ambiguous and "as /x" in ambiguous
    table = cli("explain", hardened, *targets).out.splitlines()
    for target, (reason, decision) in targets.items():
        line = next(line for line in table if f" {target} " in line)
        assert line.split()[0] == decision and reason in line, line


BLOCKED_TARGETS = [
    "https://h.acme.com/admin/",
    "http://h.acme.com/admin/",
    "wss://h.acme.com/admin/",
    "ws://h.acme.com:8080/admin/x",
    "https://h.acme.com:8443/admin/",
    "https://h.acme.com/admin./",
    "https://h.acme.com/admin%20/",
    "https://h.acme.com/admin;x/",
    "https://h.acme.com/ADMIN",
    "https://h.acme.com/admin",
    "https://h.acme.com/admin//../x",
    "http://h.acme.com:81/x/../admin/",
]


def test_explain_blocks_a_prefix_on_every_scheme_port_and_spelling(hardened: Path) -> None:
    rows = by_target(explain(hardened, *BLOCKED_TARGETS, "https://h.acme.com/%2561dmin/"))
    for target in BLOCKED_TARGETS:
        row = rows[target]
        assert (row["allowed"], row["reason"], row["rule"]) == (
            False,
            "blocked",
            "network_access.blocked[0]",
        ), row
    double = rows["https://h.acme.com/%2561dmin/"]
    assert (double["allowed"], double["reason"]) == (False, "ambiguous_path")
    # The rest of the host stays open, and every TLS port of it is inspected.
    rows = by_target(explain(hardened, "https://h.acme.com/public", "h.acme.com:8443"))
    assert rows["https://h.acme.com/public"]["allowed"] is True
    assert rows["h.acme.com:8443"]["needs_inspection"] is True


def test_check_shows_a_blocked_prefix_on_any_scheme_and_port(hardened: Path) -> None:
    result = cli("check", hardened)
    assert result.code == 0, result.out
    line = next(line for line in result.out.splitlines() if "network_access.blocked[0]" in line)
    assert "*://h.acme.com:*/admin/" in line
    (rule,) = [
        r for r in cli("check", hardened, "--json").json()["rules"] if r["action"] == "block"
    ]
    assert (rule["scheme"], rule["port"], rule["path"]) == (None, None, "/admin/")


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("https://ok.test/api;v=1/", "invalid_path"),
        ("https://ok.test/admin./", "invalid_path"),
        ("https://ok.test/a%20/", "invalid_path"),
        ("https://ok.test/%2561/", "invalid_path"),
        ("https://ok.test/a//b/", "not_canonical"),
        ("https://ok.test/a/../b/", "not_canonical"),
    ],
)
def test_check_refuses_url_patterns_no_request_could_match(
    tmp_path: Path, pattern: str, reason: str
) -> None:
    for key in ("allowed", "blocked"):
        manifest = write(
            tmp_path, "agent.toml", f'schema_version = 1\n[network_access]\n{key} = ["{pattern}"]\n'
        )
        result = cli("check", manifest, "--json")
        assert result.code == 1, result.out
        (finding,) = result.json()["findings"]
        assert finding["reason"] == reason, finding


@pytest.mark.parametrize(
    "target", ["[github.com]", "[github.com]:443", "https://[github.com]/", "[1.2.3.4]:443"]
)
def test_explain_refuses_a_bracketed_name(hardened: Path, target: str) -> None:
    (row,) = explain(hardened, target)
    assert (row["allowed"], row["reason"], row["stage"]) == (False, "invalid_host", "name")
    assert "IPv6" in row["message"]


def test_explain_refuses_a_bracketed_name_through_the_installed_command(hardened: Path) -> None:
    result = run("explain", hardened, "[github.com]", "github.com")
    assert result.code == 0
    rows = [line.split() for line in result.out.splitlines()[1:]]
    assert rows[0][:4] == ["DENY", "[github.com]", "name", "invalid_host"]
    assert rows[1][0] == "allow"


@pytest.mark.usefixtures("no_network")
def test_explain_an_answer_without_addresses_is_a_denial(hardened: Path) -> None:
    (row,) = explain(hardened, "--resolve", "github.com=", "github.com")
    assert (row["allowed"], row["stage"], row["reason"]) == (False, "address", "no_addresses")
    assert row["addresses"] == [] and "no address" in row["message"]
    assert row["rule"] == "network_access.allowed[2]"
    result = cli("explain", hardened, "--resolve", "GitHub.com.=", "https://github.com/x")
    assert result.code == 0
    (line,) = result.out.splitlines()[1:]
    assert line.split()[:4] == ["DENY", "https://github.com/x", "address", "no_addresses"]


def test_explain_duplicate_addresses_in_one_answer_count_once(hardened: Path) -> None:
    (row,) = explain(hardened, "--resolve", "github.com=140.82.121.4,140.82.121.4", "github.com")
    assert row["allowed"] is True
    assert [a["address"] for a in row["addresses"]] == ["140.82.121.4"]


# -- ceiling ---------------------------------------------------------------------------------------


def test_a_ceiling_admits_declarations_under_it(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress: [api.github.com]\n")
    ceiling = write(tmp_path, "ceiling.yaml", "tenant: northwind\negress: [github.com]\n")
    result = cli("check", manifest, "--ceiling", ceiling, "--json")
    assert result.code == 0
    (rule,) = result.json()["rules"]
    assert rule["host"] == "api.github.com" and rule["ceiling"] == "ceiling.egress[0]"
    rows = by_target(explain(manifest, "--ceiling", ceiling, "x.api.github.com", "github.com"))
    assert rows["x.api.github.com"]["allowed"] is True
    assert rows["github.com"]["allowed"] is False  # the ceiling never adds a destination


def test_a_ceiling_exclusion_names_entry_and_ceiling(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress: [github.com, example.org]\n")
    ceiling = write(tmp_path, "ceiling.yaml", "tenant: northwind\negress: [github.com]\n")
    result = cli("check", manifest, "--ceiling", ceiling, "--json")
    assert result.code == 1
    (finding,) = result.json()["findings"]
    assert finding["path"] == "network.egress[1]" and finding["reason"] == "outside_ceiling"
    assert "'example.org'" in finding["message"]
    assert "northwind" in finding["message"] and str(ceiling) in finding["message"]
    human = cli("check", manifest, "--ceiling", ceiling)
    assert human.code == 1 and "outside_ceiling" in human.out and "example.org" in human.out
    # A ceiling lowered after deploy narrows the live decision the same way.
    (row,) = explain(manifest, "--ceiling", ceiling, "example.org")
    assert row["allowed"] is False and row["reason"] == "outside_ceiling"


def test_an_empty_ceiling_admits_nothing(github: Path, tmp_path: Path) -> None:
    ceiling = write(tmp_path, "ceiling.yaml", "egress: []\n")
    assert cli("check", github, "--ceiling", ceiling).code == 1
    (row,) = explain(github, "--ceiling", ceiling, "github.com")
    assert row["allowed"] is False


def test_public_mode_is_refused_under_a_ceiling(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress_mode: public\n")
    assert cli("check", manifest).code == 0
    ceiling = write(tmp_path, "ceiling.yaml", "egress: [github.com]\n")
    result = cli("check", manifest, "--ceiling", ceiling, "--json")
    assert result.code == 1
    assert [f["reason"] for f in result.json()["findings"]] == ["public_mode_with_ceiling"]


# -- classify --------------------------------------------------------------------------------------


def test_classify_json_shape() -> None:
    result = cli("classify", "127.0.0.1", "8.8.8.8", "not-an-ip", "127.1", "[::1]", "--json")
    assert result.code == 0
    rows = result.json()
    for row in rows:
        assert row.keys() >= CLASSIFY_KEYS
    found = {r["address"]: r for r in rows}
    assert (found["127.0.0.1"]["public"], found["127.0.0.1"]["reason"]) == (False, "loopback")
    assert found["127.0.0.1"]["range"] == "127.0.0.0/8"
    assert (found["8.8.8.8"]["public"], found["8.8.8.8"]["reason"]) == (True, "global")
    for bad in ("not-an-ip", "127.1"):
        assert found[bad]["public"] is False
        assert found[bad]["reason"] == "invalid_address"
        assert found[bad]["range"] is None
    assert found["[::1]"]["reason"] == "loopback"


def test_classify_human_table() -> None:
    result = cli("classify", "10.1.2.3", "1.1.1.1", "169.254.169.254")
    assert result.code == 0
    lines = result.out.splitlines()
    assert lines[0].split()[:4] == ["ADDRESS", "PUBLIC", "REASON", "RANGE"]
    assert lines[1].split()[:4] == ["10.1.2.3", "no", "private", "10.0.0.0/8"]
    assert lines[2].split()[:3] == ["1.1.1.1", "yes", "global"]
    assert lines[3].split()[:3] == ["169.254.169.254", "no", "metadata"]


def test_classify_config_allow_exempts_but_never_metadata_or_deny(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "config.yaml",
        "addresses:\n"
        "  allow: [127.0.0.0/8, 169.254.0.0/16, 10.0.0.0/8]\n"
        "  deny: [10.9.0.0/16]\n"
        "  in_cluster: [10.96.0.0/12]\n",
    )
    result = cli(
        "classify",
        "--config",
        config,
        "--json",
        "127.0.0.1",
        "169.254.169.254",
        "169.254.1.1",
        "10.9.1.1",
        "10.96.0.1",
        "::1",
    )
    assert result.code == 0
    found = {r["address"]: r for r in result.json()}
    assert (found["127.0.0.1"]["public"], found["127.0.0.1"]["reason"]) == (True, "operator_allow")
    assert found["127.0.0.1"]["range"] == "127.0.0.0/8"
    assert (found["169.254.1.1"]["public"], found["169.254.1.1"]["reason"]) == (
        True,
        "operator_allow",
    )
    assert (found["169.254.169.254"]["public"], found["169.254.169.254"]["reason"]) == (
        False,
        "metadata",
    )
    assert (found["10.9.1.1"]["public"], found["10.9.1.1"]["reason"]) == (False, "operator_deny")
    assert (found["10.96.0.1"]["public"], found["10.96.0.1"]["reason"]) == (False, "in_cluster")
    assert found["::1"]["public"] is False  # an IPv4 allow says nothing about IPv6
    without = {r["address"]: r for r in cli("classify", "127.0.0.1", "--json").json()}
    assert without["127.0.0.1"]["public"] is False


def test_classify_through_the_installed_command(tmp_path: Path) -> None:
    config = write(tmp_path, "config.yaml", "addresses:\n  allow: [127.0.0.0/8]\n")
    result = run("classify", "--config", config, "127.0.0.1", "--json")
    assert result.code == 0
    (row,) = result.json()
    assert row["public"] is True and row["reason"] == "operator_allow"
    usage = run("classify", "--config", tmp_path / "absent.yaml", "127.0.0.1")
    assert usage.code == 2 and "absent.yaml" in usage.err


def test_check_through_the_installed_command() -> None:
    ok = run("check", EXAMPLES / "agent.toml", "--ceiling", EXAMPLES / "ceiling.yaml", "--json")
    assert ok.code == 0, ok.err
    assert ok.json()["format"] == "agent.toml"
    bad = run("check", EXAMPLES / "broken-agent.yaml")
    assert bad.code == 1 and "INVALID" in bad.out


def test_config_internal_suffixes_reach_check(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress: [wiki.corp.example]\n")
    assert cli("check", manifest).code == 0
    result = cli("check", manifest, "--config", EXAMPLES / "config.yaml", "--json")
    assert result.code == 1
    assert [f["reason"] for f in result.json()["findings"]] == ["internal_name"]


def test_a_platform_destination_is_not_declarable(tmp_path: Path) -> None:
    manifest = write(tmp_path, "agent.yaml", "network:\n  egress: [gw.example.net]\n")
    config = write(
        tmp_path,
        "config.yaml",
        "platform_destinations:\n  - {host: gw.example.net, ports: [443]}\n",
    )
    result = cli("check", manifest, "--config", config, "--json")
    assert result.code == 1
    assert [f["reason"] for f in result.json()["findings"]] == ["platform_destination"]
