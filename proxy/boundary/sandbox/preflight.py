"""What the sandbox checks before it creates anything: its capabilities and the programs it
runs (ip, nft, setpriv)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from proxy.boundary.sandbox.outcome import ActivationRefused

# capability(7) numbers
_CAPABILITIES = {
    "CAP_NET_ADMIN": 12,  # namespaces' links, addresses, routes; nftables
    "CAP_SYS_ADMIN": 21,  # `ip netns add` / `ip netns exec` (mounts, setns)
    "CAP_SETUID": 7,  # COMMAND and the canary as an unprivileged user
    "CAP_SETGID": 6,
    "CAP_KILL": 5,  # stopping COMMAND, which runs as another user
    "CAP_DAC_OVERRIDE": 1,  # /run/netns and /etc/netns belong to root
}


def missing_capabilities(status: str | None = None) -> list[str]:
    """The capabilities the sandbox needs that this process does not have in effect."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return sorted(_CAPABILITIES)
    effective = 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
    return [name for name, bit in _CAPABILITIES.items() if not effective >> bit & 1]


@dataclass(frozen=True, slots=True)
class Tools:
    ip: str
    nft: str
    setpriv: str | None


def find_tools(nft: str, need_setpriv: bool) -> Tools:
    found = {"ip": shutil.which("ip"), "nft": shutil.which(nft)}
    found["setpriv"] = shutil.which("setpriv") if need_setpriv else None
    missing = [
        name for name, path in found.items() if path is None and (name != "setpriv" or need_setpriv)
    ]
    if missing:
        packages = {"ip": "iproute2", "nft": "nftables", "setpriv": "util-linux"}
        raise ActivationRefused(
            "missing " + ", ".join(f"{m} (package {packages[m]})" for m in missing)
        )
    setpriv = found["setpriv"]
    if setpriv is not None:
        help_text = subprocess.run(
            [setpriv, "--help"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        absent = [
            o for o in ("--pdeathsig", "--no-new-privs", "--clear-groups") if o not in help_text
        ]
        if absent:
            raise ActivationRefused(
                f"{setpriv} lacks {', '.join(absent)} (util-linux 2.33 or later needed)"
            )
    assert found["ip"] and found["nft"]
    return Tools(found["ip"], found["nft"], setpriv)
