"""The real servers of tests/support/real_servers.py, used directly (no proxy): each starts, a
real client gets its answer, and nothing is left running after it. The proxy's tests rely on
these working; a failure here is the fixture's, not the proxy's."""

from __future__ import annotations

import os
import smtplib
import socket
from email.message import EmailMessage
from pathlib import Path

import pytest
from support.real_servers import (
    BANNER,
    GIT,
    REPO_README,
    SMTP_BANNER,
    banner_server,
    postgres,
    recv_until,
    redis,
    run_client,
    smtp_banner,
    sshd,
)

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ssh_runs_a_command(tmp_path: Path) -> None:
    with sshd(tmp_path) as server:
        done = run_client(server.ssh("echo", "ok"))
        assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
        pid = server.process.pid
    assert gone(pid)
    assert not server.directory.joinpath("sshd.pid").exists()


def test_git_clones_over_ssh(tmp_path: Path) -> None:
    with sshd(tmp_path) as server:
        clone = tmp_path / "clone"
        done = run_client([GIT, "clone", "-q", server.repo_url(), str(clone)], env=server.git_env())
        assert done.returncode == 0, done.stderr
    assert (clone / "README").read_text() == REPO_README


def test_the_sshd_speaks_first(tmp_path: Path) -> None:
    with sshd(tmp_path) as server, socket.create_connection((server.host, server.port), 5) as s:
        assert recv_until(s, b"\r\n").startswith(b"SSH-2.0-OpenSSH")


def test_psql_selects_1(tmp_path: Path) -> None:
    with postgres(tmp_path) as db:
        done = db.psql("select 1")
        assert (done.returncode, done.stdout.strip()) == (0, "1"), done.stderr
        pid = db.process.pid
    assert gone(pid)
    # The server's directory is removed with it (as root it lives outside tmp_path).
    assert not db.data.exists()


def test_redis_answers_ping(tmp_path: Path) -> None:
    with redis(tmp_path) as cache:
        done = cache.cli("PING")
        assert (done.returncode, done.stdout.strip()) == (0, "PONG"), done.stderr
        pid = cache.process.pid
    assert gone(pid)


def test_smtplib_sends_a_message() -> None:
    with smtp_banner() as mail:
        message = EmailMessage()
        message["From"], message["To"], message["Subject"] = "a@smtp.test", "b@smtp.test", "hi"
        message.set_content("hello\n.leading dot\n")
        with smtplib.SMTP(*mail.address, timeout=10) as client:
            client.send_message(message)
        assert len(mail.messages) == 1
        sent = mail.messages[0]
        assert (sent["from"], sent["to"]) == ("a@smtp.test", ["b@smtp.test"])
        assert b"\r\n.leading dot\r\n" in sent["data"]  # type: ignore[operator]


def test_the_smtp_server_speaks_first() -> None:
    with smtp_banner() as mail, socket.create_connection(mail.address, 5) as s:
        assert recv_until(s, b"\r\n") == SMTP_BANNER


def test_the_banner_server_speaks_first_then_echoes() -> None:
    with banner_server() as server, socket.create_connection(server.address, 5) as s:
        assert recv_until(s, b"\r\n") == BANNER
        s.sendall(b"ping\n")
        assert recv_until(s, b"ping\n") == b"ping\n"
    assert server.connections == 1


def test_a_stopped_server_group_is_gone(tmp_path: Path) -> None:
    # sshd forks a process per connection: the whole group goes with the fixture.
    with sshd(tmp_path) as server:
        with socket.create_connection((server.host, server.port), 5) as s:
            recv_until(s, b"\r\n")
            group = server.process.pid
        pid = server.process.pid
    assert gone(pid)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return
    raise AssertionError("sshd's process group is still there")
