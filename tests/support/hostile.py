"""Hostile input files and the CLI that must refuse them, run both ways: in process (`cli`: the
whole matrix, quickly) and as the installed command (`run`: only a real process shows what a
user would see, an uncaught exception or a traceback on stderr)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from proxy.cli import main

_SCRIPT = shutil.which("egress-proxy", path=str(Path(sys.executable).parent))


COMMAND = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "proxy"]


VALID_MANIFEST = "network:\n  egress: [github.com]\n"


@dataclass
class Run:
    code: int
    out: str
    err: str


def cli(*args: str | Path) -> Run:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], out=out, err=err)
    return Run(code, out.getvalue(), err.getvalue())


def run(*args: str | Path, stdin: BinaryIO | None = None, timeout: float = 60) -> Run:
    done = subprocess.run(
        [*COMMAND, *(str(a) for a in args)],
        stdin=subprocess.DEVNULL if stdin is None else stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return Run(
        done.returncode,
        done.stdout.decode("utf-8", "replace"),
        done.stderr.decode("utf-8", "replace"),
    )


def bytes_file(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        path = directory / name
        path.write_bytes(data)
        return path

    return make


# Numbers out of bounds (policy/numbers.py), refused wherever a document is read, at the line
# and column of the number. HUGE has more digits than Python converts to or from text.
HUGE = b"9" * 5000


NUMBERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "toml_huge_int": (bytes_file("int.toml", b"name = 'x'\nsize = " + HUGE + b"\n"), ":2:8:"),
    "toml_huge_int_in_a_list": (
        bytes_file("list.toml", b'[network_access]\nallowed = ["a.com", ' + HUGE + b"]\n"),
        ":2:21:",
    ),
    # Fewer digits than Python's limit, still far out of range.
    "toml_4000_digits": (bytes_file("int4000.toml", b"size = " + b"9" * 4000 + b"\n"), ":1:8:"),
    "toml_huge_hex": (bytes_file("hex.toml", b"size = 0x" + b"f" * 5000 + b"\n"), ":1:8:"),
    "toml_2_to_the_64": (bytes_file("big.toml", b"size = 18446744073709551616\n"), ":1:8:"),
    "toml_inf": (bytes_file("inf.toml", b"size = -inf\n"), ":1:8:"),
    "toml_nan": (bytes_file("nan.toml", b"size = nan\n"), ":1:8:"),
    "toml_1e400": (bytes_file("e400.toml", b"size = 1e400\n"), ":1:8:"),
    # Digits in strings, comments and keys before the number are no numbers.
    "toml_after_strings": (
        bytes_file(
            "strings.toml",
            b"# 1e999 " + HUGE + b'\na = "1e999"\nb = """\n' + HUGE + b'\n"""\n'
            b"c = '" + HUGE + b"'\n12345 = 1\nd = [1, 2, " + HUGE + b"]\n",
        ),
        ":8:12:",
    ),
    "json_huge_int": (
        bytes_file("int.json", b'{"network": {"egress": [' + HUGE + b"]}}"),
        ":1:25:",
    ),
    "json_1e400": (bytes_file("e400.json", b'{\n  "size": 1e400\n}'), ":2:11:"),
    "json_huge_exponent": (bytes_file("exp.json", b'{"size": -1e99999999999999}'), ":1:10:"),
    "json_nan": (bytes_file("nan.json", b'{"size": NaN}'), ":1:10:"),
    "json_infinity": (bytes_file("infinity.json", b'{"a": "NaN", "size": -Infinity}'), ":1:22:"),
    "yaml_huge_int": (bytes_file("int.yaml", b"network:\n  egress: [" + HUGE + b"]\n"), ":2:12:"),
    "yaml_huge_hex": (bytes_file("hex.yaml", b"size: 0x" + b"f" * 5000 + b"\n"), ":1:7:"),
    "yaml_huge_octal": (bytes_file("octal.yaml", b"size: 0" + b"7" * 30 + b"\n"), ":1:7:"),
    "yaml_sexagesimal": (
        bytes_file("sexagesimal.yaml", b"size: 1" + b":59" * 3000 + b"\n"),
        ":1:7:",
    ),
    "yaml_underscores": (bytes_file("underscores.yaml", b"size: 1" + b"_0" * 60 + b"\n"), ":1:7:"),
    "yaml_inf": (bytes_file("inf.yaml", b"size: -.inf\n"), ":1:7:"),
    "yaml_nan": (bytes_file("nan.yaml", b"size: .NaN\n"), ":1:7:"),
    "yaml_1e999": (bytes_file("e999.yaml", b"size: 1.0e+999\n"), ":1:7:"),
    "yaml_huge_key": (
        bytes_file("key.yaml", b"network:\n  ? 0x" + b"f" * 5000 + b"\n  : 1\n"),
        ":2:5:",
    ),
}
