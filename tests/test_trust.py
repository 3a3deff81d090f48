"""The session trust bundle (proxy/tls/bundle.py) and `egress-proxy trust`: the system's roots (as
OpenSSL finds them in this process) plus the session CA, public files beside the CA or in
`inspection.trust_dir`, never the key; the variables that point common tools at them; real TLS
handshakes verified against the bundle."""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trustme
from support.dns_server import DNSServer
from support.running import RunningProxy

from proxy.cli import main
from proxy.common.errors import ProxyError
from proxy.tls.bundle import TRUST_VARIABLES, publish, system_roots, trust_environment
from proxy.tls.ca import ensure_ca

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def system_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[trustme.CA]:
    """A "system" store of two roots, one of them twice, and a damaged entry between them, as
    OpenSSL in this process finds it (SSL_CERT_FILE)."""
    roots = [trustme.CA(), trustme.CA()]
    damaged = b"-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n"
    store = tmp_path / "system.pem"
    store.write_bytes(
        roots[0].cert_pem.bytes() + damaged + roots[1].cert_pem.bytes() + roots[0].cert_pem.bytes()
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(store))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-such-dir"))
    return roots


def handshake(server_ca: trustme.CA, name: str, cafile: Path) -> str:
    """A real TLS handshake to a loopback server whose certificate `server_ca` issued for
    `name`, verified against `cafile`: 'ok' or the verification error's name."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ca.issue_cert(name).configure_cert(server_context)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ssl.SSLError):
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ssl.create_default_context(cafile=str(cafile))
    try:
        with (
            socket.create_connection(listener.getsockname(), timeout=10) as raw,
            client.wrap_socket(raw, server_hostname=name),
        ):
            return "ok"
    except ssl.SSLCertVerificationError as exc:
        return type(exc).__name__
    finally:
        thread.join(timeout=10)
        listener.close()


def test_the_bundle_is_the_system_roots_then_the_session_ca(
    tmp_path: Path, system_store: list[trustme.CA]
) -> None:
    ca = ensure_ca(tmp_path / "ca")
    files = publish(ca)
    # Beside the CA: the directory lets others reach a file they can name (0711), the two
    # public files are 0644, and the key stays 0600.
    assert files.directory == ca.directory
    assert stat.S_IMODE(ca.directory.stat().st_mode) == 0o711
    for path in (files.bundle, files.ca):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    # Two roots (the duplicate once, the damaged entry skipped), then the session CA.
    assert files.roots == 2
    assert files.roots_source == os.environ["SSL_CERT_FILE"]
    text = files.bundle.read_text()
    assert text.count("BEGIN CERTIFICATE") == 3
    assert text.endswith(ca.cert_path.read_text().strip() + "\n")
    assert "PRIVATE KEY" not in text and "PRIVATE KEY" not in files.ca.read_text()
    assert files.ca.read_bytes().strip() == ca.cert_path.read_bytes().strip()
    # What a tool that replaces its store with the bundle sees: a host under a system root
    # still verifies (the whole point), one under no root does not.
    assert handshake(system_store[1], "passthrough.test", files.bundle) == "ok"
    assert handshake(trustme.CA(), "other.test", files.bundle) == "SSLCertVerificationError"
    # And the CA file alone would have broken the passthrough host.
    assert handshake(system_store[1], "passthrough.test", files.ca) == "SSLCertVerificationError"


def test_publishing_elsewhere_copies_no_key_and_follows_the_store(
    tmp_path: Path, system_store: list[trustme.CA]
) -> None:
    ca = ensure_ca(tmp_path / "ca")
    files = publish(ca, tmp_path / "public" / "trust")
    assert sorted(p.name for p in files.directory.iterdir()) == [
        "session-ca.pem",
        "trust-bundle.pem",
    ]
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o755
    # A store that changed is picked up by the next publication; an older bundle used as the
    # store does not carry the session CA twice.
    os.environ["SSL_CERT_FILE"] = str(files.bundle)
    again = publish(ca, files.directory)
    assert again.roots == 2
    assert again.bundle.read_text().count("BEGIN CERTIFICATE") == 3


def test_no_system_store_falls_back_to_certifi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "none"))
    roots, source = system_roots()
    assert source.startswith("certifi ")
    assert len(roots) > 50


def test_bad_places_are_clear_errors(tmp_path: Path, system_store: list[trustme.CA]) -> None:
    ca = ensure_ca(tmp_path / "ca")
    with pytest.raises(ProxyError) as caught:
        publish(ca, tmp_path / "a\nb")
    assert caught.value.reason == "trust_error"
    assert "control characters" in caught.value.message
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ProxyError) as caught:
        publish(ca, blocker / "trust")
    assert caught.value.reason == "trust_error"
    assert str(blocker / "trust") == caught.value.source


def test_the_variables_name_the_bundle_and_the_ca_alone_for_node() -> None:
    environment = trust_environment("/t/bundle.pem", "/t/ca.pem")
    assert list(environment) == [name for name, _, _ in TRUST_VARIABLES]
    replacing = ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE"]
    replacing += ["GIT_SSL_CAINFO", "npm_config_cafile", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"]
    for name in replacing:
        assert environment[name] == "/t/bundle.pem"
    assert environment["NODE_EXTRA_CA_CERTS"] == "/t/ca.pem"


# -- `egress-proxy trust` ------------------------------------------------------------------------


def trust_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "trust", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_trust_command_prints_what_a_shell_evaluates(
    tmp_path: Path, system_store: list[trustme.CA]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"inspection:\n  ca_dir: {tmp_path / 'my ca'}\n")
    done = trust_command(tmp_path, "--config", str(config))
    assert done.returncode == 0, done.stderr
    # A path with a space survives the shell.
    show = 'printf \'%s\\n\' "$SSL_CERT_FILE" "$NODE_EXTRA_CA_CERTS"'
    shell = subprocess.run(
        ["bash", "-c", f"{done.stdout}\n{show}"], capture_output=True, text=True, timeout=30
    )
    bundle, alone = shell.stdout.splitlines()
    assert bundle == str(tmp_path / "my ca" / "trust-bundle.pem")
    assert alone == str(tmp_path / "my ca" / "session-ca.pem")
    assert Path(bundle).read_text().count("BEGIN CERTIFICATE") == 3

    env = trust_command(tmp_path, "--config", str(config), "--format", "env", "--dir",
                        str(tmp_path / "pub"))  # fmt: skip
    assert env.returncode == 0, env.stderr
    lines = dict(line.split("=", 1) for line in env.stdout.splitlines())
    assert lines["CURL_CA_BUNDLE"] == str(tmp_path / "pub" / "trust-bundle.pem")

    shown = trust_command(tmp_path, "--config", str(config), "--format", "json")
    data = json.loads(shown.stdout)
    assert data["ca_created"] is False  # the first run made it
    assert data["roots"] == 2
    assert data["environment"]["PIP_CERT"] == data["bundle"]
    assert data["readers"]["GIT_SSL_CAINFO"] == "git"


def test_trust_command_refusals(tmp_path: Path) -> None:
    disabled = tmp_path / "off.yaml"
    disabled.write_text("inspection:\n  enabled: false\n")
    done = trust_command(tmp_path, "--config", str(disabled))
    assert done.returncode == 2
    assert "inspection.enabled is false" in done.stderr
    assert "Traceback" not in done.stderr
    # trust_dir is a place for the CA's certificate: without inspection it is a config error.
    bad = tmp_path / "bad.yaml"
    bad.write_text("inspection:\n  enabled: false\n  trust_dir: /tmp/x\n")
    done = trust_command(tmp_path, "--config", str(bad))
    assert done.returncode == 2
    assert "inspection.trust_dir: at" in done.stderr and "needs inspection.enabled" in done.stderr
    assert main(["trust", "--format", "xml"]) == 2


# -- `run` with inspection.trust_dir -------------------------------------------------------------


def test_run_publishes_the_trust_dir_before_it_is_ready(
    tmp_path: Path, dns: DNSServer, system_store: list[trustme.CA]
) -> None:
    """A mounted trust directory must hold its files before the agent starts, even in a session
    that intercepts nothing yet (the CA is made for it)."""
    trust_dir = tmp_path / "trust"
    extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  trust_dir: {trust_dir}\n"
    manifest = "network:\n  egress: [example.test]\n"  # allowed whole: nothing intercepted
    with RunningProxy(tmp_path / "run", manifest, dns=dns, config_extra=extra) as proxy:
        assert (trust_dir / "trust-bundle.pem").read_text().count("BEGIN CERTIFICATE") == 3
        assert f"GIT_SSL_CAINFO={trust_dir / 'trust-bundle.pem'}" in proxy.stderr()
        assert not (trust_dir / "mitmproxy-ca.pem").exists()
