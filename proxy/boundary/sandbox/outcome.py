"""How a sandbox session ends: its exit statuses, the Outcome it reports (stderr and
`--status-file`), and the exceptions that stop activation."""

from __future__ import annotations

import signal
from dataclasses import dataclass

# Exit statuses of the sandbox itself. COMMAND's own status is passed through unchanged, so a
# caller tells them apart by the last stderr line (`egress-proxy sandbox: error: ...`, printed
# only for the sandbox's own failures) or, robustly, by `--status-file`.
EXIT_FINDINGS = 1  # the manifest does not compile (as `check` and `run`)
EXIT_USAGE = 2  # usage error or unreadable input (as the other commands)
EXIT_BOUNDARY = 69  # EX_UNAVAILABLE: the boundary could not be established; COMMAND never ran
EXIT_INTERNAL = 70  # a bug, reported without a traceback
EXIT_PROXY_DIED = 75  # the proxy exited while COMMAND ran; COMMAND was stopped
EXIT_PRIVILEGES = 77  # EX_NOPERM: missing capabilities; nothing was created

PREFIX = "egress-proxy sandbox"


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ActivationRefused(Exception):
    """Activation refused: the boundary could not be established (exit EXIT_BOUNDARY)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # command_exited, proxy_died, boundary_failed, interrupted, internal_error
    status: int  # the exit status
    message: str


def interrupted(signum: int) -> Outcome:
    name = signal.Signals(signum).name
    return Outcome("interrupted", 128 + signum, f"interrupted by {name} before COMMAND started")


def boundary_failed(why: str) -> Outcome:
    return Outcome(
        "boundary_failed", EXIT_BOUNDARY, f"activation refused, COMMAND did not run: {why}"
    )


def internal_error(exc: Exception) -> Outcome:
    return Outcome(
        "internal_error",
        EXIT_INTERNAL,
        f"internal error ({type(exc).__name__}: {str(exc)[:200]}); please report it",
    )
