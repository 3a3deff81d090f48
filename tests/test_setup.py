"""scripts/find-python: the set-up finds a Python >= 3.12 or says what is missing."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

FIND = Path(__file__).resolve().parents[1] / "scripts" / "find-python"


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(FIND)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_finds_a_new_enough_python_here() -> None:
    result = run(dict(os.environ))
    assert result.returncode == 0, result.stderr
    version = subprocess.run(
        [result.stdout.strip(), "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == "True"


def test_python_variable_is_honoured_and_checked(tmp_path: Path) -> None:
    result = run({**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0 and Path(result.stdout.strip()).exists()
    old = tmp_path / "python-old"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    result = run({**os.environ, "PYTHON": str(old)})
    assert result.returncode == 1 and "not a Python >= 3.12" in result.stderr


def test_says_what_is_missing_when_there_is_none(tmp_path: Path) -> None:
    # A PATH whose only python3 is too old, and no pyenv versions.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat", "ls", "grep", "sort"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")  # fails the version test, as 3.11 would
    fake.chmod(0o755)
    env = {"PATH": str(bin_dir), "PYENV_ROOT": str(tmp_path / "no-pyenv"), "HOME": str(tmp_path)}
    result = run(env)
    assert result.returncode == 1
    assert "needs Python >= 3.12" in result.stderr and "PYTHON=" in result.stderr


def test_the_wheel_holds_every_package_of_the_tree(tmp_path: Path) -> None:
    """A non-editable install (the container image's `pip install .`) gets what the wheel holds:
    every package directory under policy/ and proxy/ must be in it, with all its modules."""
    root = FIND.parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(root)],
        check=True, capture_output=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("egress_proxy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.endswith(".py")}
    expected = {
        str(path.relative_to(root))
        for package in ("policy", "proxy")
        for path in (root / package).rglob("*.py")
    }
    assert expected - packed == set()
    assert any(name.startswith("proxy/dataplane/") for name in packed)


def test_the_version_has_one_source() -> None:
    """pyproject.toml reads the version from proxy/__init__.py; the installed metadata agrees."""
    from importlib import metadata

    import proxy

    assert metadata.version("egress-proxy") == proxy.__version__
