"""scripts/find-python: the set-up finds a Python >= 3.12 or says what is missing.
scripts/install-wheel: the wheel installs into a fresh virtual environment and runs, and the
container image installs it the same way."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

ROOT = Path(__file__).resolve().parents[1]
FIND = ROOT / "scripts" / "find-python"
INSTALL = ROOT / "scripts" / "install-wheel"


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


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """egress-proxy installed into a fresh virtual environment the way a user's tool installer
    and the container image install it: `scripts/install-wheel --offline VENV` (the script the
    Containerfile runs, online there) builds the wheel with `python -m build --no-isolation`
    (this environment's setuptools) and installs it into a new venv, system site packages off,
    with `pip install --no-index --no-deps`. No network is used.

    Its dependencies come from this test environment, offline and without copying them: a .pth
    file in the new venv's site-packages names this environment's site-packages. A .pth line
    only appends a directory to sys.path, after the venv's own site-packages, and the .pth files
    in that directory are not run (only a site directory's are): the editable install of this
    checkout stays inert, and `proxy` and `policy` are the wheel's (checked below). A wheelhouse
    of every installed distribution would prove the same, minus the resolver, at the cost of a
    hundred megabytes per run."""
    venv = tmp_path_factory.mktemp("tool") / "venv"
    subprocess.run(
        ["/bin/sh", str(INSTALL), "--offline", str(venv)],
        env={**os.environ, "PYTHON": sys.executable},
        check=True, capture_output=True, timeout=600, cwd=venv.parent,
    )  # fmt: skip
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    (site,) = venv.glob("lib/python3*/site-packages")
    ours = dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]))
    (site / "test-environment-dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return venv


def in_venv(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command of the installed tool, away from the checkout (nothing of it on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=venv.parent,
    )  # fmt: skip


def test_the_wheel_installs_into_a_fresh_environment_and_runs(installed: Path) -> None:
    import proxy

    version = in_venv(installed, "egress-proxy", "--version")
    assert version.returncode == 0 and version.stdout.split() == ["egress-proxy", proxy.__version__]
    check = in_venv(installed, "egress-proxy", "check", str(ROOT / "examples" / "agent.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr
    where = in_venv(installed, "python", "-c", "import proxy, policy; print(proxy.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout + where.stderr


def test_the_wheel_holds_every_package_of_the_tree(installed: Path) -> None:
    """A non-editable install gets what the wheel holds: every package directory under policy/
    and proxy/ must be in it, with all its modules."""
    (site,) = installed.glob("lib/python3*/site-packages")
    packed = {str(path.relative_to(site)) for path in site.rglob("*.py")}
    expected = {
        str(path.relative_to(ROOT))
        for package in ("policy", "proxy")
        for path in (ROOT / package).rglob("*.py")
    }
    assert expected - packed == set()
    assert any(name.startswith("proxy/dataplane/") for name in packed)


def test_the_image_installs_with_the_same_script_and_build_pin() -> None:
    """deploy/Containerfile installs by scripts/install-wheel, the procedure tested above, with
    the build frontend pinned as in pyproject.toml, and runs the venv's `egress-proxy`."""
    text = re.sub(r"\\\n", " ", (ROOT / "deploy" / "Containerfile").read_text())
    steps = [line.split(maxsplit=1) for line in text.splitlines() if line.strip()[:1].isalpha()]
    copies = [rest for instruction, rest in steps if instruction == "COPY"]
    runs = [shlex.split(rest) for instruction, rest in steps if instruction == "RUN"]
    assert "scripts/install-wheel ./scripts/install-wheel" in copies
    (install,) = [words for words in runs if "scripts/install-wheel" in words]
    venv = install[install.index("scripts/install-wheel") + 1]
    assert f"PATH={venv}/bin:$PATH" in [rest for instruction, rest in steps if instruction == "ENV"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in extras["optional-dependencies"]["test"] if r.startswith("build")]
    assert install[: install.index("&&")] == ["pip", "install", pin]


def test_the_version_has_one_source() -> None:
    """pyproject.toml reads the version from proxy/__init__.py; the installed metadata agrees."""
    from importlib import metadata

    import proxy

    assert metadata.version("egress-proxy") == proxy.__version__
