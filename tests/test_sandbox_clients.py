"""Real tools inside `egress-proxy sandbox` with no proxy variables (root only): curl, pip, git and
Node's built-in fetch reach a host whose rules are URL prefixes through the transparent redirect,
intercepted, trusting the session CA only through the variables the sandbox set (a bundle of the
system's roots plus the session CA), while a host allowed whole keeps its own certificate, which
the same bundle's system roots vouch for. Refusals are readable: a 403 naming the reason and the
change that would allow it.

The upstreams listen on the host side of the session's veth (bound with IP_FREEBIND before the
sandbox creates the address; the test's DNS server answers their names with it), so a client
inside the namespace dials an address that the boundary redirects, as it would a public one.
The "system roots" are the test CA: the sandbox runs with SSL_CERT_FILE naming it, which is
where OpenSSL, and so the trust bundle, takes the system store from. Skips with the reason when
not root or without a tool."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import uuid
import zipfile
from pathlib import Path

import pytest
import trustme
from support.dns_server import running_dns_server
from support.real_servers import IP_FREEBIND
from support.running import make_config
from support.sandbox import ROOT, SESSION_TIMEOUT, Session, Subnets, finished

TOOLS = {
    name: shutil.which(name)
    for name in ("ip", "nft", "curl", "bash", "setpriv", "git", "node", "python3")
}


def _system_pip() -> bool:
    python = TOOLS["python3"]
    if python is None:
        return False
    done = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, timeout=60)
    return done.returncode == 0


pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("nothing_left"),  # conftest.py: nothing of the session may be left
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a network namespace"),
    *(
        pytest.mark.skipif(path is None, reason=f"needs {name} on PATH")
        for name, path in TOOLS.items()
    ),
    pytest.mark.skipif(not _system_pip(), reason="needs pip for the system's python3"),
]


# -- the upstream world: a package index, a git repository, static files ---------------------


def tiny_wheel() -> tuple[str, bytes]:
    """A valid pure-Python wheel, built in memory."""
    name = "tinypkg-1.0-py3-none-any.whl"
    files = {
        "tinypkg/__init__.py": b"VALUE = 1\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    files["tinypkg-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return name, buffer.getvalue()


def site(root: Path) -> None:
    """/simple/tinypkg/ (PEP 503), /packages/the wheel, /repo.git (a bare repository served
    the dumb way), /hello.txt and /private/."""
    wheel_name, wheel = tiny_wheel()
    (root / "packages").mkdir()
    (root / "packages" / wheel_name).write_bytes(wheel)
    digest = hashlib.sha256(wheel).hexdigest()
    (root / "simple" / "tinypkg").mkdir(parents=True)
    (root / "simple" / "tinypkg" / "index.html").write_text(
        f'<html><body><a href="/packages/{wheel_name}#sha256={digest}">{wheel_name}</a>'
        "</body></html>\n"
    )
    (root / "hello.txt").write_text("hello from upstream\n")
    (root / "private").mkdir()
    (root / "private" / "index.html").write_text("secret\n")
    work = root.parent / "repo-work"
    git = str(TOOLS["git"])
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    for argv in (
        [git, "init", "-q", "-b", "main", str(work)],
        [git, "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "--allow-empty", "-m", "start"],
    ):  # fmt: skip
        subprocess.run(argv, check=True, env=env, timeout=60)
    (work / "README").write_text("cloned through the proxy\n")
    for argv in (
        [git, "-C", str(work), "add", "README"],
        [git, "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "-m", "readme"],
        [git, "clone", "-q", "--bare", str(work), str(root / "repo.git")],
        [git, "-C", str(root / "repo.git"), "update-server-info"],
    ):  # fmt: skip
        subprocess.run(argv, check=True, env=env, timeout=60)


class Recording(http.server.SimpleHTTPRequestHandler):
    seen: list[tuple[str, str]]  # (Host, path), set per server
    authorization: list[tuple[str, str]]  # (Host, Authorization) of the requests carrying one

    def do_GET(self) -> None:
        self.seen.append((self.headers.get("Host", ""), self.path))
        if "Authorization" in self.headers:
            self.authorization.append((self.headers["Host"], self.headers["Authorization"]))
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


class FreeBindServer(http.server.ThreadingHTTPServer):
    """Listens on an address that exists only once the sandbox has made its veth."""

    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        super().server_bind()


def serve(
    host: str, root: Path, tls: ssl.SSLContext | None
) -> tuple[FreeBindServer, list[tuple[str, str]], list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    authorization: list[tuple[str, str]] = []

    class Handler(Recording):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

    Handler.seen = seen
    Handler.authorization = authorization
    server = FreeBindServer((host, 0), Handler)
    if tls is not None:
        # The handshake in the handler's thread, not in the accepting one.
        server.socket = tls.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    serving.daemon = True
    serving.start()
    return server, seen, authorization


def test_tools_reach_an_intercepted_host_through_the_redirect_trusting_the_bundle(
    tmp_path: Path,
    shared: Path,
    subnets: Subnets,
) -> None:
    ca = trustme.CA()
    upstream_ca = shared / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(upstream_ca))
    upstream_ca.chmod(0o644)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("pypi.test", "git.test", "passthrough.test", "api.test").configure_cert(
        server_tls
    )
    root = shared / "site"
    root.mkdir()
    site(root)
    host4 = subnets.host4
    tls_server, seen, authorization = serve(host4, root, server_tls)
    plain_server, plain_seen, _ = serve(host4, root, None)
    port, plain_port = tls_server.server_address[1], plain_server.server_address[1]
    script = shared / "sandbox_clients.sh"
    shutil.copyfile(ROOT / "tests" / "support" / "sandbox_clients.sh", script)
    script.chmod(0o755)
    ca_dir = tmp_path / "proxy-ca"
    try:
        with running_dns_server() as dns:
            for name in ("pypi.test", "git.test", "passthrough.test", "plain.test", "api.test"):
                dns.set(name, a=[host4])
            # agent.toml: its entries may be URL prefixes, which decide paths.
            allowed = [
                f"https://pypi.test:{port}/simple/",
                f"https://pypi.test:{port}/packages/",
                f"https://git.test:{port}/repo.git/",
                "passthrough.test",
                "plain.test",
                "api.test",
            ]
            (tmp_path / "agent.toml").write_text(
                "schema_version = 1\n[network_access]\n"
                f"allowed = [{', '.join(f'{entry!r}' for entry in allowed)}]\n".replace("'", '"')
            )
            # A credential COMMAND never sees: only its placeholder, in API_TOKEN.
            secret = f"secret-{uuid.uuid4()}"
            (tmp_path / "api-token").write_text(secret + "\n")
            (tmp_path / "api-token").chmod(0o600)
            credentials = (
                "credentials:\n  - name: api\n    host: api.test\n    header: Authorization\n"
                f"    value_file: {tmp_path / 'api-token'}\n    template: 'Bearer {{value}}'\n"
                "    placeholder: EGRESS-PLACEHOLDER-api\n    env: API_TOKEN\n"
            )
            (tmp_path / "config.yaml").write_text(
                make_config(
                    dns,
                    allow=("127.0.0.0/8", str(subnets.subnet4)),
                    extra=f"inspection:\n  ca_dir: {ca_dir}\n  upstream_ca: {upstream_ca}\n"
                    + credentials,
                )
            )
            done = subprocess.run(
                [sys.executable, "-m", "proxy", "sandbox", str(tmp_path / "agent.toml"),
                 "--config", str(tmp_path / "config.yaml"), *subnets.args(), "--user", "nobody",
                 "--status-file", str(tmp_path / "status.json"),
                 "--audit-log", str(tmp_path / "audit.jsonl"), "--",
                 str(TOOLS["bash"]), str(script), str(port), str(plain_port),
                 str(shared / "work"), str(ca_dir)],
                cwd=ROOT, capture_output=True, text=True, timeout=SESSION_TIMEOUT * 2,
                stdin=subprocess.DEVNULL,
                # The "system" store the bundle is made of: the upstreams' CA.
                env={**os.environ, "SSL_CERT_FILE": str(upstream_ca)},
            )  # fmt: skip
    finally:
        tls_server.shutdown()
        plain_server.shutdown()
    session: Session = finished(tmp_path, done)
    logs = "".join(
        f"\n{p.name}:\n{p.read_text(errors='replace')}" for p in (shared / "work").glob("*.log")
    )
    diagnostics = f"stdout:\n{session.stdout}\nstderr:\n{session.stderr}{logs}"
    assert session.returncode == 0, diagnostics
    results = session.lines()
    assert "done" in results, diagnostics

    # The sandbox said what it set, and COMMAND got exactly that: the bundle for the tools that
    # replace their store, the CA alone for Node; two public files, never the key.
    assert "trust bundle" in session.stderr and "NODE_EXTRA_CA_CERTS" in session.stderr
    trust = results["trust"]
    bundle = trust["ssl_cert_file"]
    assert bundle.endswith("/trust-bundle.pem")
    assert trust["pip"] == trust["git"] == trust["curl"] == trust["requests"] == bundle
    assert trust["npm"] == bundle
    assert trust["node"] == str(Path(bundle).parent / "session-ca.pem")
    assert trust["files"] == "session-ca.pem,trust-bundle.pem,"
    assert results["read_key"]["rc"] != "0"
    assert not Path(bundle).parent.exists()  # removed with the session

    # curl: intercepted and allowed, intercepted and refused with the reason and the remedy,
    # and a passthrough host under its own certificate.
    assert results["curl_index"] == {"rc": "0", "code": "200", "denied": "none"}, diagnostics
    assert results["curl_denied"] == {"rc": "0", "code": "403", "denied": "path_not_allowed"}
    body = (shared / "work" / "curl_denied.body").read_text()
    assert f"pypi.test:{port} denied: path_not_allowed" in body
    # The change that would allow it, in the manifest's own grammar.
    assert f"add 'https://pypi.test:{port}/private/' to network_access.allowed" in body
    assert results["curl_passthrough"] == {"rc": "0", "code": "200", "denied": "none"}
    # pip and git through the intercepted hosts, trusting only what the sandbox set.
    assert results["pip"] == {"rc": "0", "files": "tinypkg-1.0-py3-none-any.whl,"}, diagnostics
    assert results["git"] == {"rc": "0", "readme": "cloned_through_the_proxy"}, diagnostics
    # Node's fetch (which ignores proxy variables): intercepted, refused, and plain HTTP.
    assert results["node_intercepted"]["code"] == "200", diagnostics
    assert results["node_denied"]["code"] == "403", diagnostics
    assert results["node_denied"]["denied"] == "path_not_allowed"
    assert results["node_plain"] == {
        "rc": "0", "code": "200", "denied": "none", "body": "hello_from_upstream"
    }  # fmt: skip

    # The credential: COMMAND had the placeholder only; the upstream of its host got the secret,
    # and nothing COMMAND or the sandbox printed carries it.
    assert results["api"] == {"rc": "0", "code": "200", "denied": "none"}, diagnostics
    assert results["env"]["api_token"] == "EGRESS-PLACEHOLDER-api"
    assert authorization == [(f"api.test:{port}", f"Bearer {secret}")]
    for output in (session.stdout, session.stderr, logs, (tmp_path / "audit.jsonl").read_text()):
        assert secret not in output
    assert [x["credential"] for x in session.audit if x.get("credential")] == ["api"]

    # The upstream saw only allowed paths, each for its own name; /private/ never left.
    assert not [path for _, path in seen if path.startswith("/private")]
    names = ("pypi.test", "git.test", "passthrough.test", "api.test")
    assert {host for host, _ in seen} == {f"{name}:{port}" for name in names}
    assert plain_seen == [(f"plain.test:{plain_port}", "/hello.txt")]
    # Interception is the l7 plane's; the passthrough host was relayed, not intercepted.
    intercepted = {x["host"] for x in session.audit if x["event"] == "close" and x["plane"] == "l7"}
    assert intercepted == {"pypi.test", "git.test", "api.test"}  # a credential's host: always
    gates = {x["host"] for x in session.audit if x.get("stage") == "sni"}
    assert "passthrough.test" in gates
