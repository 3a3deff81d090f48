"""What every process the sandbox starts (the proxy, the canary, COMMAND) shares: an
environment without the caller's proxy variables, and a signal when the sandbox dies."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
DROPPED_VARIABLES = ("ALL_PROXY", "all_proxy", "FTP_PROXY", "ftp_proxy")


def without_proxy_variables(environ: Mapping[str, str]) -> dict[str, str]:
    drop = {*PROXY_VARIABLES, *DROPPED_VARIABLES, "NO_PROXY", "no_proxy"}
    return {k: v for k, v in environ.items() if k not in drop}


def parent_death_signal(signum: int) -> Callable[[], None]:
    """A preexec_fn: the child gets `signum` when this process dies (even by SIGKILL)."""

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG

    return preexec
