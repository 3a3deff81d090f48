"""Network namespaces for the transparent-mode tests (root only): `ip` and `nft` found on PATH,
the marks that skip a module with the reason when either is missing or the user is not root,
and a command run in a namespace (or not) that must succeed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

IP, NFT = shutil.which("ip"), shutil.which("nft")

needs_namespaces = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a network namespace"),
    pytest.mark.skipif(IP is None, reason="needs iproute2 (ip)"),
    pytest.mark.skipif(NFT is None, reason="needs nftables (nft)"),
]


def run(
    *args: str, namespace: str | None = None, input: str | None = None, cwd: str | None = None
) -> str:
    """The stdout of `args` (in `namespace` when given); AssertionError with its stderr when it
    fails."""
    command = [*([str(IP), "netns", "exec", namespace] if namespace else []), *args]
    done = subprocess.run(command, input=input, capture_output=True, text=True, timeout=60, cwd=cwd)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)}: {done.stderr or done.stdout}")
    return done.stdout
