"""Every TCP protocol inside `egress-proxy sandbox` (issue 18, root only): OpenSSH,
`git clone ssh://`, psql and redis-cli by name with no proxy settings, so each connection takes
the transparent redirect, carries no SNI and no Host, and is attributed to a name by the
session's DNS answers (`"attribution": "dns"`). An address the session never got from its DNS
is refused `unattributed` (OpenSSH prints it: our SSH_MSG_DISCONNECT), and TLS is still decided
on its SNI.

The real servers (tests/support/real_servers.py) listen on 127.0.0.1; a relay of ours on the
host side of the session's veth (bound with IP_FREEBIND before the sandbox creates the
address) forwards each to its server, and the test's DNS server answers the servers' names
with that address. COMMAND is tests/support/sandbox_opaque.sh, as `nobody`. Skips with the
reason when not root or without a tool."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.dns_server import running_dns_server
from support.real_servers import REPO_README, banner_server, postgres, redis, sshd
from support.running import make_config
from support.sandbox import ROOT, SESSION_TIMEOUT, Session, Subnets, finished
from support.tunnels import direct, forwarding

TOOLS = {
    name: shutil.which(name)
    for name in ("ip", "nft", "bash", "setpriv", "git", "ssh", "redis-cli", "curl", "timeout")
}

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("nothing_left"),  # conftest.py: nothing of the session may be left
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a network namespace"),
    *(
        pytest.mark.skipif(path is None, reason=f"needs {name} on PATH")
        for name, path in TOOLS.items()
    ),
]

NAMES = ("git.test", "db.test", "cache.test", "tls.test")
MANIFEST = "network:\n  egress: [" + ", ".join(NAMES) + "]\n"


def test_ssh_git_psql_and_redis_by_name_inside_the_sandbox(
    tmp_path: Path,
    shared: Path,
    subnets: Subnets,
) -> None:
    host4 = subnets.host4
    servers = tmp_path / "servers"
    servers.mkdir()
    nobody = pwd.getpwnam("nobody")
    with (
        sshd(servers) as ssh,
        postgres(servers) as db,
        redis(servers) as cache,
        # TLS's upstream: silent, so a server-first relay would show nothing; records bytes.
        banner_server(host4, banner=b"", freebind=True) as tls_like,
        forwarding(direct(ssh.host, ssh.port), host4, freebind=True) as ssh_relay,
        forwarding(direct(db.host, db.port), host4, freebind=True) as db_relay,
        forwarding(direct(cache.host, cache.port), host4, freebind=True) as cache_relay,
        running_dns_server() as dns,
    ):
        for name in NAMES:
            dns.set(name, a=[host4])
        # The client's key, nobody's own (ssh refuses a private key others can read); the
        # repository sshd serves is root's, read by sshd's session as root.
        key = shared / "client_key"
        shutil.copyfile(ssh.key, key)
        os.chown(key, nobody.pw_uid, nobody.pw_gid)
        key.chmod(0o600)
        script = shared / "sandbox_opaque.sh"
        shutil.copyfile(ROOT / "tests" / "support" / "sandbox_opaque.sh", script)
        script.chmod(0o755)
        (tmp_path / "agent.yaml").write_text(MANIFEST)
        (tmp_path / "config.yaml").write_text(
            make_config(dns, allow=("127.0.0.0/8", str(subnets.subnet4)))
        )
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "sandbox", str(tmp_path / "agent.yaml"),
             "--config", str(tmp_path / "config.yaml"), *subnets.args(), "--user", "nobody",
             "--status-file", str(tmp_path / "status.json"),
             "--audit-log", str(tmp_path / "audit.jsonl"), "--",
             str(TOOLS["bash"]), str(script), str(shared / "work"), str(key),
             str(ssh_relay.port), str(ssh.repo), str(db.bindir / "psql"), str(db_relay.port),
             str(cache_relay.port), host4, str(tls_like.port)],
            cwd=ROOT, capture_output=True, text=True, timeout=SESSION_TIMEOUT * 2,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    session: Session = finished(tmp_path, done)
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}"
    results = session.lines()
    assert "done" in results, diagnostics
    closes = [x for x in session.audit if x.get("event") == "close"]
    decisions = [x for x in session.audit if x.get("event") == "decision"]

    # The allowed ones: by name, attributed by the session's DNS, relayed opaque.
    assert results["ssh"]["rc"] == "0" and results["ssh"]["out"] == "ok_", diagnostics
    assert results["git"]["rc"] == "0", diagnostics
    assert results["git"]["readme"] == REPO_README.replace(" ", "_").replace("\n", "_")
    assert results["psql"]["rc"] == "0" and results["psql"]["out"] == "42_", diagnostics
    assert results["redis"]["rc"] == "0" and results["redis"]["out"] == "PONG_", diagnostics
    streams = {(x.get("host"), x.get("protocol"), x.get("attribution")) for x in closes}
    for expected in (
        ("git.test", "ssh", "dns"),
        ("db.test", "tcp", "dns"),
        ("cache.test", "tcp", "dns"),
    ):
        assert expected in streams, (expected, closes)
    ssh_close = next(x for x in closes if x.get("host") == "git.test")
    assert ssh_close["upstream"] == f"{host4}:{ssh_relay.port}", ssh_close

    # A hard-coded address the session never resolved: refused, in OpenSSH's own words.
    assert results["ssh_address"]["rc"] == "255", diagnostics
    assert "unattributed" in results["ssh_address"]["err"], diagnostics
    unattributed = [x for x in decisions if x.get("reason") == "unattributed"]
    assert unattributed, decisions
    assert unattributed[0]["protocol"] == "ssh", unattributed

    # TLS is still decided on its SNI: a name the manifest does not allow is refused.
    assert results["tls_denied"]["rc"] != "0", diagnostics
    tls = [x for x in decisions if x.get("sni") == "denied.test"]
    assert tls and tls[0]["decision"] == "deny", decisions
    # The address may be dialled before the first bytes (for servers that speak first), but
    # the refused ClientHello never reaches it.
    assert tls_like.received == b""
    assert tls[0]["reason"] in ("not_allowed", "sni_mismatch"), tls


def test_ssh_inside_the_sandbox_where_opaque_streams_are_off_prints_the_reason(
    tmp_path: Path,
    shared: Path,
    subnets: Subnets,
) -> None:
    host4 = subnets.host4
    servers = tmp_path / "servers"
    servers.mkdir()
    nobody = pwd.getpwnam("nobody")
    with (
        sshd(servers) as ssh,
        forwarding(direct(ssh.host, ssh.port), host4, freebind=True) as ssh_relay,
        running_dns_server() as dns,
    ):
        dns.set("git.test", a=[host4])
        key = shared / "client_key"
        shutil.copyfile(ssh.key, key)
        os.chown(key, nobody.pw_uid, nobody.pw_gid)
        key.chmod(0o600)
        (tmp_path / "agent.yaml").write_text("network:\n  egress: [git.test]\n")
        (tmp_path / "config.yaml").write_text(
            make_config(
                dns, allow=("127.0.0.0/8", str(subnets.subnet4)), extra="opaque_ports: []\n"
            )
        )
        argv = [
            a if a != str(ssh.key) else str(key) for a in ssh.ssh("echo", "ok", host="git.test")
        ]
        argv = [str(TOOLS["ssh"]), *argv[1:]]
        argv[argv.index("-p") + 1] = str(ssh_relay.port)
        argv[argv.index(f"UserKnownHostsFile={ssh.known_hosts}")] = (
            f"UserKnownHostsFile={shared / 'work' / 'known_hosts'}"
        )
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "sandbox", str(tmp_path / "agent.yaml"),
             "--config", str(tmp_path / "config.yaml"), *subnets.args(), "--user", "nobody",
             "--status-file", str(tmp_path / "status.json"),
             "--audit-log", str(tmp_path / "audit.jsonl"), "--", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=SESSION_TIMEOUT * 2,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    session: Session = finished(tmp_path, done)
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}"
    assert session.returncode == 255 and "ok" not in session.stdout, diagnostics
    assert "opaque_not_allowed" in session.stderr, diagnostics
    # (The sandbox's own boundary probes are refused too: their lines are not ours.)
    denials = [
        x for x in session.audit if x.get("decision") == "deny" and x.get("host") == "git.test"
    ]
    assert [(x["host"], x["protocol"], x["reason"]) for x in denials] == [
        ("git.test", "ssh", "opaque_not_allowed")
    ], denials
    assert denials[0].get("attribution") == "dns", denials
    assert "Accepted publickey" not in ssh.log.read_text(errors="replace")
