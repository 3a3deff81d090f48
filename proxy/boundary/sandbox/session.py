"""`egress-proxy sandbox MANIFEST [options] -- COMMAND [ARGS...]`: the one-machine shape
(docs/deployment.md). COMMAND runs in a network namespace of its own whose only way out is
the session proxy, and only after that has been shown to hold.

Activation, in order; any failure tears down what exists and COMMAND never runs:
1. preflight (preflight.py): capabilities, tools, the user to run as, the policy compiled
   (nothing created yet);
2. the session's names (`egress-sb-XXXXXXXX`, veth `egsbXXXXXXXXh`/`…n`, table
   `inet egress_sb_XXXXXXXX`) and addresses (net.py); /etc/netns/NAME/resolv.conf naming the
   host side as the nameserver;
3. the namespace and the veth pair, addressed, links down;
4. the host-side nftables rules (proxy/boundary/nft/sandbox_rules.py), loaded, read back and
   compared (`apply_ruleset`); only then are the links brought up and routed;
5. the session proxy (session_proxy.py: `egress-proxy run`) on the host side: an explicit HTTP
   listener, a transparent one for v4 and v6, the DNS responder for v4 and v6, and its admin
   listener; it must answer `/readyz` 200 within `--ready-timeout`;
6. the canary (canary.py, observers.py): `python -m proxy.probes` inside the namespace as
   COMMAND's user. Its targets are only the host side's addresses, where this process holds
   observer sockets of its own: TCP to an observer must be answered by the proxy instead, UDP
   to an echo observer must get no echo, a DNS query for a name outside any policy must be
   refused; ICMP echo to the host side, sent as root (an unprivileged user usually cannot send
   ICMP at all), must get no reply. The observers must have seen nothing;
7. COMMAND (command.py), inside the namespace, as its user (`setpriv`, no new privileges, no
   supplementary groups), with HTTP(S)_PROXY pointing at the explicit listener and, with
   inspection enabled, the trust variables pointing at the session's bundle (trust.py, written
   before the proxy starts).

Then: COMMAND's exit ends the session with COMMAND's status; the proxy exiting while COMMAND runs
stops COMMAND (fail closed) and ends it with EXIT_PROXY_DIED (outcome.py). SIGINT, SIGTERM,
SIGHUP and SIGQUIT are passed on to COMMAND (not those a terminal already sent to COMMAND's
process group). Teardown runs on every path and is idempotent; a step that fails is reported
and the others still run. It never removes the rules while the veth pair may still exist.

The orchestrator is synchronous (subprocess and select, no threads), so forking is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from proxy.boundary.nft.load import apply_ruleset, remove_table
from proxy.boundary.nft.sandbox_rules import sandbox_ruleset
from proxy.boundary.sandbox import command as commands
from proxy.boundary.sandbox import net as sandbox_net
from proxy.boundary.sandbox import session_proxy
from proxy.boundary.sandbox.canary import run_canary
from proxy.boundary.sandbox.net import AddressPlan, SandboxError, SessionNames
from proxy.boundary.sandbox.options import Options
from proxy.boundary.sandbox.outcome import (
    EXIT_INTERNAL,
    EXIT_PROXY_DIED,
    PREFIX,
    ActivationRefused,
    Interrupted,
    Outcome,
    boundary_failed,
    internal_error,
    interrupted,
)
from proxy.boundary.sandbox.preflight import Tools, find_tools
from proxy.boundary.sandbox.session_trust import publish_session_trust, trust_message
from proxy.common.errors import ProxyError
from proxy.common.terminal import printable

if TYPE_CHECKING:
    from proxy.app.inputs import Compiled
    from proxy.tls.bundle import TrustFiles

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Sandbox:
    """One session: set up, run COMMAND, tear down. Use `run()` once."""

    def __init__(self, options: Options, err: TextIO, compiled: Compiled) -> None:
        self.options = options
        self.err = err
        self.compiled = compiled  # the policy and operator config, as compiled at preflight
        self.trust: TrustFiles | None = None
        self.tools: Tools | None = None
        self.names: SessionNames | None = None
        self.plan: AddressPlan | None = None
        self.ports: tuple[int, int, int] | None = None
        self.admin: tuple[str, int] | None = None
        self.workdir: Path | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.command: subprocess.Popen[bytes] | None = None
        self.signals: list[int] = []
        self._wake_r, self._wake_w = -1, -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        # What may exist (set before each step, so an interrupted step is undone too).
        self._made: set[str] = set()
        self.command_status: int | None = None
        self.canary_count = 0

    # -- output ----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        first, *more = text.splitlines() or [""]
        lines = [f"{PREFIX}: {first}", *more]  # continuation lines are indented by the caller
        with contextlib.suppress(Exception):
            self.err.write("".join(printable(line) + "\n" for line in lines))
            self.err.flush()

    # -- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for signum in _FORWARDED:
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        if self._wake_w >= 0:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _check_interrupted(self) -> None:
        if self.signals:
            raise Interrupted(self.signals[0])

    # -- the whole life --------------------------------------------------------------------

    def run(self) -> int:
        """Activate, run COMMAND, tear down; the exit status (see outcome.py's EXIT_*)."""
        self._install_signals()
        outcome = Outcome("internal_error", EXIT_INTERNAL, "")
        try:
            outcome = self._session()
        finally:
            problems = self.teardown()
            self._restore_signals()
        if outcome.kind != "command_exited":
            self.say(f"error: {outcome.message}")
        message = outcome.message
        if problems:
            message = "; ".join(filter(None, [message, "teardown: " + "; ".join(problems)]))
        self._write_status(outcome.kind, outcome.status, message)
        return outcome.status

    def _session(self) -> Outcome:
        try:
            self._activate()
        except Interrupted as exc:
            return interrupted(exc.signum)
        except ActivationRefused as exc:
            return self._refused(str(exc))
        except ProxyError as exc:  # SandboxError and the rules' boundary_failed
            return self._refused(exc.message)
        except Exception as exc:  # a bug: still torn down, never a traceback
            return internal_error(exc)
        try:
            return self._run_command()
        except Interrupted as exc:
            return interrupted(exc.signum)
        except ActivationRefused as exc:
            return self._refused(str(exc))
        except Exception as exc:
            return internal_error(exc)

    def _refused(self, why: str) -> Outcome:
        if self.signals:
            # A step that failed because ^C reached its subprocess too: say what happened.
            return interrupted(self.signals[0])
        return boundary_failed(why)

    def _write_status(self, outcome: str, status: int, message: str) -> None:
        path = self.options.status_file
        if path is None:
            return
        report = {
            "outcome": outcome,
            "exit_status": status,
            "command_status": self.command_status,
            "session": self.names.suffix if self.names else None,
            "message": message,
        }
        try:
            Path(path).write_text(json.dumps(report) + "\n")
        except OSError as exc:
            self.say(f"cannot write --status-file {path}: {exc.strerror or exc}")

    # -- activation ------------------------------------------------------------------------

    def _activate(self) -> None:
        options = self.options
        self.tools = find_tools(options.nft, need_setpriv=not options.run_as.is_root)
        ip = self.tools.ip
        in_use = sandbox_net.networks_in_use(ip)
        self.plan = sandbox_net.plan_addresses(options.subnet4, options.subnet6, in_use=in_use)
        self.names = names = SessionNames.new(taken=sandbox_net.existing_session_names())
        self._check_interrupted()

        self._made.add("etc")
        sandbox_net.write_resolv_conf(names, self.plan)
        self._made.add("netns")
        sandbox_net.create_namespace(ip, names, self.plan)
        self._check_interrupted()

        self.ports = session_proxy.session_ports(self.plan)
        explicit, transparent, dns = self.ports
        text = sandbox_ruleset(
            names.table, names.host_link, str(self.plan.host4), str(self.plan.host6),
            explicit_port=explicit, transparent_port=transparent, dns_port=dns,
        )  # fmt: skip
        self._made.add("table")
        apply_ruleset(text, names.table, nft=self.tools.nft)
        self._check_interrupted()
        sandbox_net.bring_up(ip, names, self.plan)
        self._check_interrupted()

        self._made.add("trust")
        self.trust = publish_session_trust(self.compiled.policy, self.compiled.config, names.suffix)
        self._start_proxy()
        self._wait_ready()
        self.canary_count = run_canary(self.tools, names, self.plan, options.run_as)
        if not self.proxy_alive():
            raise ActivationRefused(f"the proxy exited during the canary{self._proxy_log_tail()}")

    # -- the proxy -------------------------------------------------------------------------

    def _start_proxy(self) -> None:
        assert self.plan and self.ports and self.names
        host, port = self.options.admin
        self.admin = (host, port or session_proxy.free_port(host))
        self._made.add("workdir")
        # 0700, this process's own: COMMAND's user cannot enter it, so the token that answers
        # asks (kept here) is out of its reach.
        self.workdir = Path(tempfile.mkdtemp(prefix=f"egress-sb-{self.names.suffix}-"))
        command = session_proxy.proxy_command(
            self.options, self.plan, self.ports, self.names, self.admin, self.ask_token
        )
        self._made.add("proxy")
        self.proxy = session_proxy.start_proxy(command, self.workdir / "proxy.log", self.err)

    @property
    def ask_token(self) -> Path | None:
        """With --ask: the token file the session proxy makes in the work directory."""
        if not self.options.ask or self.workdir is None:
            return None
        return self.workdir / "ask-token"

    def _wait_ready(self) -> None:
        assert self.admin and self.proxy and self.workdir
        session_proxy.wait_ready(
            self.proxy,
            self.admin,
            self.options.ready_timeout,
            self.workdir / "proxy.log",
            self._check_interrupted,
        )

    def proxy_alive(self) -> bool:
        return self.proxy is not None and self.proxy.poll() is None

    def _proxy_log_tail(self) -> str:
        if self.workdir is None:
            return ""
        return session_proxy.log_tail(self.workdir / "proxy.log")

    # -- COMMAND ---------------------------------------------------------------------------

    def _run_command(self) -> Outcome:
        assert self.plan and self.ports and self.names and self.tools
        self._check_interrupted()
        options, names = self.options, self.names
        run_as = options.run_as
        proxy_url = f"http://{self.plan.host4}:{self.ports[0]}"
        if not options.quiet:
            proxy_pid = self.proxy.pid if self.proxy else "?"
            self.say(
                f"session {names.suffix}: boundary verified ({self.canary_count} canary "
                f"probes held); namespace {names.netns}, proxy {proxy_url} (pid {proxy_pid}); "
                f"running {options.command[0]} as {run_as}"
            )
        if self.trust is not None and not options.quiet:
            self.say(trust_message(self.trust))
        if options.learn:
            # Said whatever --quiet says: a session that lets refusals through is never silent.
            self.say(
                "LEARNING MODE: the proxy lets through (and audits as would_deny) connections "
                "the manifest does not allow; this session is not enforcing the manifest"
            )
        if self.ask_token is not None and self.admin is not None:
            # Said whatever --quiet says: someone must answer, from another terminal.
            self.say(
                "ASK MODE: connections the manifest does not allow wait for a person; answer "
                "them from another terminal with:\n  "
                + session_proxy.ask_command(self.admin, self.ask_token)
            )
        if run_as.is_root:
            self.say(
                "warning: COMMAND runs as root, which can leave a network namespace (setns into "
                "the host's): it is not contained"
            )
        self._made.add("command")
        trust = self.trust.environment() if self.trust else {}
        credentials = self.compiled.config.credentials  # placeholders only, never a secret
        self.command = commands.start_command(
            commands.command_argv(self.tools, names.netns, run_as, options.command),
            commands.command_env(
                proxy_url, names.netns, run_as, trust=trust, credentials=credentials
            ),
        )
        return self._supervise()

    def _supervise(self) -> Outcome:
        """Wait for COMMAND or the proxy, passing signals on. COMMAND's exit is the outcome;
        the proxy exiting first stops COMMAND (fail closed)."""
        assert self.command and self.proxy
        # Neither child has been waited for yet, so both pids still name them (a zombie too).
        watched = [os.pidfd_open(self.command.pid), os.pidfd_open(self.proxy.pid)]
        handled = 0
        try:
            while True:
                select.select([*watched, self._wake_r], [], [], 1.0)
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 512)
                while handled < len(self.signals):
                    self._forward(self.signals[handled])
                    handled += 1
                if self.command.poll() is not None:
                    return Outcome("command_exited", self._command_exit_status(), "")
                if self.proxy.poll() is not None:
                    status = self.proxy.returncode
                    self._stop_command()
                    return Outcome(
                        "proxy_died",
                        EXIT_PROXY_DIED,
                        f"the session proxy exited (status {status}) while COMMAND ran; "
                        f"COMMAND was stopped (fail closed){self._proxy_log_tail()}",
                    )
        finally:
            for fd in watched:
                os.close(fd)

    def _command_exit_status(self) -> int:
        assert self.command
        self.command_status = commands.exit_status(self.command.returncode)
        return self.command_status

    def _forward(self, signum: int) -> None:
        assert self.command
        if signum in commands.FROM_TERMINAL and commands.terminal_signals_reach_us():
            return  # the terminal sent it to our whole process group: COMMAND has it already
        with contextlib.suppress(ProcessLookupError):
            self.command.send_signal(signum)

    def _stop_command(self) -> None:
        command = self.command
        if command is None or command.poll() is not None:
            return
        commands.stop_command(command)
        if self.command_status is None:
            self._command_exit_status()

    # -- teardown --------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Undo everything that may exist; idempotent. Every failing step is reported and the
        rest still run; the rules go only once the veth pair is gone."""
        problems: list[str] = []

        def step(what: str, action: Callable[[], object]) -> bool:
            try:
                action()
                return True
            except Exception as exc:
                text = exc.message if isinstance(exc, ProxyError) else str(exc)
                problems.append(f"{what}: {text}")
                self.say(f"teardown: {what} failed: {text}")
                return False

        ip = self.tools.ip if self.tools else None
        nft = self.tools.nft if self.tools else None
        names, workdir = self.names, self.workdir
        if "command" in self._made:
            step("stopping COMMAND", self._stop_command)
        if names is not None and "netns" in self._made:
            step("stopping processes left in the namespace", self._kill_namespace_processes)
        if "proxy" in self._made:
            step("stopping the proxy", self._stop_proxy)
        link_gone = True
        if names is not None and ip is not None and "netns" in self._made:
            link_gone = step(
                "deleting the veth pair", lambda: sandbox_net.delete_host_link(ip, names)
            )
        if names is not None and nft is not None and "table" in self._made:
            if link_gone:
                step(
                    f"deleting table inet {names.table}",
                    lambda: remove_table(names.table, nft=nft),
                )
            else:
                problems.append(f"kept table inet {names.table}: the veth pair may still exist")
        if names is not None and ip is not None and "netns" in self._made:
            step("deleting the namespace", lambda: sandbox_net.delete_namespace(ip, names))
        if names is not None and "etc" in self._made:
            step(f"removing {names.etc_dir}", lambda: sandbox_net.remove_resolv_conf(names))
        if workdir is not None:
            step("removing the work directory", lambda: shutil.rmtree(workdir, ignore_errors=True))
        trust = self.trust
        if trust is not None and "trust" in self._made:
            step(
                "removing the trust directory",
                lambda: shutil.rmtree(trust.directory, ignore_errors=True),
            )
        self._made.clear()
        return problems

    def _kill_namespace_processes(self) -> None:
        assert self.names
        deadline = time.monotonic() + 5.0
        while pids := [p for p in sandbox_net.namespace_pids(self.names) if p != os.getpid()]:
            if time.monotonic() > deadline:
                raise SandboxError("sandbox_teardown", f"processes {pids[:10]} would not die")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        # Reap a COMMAND killed here, so it leaves no zombie.
        if self.command is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.command.wait(timeout=1)

    def _stop_proxy(self) -> None:
        if self.proxy is not None:
            session_proxy.stop_proxy(self.proxy)
