"""The documentation cannot go stale silently: every repository path named in README.md, docs/
and the docstrings of policy/ and proxy/ exists; every operator config key, CLI option, metric,
audit field and reason code the code has is documented on its page; and nothing points at a
document outside the repository. Files and parsers only: no processes, no sockets."""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from policy.asking import Question
from policy.reasons import Reason
from proxy.app import config
from proxy.app.credentials_config import KEYS as CREDENTIAL_KEYS
from proxy.cli import build_parser
from proxy.decide.asks import AskEvent
from proxy.decide.events import CloseEvent, DecisionEvent
from proxy.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# The top-level entries of the repository a path in prose may start with.
TOP = ("policy", "proxy", "tests", "benchmarks", "deploy", "examples", "scripts", "docs")
# A repo-relative path: one of TOP, then at least one more part; not inside a longer path
# (`/usr/lib/proxy/x`) nor a module name (`proxy.cli`) nor a URL.
PATH = re.compile(
    r"(?<![\w./~:-])(?:" + "|".join(TOP) + r")/[\w.*/-]*[\w*/]",
)
# Written by the build or the benchmarks, never committed (.gitignore).
GENERATED = ("benchmarks/build/", "benchmarks/results/tmp/")


def page(name: str) -> str:
    return (DOCS / name).read_text()


def docstrings(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text:
                yield text


def named_paths(text: str) -> set[str]:
    return {m.group(0).rstrip(".") for m in PATH.finditer(text)}


def path_exists(name: str) -> bool:
    if name.startswith(GENERATED):
        return True
    if "*" in name:
        return any(ROOT.glob(name))
    return (ROOT / name).exists()


def prose() -> Iterator[tuple[str, str]]:
    """(where, text) for the README, every docs page, and every docstring of the code."""
    yield "README.md", (ROOT / "README.md").read_text()
    for path in PAGES:
        yield str(path.relative_to(ROOT)), path.read_text()
    for package in ("policy", "proxy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for text in docstrings(path):
                yield str(path.relative_to(ROOT)), text


def test_the_path_pattern_finds_paths_and_nothing_else() -> None:
    text = (
        "see `proxy/net/relay.py`, proxy/dataplane/http*.py and deploy/README.md. "
        "Not /usr/lib/proxy/x, ~/.local/share/egress-proxy/ca, proxy.cli or "
        "https://example.test/policy/x"
    )
    assert named_paths(text) == {
        "proxy/net/relay.py",
        "proxy/dataplane/http*.py",
        "deploy/README.md",
    }


def test_every_repository_path_named_in_prose_exists() -> None:
    missing = sorted(
        f"{where}: {name}"
        for where, text in prose()
        for name in named_paths(text)
        if not path_exists(name)
    )
    assert not missing, "paths named that do not exist:\n" + "\n".join(missing)


def test_nothing_points_outside_the_repository() -> None:
    # Spelled in two parts so that this file does not name them itself.
    design, shared = "DES" + "IGN", "../" + "shared"
    pattern = re.compile(rf"\b{design}\b|{re.escape(shared)}")
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    for top in ("docs", "policy", "proxy", "tests", "benchmarks", "deploy", "examples", "scripts"):
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix != ".png"]
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def config_keys() -> list[str]:
    """Every key the operator config accepts, as the config page writes it."""
    keys = []
    for section, inner in config.SECTIONS.items():
        # A mapping's keys are written whole (`limits.max_held`); a list or a value by its name.
        keys += [f"{section}.{key}" for key in inner] if inner else [section]
    keys += [f"platform_destinations[].{key}" for key in config._PLATFORM_KEYS]
    keys += [f"credentials[].{key}" for key in CREDENTIAL_KEYS]
    return keys


def test_config_keys_are_the_ones_the_loader_reads() -> None:
    assert "limits.max_held" in config_keys()
    assert "credentials[].value_file" in config_keys()


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_is_documented(key: str) -> None:
    assert f"`{key}`" in page("config.md"), f"docs/config.md does not describe `{key}`"


def commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(`check`, `boundary apply`, ...) and its parser, for every command."""

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> Iterator[tuple[str, Any]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield " ".join(words), parser
        for action in subs:
            for name, sub in action.choices.items():
                yield from walk(sub, [*words, name])

    yield from walk(build_parser(), [])


def command_section(command: str) -> str:
    """The part of docs/commands.md under the heading that names `egress-proxy COMMAND`: for
    `boundary apply` and `boundary verify`, the heading names `boundary apply` and `verify`."""
    text = page("commands.md")
    sections = re.split(r"^## ", text, flags=re.M)
    first = command.split()[0]
    for section in sections:
        heading = section.split("\n", 1)[0]
        if f"egress-proxy {command}`" in heading or (
            " " in command and f"egress-proxy {first}" in heading
        ):
            return section
    raise AssertionError(f"docs/commands.md has no section for egress-proxy {command}")


OPTIONS = [
    (command, option)
    for command, parser in commands()
    for action in parser._actions
    if not isinstance(action, argparse._HelpAction)
    for option in action.option_strings
]


def test_every_command_is_found() -> None:
    assert {command for command, _ in commands()} >= {
        "check", "explain", "classify", "run", "sandbox", "suggest", "trust", "ask",
        "boundary apply", "boundary verify",
    }  # fmt: skip
    assert ("run", "--ask-token") in OPTIONS


@pytest.mark.parametrize(("command", "option"), OPTIONS)
def test_every_cli_option_is_documented(command: str, option: str) -> None:
    section = command_section(command)
    assert f"`{option}" in section, f"docs/commands.md: egress-proxy {command} lacks {option}"


def test_every_metric_is_documented() -> None:
    text = page("observability.md")
    names = [family.name for family in Metrics().families()]
    assert "egress_decisions" in names
    for name in names:
        # prometheus-client keeps a counter's name without `_total`; the page writes it whole.
        assert f"`{name}`" in text or f"`{name}_total`" in text, f"{name} is not documented"


def audit_fields() -> set[str]:
    """Every field an audit line can carry: each kind of line with every optional field set."""
    decision = DecisionEvent(
        "allow", "allowed", ech=True, credential="c", attribution="dns", attributed=("a.test",)
    )
    close = CloseEvent(ech=True, attribution="dns", attributed=("a.test",))
    ask = AskEvent("asked", "1", Question("a.test", 443, "/x", "https"))
    fields: set[str] = set()
    for line in (
        decision.line(session="s", now=0.0),
        close.line(session="s", now=0.0),
        ask.line(session="s", now=0.0),
    ):
        fields |= set(json.loads(line))
    return fields | {"truncated"}


def test_every_audit_field_is_documented() -> None:
    text = page("observability.md")
    missing = sorted(f for f in audit_fields() if f"`{f}`" not in text)
    assert not missing, f"docs/observability.md does not describe {missing}"


def test_every_admin_endpoint_is_documented() -> None:
    text = page("observability.md")
    for endpoint in ("/healthz", "/readyz", "/metrics", "/denials", "/asks", "/asks/stream",
                     "/asks/ID", "/grants"):  # fmt: skip
        assert f"{endpoint}`" in text, endpoint


def test_every_reason_code_says_where_it_is_decided() -> None:
    text = page("architecture.md")
    missing = sorted(r.value for r in Reason if f"`{r.value}`" not in text)
    assert not missing, f"docs/architecture.md does not place {missing}"


def layers() -> tuple[tuple[str, ...], ...]:
    """LAYERS of tests/test_layering.py, read from its source (a test module imports none)."""
    tree = ast.parse((ROOT / "tests" / "test_layering.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "LAYERS":
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_layering.py has no LAYERS")


def test_the_architecture_page_names_every_layer() -> None:
    text = page("architecture.md")
    for entries in layers():
        for entry in entries:
            shown = entry.replace(".", "/")
            assert f"`{shown}/`" in text or f"`{shown}.py`" in text, entry


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in PAGES:
        assert f": {path.name}" in nav, f"{path.name} is not in mkdocs.yml's nav"


def test_the_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    cells = [cell for line in lines if line.startswith("| ") for cell in line.split(" | ")]
    assert max(len(cell) for cell in cells) <= 120
