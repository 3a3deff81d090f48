"""The suite's own layout (tests/README.md): a test module imports no other test module (what two
modules share lives in tests/support/ or in conftest.py), and tests/ holds test modules, the
conftest and the support package only."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (a function's own imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m.split(".")[0].startswith("test_"))
        for path in sorted([*TESTS.glob("test_*.py"), *TESTS.glob("support/*.py")])
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_tests_holds_tests_conftest_and_support_only() -> None:
    others = sorted(
        path.name
        for path in TESTS.iterdir()
        if not path.name.startswith((".", "__pycache__"))
        and path.name not in {"conftest.py", "support", "README.md"}
        and not (path.name.startswith("test_") and path.suffix == ".py")
    )
    assert others == [], "helpers and the scripts the tests run belong in tests/support/"


def test_the_layout_test_sees_imports_of_every_kind(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text(
        "import test_a\nfrom test_b import x\nfrom support.c import y\n"
        "def f():\n    from test_d import z\n"
    )
    assert imported_modules(module) == {"test_a", "test_b", "support.c", "test_d"}
