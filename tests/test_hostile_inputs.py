"""Bad input everywhere gets a clear message and a non-zero exit, never a traceback.

Every hostile file is tried in every place a file is read: the manifest of `check` and
`explain`, `--ceiling`, and `--config` (of `check` and of `classify`). In-process runs cover
the whole matrix quickly; the installed command runs each hostile file once more, because only a
real process shows what a user would see (an uncaught exception, a traceback on stderr).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.hostile import NUMBERS, VALID_MANIFEST, Run, bytes_file, cli, run

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00"
FIFTY_MB = 50 * 1024 * 1024


def _sparse(directory: Path) -> Path:
    # Sparse: 50 MB on paper, a few bytes on disk, created instantly.
    path = directory / "huge.yaml"
    with path.open("wb") as handle:
        handle.write(b"network:\n  egress:\n")
        handle.truncate(FIFTY_MB)
    return path


def _directory(directory: Path) -> Path:
    path = directory / "a-directory.yaml"
    path.mkdir()
    return path


def _missing(directory: Path) -> Path:
    return directory / "no-such-file.yaml"


def _laughs() -> bytes:
    lines = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        refs = ", ".join([f"*lol{i - 1}"] * 9)
        lines.append(f"lol{i}: &lol{i} [{refs}]")
    lines.append("network:\n  egress: *lol9")
    return ("\n".join(lines) + "\n").encode()


DEPTH = 10_000

# name -> (maker, what stderr must also say besides "egress-proxy:" and the file name)
HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "empty": (bytes_file("empty.yaml", b""), "empty"),
    "whitespace": (bytes_file("blank.yaml", b"  \n\t\n   \r\n"), "empty"),
    "png": (bytes_file("image.yaml", PNG), "not a text document"),
    "png_json": (bytes_file("image.json", PNG), "not a text document"),
    "nul": (bytes_file("nul.yaml", b"network:\n  egress: [github.com]\n\x00\n"), "NUL"),
    "nul_toml": (bytes_file("nul.toml", b'[network_access]\nallowed = ["a\x00.com"]\n'), "NUL"),
    "utf16": (bytes_file("utf16.yaml", VALID_MANIFEST.encode("utf-16")), ""),
    "invalid_utf8": (
        bytes_file("latin1.yaml", b"network:\n  egress: [caf\xe9.example]\n"),
        "UTF-8",
    ),
    "fifty_mb": (_sparse, str(FIFTY_MB)),
    "deep_block": (bytes_file("deep.yaml", b"- " * DEPTH + b"x\n"), "deep"),
    "deep_mapping": (bytes_file("deepmap.yaml", b"{a: " * DEPTH + b"1" + b"}" * DEPTH), "nest"),
    "deep_flow": (
        bytes_file("deepflow.yaml", b"network:\n  egress: " + b"[" * DEPTH + b"]" * DEPTH + b"\n"),
        "nest",
    ),
    "deep_json": (bytes_file("deep.json", b"[" * DEPTH + b"]" * DEPTH), "deep"),
    "deep_toml": (bytes_file("deep.toml", b"a = " + b"[" * DEPTH + b"]" * DEPTH + b"\n"), "deep"),
    "billion_laughs": (bytes_file("laughs.yaml", _laughs()), "alias"),
    "directory": (_directory, "directory"),
    "missing": (_missing, "No such file"),
    "top_level_list": (bytes_file("list.yaml", b"- network\n- egress\n"), "mapping"),
    "top_level_scalar": (bytes_file("scalar.yaml", b"just some words\n"), "mapping"),
    "top_level_json_list": (bytes_file("list.json", b'["github.com"]'), "mapping"),
    "yaml_syntax": (bytes_file("syntax.yaml", b"network:\n  egress: [github.com\n"), ":3:"),
    "yaml_tabs": (bytes_file("tabs.yaml", b"network:\n\tegress: []\n"), ":2:"),
    "toml_syntax": (
        bytes_file("syntax.toml", b'[network_access]\nallowed = ["a.com"\nblocked = []\n'),
        ":3:",
    ),
    "json_syntax": (bytes_file("syntax.json", b'{\n  "network": {"egress": ["a.com",]}\n}'), ":2:"),
    "yaml_duplicate_key": (bytes_file("dup.yaml", b"network: {}\nname: x\nnetwork: {}\n"), ":3:"),
    "json_duplicate_key": (bytes_file("dup.json", b'{"network": {}, "network": {}}'), "duplicate"),
    "toml_duplicate_key": (bytes_file("dup.toml", b"a = 1\na = 2\n"), ":2:"),
    "two_documents": (bytes_file("two.yaml", b"network: {}\n---\nnetwork: {}\n"), ":2:"),
}

# Numbers out of bounds (support/hostile.py), refused wherever a document is read.
HOSTILE.update(NUMBERS)

# Where a file is read, as argv with {} for the hostile file.
ROLES: dict[str, list[str]] = {
    "check": ["check", "{}"],
    "check_json": ["check", "{}", "--json"],
    "explain": ["explain", "{}", "github.com"],
    "ceiling": ["check", "{manifest}", "--ceiling", "{}"],
    "config": ["explain", "{manifest}", "--config", "{}", "github.com"],
    "classify_config": ["classify", "--config", "{}", "1.1.1.1"],
}


def argv_for(role: str, hostile: Path, manifest: Path) -> list[str]:
    return [
        str(hostile) if a == "{}" else str(manifest) if a == "{manifest}" else a
        for a in ROLES[role]
    ]


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "valid.yaml"
    path.write_text(VALID_MANIFEST)
    return path


def assert_refused(result: Run, path: Path, also: str, *, json_out: bool = False) -> None:
    assert result.code == 2, (result.code, result.err)
    assert "Traceback" not in result.out and "Traceback" not in result.err
    first = result.err.splitlines()[0]
    assert first.startswith("egress-proxy: "), result.err
    assert str(path) in first, result.err
    assert also in result.err, result.err
    if not json_out:
        assert result.out == ""


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_is_refused_clearly(
    case: str, role: str, tmp_path: Path, manifest: Path
) -> None:
    make, also = HOSTILE[case]
    hostile = make(tmp_path)
    result = cli(*argv_for(role, hostile, manifest))
    assert_refused(result, hostile, also, json_out=role == "check_json")


@pytest.mark.integration  # runs the installed command
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_manifest_through_the_installed_command(case: str, tmp_path: Path) -> None:
    make, also = HOSTILE[case]
    hostile = make(tmp_path)
    assert_refused(run("check", hostile), hostile, also)


@pytest.mark.integration  # runs the installed command
@pytest.mark.parametrize("role", ["explain", "ceiling", "config", "classify_config"])
def test_hostile_file_in_each_role_through_the_installed_command(
    role: str, tmp_path: Path, manifest: Path
) -> None:
    for case in ("png", "billion_laughs", "yaml_syntax"):
        make, also = HOSTILE[case]
        directory = tmp_path / case
        directory.mkdir()
        hostile = make(directory)
        assert_refused(run(*argv_for(role, hostile, manifest)), hostile, also)


def test_a_fifty_mb_file_is_refused_by_its_size_before_reading(tmp_path: Path) -> None:
    hostile = _sparse(tmp_path)
    result = cli("check", hostile)
    # The exact size can only come from the file's metadata: nothing read 50 MB to count it.
    assert f"{FIFTY_MB} bytes" in result.err
    assert result.code == 2


@pytest.mark.integration  # runs the installed command
def test_a_fifty_mb_stdin_is_cut_off(tmp_path: Path) -> None:
    hostile = _sparse(tmp_path)
    with hostile.open("rb") as handle:
        result = run("check", "-", stdin=handle)
    assert result.code == 2
    assert "egress-proxy: <stdin>:" in result.err and "over the limit" in result.err
    assert "Traceback" not in result.err


# -- files that parse but are wrong in their content -----------------------------------------------


def test_non_string_manifest_entries_are_findings(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("network:\n  egress: [1, null, {a: b}, [x], 2.5, true, github.com]\n")
    result = cli("check", path, "--json")
    assert result.code == 1
    findings = json.loads(result.out)["findings"]
    assert [f["path"] for f in findings] == [f"network.egress[{i}]" for i in range(6)]
    assert {f["reason"] for f in findings} == {"not_a_string"}
    # explain cannot decide with a manifest that does not compile: findings exit, not a crash.
    explained = cli("explain", path, "github.com")
    assert explained.code == 1 and str(path) in explained.err


@pytest.mark.parametrize(
    "text",
    [
        "network: [github.com]\n",
        "network:\n  egress: github.com\n",
        "network:\n  egress_mode: [public]\n",
        "network_access: [a.com]\n",
        "network_access:\n  allowed: a.com\n",
        "network_access:\n  allowed: [1, 2]\n",
        "schema_version: two\n",
        "access: [github]\nnetwork: {}\n",
        "access:\n  github: [x]\nnetwork: {}\n",
        "{1: 2, null: 3, [a]: 4}\n",
    ],
)
def test_wrong_shapes_inside_a_manifest_exit_0_or_1_with_no_crash(
    text: str, tmp_path: Path
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    result = cli("check", path)
    assert result.code in (0, 1, 2), result.err
    assert "internal error" not in result.err


@pytest.mark.integration  # runs the installed command
def test_a_ceiling_with_bad_entries_lists_every_one(tmp_path: Path, manifest: Path) -> None:
    ceiling = tmp_path / "ceiling.yaml"
    ceiling.write_text(
        "tenant: northwind\negress: [1, '*.github.com', localhost, GitHub.com, github.com]\n"
        "color: blue\n"
    )
    result = run("check", manifest, "--ceiling", ceiling)
    assert result.code == 2
    assert "Traceback" not in result.err
    lines = result.err.splitlines()
    assert lines[0].startswith(f"egress-proxy: {ceiling}: invalid ceiling")
    for expected in ("egress[0]", "egress[1]", "egress[2]", "egress[3]", "color"):
        assert any(line.strip().startswith(expected + ":") for line in lines[1:]), expected
    assert not any(line.strip().startswith("egress[4]") for line in lines)


@pytest.mark.parametrize(
    "text",
    ["egress: github.com\n", "egress:\n", "tenant: x\n", "tenant: [x]\negress: []\n"],
)
def test_ceiling_shape_problems(text: str, tmp_path: Path, manifest: Path) -> None:
    ceiling = tmp_path / "ceiling.yaml"
    ceiling.write_text(text)
    assert_refused(cli("check", manifest, "--ceiling", ceiling), ceiling, "invalid ceiling")


@pytest.mark.integration  # runs the installed command
def test_a_config_with_unknown_keys_names_them(tmp_path: Path, manifest: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("dns:\n  nameserver: [10.0.0.2]\nlimit:\n  max_connections: 5\n")
    result = run("classify", "--config", config, "1.1.1.1")
    assert result.code == 2
    assert "Traceback" not in result.err
    assert result.err.startswith(f"egress-proxy: {config}: invalid config, 2 problem(s)")
    assert "dns.nameserver:" in result.err and "'nameserver'" in result.err
    assert "limit:" in result.err and "did you mean 'limits'" in result.err
    assert result.out == ""


def test_a_config_with_duplicate_keys_is_refused(tmp_path: Path, manifest: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("ports: [443]\nports: [80]\n")
    assert_refused(cli("check", manifest, "--config", config), config, ":2:")


@pytest.mark.integration  # runs the installed command
def test_control_characters_in_a_hostile_key_do_not_reach_the_terminal(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text('network:\n  egress: [github.com]\n  "\\e]0;pwned\\a\\e[2J\\u202e": 1\n')
    result = run("check", path)
    assert result.code == 1
    assert "\x1b" not in result.out and "\u202e" not in result.out and "\a" not in result.out
    assert "\\x1b" in result.out


# -- big but legitimate ----------------------------------------------------------------------------


@pytest.mark.integration  # runs the installed command
def test_ten_thousand_entries_succeed(tmp_path: Path) -> None:
    entries = "".join(f"    - host{i}.example.com\n" for i in range(10_000))
    path = tmp_path / "agent.yaml"
    path.write_text(f"network:\n  egress:\n{entries}")
    ceiling = tmp_path / "ceiling.yaml"
    ceiling.write_text("egress:\n" + "".join(f"  - host{i}.example.com\n" for i in range(10_000)))
    result = run("check", path, "--ceiling", ceiling, timeout=120)
    assert result.code == 0, result.err
    assert "valid, 0 error(s)" in result.out
    explained = run(
        "explain", "--json", path, "--ceiling", ceiling, "a.host9999.example.com", "x.example.com"
    )
    assert explained.code == 0
    assert '"allowed": true' in explained.out and '"allowed": false' in explained.out


def test_ten_thousand_toml_patterns_succeed(tmp_path: Path) -> None:
    allowed = ", ".join(
        f'"*.h{i}.example.com", "https://api{i}.example.com/v1/"' for i in range(5000)
    )
    path = tmp_path / "agent.toml"
    path.write_text(f"[network_access]\nallowed = [{allowed}]\n")
    result = cli("explain", "--json", path, "a.h4999.example.com", "https://api7.example.com/v2/")
    assert result.code == 0
    assert result.out.count('"allowed": true') == 1


def test_ten_thousand_bad_entries_are_listed_quickly(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("network:\n  egress:\n" + "    - Bad.Example.com\n" * 10_000)
    result = cli("check", path, "--json")
    assert result.code == 1
    human = cli("check", path)
    assert human.code == 1
    # The table is for a person: it is cut, and says where the rest is.
    assert "more findings (--json lists them all)" in human.out
    assert human.out.count("not_canonical") <= 1000


# -- syntax corners --------------------------------------------------------------------------------


def test_toml_error_at_end_of_document_has_line_and_column(tmp_path: Path) -> None:
    # tomllib before 3.14 says "(at end of document)" instead of a position.
    path = tmp_path / "agent.toml"
    path.write_bytes(b'[network_access]\nallowed = ["a.com"')
    result = cli("check", path)
    assert result.code == 2
    assert f"{path}:2:" in result.err


def test_a_bad_date_elsewhere_in_the_manifest_is_not_our_business(tmp_path: Path) -> None:
    # YAML's implicit timestamps would make an impossible date under someone else's key fail
    # the whole document.
    path = tmp_path / "agent.yaml"
    path.write_text("name: x\nreleased: 2024-02-30\nnetwork:\n  egress: [github.com]\n")
    result = cli("check", path)
    assert result.code == 0, result.err


# -- random input ----------------------------------------------------------------------------------

_yamlish = st.text(
    alphabet=st.sampled_from(list("network_access:egress- []{}*&!|>'\"#\n\t .,=/\\%@x1\x00\u00e9")),
    max_size=200,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(st.binary(max_size=300), _yamlish.map(lambda s: s.encode("utf-8"))),
    suffix=st.sampled_from([".yaml", ".toml", ".json"]),
    role=st.sampled_from(["check", "explain", "ceiling", "config"]),
)
def test_random_bytes_never_crash_the_cli(
    data: bytes, suffix: str, role: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.getbasetemp() / "random-input"
    directory.mkdir(exist_ok=True)
    manifest = directory / "valid.yaml"
    manifest.write_text(VALID_MANIFEST)
    hostile = directory / f"input{suffix}"
    hostile.write_bytes(data)
    result = cli(*argv_for(role, hostile, manifest))
    assert result.code in (0, 1, 2), result.err
    assert "internal error" not in result.err


def test_a_python_tag_is_inert(tmp_path: Path) -> None:
    # Tags are read as the plain value under them: nothing is ever constructed or run.
    marker = tmp_path / "ran"
    path = tmp_path / "agent.yaml"
    path.write_text(f"network: !!python/object/apply:os.system ['touch {marker}']\n")
    result = cli("check", "--json", path)
    assert result.code == 1 and not marker.exists()
    assert '"not_a_mapping"' in result.out
