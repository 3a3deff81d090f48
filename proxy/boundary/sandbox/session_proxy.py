"""The session proxy, `egress-proxy run` on the host side of the veth: its ports there, its
command line, starting it, waiting until `/readyz` answers, its log, stopping it."""

from __future__ import annotations

import contextlib
import http.client
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from proxy.boundary.sandbox.children import parent_death_signal, without_proxy_variables
from proxy.boundary.sandbox.net import AddressPlan, SandboxError, SessionNames
from proxy.boundary.sandbox.options import Options
from proxy.boundary.sandbox.outcome import ActivationRefused
from proxy.common.listeners import format_listen

PROXY_STOP_TIMEOUT = 10.0
_LOG_TAIL_LINES = 20


# -- ports ---------------------------------------------------------------------------------


def free_port(host: str, kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int, kind: socket.SocketKind) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def session_ports(plan: AddressPlan) -> tuple[int, int, int]:
    """(explicit, transparent, dns) ports, free on both host-side addresses: TCP for the first
    two, TCP and UDP for the DNS one (the responder serves both). The addresses are the
    session's own, so only a wildcard bind elsewhere can take one."""
    hosts = (str(plan.host4), str(plan.host6))
    kinds = {
        "explicit": (socket.SOCK_STREAM,),
        "transparent": (socket.SOCK_STREAM,),
        "dns": (socket.SOCK_DGRAM, socket.SOCK_STREAM),
    }
    chosen: list[int] = []
    for needs in kinds.values():
        for _ in range(32):
            port = free_port(hosts[0], needs[0])
            if port not in chosen and all(_bindable(h, port, k) for h in hosts for k in needs):
                chosen.append(port)
                break
        else:
            raise SandboxError("sandbox_setup", "no free port on the host side of the veth")
    explicit, transparent, dns = chosen
    return explicit, transparent, dns


# -- the process ---------------------------------------------------------------------------


def proxy_command(
    options: Options,
    plan: AddressPlan,
    ports: tuple[int, int, int],
    names: SessionNames,
    admin: tuple[str, int],
    ask_token: Path | None = None,
) -> list[str]:
    """`egress-proxy run` with an explicit HTTP listener, a transparent one and the DNS
    responder on both host-side addresses, and the admin listener."""
    explicit, transparent, dns = ports
    host4, host6 = str(plan.host4), str(plan.host6)
    command = [sys.executable, "-m", "proxy", "run", options.manifest]
    if options.ceiling:
        command += ["--ceiling", options.ceiling]
    if options.config:
        command += ["--config", options.config]
    if options.format:
        command += ["--format", options.format]
    command += [
        "--listen", f"http://{host4}:{explicit}",
        "--listen", f"http://[{host6}]:{explicit}",
        "--listen", f"transparent://{host4}:{transparent}",
        "--listen", f"transparent://[{host6}]:{transparent}",
        "--dns-listen", f"{host4}:{dns}",
        "--dns-listen", f"[{host6}]:{dns}",
        "--admin", format_listen(*admin),
        "--session-id", options.session_id or f"sandbox-{names.suffix}",
    ]  # fmt: skip
    if options.audit_log:
        command += ["--audit-log", options.audit_log]
    if options.learn:
        command.append("--learn")
    if ask_token is not None:
        command += ["--ask", "--ask-token", str(ask_token)]
    return command


def ask_command(admin: tuple[str, int], token: Path) -> str:
    """The exact `egress-proxy ask` command line that answers this session's asks; through
    sudo when the sandbox runs under it, since the token file is root's alone."""
    program = shutil.which("egress-proxy") or f"{sys.executable} -m proxy"
    sudo = "sudo " if os.geteuid() == 0 and os.environ.get("SUDO_USER") else ""
    words = ["ask", "--admin", format_listen(*admin), "--token", str(token)]
    return sudo + " ".join([program, *map(shlex.quote, words)])


def start_proxy(command: list[str], log: Path, err: TextIO) -> subprocess.Popen[bytes]:
    """Start the proxy, its stderr into `log`, its stdout (audit lines without --audit-log)
    onto `err`."""
    with open(log, "wb") as stderr:
        try:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                # Audit lines (without --audit-log): stdout is COMMAND's, stderr is free.
                stdout=err.fileno() if _has_fileno(err) else subprocess.DEVNULL,
                stderr=stderr,
                cwd="/",
                env=without_proxy_variables(os.environ),
                # Its own session: a terminal's ^C is for COMMAND, not the proxy.
                start_new_session=True,
                preexec_fn=parent_death_signal(signal.SIGTERM),
            )
        except OSError as exc:
            raise ActivationRefused(f"cannot start the proxy: {exc.strerror or exc}") from None


def log_tail(log: Path) -> str:
    """The last lines the proxy printed, to end a message with."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    tail = [line for line in lines if line.strip()][-_LOG_TAIL_LINES:]
    return (":\n  " + "\n  ".join(tail)) if tail else " (it printed nothing)"


def wait_ready(
    proxy: subprocess.Popen[bytes],
    admin: tuple[str, int],
    timeout: float,
    log: Path,
    check_interrupted: Callable[[], None],
) -> None:
    """Until `/readyz` on `admin` answers 200; ActivationRefused when the proxy exits first or
    `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        check_interrupted()
        if proxy.poll() is not None:
            raise ActivationRefused(
                f"the proxy exited with status {proxy.returncode} before it was "
                f"ready{log_tail(log)}"
            )
        if _ready(*admin):
            return
        if time.monotonic() > deadline:
            raise ActivationRefused(
                f"the proxy was not ready within {timeout:g}s "
                f"(/readyz on {format_listen(*admin)}){log_tail(log)}"
            )
        time.sleep(0.1)


def stop_proxy(proxy: subprocess.Popen[bytes]) -> None:
    if proxy.poll() is not None:
        return
    # Nothing is left to drain for: a second SIGTERM ends the drain at once.
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            proxy.terminate()
        try:
            proxy.wait(timeout=1.0)
            return
        except subprocess.TimeoutExpired:
            continue
    try:
        proxy.wait(timeout=PROXY_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proxy.kill()
        proxy.wait(timeout=10)


def _ready(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", "/readyz")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _has_fileno(stream: TextIO) -> bool:
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True
