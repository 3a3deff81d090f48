"""`egress-proxy sandbox` sessions as the tests run them (root only): the session's random
subnets, what a finished session reported (exit, output, status file, audit log), and every
namespace, table, veth, /etc/netns directory or process a session could leave behind.
conftest.py's `nothing_left` fixture asserts none is."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this is tests/support/)
IP, NFT = shutil.which("ip") or "ip", shutil.which("nft") or "nft"

SESSION_TIMEOUT = 90.0


def session_objects(subnets: Subnets) -> set[str]:
    """Every sandbox namespace, table, link and /etc/netns directory that exists now, and every
    process (the sandbox, its proxy) that names the test's subnets."""
    found = set()
    with contextlib.suppress(OSError):
        found |= {f"netns:{n}" for n in os.listdir("/run/netns") if n.startswith("egress-sb-")}
    with contextlib.suppress(OSError):
        found |= {f"etc:{n}" for n in os.listdir("/etc/netns") if n.startswith("egress-sb-")}
    links = subprocess.run(
        [IP, "-o", "link", "show"], capture_output=True, text=True, timeout=30
    ).stdout
    found |= {f"link:{m}" for m in re.findall(r"^\d+: (egsb[0-9a-f]+[hn])\b", links, re.M)}
    tables = subprocess.run(
        [NFT, "list", "tables"], capture_output=True, text=True, timeout=30
    ).stdout
    found |= {f"table:{m}" for m in re.findall(r"table inet (egress_sb_[0-9a-f]+)", tables)}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                if subnets.host4.encode() in command or str(subnets.subnet4).encode() in command:
                    found.add(f"process:{entry}:{command[:120]!r}")
    return found


@dataclass(frozen=True)
class Subnets:
    subnet4: ipaddress.IPv4Network
    subnet6: ipaddress.IPv6Network

    @classmethod
    def random(cls) -> Subnets:
        base = int(ipaddress.IPv4Address("198.51.100.0")) + 4 * secrets.randbelow(64)
        ula = (0xFD << 120) | (secrets.randbits(56) << 64)
        return cls(ipaddress.IPv4Network((base, 30)), ipaddress.IPv6Network((ula, 64)))

    @property
    def host4(self) -> str:
        return str(self.subnet4.network_address + 1)

    @property
    def ns4(self) -> str:
        return str(self.subnet4.network_address + 2)

    @property
    def host6(self) -> str:
        return str(self.subnet6.network_address + 1)

    def args(self) -> list[str]:
        return ["--subnet4", str(self.subnet4), "--subnet6", str(self.subnet6)]


@dataclass
class Session:
    returncode: int
    stdout: str
    stderr: str
    status: dict
    audit: list[dict]

    def lines(self) -> dict[str, dict[str, str]]:
        """COMMAND's `NAME key=value ...` lines."""
        parsed = {}
        for line in self.stdout.splitlines():
            name, *pairs = line.split()
            parsed[name] = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
        return parsed


def finished(directory: Path, done: subprocess.CompletedProcess[str] | tuple) -> Session:
    returncode, stdout, stderr = (
        (done.returncode, done.stdout, done.stderr)
        if isinstance(done, subprocess.CompletedProcess)
        else done
    )
    status_file = directory / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    audit_file = directory / "audit.jsonl"
    audit = (
        [json.loads(line) for line in audit_file.read_text().splitlines()]
        if audit_file.exists()
        else []
    )
    return Session(returncode, stdout, stderr, status, audit)
