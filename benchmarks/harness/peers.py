"""The peers of the benchmark harness (what a user would pick instead of egress-proxy) and the
HTTP origin: whether each is installed, its configuration for one run (generated into a temp
directory, never the system's), and its process from start to stop.

Every peer is a child of the harness, bound to 127.0.0.1 on a free port, in the foreground,
with access logging and caching off and, where it has one, an allow-list equivalent to the
test policy (`egress: [bench.test]`: the name and its subdomains). The Debian packages' own
services are never used: nothing here reads /etc/squid, /etc/tinyproxy or /etc/privoxy, or
talks to their default ports.

Name resolution (the hard network rule): tinyproxy, privoxy and mitmdump resolve with the
system resolver, which here is a nameserver off the machine. Each runs in a private mount
namespace (`unshare --mount`, root only) where /etc/hosts maps the test names to 127.0.0.1
and /etc/resolv.conf names only 127.0.0.1, so no query can leave the machine. Where that is
not possible those peers are skipped with a note. Squid has its own resolver and is told in
its configuration (`hosts_file`, `dns_nameservers 127.0.0.1`); it runs in the same namespace
when it can, without it otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .proc import accepts, connect_accepted, race_probes, stop_child

LOOPBACK = "127.0.0.1"
PEERS = ("tinyproxy", "privoxy", "squid", "mitmdump")
# Peers that resolve through the system resolver: they run only with a private /etc/hosts.
SYSTEM_RESOLVER = frozenset({"tinyproxy", "privoxy", "mitmdump"})
BINARIES = {
    "tinyproxy": "tinyproxy",
    "privoxy": "privoxy",
    "squid": "squid",
    "mitmdump": "mitmdump",
    "nginx": "nginx",
    "wrk": "wrk",
}
VERSION_ARGS = {
    "tinyproxy": ("-v",),
    "privoxy": ("--version",),
    "squid": ("-v",),
    "mitmdump": ("--version",),
    "nginx": ("-v",),
    "wrk": ("-v",),
}
VERSION_NUMBER = re.compile(r"\d+\.\d+(?:\.\d+)*")
INSTALL_HINT = "`make bench-deps` installs it"
READY_TIMEOUT = 30.0  # until the port accepts a connection
STOP_TIMEOUT = 15.0
VERSION_TIMEOUT = 10.0
START_ATTEMPTS = 3  # a free port can be taken between finding it and binding it
RESOLV_CONF = "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n"
# Run in the namespace: bind the files named by $0 and $1 over the system's, then exec "$@".
PRIVATE_HOSTS_SCRIPT = (
    'mount --bind "$0" /etc/hosts && mount --bind "$1" /etc/resolv.conf && shift && exec "$@"'
)


def search_path() -> str:
    """PATH with the sbin directories (squid, privoxy and nginx live there) and this Python's
    bin directory first (the venv's mitmdump is the mitmproxy egress-proxy embeds)."""
    parts = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    parts += ["/usr/local/sbin", "/usr/sbin", "/sbin"]
    return os.pathsep.join(p for p in parts if p)


def find_binary(name: str, path: str | None = None) -> str | None:
    return shutil.which(BINARIES.get(name, name), path=search_path() if path is None else path)


def version_of(name: str, binary: str) -> str | None:
    """The version number the program prints (`Squid Cache: Version 5.7` -> 5.7; some print
    it on stderr), or its first line when that has no number."""
    try:
        done = subprocess.run(
            [binary, *VERSION_ARGS.get(name, ("--version",))],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if line.strip():
            number = VERSION_NUMBER.search(line)
            return number[0] if number else line.strip()
    return None


@functools.cache
def private_hosts_problem() -> str | None:
    """Why a peer cannot get a private /etc/hosts here, or None when it can (checked once, by
    running the namespace script with `true`)."""
    if os.geteuid() != 0:
        return "a private /etc/hosts (unshare --mount) needs root"
    unshare = shutil.which("unshare", path=search_path())
    if unshare is None:
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory(prefix="bench-ns-") as tmp:
        hosts, resolv = Path(tmp) / "hosts", Path(tmp) / "resolv.conf"
        hosts.write_text(hosts_text(["bench.test"]))
        resolv.write_text(RESOLV_CONF)
        try:
            done = subprocess.run(
                private_hosts(["true"], hosts, resolv, unshare),
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unshare --mount failed: {exc}"
    if done.returncode != 0:
        return f"unshare --mount failed: {done.stderr.strip()[:200]}"
    return None


def private_hosts(
    command: Sequence[str], hosts: Path, resolv: Path, unshare: str = "unshare"
) -> list[str]:
    """`command` in a private mount namespace with `hosts` as /etc/hosts and `resolv` as
    /etc/resolv.conf. The process keeps the pid: unshare and sh exec, neither forks."""
    namespace = [unshare, "--mount", "--propagation", "private"]
    return [*namespace, "sh", "-c", PRIVATE_HOSTS_SCRIPT, str(hosts), str(resolv), *command]


@dataclass(frozen=True)
class PeerStatus:
    """Whether a peer (or tool) can run here; `note` says why not, for the report."""

    name: str
    available: bool
    binary: str | None = None
    version: str | None = None
    note: str = ""


def peer_status(name: str, path: str | None = None) -> PeerStatus:
    binary = find_binary(name, path)
    if binary is None:
        return PeerStatus(name, False, note=f"{name} not installed ({INSTALL_HINT}): skipped")
    if name in SYSTEM_RESOLVER and (problem := private_hosts_problem()):
        return PeerStatus(
            name,
            False,
            binary,
            version_of(name, binary),
            f"{name} skipped: it resolves with the system resolver, and {problem}",
        )
    return PeerStatus(name, True, binary, version_of(name, binary))


# --------------------------------------------------------------------------------------------
# Configurations (text only: the tests check them with the programs themselves)


def hosts_text(names: Iterable[str]) -> str:
    lines = ["127.0.0.1 localhost", *(f"127.0.0.1 {name}" for name in names)]
    return "\n".join(lines) + "\n"


def tinyproxy_config(port: int, filter_file: Path, user: str | None = None) -> str:
    lines = [
        f"Port {port}",
        f"Listen {LOOPBACK}",
        "Timeout 600",
        "MaxClients 1024",
        # Critical messages only (to stderr, which the harness keeps): logging off.
        "LogLevel Critical",
        "DisableViaHeader Yes",
        f'Filter "{filter_file}"',
        "FilterType ere",
        "FilterDefaultDeny Yes",
        "FilterURLs Off",
        f"Allow {LOOPBACK}",
    ]
    if user:
        lines += [f"User {user}", f"Group {primary_group(user)}"]
    return "\n".join(lines) + "\n"


def tinyproxy_filter(domains: Iterable[str]) -> str:
    """One extended regular expression per domain: the name itself and its subdomains."""
    return "".join(f"^(.+\\.)?{d.replace('.', chr(92) + '.')}$\n" for d in domains)


def privoxy_config(port: int, directory: Path, actions: Path, templates: Path | None) -> str:
    lines = [
        f"confdir {directory}",
        f"actionsfile {actions}",
        f"listen-address {LOOPBACK}:{port}",
        # No `logfile` directive: no log file (errors only go to stderr, which we keep).
        "toggle 1",
        "enable-remote-toggle 0",
        "enable-remote-http-toggle 0",
        "enable-edit-actions 0",
        "enforce-blocks 1",
        "buffer-limit 4096",
        "forwarded-connect-retries 0",
        "accept-intercepted-requests 0",
        "allow-cgi-request-crunching 0",
        "split-large-forms 0",
        "keep-alive-timeout 600",
        "tolerate-pipelining 1",
        "socket-timeout 300",
        "max-client-connections 1024",
    ]
    if templates is not None:
        lines.append(f"templdir {templates}")
    return "\n".join(lines) + "\n"


def privoxy_actions(domains: Iterable[str]) -> str:
    """Block every host, then unblock each domain (`.name` is the name and its subdomains)."""
    allowed = "\n".join(f".{d}" for d in domains)
    return f"{{ +block{{not on the allow-list}} }}\n/\n\n{{ -block }}\n{allowed}\n"


def squid_config(
    port: int, hosts_file: Path, domains: Iterable[str], user: str | None = None
) -> str:
    lines = [
        f"http_port {LOOPBACK}:{port}",
        "visible_hostname bench-squid",
        # `.name` is the name and its subdomains.
        "acl allowed dstdomain " + " ".join(f".{d}" for d in domains),
        "http_access allow allowed",
        "http_access deny all",
        # Caching off.
        "cache deny all",
        "cache_mem 0 MB",
        # Logging off (cache_log keeps only what -d sends to stderr).
        "access_log none",
        "cache_store_log none",
        "cache_log /dev/null",
        "logfile_rotate 0",
        "pid_filename none",
        "netdb_filename none",
        # Names from our hosts file; any DNS query to loopback only.
        f"hosts_file {hosts_file}",
        f"dns_nameservers {LOOPBACK}",
        "icp_port 0",
        "htcp_port 0",
        "forwarded_for delete",
        "dns_timeout 2 seconds",
        # No helper processes: no ICMP pinger, nothing but the one squid process.
        "pinger_enable off",
        "shutdown_lifetime 0 seconds",
        "client_persistent_connections on",
        "server_persistent_connections on",
    ]
    if user:
        lines.append(f"cache_effective_user {user}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class OriginTLS:
    """nginx's HTTPS server: its port, its certificate chain and key (files)."""

    port: int
    cert: Path
    key: Path


def nginx_config(port: int, directory: Path, body_bytes: int, tls: OriginTLS | None = None) -> str:
    """A single-process nginx answering every path with `body_bytes` bytes, keep-alive without
    limits, and /nginx_status (stub_status: the request count the harness checks); with `tls`,
    the same over HTTPS on a second port."""
    body = "x" * max(0, body_bytes - 1) + "\\n" if body_bytes else ""
    temp = "\n".join(
        f"    {kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    locations = f"""\
        location = /nginx_status {{
            stub_status;
        }}
        location / {{
            default_type text/plain;
            return 200 "{body}";
        }}"""
    https = ""
    if tls is not None:
        https = f"""
    server {{
        listen {LOOPBACK}:{tls.port} ssl backlog=4096;
        server_name _;
        ssl_certificate {tls.cert};
        ssl_certificate_key {tls.key};
        ssl_session_cache off;
        ssl_session_tickets off;
{locations}
    }}"""
    return f"""\
daemon off;
master_process off;
worker_processes 1;
pid {directory / "nginx.pid"};
error_log stderr error;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp}
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    server {{
        listen {LOOPBACK}:{port} backlog=4096;
        server_name _;
{locations}
    }}{https}
}}
"""


def mitmdump_args(port: int, confdir: Path) -> list[str]:
    """Passthrough of everything (`--ignore-hosts '.*'`), no addons of ours, quiet."""
    args = ["--mode", f"regular@{port}", "--listen-host", LOOPBACK, "--ignore-hosts", ".*"]
    args += ["--set", f"confdir={confdir}", "--set", "termlog_verbosity=error"]
    return [*args, "--set", "flow_detail=0", "-q"]


def primary_group(user: str) -> str:
    try:
        return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    except KeyError:
        return "nogroup"


def unprivileged_user(peer: str) -> str | None:
    """The user a root-started peer drops to (squid: `proxy`, as its Debian package has it;
    tinyproxy: `nobody`), or None when we are not root (nothing to drop)."""
    if os.geteuid() != 0:
        return None
    for name in ("proxy", "nobody") if peer == "squid" else ("nobody",):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    return None


# --------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class Served:
    """A child process listening on 127.0.0.1:`port` (a peer or the origin)."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    directory: Path
    started: float
    ready_s: float = 0.0  # exec to the first accepted TCP connection
    first_connect_s: float | None = None  # exec to the first CONNECT answered 200 (peers)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_tail(self, limit: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "stderr.txt").read_text(errors="replace")[-limit:]
        return ""

    def stop(self) -> int:
        return stop_child(self.process, STOP_TIMEOUT)


def spawn(
    name: str,
    command: Sequence[str],
    port: int,
    directory: Path,
    env: dict[str, str] | None,
    probe_port: int | None = None,
) -> Served:
    """`command` started in `directory` and listening on 127.0.0.1:`port`; with `probe_port`,
    also until a CONNECT bench.test:probe_port through it is answered 200 (both timed from
    exec, polled every 2 ms)."""
    with open(directory / "stderr.txt", "wb") as err:
        started = time.perf_counter()
        process = subprocess.Popen(
            list(command),
            cwd=directory,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
    served = Served(name, process, port, directory, started)
    probes = {"ready_s": accepts(port)}
    if probe_port is not None:
        probes["first_connect_s"] = connect_accepted(port, "bench.test", probe_port)
    try:
        times = race_probes(process, started, probes, READY_TIMEOUT)
    except RuntimeError as exc:
        served.stop()
        raise RuntimeError(f"{name} on port {port}: {exc}:\n{served.stderr_tail()}") from None
    served.first_connect_s = times.get("first_connect_s")
    # A CONNECT answered proves the port accepted by then; the two probes poll on threads of
    # their own, so the accept probe may notice a little later than the CONNECT one did.
    served.ready_s = min(times["ready_s"], served.first_connect_s or times["ready_s"])
    return served


def peer_command(
    status: PeerStatus,
    directory: Path,
    port: int,
    domains: Sequence[str],
    shared: Path,
    private: bool,
) -> list[str]:
    """Writes the peer's files into `directory` and returns the command that runs it. `shared`
    holds what every instance of a run shares (mitmdump's CA, made once); `private`: the
    command will run with `directory`/hosts as its /etc/hosts."""
    assert status.binary is not None
    user = unprivileged_user(status.name)
    hosts = directory / "hosts"
    hosts.write_text(hosts_text(domains))
    (directory / "resolv.conf").write_text(RESOLV_CONF)
    if status.name == "tinyproxy":
        conf = directory / "tinyproxy.conf"
        (directory / "filter").write_text(tinyproxy_filter(domains))
        conf.write_text(tinyproxy_config(port, directory / "filter", user))
        return [status.binary, "-d", "-c", str(conf)]
    if status.name == "privoxy":
        (directory / "allow.action").write_text(privoxy_actions(domains))
        templates = Path("/etc/privoxy/templates")
        conf = directory / "privoxy.conf"
        conf.write_text(
            privoxy_config(
                port,
                directory,
                directory / "allow.action",
                templates if templates.is_dir() else None,
            )
        )
        return [status.binary, "--no-daemon", str(conf)]
    if status.name == "squid":
        conf = directory / "squid.conf"
        # Squid reads its hosts file after dropping to `user`, who may not be able to reach
        # `directory` (a 0700 parent); in the namespace the same file is /etc/hosts.
        conf.write_text(squid_config(port, Path("/etc/hosts") if private else hosts, domains, user))
        return [status.binary, "-N", "-d", "1", "-f", str(conf)]
    if status.name == "mitmdump":
        confdir = shared / "mitmproxy-confdir"
        confdir.mkdir(parents=True, exist_ok=True)
        return [status.binary, *mitmdump_args(port, confdir)]
    raise ValueError(f"unknown peer {status.name!r}")


def start_peer(
    status: PeerStatus,
    directory: Path,
    domains: Sequence[str],
    env: dict[str, str] | None = None,
    shared: Path | None = None,
    probe_port: int | None = None,
) -> Served:
    """The peer running with its own configuration in `directory`, listening (or RuntimeError
    after START_ATTEMPTS tries on fresh ports). `shared` (default: the parent of `directory`)
    holds what the run's instances share; `probe_port`: see spawn()."""
    directory.mkdir(parents=True, exist_ok=True)
    # A peer that drops privileges (squid to `proxy`) still reads its files here.
    directory.chmod(0o755)
    problem = private_hosts_problem()
    error: RuntimeError | None = None
    for _ in range(START_ATTEMPTS):
        port = free_port()
        command = peer_command(
            status, directory, port, domains, shared or directory.parent, problem is None
        )
        if problem is None:
            command = private_hosts(command, directory / "hosts", directory / "resolv.conf")
        elif status.name in SYSTEM_RESOLVER:
            raise RuntimeError(f"{status.name}: {problem}")
        try:
            return spawn(status.name, command, port, directory, env, probe_port)
        except RuntimeError as exc:
            error = exc
    assert error is not None
    raise error


def start_origin(
    nginx: str, directory: Path, body_bytes: int, tls: tuple[Path, Path] | None = None
) -> tuple[Served, OriginTLS | None]:
    """nginx as the HTTP origin (single process, its own configuration in `directory`), and
    its HTTPS server when `tls` (certificate chain, key) is given."""
    directory.mkdir(parents=True, exist_ok=True)
    error: RuntimeError | None = None
    for _ in range(START_ATTEMPTS):
        port, tls_port = free_port(), free_port()
        https = OriginTLS(tls_port, *tls) if tls else None
        conf = directory / "nginx.conf"
        conf.write_text(nginx_config(port, directory, body_bytes, https))
        try:
            served = spawn(
                "nginx",
                [nginx, "-p", str(directory), "-e", "stderr", "-c", str(conf)],
                port,
                directory,
                None,
            )
            return served, https
        except RuntimeError as exc:
            error = exc
    assert error is not None
    raise error


def origin_requests(port: int, timeout: float = 2.0) -> int:
    """The origin's request count (nginx stub_status; the status request itself included)."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        sock.sendall(b"GET /nginx_status HTTP/1.1\r\nHost: origin\r\nConnection: close\r\n\r\n")
        data = b""
        while len(data) < 65536 and (chunk := sock.recv(65536)):
            data += chunk
    body = data.partition(b"\r\n\r\n")[2].decode(errors="replace").splitlines()
    # "Active connections: N", "server accepts handled requests", " A H R", ...
    for i, line in enumerate(body):
        if line.strip().startswith("server accepts") and i + 1 < len(body):
            return int(body[i + 1].split()[2])
    raise ValueError(f"no request count in the origin's status: {body[:4]}")
