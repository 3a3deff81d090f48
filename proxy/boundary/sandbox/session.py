"""`egress-proxy sandbox MANIFEST [options] -- COMMAND [ARGS...]`: the one-machine shape of
DESIGN 6. COMMAND runs in a network namespace of its own whose only way out is the session
proxy, and only after that has been shown to hold.

Activation, in order; any failure tears down what exists and COMMAND never runs:
1. preflight: capabilities, tools, the user to run as, the policy compiled (nothing created yet);
2. the session's names (`egress-sb-XXXXXXXX`, veth `egsbXXXXXXXXh`/`…n`, table
   `inet egress_sb_XXXXXXXX`) and addresses (proxy/sandbox_net.py); /etc/netns/NAME/resolv.conf
   naming the host side as the nameserver;
3. the namespace and the veth pair, addressed, links down;
4. the host-side nftables rules (proxy/boundary/nft/sandbox.py), loaded, read back and
   compared (`apply_ruleset`); only then are the links brought up and routed;
5. the session proxy (`egress-proxy run`) on the host side: an explicit HTTP listener, a
   transparent one for v4 and v6, the DNS responder for v4 and v6, and its admin listener;
   it must answer `/readyz` 200 within `--ready-timeout`;
6. the canary: `python -m proxy.probes` inside the namespace as COMMAND's user. Its targets are
   only the host side's addresses, where this process holds observer sockets of its own: TCP to
   an observer must be answered by the proxy instead, UDP to an echo observer must get no echo,
   a DNS query for a name outside any policy must be refused; ICMP echo to the host side, sent
   as root (an unprivileged user usually cannot send ICMP at all), must get no reply. The
   observers must have seen nothing;
7. COMMAND, inside the namespace, as its user (`setpriv`, no new privileges, no supplementary
   groups), with HTTP(S)_PROXY pointing at the explicit listener.

Then: COMMAND's exit ends the session with COMMAND's status; the proxy exiting while COMMAND runs
stops COMMAND (fail closed) and ends it with EXIT_PROXY_DIED. SIGINT, SIGTERM, SIGHUP and SIGQUIT
are passed on to COMMAND (not those a terminal already sent to COMMAND's process group). Teardown
runs on every path and is idempotent; a step that fails is reported and the others still run.
It never removes the rules while the veth pair may still exist.

The orchestrator is synchronous (subprocess and select, no threads), so forking is safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from proxy.boundary.nft.load import apply_ruleset, remove_table
from proxy.boundary.nft.sandbox import sandbox_ruleset
from proxy.boundary.sandbox import net as sandbox_net
from proxy.boundary.sandbox.net import AddressPlan, SandboxError, SessionNames
from proxy.boundary.sandbox.options import Options
from proxy.errors import ProxyError
from proxy.netaddr import format_listen
from proxy.terminal import printable

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
# COMMAND gets this long after SIGTERM (when the proxy died, or at teardown) before SIGKILL.
TERM_GRACE = 3.0
PROXY_STOP_TIMEOUT = 10.0
CANARY_TIMEOUT = 30.0
# A name outside every policy (`.invalid` is refused before DNS in any egress mode).
CANARY_DNS_SUFFIX = "egress-sandbox-canary.invalid"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
DROPPED_VARIABLES = ("ALL_PROXY", "all_proxy", "FTP_PROXY", "ftp_proxy")
_LOG_TAIL_LINES = 20
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Signals a terminal sends to its whole foreground process group (COMMAND is in ours).
_FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)

# capability(7) numbers
_CAPABILITIES = {
    "CAP_NET_ADMIN": 12,  # namespaces' links, addresses, routes; nftables
    "CAP_SYS_ADMIN": 21,  # `ip netns add` / `ip netns exec` (mounts, setns)
    "CAP_SETUID": 7,  # COMMAND and the canary as an unprivileged user
    "CAP_SETGID": 6,
    "CAP_KILL": 5,  # stopping COMMAND, which runs as another user
    "CAP_DAC_OVERRIDE": 1,  # /run/netns and /etc/netns belong to root
}


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ActivationRefused(Exception):
    """Activation refused: the boundary could not be established (exit EXIT_BOUNDARY)."""


# -- preflight -----------------------------------------------------------------------------


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


# -- observers -----------------------------------------------------------------------------


@dataclass
class Observers:
    """Sockets of the sandbox's own on the host side: TCP listeners and UDP echo sockets the
    canary aims at. The rules must keep every canary packet away from them."""

    tcp: dict[str, socket.socket] = field(default_factory=dict)
    udp: dict[str, socket.socket] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, plan: AddressPlan) -> Observers:
        observers = cls()
        try:
            for host in (str(plan.host4), str(plan.host6)):
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                observers.tcp[host] = listener
                listener.bind((host, 0))
                listener.listen(8)
                listener.setblocking(False)
                echo = socket.socket(family, socket.SOCK_DGRAM)
                observers.udp[host] = echo
                echo.bind((host, 0))
                echo.setblocking(False)
        except OSError:
            observers.close()
            raise
        return observers

    def port(self, host: str, kind: str) -> int:
        sock = (self.tcp if kind == "tcp" else self.udp)[host]
        return int(sock.getsockname()[1])

    def serve(self, timeout: float) -> None:
        """Answer whatever arrives within `timeout`, as a server that is not the proxy would (a
        TCP answer without the proxy's headers, a UDP echo), and note it."""
        sockets = [*self.tcp.values(), *self.udp.values()]
        ready, _, _ = select.select(sockets, [], [], max(timeout, 0))
        for sock in ready:
            with contextlib.suppress(OSError):
                if sock.type == socket.SOCK_STREAM:
                    conn, peer = sock.accept()
                    with conn:
                        self.seen.append(f"TCP connection from {peer[0]} to {_name(sock)}")
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                else:
                    data, peer = sock.recvfrom(65535)
                    self.seen.append(f"UDP datagram from {peer[0]} to {_name(sock)}")
                    sock.sendto(data, peer)

    def close(self) -> None:
        for sock in [*self.tcp.values(), *self.udp.values()]:
            sock.close()


def _name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return format_listen(host, port)


@dataclass(frozen=True, slots=True)
class CanaryRun:
    spec: dict[str, Any]
    as_root: bool  # False: as COMMAND's user


def canary_runs(
    plan: AddressPlan, observers: Observers, names: SessionNames, user_is_root: bool
) -> list[CanaryRun]:
    """The canary's probe runs, aimed only at the host side of the veth: one per address
    family as COMMAND's user (TCP, UDP, ICMP, DNS), and, for an unprivileged user, ICMP once
    more as root. An unprivileged user usually cannot open an ICMP socket at all, so its probe
    proves nothing about the rules; root's raw socket does (the drop is the same for all)."""
    runs, icmp = [], []
    for version, host in ((4, str(plan.host4)), (6, str(plan.host6))):
        icmp.append({"name": f"icmp_v{version}", "address": host, "expect": "no_echo"})
        spec = {
            "tcp": [
                {"name": f"tcp_v{version}_direct", "address": host,
                 "port": observers.port(host, "tcp")},
            ],
            "udp": [
                {"name": f"udp_v{version}", "address": host,
                 "port": observers.port(host, "udp"), "expect": "no_echo"},
            ],
            "dns": [
                {"name": f"dns_v{version}_denied_name", "server": host, "port": 53,
                 "qname": f"v{version}-{names.suffix}.{CANARY_DNS_SUFFIX}"},
            ],
        }  # fmt: skip
        if user_is_root:
            spec["icmp"] = [icmp[-1]]
        runs.append(CanaryRun(spec, as_root=user_is_root))
    if not user_is_root:
        runs.append(CanaryRun({"icmp": [dict(x, name=f"{x['name']}_root") for x in icmp]}, True))
    return runs


# -- the session ---------------------------------------------------------------------------


def _set_parent_death_signal(signum: int) -> Callable[[], None]:
    """A preexec_fn: the child gets `signum` when this process dies (even by SIGKILL)."""

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG

    return preexec


class Sandbox:
    """One session: set up, run COMMAND, tear down. Use `run()` once."""

    def __init__(self, options: Options, err: TextIO) -> None:
        self.options = options
        self.err = err
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
        """Activate, run COMMAND, tear down; the exit status (see the module's EXIT_*)."""
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
            return self._interrupted(exc.signum)
        except ActivationRefused as exc:
            return self._refused(str(exc))
        except ProxyError as exc:  # SandboxError and the rules' boundary_failed
            return self._refused(exc.message)
        except Exception as exc:  # a bug: still torn down, never a traceback
            return _internal(exc)
        try:
            return self._run_command()
        except Interrupted as exc:
            return self._interrupted(exc.signum)
        except ActivationRefused as exc:
            return self._refused(str(exc))
        except Exception as exc:
            return _internal(exc)

    def _interrupted(self, signum: int) -> Outcome:
        name = signal.Signals(signum).name
        return Outcome("interrupted", 128 + signum, f"interrupted by {name} before COMMAND started")

    def _refused(self, why: str) -> Outcome:
        if self.signals:
            # A step that failed because ^C reached its subprocess too: say what happened.
            return self._interrupted(self.signals[0])
        return Outcome(
            "boundary_failed", EXIT_BOUNDARY, f"activation refused, COMMAND did not run: {why}"
        )

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

        self.ports = session_ports(self.plan)
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

        self._start_proxy()
        self._wait_ready()
        self._run_canary()
        if not self.proxy_alive():
            raise ActivationRefused(f"the proxy exited during the canary{self._proxy_log_tail()}")

    # -- the proxy -------------------------------------------------------------------------

    def _proxy_command(self) -> list[str]:
        assert self.plan and self.ports and self.names and self.admin
        options = self.options
        explicit, transparent, dns = self.ports
        host4, host6 = str(self.plan.host4), str(self.plan.host6)
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
            "--admin", format_listen(*self.admin),
            "--session-id", options.session_id or f"sandbox-{self.names.suffix}",
        ]  # fmt: skip
        if options.audit_log:
            command += ["--audit-log", options.audit_log]
        return command

    def _start_proxy(self) -> None:
        assert self.names
        host, port = self.options.admin
        self.admin = (host, port or free_port(host))
        self._made.add("workdir")
        self.workdir = Path(tempfile.mkdtemp(prefix=f"egress-sb-{self.names.suffix}-"))
        log = self.workdir / "proxy.log"
        with open(log, "wb") as stderr:
            self._made.add("proxy")
            try:
                self.proxy = subprocess.Popen(
                    self._proxy_command(),
                    stdin=subprocess.DEVNULL,
                    # Audit lines (without --audit-log): stdout is COMMAND's, stderr is free.
                    stdout=self.err.fileno() if _has_fileno(self.err) else subprocess.DEVNULL,
                    stderr=stderr,
                    cwd="/",
                    env=_without_proxy_variables(os.environ),
                    # Its own session: a terminal's ^C is for COMMAND, not the proxy.
                    start_new_session=True,
                    preexec_fn=_set_parent_death_signal(signal.SIGTERM),
                )
            except OSError as exc:
                raise ActivationRefused(f"cannot start the proxy: {exc.strerror or exc}") from None

    def proxy_alive(self) -> bool:
        return self.proxy is not None and self.proxy.poll() is None

    def _proxy_log_tail(self) -> str:
        if self.workdir is None:
            return ""
        try:
            lines = (self.workdir / "proxy.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = [line for line in lines if line.strip()][-_LOG_TAIL_LINES:]
        return (":\n  " + "\n  ".join(tail)) if tail else " (it printed nothing)"

    def _wait_ready(self) -> None:
        assert self.admin and self.proxy
        deadline = time.monotonic() + self.options.ready_timeout
        while True:
            self._check_interrupted()
            if self.proxy.poll() is not None:
                raise ActivationRefused(
                    f"the proxy exited with status {self.proxy.returncode} before it was "
                    f"ready{self._proxy_log_tail()}"
                )
            if _ready(*self.admin):
                return
            if time.monotonic() > deadline:
                raise ActivationRefused(
                    f"the proxy was not ready within {self.options.ready_timeout:g}s "
                    f"(/readyz on {format_listen(*self.admin)}){self._proxy_log_tail()}"
                )
            time.sleep(0.1)

    # -- the canary ------------------------------------------------------------------------

    def _run_canary(self) -> None:
        assert self.plan and self.names and self.tools
        observers = Observers.open(self.plan)
        try:
            runs = canary_runs(self.plan, observers, self.names, self.options.run_as.is_root)
            results = self._probe(runs, observers)
            observers.serve(0)  # anything still queued
        finally:
            observers.close()
        failed = [r for r in results if not r.get("passed")]
        problems = [f"{r.get('name')}: {r.get('detail')}" for r in failed]
        problems += [f"observer saw a {what}" for what in observers.seen]
        if problems:
            raise ActivationRefused("the canary got through: " + "; ".join(problems))
        self.canary_count = len(results)

    canary_count = 0

    def _probe(self, runs: Sequence[CanaryRun], observers: Observers) -> list[dict]:
        """Run the probes inside the namespace (python starts as root, so it can read the
        package, and drops to COMMAND's user before its first probe); their results, while
        the observers answer whatever reaches them."""
        assert self.tools and self.names
        run_as = self.options.run_as
        processes = []
        for run in runs:
            command = [self.tools.ip, "netns", "exec", self.names.netns, sys.executable, "-m",
                       "proxy.probes", "--spec", json.dumps(run.spec)]  # fmt: skip
            if not run.as_root:
                command += ["--as-user", f"{run_as.uid}:{run_as.gid}"]
            processes.append(
                subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd="/",
                    env=_without_proxy_variables(os.environ),
                )
            )
        deadline = time.monotonic() + CANARY_TIMEOUT
        try:
            while any(p.poll() is None for p in processes):
                if time.monotonic() > deadline:
                    raise ActivationRefused(f"the canary did not finish within {CANARY_TIMEOUT:g}s")
                observers.serve(0.05)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        results: list[dict] = []
        for process in processes:
            out, err = process.communicate(timeout=10)
            try:
                report = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
                results += [r for r in report["results"] if isinstance(r, dict)]
            except (ValueError, IndexError, KeyError, TypeError):
                detail = (err or out).decode("utf-8", "replace").strip()[-300:]
                raise ActivationRefused(
                    f"the canary failed to run (status {process.returncode}): {detail}"
                ) from None
        return results

    # -- COMMAND ---------------------------------------------------------------------------

    def _command_argv(self) -> list[str]:
        assert self.tools and self.names
        run_as = self.options.run_as
        argv = [self.tools.ip, "netns", "exec", self.names.netns]
        if not run_as.is_root:
            assert self.tools.setpriv
            argv += [
                self.tools.setpriv, f"--reuid={run_as.uid}", f"--regid={run_as.gid}",
                "--clear-groups", "--no-new-privs", "--inh-caps=-all",
                # setpriv's change of user would clear an inherited one: set it after.
                "--pdeathsig=KILL", "--",
            ]  # fmt: skip
        return argv + list(self.options.command)

    def _command_env(self) -> dict[str, str]:
        assert self.plan and self.ports and self.names
        env = _without_proxy_variables(os.environ)
        url = f"http://{self.plan.host4}:{self.ports[0]}"
        env.update(dict.fromkeys(PROXY_VARIABLES, url))
        env["NO_PROXY"] = env["no_proxy"] = ""
        env["EGRESS_PROXY_SANDBOX"] = self.names.netns
        run_as = self.options.run_as
        if not run_as.is_root:
            # sudo leaves root's HOME behind; COMMAND could not write there anyway.
            for key in ("HOME", "USER", "LOGNAME"):
                env.pop(key, None)
            if run_as.name:
                env["USER"] = env["LOGNAME"] = run_as.name
            if run_as.home:
                env["HOME"] = run_as.home
        return env

    def _run_command(self) -> Outcome:
        assert self.plan and self.ports and self.names
        self._check_interrupted()
        run_as = self.options.run_as
        if not self.options.quiet:
            proxy_pid = self.proxy.pid if self.proxy else "?"
            self.say(
                f"session {self.names.suffix}: boundary verified ({self.canary_count} canary "
                f"probes held); namespace {self.names.netns}, proxy "
                f"http://{self.plan.host4}:{self.ports[0]} (pid {proxy_pid}); "
                f"running {self.options.command[0]} as {run_as}"
            )
        if run_as.is_root:
            self.say(
                "warning: COMMAND runs as root, which can leave a network namespace (setns into "
                "the host's): it is not contained"
            )
        self._made.add("command")
        try:
            self.command = subprocess.Popen(
                self._command_argv(),
                env=self._command_env(),
                preexec_fn=_set_parent_death_signal(signal.SIGKILL),
            )
        except OSError as exc:
            raise ActivationRefused(f"cannot start COMMAND: {exc.strerror or exc}") from None
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
        code = self.command.returncode
        self.command_status = code if code >= 0 else 128 - code
        return self.command_status

    def _forward(self, signum: int) -> None:
        assert self.command
        if signum in _FROM_TERMINAL and _terminal_signals_reach_us():
            return  # the terminal sent it to our whole process group: COMMAND has it already
        with contextlib.suppress(ProcessLookupError):
            self.command.send_signal(signum)

    def _stop_command(self) -> None:
        command = self.command
        if command is None or command.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            command.terminate()
        try:
            command.wait(timeout=TERM_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                command.kill()
            command.wait(timeout=10)
        if self.command_status is None:
            self._command_exit_status()

    # -- teardown --------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Undo everything that may exist; idempotent. Every failing step is reported and the
        rest still run; the rules go only once the veth pair is gone."""
        problems: list[str] = []

        def step(what: str, action: Callable[[], None]) -> bool:
            try:
                action()
                return True
            except Exception as exc:
                text = exc.message if isinstance(exc, ProxyError) else str(exc)
                problems.append(f"{what}: {text}")
                self.say(f"teardown: {what} failed: {text}")
                return False

        ip = self.tools.ip if self.tools else None
        names = self.names
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
        if names is not None and self.tools is not None and "table" in self._made:
            if link_gone:
                step(
                    f"deleting table inet {names.table}",
                    lambda: remove_table(names.table, nft=self.tools.nft),  # type: ignore[union-attr]
                )
            else:
                problems.append(f"kept table inet {names.table}: the veth pair may still exist")
        if names is not None and ip is not None and "netns" in self._made:
            step("deleting the namespace", lambda: sandbox_net.delete_namespace(ip, names))
        if names is not None and "etc" in self._made:
            step(f"removing {names.etc_dir}", lambda: sandbox_net.remove_resolv_conf(names))
        if self.workdir is not None:
            step(
                "removing the work directory",
                lambda: shutil.rmtree(self.workdir, ignore_errors=True),
            )  # type: ignore[arg-type]
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
        proxy = self.proxy
        if proxy is None or proxy.poll() is not None:
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


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # command_exited, proxy_died, boundary_failed, interrupted, internal_error
    status: int  # the exit status
    message: str


def _internal(exc: Exception) -> Outcome:
    return Outcome(
        "internal_error",
        EXIT_INTERNAL,
        f"internal error ({type(exc).__name__}: {str(exc)[:200]}); please report it",
    )


# -- helpers -------------------------------------------------------------------------------


def _has_fileno(stream: TextIO) -> bool:
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _without_proxy_variables(environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    drop = {*PROXY_VARIABLES, *DROPPED_VARIABLES, "NO_PROXY", "no_proxy"}
    return {k: v for k, v in environ.items() if k not in drop}


def _ready(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", "/readyz")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _terminal_signals_reach_us() -> bool:
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
