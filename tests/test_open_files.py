"""The open-files limit of the real `egress-proxy run` process (proxy/app/open_files.py): started
with systemd's soft RLIMIT_NOFILE of 1024 (through util-linux's prlimit, which sets it and
execs the command, so the proxy keeps the PID), it runs with the hard limit, and says so on one
line when even the hard limit is below what `limits.max_connections` needs."""

from __future__ import annotations

import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.running import RunningProxy, metric_value

PRLIMIT = shutil.which("prlimit")
SYSTEMD_SOFT = 1024
MANIFEST = "network:\n  egress: [up.test]\n"
HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

pytestmark = [
    pytest.mark.integration,  # it starts processes
    pytest.mark.skipif(PRLIMIT is None, reason="util-linux's prlimit is not installed"),
]


@dataclass
class LimitedProxy(RunningProxy):
    """`egress-proxy run` started with RLIMIT_NOFILE soft:hard."""

    soft: int = SYSTEMD_SOFT
    hard: int = SYSTEMD_SOFT

    def command(self) -> list[str]:
        assert PRLIMIT is not None
        return [PRLIMIT, f"--nofile={self.soft}:{self.hard}", "--", *super().command()]


def open_files(pid: int) -> tuple[int, int]:
    """(soft, hard) "Max open files" of a running process."""
    text = Path(f"/proc/{pid}/limits").read_text()
    match = re.search(r"^Max open files\s+(\d+)\s+(\d+)", text, re.MULTILINE)
    assert match is not None, text
    return int(match[1]), int(match[2])


@pytest.mark.skipif(
    HARD == resource.RLIM_INFINITY or HARD < 4096, reason="the hard limit here is too low"
)
def test_a_soft_limit_of_1024_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    hard = min(HARD, 65536)
    with LimitedProxy(tmp_path, MANIFEST, soft=SYSTEMD_SOFT, hard=hard) as proxy:
        assert open_files(proxy.pid) == (hard, hard)
        assert metric_value(proxy.metrics(), "egress_open_files_limit") == hard
        assert "RLIMIT_NOFILE" not in proxy.stderr()  # enough for 1024 connections
    assert proxy.returncode == 0


def test_a_hard_limit_too_low_for_max_connections_is_said(tmp_path: Path) -> None:
    extra = "limits:\n  max_connections: 1024\n"
    with LimitedProxy(tmp_path, MANIFEST, config_extra=extra) as proxy:
        assert open_files(proxy.pid) == (SYSTEMD_SOFT, SYSTEMD_SOFT)
        lines = [line for line in proxy.stderr().splitlines() if "RLIMIT_NOFILE" in line]
        assert len(lines) == 1, proxy.stderr()
        assert "stays at 1024" in lines[0] and "limits.max_connections" in lines[0]
        assert metric_value(proxy.metrics(), "egress_open_files_limit") == SYSTEMD_SOFT
    assert proxy.returncode == 0
