"""benchmarks/policy_decide.py, split into benchmarks/decisions/ (generate, measure, report):
a small quick run still answers the same mix at every size, meets its goals on a toy size and
writes a JSON document with the very keys of the committed results, so a full run's file and a
redrawn table stay comparable. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # it starts processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "policy_decide.py"
COMMITTED = ROOT / "benchmarks" / "results" / "policy_decide.json"


def shape(value: Any, path: str = "") -> set[str]:
    """Every key path of a JSON document (a list by its first element)."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {f"{path}/{k}", *shape(v, f"{path}/{k}")}}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return shape(value[0], f"{path}[]")
    return set()


def test_a_quick_run_writes_what_a_full_run_wrote(tmp_path: Path) -> None:
    out = tmp_path / "policy_decide.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--sizes", "10,100", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert shape(document) == shape(json.loads(COMMITTED.read_text()))
    assert document["sizes"] == [10, 100] and document["quick"] is True
    variants = ["agent.yaml", "agent.toml", "agent.yaml+ceiling"]
    assert [g["variant"] for g in document["goals"]] == variants
    assert list(document["mix"]) == variants
    assert all(row["trie"]["decisions_per_s"] > 0 for row in document["results"])
    assert "| manifest | rules |" in result.stdout and "\nGoals:\n" in result.stdout


def test_the_generator_imports_nothing_it_measures() -> None:
    """The harness builds its scale manifests with decisions/generate.py and measures the proxy
    from outside only: generating must not import policy/ (nor proxy/)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from benchmarks.decisions import generate;"
        "sets = generate.rule_sets([10, 20], generate.DEFAULT_SEED, generate.VARIANTS);"
        "assert [s.size for s in sets] == [10, 20] * 3, sets;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('policy', 'proxy')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)],
        capture_output=True, text=True, timeout=60, check=True, cwd="/",
    )  # fmt: skip
    assert result.stdout.strip() == "[]"
