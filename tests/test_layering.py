"""The tree's layering (docs/architecture.md), read from the source: every import of every
module in policy/ and proxy/ (also those inside functions and under TYPE_CHECKING) goes to its
own layer or one below, never up; the planes never import each other; only the interception
package imports mitmproxy; and no two modules import each other, directly or round a longer loop."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module belongs to the first entry that is it or a package above it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("policy",),
    ("proxy.common",),  # errors, refusals, listener addresses, terminal text, settings, caches
    ("proxy.decide",),  # the decision steps every plane shares
    ("proxy.net", "proxy.tls"),  # resolver, dialing, relay; the session CA and trust bundle
    # the planes: siblings, never each other
    ("proxy.dataplane", "proxy.dns_responder", "proxy.l7"),
    ("proxy.ops",),  # admin, metrics, audit
    ("proxy.app",),  # the composition root
    ("proxy.boundary",),
    ("proxy.cli",),
    ("proxy.__main__", "proxy.probes"),  # entry points
)
ONLY_MITMPROXY = "proxy.l7"
# Imports that break the rules today, each to go with the work that removes it (none left). A
# test below fails once an entry no longer exists.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in ("policy", "proxy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(path: Path, name: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, wherever it stands."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")
                package = package if is_package else package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            yield base, node.lineno
            for alias in node.names:  # `from proxy.boundary.nft import pod_rules` names a module
                yield f"{base}.{alias.name}", node.lineno


def layer_of(name: str) -> tuple[int, str] | None:
    if name == "proxy":  # the namespace package itself, empty
        return 1, name
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if name == entry or name.startswith(entry + "."):
                return index, entry
    return None


ALL = modules()


def own_imports(name: str) -> list[tuple[str, int]]:
    """The project's modules that `name` imports (names that are not modules are dropped)."""
    seen = []
    for target, line in imports(ALL[name], name):
        if target in ALL and target != name:
            seen.append((target, line))
    return seen


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_module_has_a_layer(name: str) -> None:
    assert layer_of(name) is not None, f"{name} is in no layer of tests/test_layering.py"


@pytest.mark.parametrize("name", sorted(ALL))
def test_imports_go_down_or_sideways_within_a_package(name: str) -> None:
    here = layer_of(name)
    assert here is not None
    for target, line in own_imports(name):
        if (name, target) in KNOWN_VIOLATIONS:
            continue
        there = layer_of(target)
        assert there is not None
        where = f"{ALL[name].relative_to(ROOT)}:{line} imports {target}"
        assert there[0] <= here[0], f"{where}, a layer above it"
        if there[0] == here[0] and here[0] > 1:
            assert there[1] == here[1], f"{where}, a sibling of its layer"


def test_known_violations_still_exist() -> None:
    """An entry of KNOWN_VIOLATIONS whose import is gone must leave the list with it."""
    for name, target in sorted(KNOWN_VIOLATIONS):
        assert name in ALL and target in {t for t, _ in own_imports(name)}, (
            f"{name} no longer imports {target}: remove the entry from KNOWN_VIOLATIONS"
        )


@pytest.mark.parametrize("name", sorted(ALL))
def test_only_the_interception_package_imports_mitmproxy(name: str) -> None:
    if name == ONLY_MITMPROXY or name.startswith(ONLY_MITMPROXY + "."):
        return
    for target, line in imports(ALL[name], name):
        assert target.split(".")[0] != "mitmproxy", (
            f"{ALL[name].relative_to(ROOT)}:{line} imports {target}"
        )


def test_policy_is_pure() -> None:
    """The policy core does no I/O of its own kind: no sockets, no event loop, no proxy."""
    forbidden = {"asyncio", "socket", "selectors", "ssl", "proxy", "mitmproxy", "dns", "uvloop"}
    for name in ALL:
        if not name.startswith("policy"):
            continue
        for target, line in imports(ALL[name], name):
            assert target.split(".")[0] not in forbidden, f"{name}:{line} imports {target}"


def test_no_import_cycles() -> None:
    graph = {name: {target for target, _ in own_imports(name)} for name in ALL}
    # A package's __init__ importing its own modules is how packages re-export: not a loop back
    # up, so those edges are left out.
    for name, targets in graph.items():
        if ALL[name].name == "__init__.py":
            graph[name] = {t for t in targets if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loop = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(loop))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
