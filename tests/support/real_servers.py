"""Real servers of the tests' own, each on 127.0.0.1 (or an address the test gives) on a free
port, in a directory of its own, stopped and cleaned up on exit, every wait bounded:

    with sshd(tmp_path) as server:
        subprocess.run(server.ssh("echo", "ok"), ...)             # OpenSSH's sshd
        subprocess.run(["git", "clone", server.repo_url(), ...],  # a bare repository over it
                       env={**os.environ, "GIT_SSH_COMMAND": server.git_ssh_command()})
    with postgres(tmp_path) as db:  db.psql("select 1")           # PostgreSQL from apt
    with redis(tmp_path) as cache:  cache.cli("PING")             # redis-server from apt
    with smtp_banner() as mail:     smtplib.SMTP(*mail.address)   # a server that speaks first
    with banner_server() as echo:   ...                           # a banner line, then echo

Never the packages' system services: each server is started here with its own configuration
and data. sshd and redis-server run as the current user (root in CI is fine for them);
PostgreSQL refuses root, so as root its data directory belongs to `nobody` and it runs as that
user (setpriv). A missing binary skips the test with the reason. Everything listens on loopback
unless the test names another address (the sandbox tests: the host side of their own veth).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import select
import shlex
import shutil
import signal
import socket
import socketserver
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 30.0  # a server's start, on a loaded machine
STOP_TIMEOUT = 10.0
CLIENT_TIMEOUT = 30.0  # a client's whole run
IP_FREEBIND = 15  # linux/in.h (not in the socket module)

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
SOCAT = "/usr/bin/socat"
NC_OPENBSD = "/usr/bin/nc.openbsd"
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"
GIT = shutil.which("git") or "/usr/bin/git"
# git's own configuration never comes from the machine or the user running the tests.
GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
REPO_README = "cloned over ssh\n"


def need(path: str | None, what: str) -> str:
    """`path` when it is an executable file, else skip the test saying what is missing."""
    if path is None or not os.access(path, os.X_OK):
        pytest.skip(f"needs {what} ({path or 'not found'}); apt-get install it")
    return path


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket() as s:
        if host != LOOPBACK:
            s.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def accepting(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Stop `process` and its process group (it was started in a session of its own):
    `sig`, then SIGKILL after STOP_TIMEOUT, then reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)
    # Children (sshd's per-connection processes, postgres's backends) go with the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait(timeout=STOP_TIMEOUT)


def start_logged(
    argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: stopped as a whole
        )


def started_on_a_free_port(
    host: str,
    start: Callable[[int], subprocess.Popen[bytes]],
    ready: Callable[[int], object],
    log: Path,
    what: str,
    stop: int = signal.SIGTERM,
) -> tuple[int, subprocess.Popen[bytes]]:
    """`start(port)` on a free port, waited for until `ready(port)`: the port and the process.
    A free port can be taken between the look and the bind: then another is tried (3 at most);
    any other failure to start fails at once, with the server's log."""
    last_error = ""
    for _ in range(3):
        port = free_port(host)
        process = start(port)
        try:
            wait_started(process, log, lambda: ready(port), what)  # noqa: B023
        except AssertionError as exc:
            stop_process(process, stop)
            last_error = str(exc)
            if "Address already in use" in last_error:
                continue
            raise
        return port, process
    raise AssertionError(last_error)


def wait_started(
    process: subprocess.Popen[bytes], log: Path, ready: Callable[[], object], what: str
) -> None:
    """Wait (START_TIMEOUT) until `ready()`; fail with the server's log if it exits first."""
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if process.poll() is not None:
            raise AssertionError(
                f"{what} exited {process.returncode} before it was ready:\n"
                + log.read_text(errors="replace")
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} not ready after {START_TIMEOUT:g}s:\n" + log.read_text(errors="replace")
            )
        time.sleep(0.05)


def run_client(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = CLIENT_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """A client to completion, its output captured, stdin closed, bounded in time."""
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=timeout,
        check=False,
    )


# -- OpenSSH -----------------------------------------------------------------------------------


@dataclass
class SSHServer:
    """A running sshd, the client key it accepts, and a bare repository it serves."""

    host: str
    port: int
    user: str
    directory: Path
    key: Path  # the client's private key
    known_hosts: Path
    repo: Path  # a bare git repository with one commit (README)
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def options(self, proxy_command: str | None = None, port: int | None = None) -> list[str]:
        """ssh's options: our key only, no configuration file, no prompt, no host-key check."""
        argv = ["-i", str(self.key), "-F", "/dev/null"]
        for option in (
            f"UserKnownHostsFile={self.known_hosts}",
            "StrictHostKeyChecking=no",
            "BatchMode=yes",
            "IdentitiesOnly=yes",
            "ConnectTimeout=15",
            "LogLevel=ERROR",  # no "Permanently added" warning on stderr
        ):
            argv += ["-o", option]
        if proxy_command is not None:
            argv += ["-o", f"ProxyCommand={proxy_command}"]
        return [*argv, "-p", str(port or self.port)]

    def ssh(
        self,
        *command: str,
        host: str | None = None,
        port: int | None = None,
        proxy_command: str | None = None,
    ) -> list[str]:
        """The argv of `ssh user@host command...` (host defaults to the server's address; a
        name when a proxy resolves it)."""
        destination = f"{self.user}@{host or self.host}"
        return [SSH, *self.options(proxy_command, port), destination, *command]

    def git_ssh_command(self, proxy_command: str | None = None) -> str:
        """GIT_SSH_COMMAND for `git clone ssh://...` (git adds -p PORT and the destination)."""
        argv = [SSH, *self.options(proxy_command)[:-2]]  # git passes its own -p
        return shlex.join(argv)

    def repo_url(self, host: str | None = None, port: int | None = None) -> str:
        return f"ssh://{self.user}@{host or self.host}:{port or self.port}{self.repo}"

    def git_env(self, proxy_command: str | None = None) -> dict[str, str]:
        return {**os.environ, **GIT_ENV, "GIT_SSH_COMMAND": self.git_ssh_command(proxy_command)}


def _bare_repository(directory: Path) -> Path:
    """A bare repository with one commit, pushed to it from a scratch clone."""
    repo, work = directory / "repo.git", directory / "repo-work"
    env = {**os.environ, **GIT_ENV}

    def git(*args: str) -> None:
        run = subprocess.run(
            [GIT, *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert run.returncode == 0, f"git {args}: {run.stderr}"

    git("init", "-q", "--bare", "-b", "main", str(repo))
    git("clone", "-q", str(repo), str(work))
    (work / "README").write_text(REPO_README)
    git("-C", str(work), "add", "README")
    git("-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    git("-C", str(work), "push", "-q", "origin", "HEAD:main")
    shutil.rmtree(work)
    return repo


@contextlib.contextmanager
def sshd(tmp: Path, host: str = LOOPBACK) -> Iterator[SSHServer]:
    """OpenSSH's sshd as the current user with its own host key and configuration, accepting
    only a client key made here, serving a bare repository; `-D -e`, its log in tmp."""
    need(SSHD, "OpenSSH's sshd (openssh-server)")
    need(SSH, "OpenSSH's ssh (openssh-client)")
    need(SSH_KEYGEN, "ssh-keygen (openssh-client)")
    directory = Path(tempfile.mkdtemp(prefix="sshd-", dir=tmp))
    directory.chmod(0o700)
    host_key, client_key = directory / "host_ed25519", directory / "client_ed25519"
    for key in (host_key, client_key):
        done = run_client([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
        assert done.returncode == 0, done.stderr
    authorized = directory / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    authorized.chmod(0o600)
    repo = _bare_repository(directory)
    if os.geteuid() == 0:
        # The privilege-separation directory Debian's sshd insists on (the package's service
        # makes it at boot; no service runs here).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    user = pwd.getpwuid(os.geteuid()).pw_name
    log = directory / "sshd.log"
    config = directory / "sshd_config"

    def start(port: int) -> subprocess.Popen[bytes]:
        config.write_text(
            f"ListenAddress {host}\nPort {port}\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {authorized}\nPidFile {directory / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "AuthenticationMethods publickey\nX11Forwarding no\nAllowTcpForwarding no\n"
            "PrintMotd no\nPrintLastLog no\nUseDNS no\nLogLevel VERBOSE\nMaxStartups 50\n"
            # The server's own PATH for git-upload-pack, whatever the login environment.
            "SetEnv PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        )
        done = run_client([SSHD, "-t", "-f", str(config)])
        assert done.returncode == 0, f"sshd -t: {done.stderr}"
        return start_logged([SSHD, "-D", "-e", "-f", str(config)], log)

    port, process = started_on_a_free_port(
        host, start, lambda port: accepting(host, port), log, "sshd"
    )
    try:
        yield SSHServer(
            host, port, user, directory, client_key, directory / "known_hosts", repo, log,
            process,
        )  # fmt: skip
    finally:
        stop_process(process)


# -- PostgreSQL --------------------------------------------------------------------------------


def postgres_bin() -> Path:
    """The newest /usr/lib/postgresql/*/bin with initdb, postgres and psql."""

    def version(initdb: str) -> int:
        name = Path(initdb).parent.parent.name
        return int(name) if name.isdigit() else 0

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if not found:
        pytest.skip("needs PostgreSQL (postgresql from apt: /usr/lib/postgresql/*/bin/initdb)")
    bindir = Path(found[-1]).parent
    for name in ("postgres", "psql"):
        need(str(bindir / name), f"PostgreSQL's {name}")
    return bindir


@dataclass
class PostgresServer:
    host: str
    port: int
    user: str  # the database superuser (trust auth on TCP from 127.0.0.1 and host)
    bindir: Path
    data: Path
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def psql_argv(
        self, sql: str = "select 1", *, host: str | None = None, port: int | None = None
    ) -> list[str]:
        return [
            str(self.bindir / "psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1",
            "-h", host or self.host, "-p", str(port or self.port), "-U", self.user,
            "-d", "postgres", "-c", sql,
        ]  # fmt: skip

    def psql(
        self, sql: str = "select 1", *, host: str | None = None, port: int | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PGCONNECT_TIMEOUT": "15", "PGSSLMODE": "disable"}
        env.pop("PGPASSWORD", None)
        return run_client(self.psql_argv(sql, host=host, port=port), env=env)


@contextlib.contextmanager
def postgres(tmp: Path, host: str = LOOPBACK) -> Iterator[PostgresServer]:
    """PostgreSQL from apt: initdb and postgres in the foreground, listening on host:PORT only,
    its socket directory beside the data, trust authentication. PostgreSQL refuses to run as
    root, so as root its files go in a directory of their own under /tmp (pytest's tmp is not
    open to other users) owned by `nobody`, and both run as `nobody` (setpriv, no groups)."""
    bindir = postgres_bin()
    as_root = os.geteuid() == 0
    if as_root:
        setpriv = need(shutil.which("setpriv"), "setpriv (util-linux)")
        nobody = pwd.getpwnam("nobody")
        prefix = [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        directory = Path(tempfile.mkdtemp(prefix="egress-pg-"))
        os.chown(directory, nobody.pw_uid, nobody.pw_gid)
    else:
        prefix = []
        directory = Path(tempfile.mkdtemp(prefix="postgres-", dir=tmp))
    directory.chmod(0o700)
    data, sockets, log = directory / "data", directory / "sockets", directory / "postgres.log"
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "LC_ALL": "C", "HOME": str(directory), "TZ": "UTC"}
    try:
        subprocess.run([*prefix, "mkdir", str(sockets)], check=True, timeout=30, env=env)
        done = subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--no-locale", "--no-sync"],
            capture_output=True, text=True, timeout=120, env=env, cwd=directory, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"initdb: {done.stdout}{done.stderr}"

        def start(port: int) -> subprocess.Popen[bytes]:
            return start_logged(
                [*prefix, str(bindir / "postgres"), "-D", str(data), "-p", str(port),
                 "-c", f"listen_addresses={host}", "-c", f"unix_socket_directories={sockets}",
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "shared_buffers=16MB", "-c", "max_connections=20",
                 "-c", "logging_collector=off", "-c", "log_connections=on"],
                log, env=env, cwd=directory,
            )  # fmt: skip

        def ready(port: int) -> bool:
            return "ready to accept connections" in log.read_text(errors="replace")

        # SIGINT: PostgreSQL's fast shutdown.
        port, process = started_on_a_free_port(host, start, ready, log, "postgres", signal.SIGINT)
        try:
            yield PostgresServer(host, port, "postgres", bindir, data, log, process)
        finally:
            stop_process(process, signal.SIGINT)
    finally:
        if as_root:
            shutil.rmtree(directory, ignore_errors=True)


# -- Redis -------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    host: str
    port: int
    directory: Path
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def cli_argv(
        self, *command: str, host: str | None = None, port: int | None = None
    ) -> list[str]:
        return [REDIS_CLI, "-h", host or self.host, "-p", str(port or self.port), *command]

    def cli(
        self, *command: str, host: str | None = None, port: int | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run_client(self.cli_argv(*command, host=host, port=port))


@contextlib.contextmanager
def redis(tmp: Path, host: str = LOOPBACK) -> Iterator[RedisServer]:
    """redis-server from apt as the current user: host:PORT only, no persistence, its working
    directory in tmp."""
    need(REDIS_SERVER, "redis-server (redis-server)")
    need(REDIS_CLI, "redis-cli (redis-tools)")
    directory = Path(tempfile.mkdtemp(prefix="redis-", dir=tmp))
    log = directory / "redis.log"

    def start(port: int) -> subprocess.Popen[bytes]:
        return start_logged(
            [REDIS_SERVER, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
             "--dir", str(directory), "--daemonize", "no", "--unixsocket", "",
             "--protected-mode", "no", "--loglevel", "notice"],
            log, cwd=directory,
        )  # fmt: skip

    def ready(port: int) -> bool:
        return "Ready to accept connections" in log.read_text(errors="replace")

    port, process = started_on_a_free_port(host, start, ready, log, "redis-server")
    try:
        yield RedisServer(host, port, directory, log, process)
    finally:
        stop_process(process)


# -- Python servers that speak first -----------------------------------------------------------


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, freebind: bool) -> None:
        self.freebind = freebind
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.freebind:
            self.socket.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        super().server_bind()


@contextlib.contextmanager
def _serving(
    handle: Callable[[socket.socket], None], host: str, freebind: bool
) -> Iterator[_Server]:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.settimeout(CLIENT_TIMEOUT)
            with contextlib.suppress(OSError):
                handle(self.request)

    server = _Server((host, 0), Handler, freebind)
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _lines(conn: socket.socket) -> Iterator[bytes]:
    """Lines (with their CRLF/LF) as they arrive, until the peer closes."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            yield line + b"\n"
        chunk = conn.recv(65536)
        if not chunk:
            return
        buffer += chunk


def _path(argument: str) -> str:
    """The address of `FROM:<a@b> SIZE=1` / `TO:<a@b>`, without its parameters."""
    value = argument.partition(":")[2].strip()
    return value[1 : value.find(">")] if value.startswith("<") else value.split(" ")[0]


@dataclass
class SMTPServer:
    host: str
    port: int
    banner: bytes
    messages: list[dict[str, object]] = field(default_factory=list)
    connections: int = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


SMTP_BANNER = b"220 smtp.test ESMTP ready\r\n"


@contextlib.contextmanager
def smtp_banner(host: str = LOOPBACK, *, freebind: bool = False) -> Iterator[SMTPServer]:
    """A minimal SMTP server of our own: it speaks first (220 banner), then answers EHLO,
    HELO, MAIL, RCPT, DATA, RSET, NOOP and QUIT, and records every message
    ({"from", "to", "data"})."""
    state = SMTPServer(host, 0, SMTP_BANNER)
    lock = threading.Lock()

    def handle(conn: socket.socket) -> None:
        with lock:
            state.connections += 1
        conn.sendall(SMTP_BANNER)
        sender, recipients, data, in_data = "", [], b"", False
        for line in _lines(conn):
            if in_data:
                if line.rstrip(b"\r\n") == b".":
                    with lock:
                        state.messages.append({"from": sender, "to": recipients, "data": data})
                    sender, recipients, data, in_data = "", [], b"", False
                    conn.sendall(b"250 2.0.0 queued\r\n")
                else:
                    data += line[1:] if line.startswith(b"..") else line
                continue
            verb, _, argument = line.strip().decode("latin-1").partition(" ")
            verb = verb.upper()
            if verb == "EHLO":
                conn.sendall(b"250-smtp.test greets you\r\n250-8BITMIME\r\n250 SIZE 1000000\r\n")
            elif verb == "HELO":
                conn.sendall(b"250 smtp.test\r\n")
            elif verb == "MAIL":
                sender = _path(argument)
                conn.sendall(b"250 2.1.0 ok\r\n")
            elif verb == "RCPT":
                recipients.append(_path(argument))
                conn.sendall(b"250 2.1.5 ok\r\n")
            elif verb == "DATA":
                in_data = True
                conn.sendall(b"354 end with <CRLF>.<CRLF>\r\n")
            elif verb in ("RSET", "NOOP"):
                sender, recipients = ("", []) if verb == "RSET" else (sender, recipients)
                conn.sendall(b"250 2.0.0 ok\r\n")
            elif verb == "QUIT":
                conn.sendall(b"221 2.0.0 bye\r\n")
                return
            else:
                conn.sendall(b"502 5.5.2 not implemented\r\n")

    with _serving(handle, host, freebind) as server:
        state.port = server.server_address[1]
        yield state


@dataclass
class BannerServer:
    host: str
    port: int
    banner: bytes
    connections: int = 0
    received: bytearray = field(default_factory=bytearray)  # every byte any client sent

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


BANNER = b"hello from the banner server\r\n"


@contextlib.contextmanager
def banner_server(
    host: str = LOOPBACK, *, banner: bytes = BANNER, freebind: bool = False
) -> Iterator[BannerServer]:
    """A TCP server that writes `banner` (if any) as soon as a connection is accepted, then
    echoes every byte back until the client closes; `received` keeps what clients sent."""
    state = BannerServer(host, 0, banner)
    lock = threading.Lock()

    def handle(conn: socket.socket) -> None:
        with lock:
            state.connections += 1
        if banner:
            conn.sendall(banner)
        while chunk := conn.recv(65536):
            with lock:
                state.received += chunk
            conn.sendall(chunk)

    with _serving(handle, host, freebind) as server:
        state.port = server.server_address[1]
        yield state


def recv_until(sock: socket.socket, marker: bytes, timeout: float = 10.0) -> bytes:
    """Bytes from `sock` until `marker` was read or the peer closed (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    data = b""
    while marker not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {marker!r} after {timeout:g}s; got {data!r}")
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionError:
            return data
        if not chunk:
            return data
        data += chunk
    return data
