"""`egress-proxy sandbox` end to end (root only): a real namespace, veth pair, host-side nftables
rules, the session proxy and a real COMMAND (bash, curl, getent as `nobody`; the probes as root).

The allowed upstream is an HTTPS server on 127.0.0.1 in the host namespace (trustme CA) and the
test DNS server answers `allowed.test` with 127.0.0.1; the operator config points the proxy at
both. Every packet the tests send goes to loopback or to the session's own veth, whose subnets
the tests pick (`--subnet4` from 198.51.100.0/24, documentation space; `--subnet6` a random
ULA /64). The observers of the tests are bound (IP_FREEBIND) on the host side of the veth before
the sandbox creates it: whatever reaches them got past the boundary.

After every test nothing of the session may be left: no namespace, table, veth, /etc/netns
directory or process. Skips with the reason when not root or without the tools.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
from support.dns_server import DNSServer, running_dns_server
from support.real_servers import IP_FREEBIND
from support.running import make_config
from support.sandbox import ROOT, SESSION_TIMEOUT, Session, Subnets, finished
from support.transparent_scenario import Upstream

SUPPORT = ROOT / "tests" / "support"  # the scripts a session runs
TOOLS = {name: shutil.which(name) for name in ("ip", "nft", "curl", "bash", "getent", "setpriv")}

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("nothing_left"),  # conftest.py: nothing of the session may be left
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a network namespace"),
    *(
        pytest.mark.skipif(path is None, reason=f"needs {name} on PATH")
        for name, path in TOOLS.items()
    ),
]

MANIFEST = "network:\n  egress: [allowed.test]\n"
IPV6_FREEBIND = 78  # linux/in6.h (not in the socket module)


# -- what a session leaves behind ----------------------------------------------------------


# -- the session's subnets and the tests' observers ----------------------------------------


@dataclass
class Observers:
    """A TCP listener and a UDP echo socket on each host-side address, bound before the address
    exists (IP_FREEBIND). They record everything that reaches them."""

    subnets: Subnets
    tcp: dict[int, socket.socket] = field(default_factory=dict)
    udp: dict[int, socket.socket] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Observers:
        for version, host in ((4, self.subnets.host4), (6, self.subnets.host6)):
            family = socket.AF_INET6 if version == 6 else socket.AF_INET
            for kind, table in ((socket.SOCK_STREAM, self.tcp), (socket.SOCK_DGRAM, self.udp)):
                sock = socket.socket(family, kind)
                if version == 4:
                    sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
                else:
                    sock.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)
                sock.bind((host, 0))
                if kind == socket.SOCK_STREAM:
                    sock.listen(8)
                sock.settimeout(0.1)
                table[version] = sock
                thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def port(self, kind: str, version: int) -> int:
        return (self.tcp if kind == "tcp" else self.udp)[version].getsockname()[1]

    def _serve(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if sock.type == socket.SOCK_STREAM:
                    conn, peer = sock.accept()
                    self.seen.append(f"tcp from {peer[0]}")
                    with conn:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                else:
                    data, peer = sock.recvfrom(65535)
                    self.seen.append(f"udp from {peer[0]}")
                    sock.sendto(data, peer)
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for sock in [*self.tcp.values(), *self.udp.values()]:
            sock.close()

    def args(self) -> list[str]:
        return [str(self.port(k, v)) for k in ("tcp", "udp") for v in (4, 6)]


@pytest.fixture
def observers(subnets: Subnets) -> Iterator[Observers]:
    observing = Observers(subnets).start()
    try:
        yield observing
    finally:
        observing.close()


# -- the upstream world (host namespace, loopback only) ------------------------------------


@dataclass
class World:
    dns: DNSServer
    upstream: Upstream
    port: int
    ca_file: str  # readable by the unprivileged COMMAND
    shared: Path  # a directory COMMAND may read and write


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("allowed.test", "denied.test").configure_cert(server_tls)
    shared = Path(tempfile.mkdtemp(prefix="egress-sb-test-"))
    try:
        shared.chmod(0o755)
        ca_file = shared / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        ca_file.chmod(0o644)
        with running_dns_server() as dns:
            dns.set("allowed.test", a=["127.0.0.1"])
            dns.set("denied.test", a=["127.0.0.1"])
            upstream = Upstream("127.0.0.1", 0, server_tls)
            try:
                port = upstream.sock.getsockname()[1]
                yield World(dns, upstream, port, str(ca_file), shared)
            finally:
                upstream.close()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# -- running a session ---------------------------------------------------------------------


def sandbox_command(
    directory: Path, world: World, subnets: Subnets, *args: str, command: list[str]
) -> list[str]:
    (directory / "agent.yaml").write_text(MANIFEST)
    (directory / "config.yaml").write_text(make_config(world.dns))
    return [
        sys.executable, "-m", "proxy", "sandbox", str(directory / "agent.yaml"),
        "--config", str(directory / "config.yaml"), *subnets.args(),
        "--status-file", str(directory / "status.json"),
        "--audit-log", str(directory / "audit.jsonl"), *args, "--", *command,
    ]  # fmt: skip


def run_sandbox(directory: Path, world: World, subnets: Subnets, *args: str,
                command: list[str]) -> Session:  # fmt: skip
    done = subprocess.run(
        sandbox_command(directory, world, subnets, *args, command=command),
        cwd=ROOT, capture_output=True, text=True, timeout=SESSION_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return finished(directory, done)


def writable(world: World) -> Path:
    """A fresh directory the unprivileged COMMAND can write to (tmp_path is root's alone)."""
    directory = Path(tempfile.mkdtemp(dir=world.shared))
    directory.chmod(0o777)
    return directory


def readable_copy(world: World, name: str) -> Path:
    """A copy of tests/support/NAME that COMMAND's user can read: the checkout may sit below a
    directory only root can enter (a fresh clone in `mktemp -d`, mode 0700)."""
    copy = world.shared / name
    if not copy.exists():
        shutil.copyfile(SUPPORT / name, copy)
        copy.chmod(0o755)
    return copy


def wait_ready(process: subprocess.Popen[str], marker: Path) -> None:
    """Until COMMAND inside the sandbox has created `marker` (60 s at most); the sandbox's
    output if it ended first."""
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"COMMAND never created {marker.name}"
        time.sleep(0.05)


def agent_args(world: World, subnets: Subnets, observers: Observers) -> list[str]:
    return [str(world.port), world.ca_file, subnets.host4, subnets.host6, *observers.args()]


# -- the tests -------------------------------------------------------------------------------


def test_command_reaches_the_allowed_name_and_every_bypass_fails(
    tmp_path: Path, world: World, subnets: Subnets, observers: Observers
) -> None:
    world.dns.clear_log()
    before = world.upstream.connections
    session = run_sandbox(
        tmp_path, world, subnets, "--user", "nobody",
        command=[TOOLS["bash"], str(readable_copy(world, "sandbox_agent.sh")),
                 *agent_args(world, subnets, observers)],
    )  # fmt: skip
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}"
    assert session.returncode == 0, diagnostics
    assert session.status["outcome"] == "command_exited", session.status
    assert session.status["command_status"] == 0
    assert "boundary verified" in session.stderr
    results = session.lines()
    assert "done" in results, diagnostics

    # The sandbox named its explicit proxy, and nothing is exempt from it.
    assert (
        results["env"]["https_proxy"]
        == f"http://{subnets.host4}:" + (results["env"]["https_proxy"].rsplit(":", 1)[1])
    )
    assert results["env"]["no_proxy"] == ""
    # Through the explicit proxy (CONNECT) and, with the proxy variables unset, through the
    # transparent redirect (decided on the SNI), over IPv4 and IPv6: the real upstream answers.
    assert results["explicit_allowed"] == {"rc": "0", "code": "200", "connect": "200"}, diagnostics
    assert results["transparent_allowed_v4"]["code"] == "200", diagnostics
    assert results["transparent_allowed_v6"]["code"] == "200", diagnostics
    assert world.upstream.connections - before == 3
    # A name outside the policy: refused either way, never connected, never resolved.
    assert results["explicit_denied"]["connect"] == "403", diagnostics
    # Refused in TLS's own terms (an access_denied alert: curl's 35), no HTTP answer at all.
    assert results["transparent_denied"]["rc"] == "35", results["transparent_denied"]
    assert results["transparent_denied"]["code"] == "000"
    # DNS inside the namespace is the proxy's: the allowed name is answered with the address
    # the proxy checked (127.0.0.1, as the test DNS server says); the denied one is not, and
    # neither it nor the canary's name ever reached the real DNS server.
    assert results["dns_allowed"] == {"rc": "0", "address": "127.0.0.1"}, diagnostics
    assert results["dns_denied"]["rc"] != "0"
    assert world.dns.count("denied.test") == 0
    assert not [q for q in world.dns.queries if q[0].endswith(".invalid")]
    # Direct TCP to a host-side address that is not the proxy's: the proxy answered instead.
    assert results["tcp_direct_v4"]["proxy_denied"] == "1", diagnostics
    assert results["tcp_direct_v6"]["proxy_denied"] == "1", diagnostics
    # UDP: sent, never echoed.
    assert results["udp_v4"]["reply"] == "none"
    assert results["udp_v6"]["reply"] == "none"
    # The observers on the host side saw none of it (canary included).
    time.sleep(0.2)  # nothing must reach them: a late packet gets its chance
    assert observers.seen == []

    decisions = [x for x in session.audit if x.get("event") == "decision"]
    assert {x["host"] for x in decisions if x["decision"] == "allow"} == {"allowed.test"}
    assert "denied.test" in {x["host"] for x in decisions if x["decision"] == "deny"}


def test_root_in_the_namespace_cannot_undo_the_boundary(
    tmp_path: Path, world: World, subnets: Subnets, observers: Observers
) -> None:
    world.dns.clear_log()
    session = run_sandbox(
        tmp_path, world, subnets, "--user", "root",
        command=[sys.executable, str(SUPPORT / "sandbox_root_scenario.py"), subnets.host4,
                 subnets.host6, *observers.args()],
    )  # fmt: skip
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}"
    assert session.returncode == 0, diagnostics
    assert "not contained" in session.stderr  # root is allowed, with a warning
    result = json.loads(session.stdout.strip().splitlines()[-1])
    # Root flushed every rule it could reach: there was nothing of the boundary in there.
    assert result["flush_rc"] == 0, result["flush_stderr"]
    assert result["ruleset_after_flush"].strip() == ""
    # And still: TCP went to the proxy, UDP and ICMP (raw sockets, as root) got no answer,
    # DNS for a denied name was refused, over IPv4 and IPv6.
    probes = {p["name"]: p for p in result["probes"]}
    assert set(probes) == {
        "tcp_v4_direct", "tcp_v6_direct", "udp_v4", "udp_v6", "icmp_v4", "icmp_v6",
        "dns_v4", "dns_v6",
    }  # fmt: skip
    failed = {name: p["detail"] for name, p in probes.items() if not p["passed"]}
    assert not failed, failed
    assert "raw" not in probes["icmp_v4"]["detail"] or "no reply" in probes["icmp_v4"]["detail"]
    assert "cannot send ICMP" not in probes["icmp_v4"]["detail"]  # really sent, as root
    assert observers.seen == []
    assert world.dns.count("denied.test") == 0


def _proxy_pid(session_id: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"run" in argv and session_id.encode() in argv:
                    return int(entry)
        time.sleep(0.05)
    raise AssertionError(f"no proxy process with session id {session_id}")


def _wait_dead(pid: int) -> None:
    """Until `pid` is gone or a zombie (its sockets closed), at most 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rpartition(")")[2].split()[0] == "Z":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still alive 10 s after SIGKILL")


def _processes_with(marker: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry))
    return found


def test_the_proxy_dying_ends_the_session_and_nothing_leaks(
    tmp_path: Path, world: World, subnets: Subnets, observers: Observers
) -> None:
    shared = writable(world)
    session_id = f"test-{secrets.token_hex(6)}"
    command = sandbox_command(
        tmp_path, world, subnets, "--user", "nobody", "--session-id", session_id,
        command=[TOOLS["bash"], str(readable_copy(world, "sandbox_dying.sh")), str(world.port),
                 world.ca_file, subnets.host4, str(observers.port("tcp", 4)), str(shared)],
    )  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_ready(process, shared / "ready")
        connections = world.upstream.connections
        pid = _proxy_pid(session_id)
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)  # else a connection may still reach its closing listener (curl 56)
        (shared / "killed").touch()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    session = finished(tmp_path, (process.returncode, stdout, stderr))
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}"
    results = session.lines()

    assert results["before"] == {"rc": "0", "code": "200"}, diagnostics
    # After the proxy died, every way out was refused on the spot (nothing listens where the
    # rules send the packets): no connection reached the upstream or an observer.
    assert results["after_explicit"]["rc"] == "7", diagnostics  # curl: couldn't connect
    assert results["after_transparent"]["rc"] == "7", diagnostics
    assert results["after_tcp_direct"]["rc"] != "0", diagnostics
    assert "attempts_done" in results
    assert world.upstream.connections == connections
    assert observers.seen == []
    # COMMAND ignored SIGTERM and was killed; the sandbox says why, with its own status.
    assert "survived" not in results
    assert session.returncode == 75, diagnostics
    assert session.status["outcome"] == "proxy_died"
    assert "egress-proxy sandbox: error: the session proxy exited" in session.stderr
    # What COMMAND left running in the namespace was killed too.
    assert _processes_with(b"299.5") == []


@pytest.mark.parametrize("fault", ["refused", "altered"])
def test_a_rule_set_that_does_not_load_as_rendered_refuses_activation(
    tmp_path: Path, world: World, subnets: Subnets, fault: str
) -> None:
    # A stand-in for nft (--nft): it passes every call through, except that the rule set is
    # refused outright, or loaded with the input chain's final drop cut out.
    nft = tmp_path / "nft"
    edit = (
        'echo "Error: injected by the test" >&2; exit 1'
        if fault == "refused"
        else f"grep -v '\"egsb[0-9a-f]*h\" drop$' | {TOOLS['nft']} -f -; exit $?"
    )
    nft.write_text(f'#!/bin/sh\nif [ "$1" = "-f" ]; then\n  {edit}\nfi\nexec {TOOLS["nft"]} "$@"\n')
    nft.chmod(0o755)
    marker = writable(world) / "command-ran"
    session = run_sandbox(
        tmp_path, world, subnets, "--nft", str(nft),
        command=["/bin/sh", "-c", f"touch {marker}"],
    )  # fmt: skip
    assert session.returncode == 69, session.stderr
    assert not marker.exists()
    assert session.status["outcome"] == "boundary_failed"
    assert "COMMAND did not run" in session.stderr
    expected = "injected by the test" if fault == "refused" else "differ from the rendered"
    assert expected in session.stderr


def test_a_host_rule_that_diverts_the_session_makes_the_canary_refuse(
    tmp_path: Path, world: World, subnets: Subnets, observers: Observers
) -> None:
    # Another table on the host, ahead of the session's, sends the namespace's TCP elsewhere:
    # the rules load and read back fine, but the canary's TCP is not answered by the proxy.
    table = f"egress_test_{secrets.token_hex(4)}"
    rules = (
        f"table inet {table} {{\n chain pre {{\n"
        "  type nat hook prerouting priority -150; policy accept;\n"
        f"  ip saddr {subnets.ns4} meta l4proto tcp dnat ip to {subnets.host4}:9\n }}\n}}\n"
    )
    subprocess.run([TOOLS["nft"], "-f", "-"], input=rules, text=True, check=True, timeout=30)
    marker = writable(world) / "command-ran"
    try:
        session = run_sandbox(
            tmp_path, world, subnets, "--user", "nobody",
            command=["/bin/sh", "-c", f"touch {marker}"],
        )  # fmt: skip
    finally:
        subprocess.run([TOOLS["nft"], "delete", "table", "inet", table], timeout=30, check=False)
    assert session.returncode == 69, session.stderr
    assert not marker.exists()
    assert "the canary got through" in session.stderr
    assert "tcp_v4_direct" in session.stderr
    assert observers.seen == []


def _new_namespace(before: set[str], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            new = {n for n in os.listdir("/run/netns") if n.startswith("egress-sb-")} - before
            if new:
                return new.pop()
        time.sleep(0.02)
    raise AssertionError("the sandbox created no namespace")


def test_sigterm_goes_to_command_and_the_session_ends_with_its_status(
    tmp_path: Path, world: World, subnets: Subnets
) -> None:
    shared = writable(world)
    script = (
        f"trap 'echo got-term; exit 7' TERM; touch {shared}/ready; "
        "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; echo not-signalled"
    )
    process = subprocess.Popen(
        sandbox_command(tmp_path, world, subnets, command=["/bin/sh", "-c", script]),
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_ready(process, shared / "ready")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    session = finished(tmp_path, (process.returncode, stdout, stderr))
    assert session.stdout.strip() == "got-term", session.stderr
    assert session.returncode == 7
    assert session.status["outcome"] == "command_exited"
    assert "error" not in session.stderr


def test_a_signal_during_activation_tears_down_and_command_never_runs(
    tmp_path: Path, world: World, subnets: Subnets
) -> None:
    marker = writable(world) / "command-ran"
    before = {n for n in os.listdir("/run/netns")} if os.path.isdir("/run/netns") else set()
    process = subprocess.Popen(
        sandbox_command(tmp_path, world, subnets, command=["/bin/sh", "-c", f"touch {marker}"]),
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        _new_namespace(before)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    session = finished(tmp_path, (process.returncode, stdout, stderr))
    assert session.returncode == 128 + signal.SIGINT, session.stderr
    assert session.status["outcome"] == "interrupted"
    assert "interrupted by SIGINT before COMMAND started" in session.stderr
    assert not marker.exists()


def test_ask_the_agent_cannot_read_the_token_nor_answer_its_own_ask(
    tmp_path: Path, world: World, subnets: Subnets
) -> None:
    """`sandbox --ask`: the agent's connection to a name the manifest does not allow is held;
    from inside, the agent can neither read the token nor reach the admin listener (directly,
    through the proxy, or at the host side's address); a person outside answers."""
    shared = writable(world)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    proxy = 'curl -sS -m 5 -o /dev/null -w "%{http_code}"'
    script = (
        f"curl -sS -m 60 --cacert {world.ca_file} https://denied.test:{world.port}/ "
        f"> {shared}/held.out 2>&1 & "
        f"sleep 1; "
        f"for f in {tempfile.gettempdir()}/egress-sb-*/ask-token; do "
        f'  if cat "$f" >/dev/null 2>&1; then echo token=read; else echo token=unreadable; fi; '
        f"done; "
        f"echo direct=$({proxy} --noproxy '*' http://127.0.0.1:{admin_port}/asks 2>/dev/null); "
        f"echo via_proxy=$({proxy} http://127.0.0.1:{admin_port}/asks 2>/dev/null); "
        f"echo host_side=$({proxy} --noproxy '*' http://{subnets.host4}:{admin_port}/asks "
        f"2>/dev/null); "
        f"echo post=$({proxy} -X POST -H 'Content-Type: application/json' "
        f'--data \'{{"decision":"allow-once"}}\' http://127.0.0.1:{admin_port}/asks/x '
        f"2>/dev/null); "
        f"touch {shared}/tried; wait; cat {shared}/held.out"
    )
    process = subprocess.Popen(
        sandbox_command(
            tmp_path, world, subnets, "--ask", "--admin", f"127.0.0.1:{admin_port}",
            command=["/bin/sh", "-c", script],
        ),
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_ready(process, shared / "tried")
        base = f"http://127.0.0.1:{admin_port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{base}/asks", timeout=10) as response:
            (ask,) = json.loads(response.read())["asks"]
        assert ask["host"] == "denied.test" and ask["entry"] == "denied.test"
        token_files = list(Path(tempfile.gettempdir()).glob("egress-sb-*/ask-token"))
        assert len(token_files) == 1 and (token_files[0].stat().st_mode & 0o077) == 0
        assert (token_files[0].parent.stat().st_mode & 0o077) == 0
        request = urllib.request.Request(
            f"{base}/asks/{ask['id']}",
            data=json.dumps({"decision": "allow-once"}).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token_files[0].read_text().strip()}"},
        )
        with opener.open(request, timeout=10) as response:
            assert response.status == 200
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "token=read" not in stdout, stdout
    lines = dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)
    assert lines["direct"] in ("000", ""), stdout
    assert lines["via_proxy"] == "403", stdout
    assert lines["host_side"] in ("000", "403", ""), stdout
    assert lines["post"] in ("000", "403", ""), stdout  # refused by the proxy (ip_literal)
    assert stdout.rstrip().endswith("hello"), stdout  # the held connection, once allowed
    assert "egress-proxy ask --admin" in stderr or " ask --admin " in stderr, stderr
    assert str(token_files[0]) in stderr
