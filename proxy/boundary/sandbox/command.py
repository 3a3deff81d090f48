"""COMMAND: its command line inside the namespace as its user (`setpriv`, no new privileges,
no supplementary groups), its environment (HTTP(S)_PROXY at the explicit listener), starting
and stopping it, and its exit status."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

from proxy.boundary.sandbox.children import (
    PROXY_VARIABLES,
    parent_death_signal,
    without_proxy_variables,
)
from proxy.boundary.sandbox.options import RunAs
from proxy.boundary.sandbox.outcome import ActivationRefused
from proxy.boundary.sandbox.preflight import Tools
from proxy.common.settings import Credential

# COMMAND gets this long after SIGTERM (when the proxy died, or at teardown) before SIGKILL.
TERM_GRACE = 3.0
# Signals a terminal sends to its whole foreground process group (COMMAND is in ours).
FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def command_argv(tools: Tools, netns: str, run_as: RunAs, command: tuple[str, ...]) -> list[str]:
    argv = [tools.ip, "netns", "exec", netns]
    if not run_as.is_root:
        assert tools.setpriv
        argv += [
            tools.setpriv, f"--reuid={run_as.uid}", f"--regid={run_as.gid}",
            "--clear-groups", "--no-new-privs", "--inh-caps=-all",
            # setpriv's change of user would clear an inherited one: set it after.
            "--pdeathsig=KILL", "--",
        ]  # fmt: skip
    return argv + list(command)


def command_env(
    proxy_url: str,
    netns: str,
    run_as: RunAs,
    *,
    trust: dict[str, str] | None = None,
    credentials: Sequence[Credential] = (),
) -> dict[str, str]:
    """`trust`: the trust variables (proxy/tls/bundle.py), which replace any the caller had.
    `credentials`: the operator's (proxy/app/credentials_config.py); each one's `env` is set to its
    placeholder, and no secret reaches COMMAND (see `without_secrets`)."""
    env = without_secrets(without_proxy_variables(os.environ), credentials)
    env.update({c.env: c.placeholder for c in credentials if c.env and c.placeholder})
    env.update(dict.fromkeys(PROXY_VARIABLES, proxy_url))
    env.update(trust or {})
    env["NO_PROXY"] = env["no_proxy"] = ""
    env["EGRESS_PROXY_SANDBOX"] = netns
    if not run_as.is_root:
        # sudo leaves root's HOME behind; COMMAND could not write there anyway.
        for key in ("HOME", "USER", "LOGNAME"):
            env.pop(key, None)
        if run_as.name:
            env["USER"] = env["LOGNAME"] = run_as.name
        if run_as.home:
            env["HOME"] = run_as.home
    return env


def without_secrets(env: dict[str, str], credentials: Sequence[Credential]) -> dict[str, str]:
    """`env` without the variables credentials are read from (`value_env`), nor any variable
    whose value holds a secret (the operator's shell may have exported it under another name):
    the placeholder is all COMMAND may know."""
    drop = {c.value_env for c in credentials if c.value_env}
    secrets = [c.secret.reveal() for c in credentials if c.secret is not None]
    return {
        name: value
        for name, value in env.items()
        if name not in drop
        and not any(secret in value.encode("utf-8", "surrogateescape") for secret in secrets)
    }


def start_command(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, env=env, preexec_fn=parent_death_signal(signal.SIGKILL))
    except OSError as exc:
        raise ActivationRefused(f"cannot start COMMAND: {exc.strerror or exc}") from None


def exit_status(returncode: int) -> int:
    """COMMAND's status as a shell reports it: 128 + N for death by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def stop_command(command: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after TERM_GRACE; waited for either way."""
    if command.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        command.terminate()
    try:
        command.wait(timeout=TERM_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            command.kill()
        command.wait(timeout=10)


def terminal_signals_reach_us() -> bool:
    """Whether our process group is the foreground one of our controlling terminal: then a ^C
    reaches COMMAND (in our group) without us."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)
