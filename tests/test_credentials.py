"""Credential injection through the real `egress-proxy run` (tests/support/running.py) with real
clients (curl; Python's urllib) against loopback upstreams that record what they receive: the
upstream of the credential's host gets the secret, the agent never sees it, and nothing else does
either (the proxy's stdout and stderr, the audit log, /metrics, /denials, the CA directory,
another upstream that got the placeholder). Each secret is a fresh uuid, searched for in every
output.

Everything talks to loopback only; the proxy uses the tests' own DNS server; every wait is
bounded."""

from __future__ import annotations

import contextlib
import signal
import ssl
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import trustme
from support.dns_server import DNSServer
from support.running import RunningProxy, curl, make_config, metric_value, wait_for
from support.tls import tls_context
from support.upstreams import OK, REDIRECT, Recorded, recording_upstream

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [api.test, other.test, plain.test]\n"
PLACEHOLDER = "EGRESS-PLACEHOLDER-api"


# -- upstreams that record ------------------------------------------------------------------


@pytest.fixture
def names(dns: DNSServer) -> DNSServer:
    for name in ("api.test", "sub.api.test", "other.test", "plain.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


# -- the proxy ------------------------------------------------------------------------------


def credential(
    *,
    name: str = "api",
    host: str = "api.test",
    header: str = "Authorization",
    source: str,
    template: str | None = "Bearer {value}",
    placeholder: str | None = PLACEHOLDER,
    plain: bool = False,
) -> str:
    """One `credentials` entry, YAML; `source` is `value_file: ...` or `value_env: ...`."""
    text = f"  - name: {name}\n    host: {host}\n    header: {header}\n    {source}\n"
    if template is not None:
        text += f'    template: "{template}"\n'
    if placeholder is not None:
        text += f"    placeholder: {placeholder}\n"
    if plain:
        text += "    allow_plain_http: true\n"
    return text


def config_text(dns: DNSServer, tmp_path: Path, ca: trustme.CA, *entries: str) -> str:
    bundle = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n"
    if entries:
        extra += "credentials:\n" + "".join(entries)
    return make_config(dns, extra=extra)


def client_bundle(tmp_path: Path, ca: trustme.CA) -> str:
    """What the agent trusts: the session CA (intercepted hosts) and the upstreams' CA
    (passthrough hosts)."""
    bundle = tmp_path / "client-bundle.pem"
    bundle.write_bytes(
        (tmp_path / "ca" / "mitmproxy-ca-cert.pem").read_bytes() + ca.cert_pem.bytes()
    )
    return str(bundle)


def secret_file(tmp_path: Path, value: str, name: str = "token") -> Path:
    path = tmp_path / "secrets" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(value + "\n")
    return path


def everything_written(proxy: RunningProxy, tmp_path: Path) -> dict[str, bytes]:
    """Every output of the proxy a secret must never reach, by name."""
    outputs = {
        "stderr": proxy.files.stderr.read_bytes(),
        "stdout": proxy.files.stdout.read_bytes(),
        "audit": proxy.files.audit.read_bytes(),
        "metrics": proxy.metrics().encode(),
        "denials": proxy.admin_get("/denials")[1].encode(),
    }
    for path in sorted((tmp_path / "ca").rglob("*")):
        if path.is_file():
            outputs[f"ca/{path.name}"] = path.read_bytes()
    return outputs


def assert_nowhere(secret: str, outputs: dict[str, bytes]) -> None:
    leaked = [name for name, data in outputs.items() if secret.encode() in data]
    assert leaked == [], f"the secret leaked into {leaked}"


@dataclass
class ApiSession:
    """A running proxy with the placeholder credential of api.test, read from `token`, and the
    recording upstream of api.test; `trust` is what its client trusts (client_bundle)."""

    proxy: RunningProxy
    port: int
    api: Recorded
    token: Path
    trust: str


@contextlib.contextmanager
def api_session(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, secret: str
) -> Iterator[ApiSession]:
    token = secret_file(tmp_path, secret)
    config = config_text(names, tmp_path, upstream_ca, credential(source=f"value_file: {token}"))
    with (
        recording_upstream(tls_context(upstream_ca, "api.test")) as (port, api),
        RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names) as proxy,
    ):
        yield ApiSession(proxy, port, api, token, client_bundle(tmp_path, upstream_ca))


def credential_lines(proxy: RunningProxy) -> list[tuple[str, str | None, str | None]]:
    """(decision, path, credential) of each request's decision line."""
    return [
        (x["decision"], x["path"], x.get("credential"))
        for x in proxy.decisions()
        if x["protocol"] in ("https", "http")
    ]


# -- tests ----------------------------------------------------------------------------------


def test_the_placeholder_becomes_the_secret_for_its_host_only(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    secret = f"tok-{uuid.uuid4().hex}"
    token = secret_file(tmp_path, secret)
    config = config_text(names, tmp_path, upstream_ca, credential(source=f"value_file: {token}"))
    api_tls = tls_context(upstream_ca, "api.test", "sub.api.test")
    with (
        recording_upstream(api_tls) as (api_port, api),
        recording_upstream(tls_context(upstream_ca, "other.test")) as (other_port, other),
        RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names) as proxy,
    ):
        trust = client_bundle(tmp_path, upstream_ca)
        sent = ("-H", f"Authorization: Bearer {PLACEHOLDER}")
        seen: list[str] = []

        def fetch(url: str, *args: str) -> int:
            result = curl(proxy.port, url, "--cacert", trust, *args)
            seen.append(repr(result))
            return result.status

        assert fetch(f"https://api.test:{api_port}/user", *sent) == 200
        # Not the placeholder exactly: passed on as sent.
        assert fetch(f"https://api.test:{api_port}/a", "-H", "Authorization: Bearer other") == 200
        assert fetch(f"https://api.test:{api_port}/b", "-H", f"Authorization: {PLACEHOLDER}") == 200
        assert fetch(f"https://api.test:{api_port}/c") == 200
        # Never a subdomain of the credential's host, never another host.
        assert fetch(f"https://sub.api.test:{api_port}/d", *sent) == 200
        assert fetch(f"https://other.test:{other_port}/e", *sent) == 200

        assert api.values("authorization") == [
            [f"Bearer {secret}"],
            ["Bearer other"],
            [PLACEHOLDER],
            [],
            [f"Bearer {PLACEHOLDER}"],
        ]
        assert other.values("authorization") == [[f"Bearer {PLACEHOLDER}"]]
        assert secret not in other.text()
        assert all(secret not in text for text in seen)
        # The allow line of the request it went into names it, and only that one.
        wait_for(lambda: len(credential_lines(proxy)) >= 4, what="the request lines")
        assert credential_lines(proxy) == [
            ("allow", "/user", "api"),
            ("allow", "/a", None),
            ("allow", "/b", None),
            ("allow", "/c", None),
        ]
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_credential_injections_total", credential="api") == 1
        # A denial for the denials feed, carrying the placeholder: still nothing of the secret.
        assert curl(proxy.port, "https://denied.test/", *sent).connect_status == 403
        assert_nowhere(secret, everything_written(proxy, tmp_path))


def test_without_a_placeholder_every_request_gets_the_header(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"key-{uuid.uuid4().hex}"
    monkeypatch.setenv("EGRESS_TEST_API_KEY", secret)  # the proxy inherits it
    entry = credential(
        header="X-Api-Key", source="value_env: EGRESS_TEST_API_KEY", template=None,
        placeholder=None,
    )  # fmt: skip
    config = config_text(names, tmp_path, upstream_ca, entry)
    with (
        recording_upstream(tls_context(upstream_ca, "api.test")) as (port, api),
        RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names) as proxy,
    ):
        trust = client_bundle(tmp_path, upstream_ca)
        # Python's urllib, through the proxy's CONNECT: a second client, and a request with
        # the agent's own values of the header (two copies), which are replaced.
        handler = urllib.request.ProxyHandler({"https": proxy.url})
        context = ssl.create_default_context(cafile=trust)
        opener = urllib.request.build_opener(handler, urllib.request.HTTPSHandler(context=context))
        request = urllib.request.Request(f"https://api.test:{port}/x")
        request.add_header("X-api-key", "agent-guess")
        with opener.open(request, timeout=10) as response:
            body = response.read()
            echoed = str(response.headers)
        assert body == OK and secret not in echoed
        result = curl(proxy.port, f"https://api.test:{port}/y", "--cacert", trust,
                      "-H", "X-Api-Key: one", "-H", "x-api-key: two")  # fmt: skip
        assert result.status == 200 and secret not in repr(result)
        assert api.values("x-api-key") == [[secret], [secret]]
        wait_for(lambda: len(credential_lines(proxy)) >= 2, what="the request lines")
        assert [c for _, _, c in credential_lines(proxy)] == ["api", "api"]
        assert_nowhere(secret, everything_written(proxy, tmp_path))


def test_requests_trusting_the_published_bundle_gets_the_credential_and_never_sees_it(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    """Python's requests, as an agent configured by the variables `run` prints: its trust is
    the bundle the proxy published (REQUESTS_CA_BUNDLE), its token the placeholder."""
    secret = f"tok-{uuid.uuid4().hex}"
    with api_session(names, tmp_path, upstream_ca, secret) as session:
        proxy, port, api = session.proxy, session.port, session.api
        bundle = tmp_path / "ca" / "trust-bundle.pem"
        assert f"REQUESTS_CA_BUNDLE={bundle}" in proxy.stderr()
        with requests.Session() as client:
            client.trust_env = False  # nothing of this machine's environment
            response = client.get(
                f"https://api.test:{port}/repos",
                headers={"Authorization": f"Bearer {PLACEHOLDER}"},
                proxies={"https": proxy.url},
                verify=str(bundle),
                timeout=10,
            )
        assert (response.status_code, response.content) == (200, OK)
        assert secret not in str(response.headers) and secret not in response.text
        assert api.values("authorization") == [[f"Bearer {secret}"]]
        wait_for(lambda: len(credential_lines(proxy)) >= 1, what="the request line")
        assert credential_lines(proxy) == [("allow", "/repos", "api")]
        assert_nowhere(secret, everything_written(proxy, tmp_path))


def test_sighup_reads_the_secret_again_and_a_failed_reload_keeps_it(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    first, second = (f"tok-{uuid.uuid4().hex}" for _ in range(2))
    with api_session(names, tmp_path, upstream_ca, first) as session:
        proxy, port, api, token, trust = (
            session.proxy, session.port, session.api, session.token, session.trust
        )  # fmt: skip
        url = f"https://api.test:{port}/"
        sent = ("--cacert", trust, "-H", f"Authorization: Bearer {PLACEHOLDER}")
        assert curl(proxy.port, url, *sent).status == 200
        token.write_text(second + "\n")  # rotated
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded:" in proxy.stderr(), what="the reload")
        assert curl(proxy.port, url, *sent).status == 200
        token.unlink()  # a reload that cannot read it: the last value stays in force
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in proxy.stderr(), what="the failed reload")
        assert curl(proxy.port, url, *sent).status == 200
        assert api.values("authorization") == [[f"Bearer {v}"] for v in (first, second, second)]
        failed = next(line for line in proxy.stderr().splitlines() if "reload failed" in line)
        assert "credentials[0].value_file" in failed and "'api'" in failed
        assert str(token) in failed and "No such file" in failed
        written = everything_written(proxy, tmp_path)
        assert_nowhere(first, written)
        assert_nowhere(second, written)


@pytest.mark.parametrize("source", ["file", "env"])
def test_start_up_fails_closed_when_a_secret_cannot_be_read(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, source: str
) -> None:
    missing = tmp_path / "secrets" / "absent"
    where = f"value_file: {missing}" if source == "file" else "value_env: EGRESS_TEST_UNSET_VAR"
    config = config_text(names, tmp_path, upstream_ca, credential(source=where))
    proxy = RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names, wait=False)
    with proxy:
        assert proxy.wait_exit() == 2
    stderr = proxy.stderr()
    assert "listening on" not in stderr
    assert "credential 'api'" in stderr
    expected = str(missing) if source == "file" else "EGRESS_TEST_UNSET_VAR is not set"
    assert expected in stderr
    assert "Traceback" not in stderr


def test_run_refuses_a_credential_for_a_host_the_policy_refuses(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    token = secret_file(tmp_path, f"tok-{uuid.uuid4().hex}")
    entry = credential(host="elsewhere.test", source=f"value_file: {token}")
    config = config_text(names, tmp_path, upstream_ca, entry)
    proxy = RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names, wait=False)
    with proxy:
        assert proxy.wait_exit() == 2
    assert "credentials[0].host" in proxy.stderr()
    assert "elsewhere.test:443" in proxy.stderr()


@pytest.mark.parametrize("plain", [False, True], ids=["not_allowed", "allow_plain_http"])
def test_plain_http_gets_it_only_when_the_entry_allows(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA, plain: bool
) -> None:
    secret = f"tok-{uuid.uuid4().hex}"
    token = secret_file(tmp_path, secret)
    entry = credential(host="plain.test", source=f"value_file: {token}", plain=plain)
    config = config_text(names, tmp_path, upstream_ca, entry)
    with (
        recording_upstream() as (port, upstream),
        RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names) as proxy,
    ):
        sent = ("-H", f"Authorization: Bearer {PLACEHOLDER}")
        result = curl(proxy.port, f"http://plain.test:{port}/p", *sent)
        assert result.status == 200 and secret not in repr(result)
        # Another host over plain HTTP: passed on unchanged either way.
        result = curl(proxy.port, f"http://other.test:{port}/o", *sent)
        assert result.status == 200
        expected = f"Bearer {secret}" if plain else f"Bearer {PLACEHOLDER}"
        assert upstream.values("authorization") == [[expected], [f"Bearer {PLACEHOLDER}"]]
        wait_for(lambda: len(credential_lines(proxy)) >= 2, what="the request lines")
        assert credential_lines(proxy) == [
            ("allow", "/p", "api" if plain else None),
            ("allow", "/o", None),
        ]
        assert_nowhere(secret, everything_written(proxy, tmp_path))


def test_an_http2_client_gets_it_too(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    """Inside interception the header is set on mitmproxy's request, whatever HTTP version the
    client spoke (curl offers h2 by ALPN; the upstream here speaks HTTP/1.1)."""
    secret = f"tok-{uuid.uuid4().hex}"
    with api_session(names, tmp_path, upstream_ca, secret) as session:
        proxy, port, api, trust = session.proxy, session.port, session.api, session.trust
        result = curl(
            proxy.port, f"https://api.test:{port}/h2", "--http2", "--cacert", trust,
            "-H", f"authorization: Bearer {PLACEHOLDER}",
        )  # fmt: skip
        assert result.status == 200 and secret not in repr(result)
        assert api.values("authorization") == [[f"Bearer {secret}"]]
        assert_nowhere(secret, everything_written(proxy, tmp_path))


def test_a_redirect_to_another_host_is_a_request_of_its_own(
    names: DNSServer, tmp_path: Path, upstream_ca: trustme.CA
) -> None:
    """The credential's host redirects elsewhere; a client that follows, resending its
    Authorization header (curl --location-trusted), sends the placeholder it holds: the other
    host gets that, decided on its own, and nothing of the secret."""
    secret = f"tok-{uuid.uuid4().hex}"
    token = secret_file(tmp_path, secret)
    config = config_text(names, tmp_path, upstream_ca, credential(source=f"value_file: {token}"))
    with (
        recording_upstream(tls_context(upstream_ca, "api.test")) as (api_port, api),
        recording_upstream(tls_context(upstream_ca, "other.test")) as (other_port, other),
        RunningProxy(tmp_path / "run", MANIFEST, config=config, dns=names) as proxy,
    ):
        trust = client_bundle(tmp_path, upstream_ca)
        target = f"https://other.test:{other_port}/landed"
        result = curl(
            proxy.port, f"https://api.test:{api_port}{REDIRECT}{target}", "-L",
            "--location-trusted", "--cacert", trust,
            "-H", f"Authorization: Bearer {PLACEHOLDER}",
        )  # fmt: skip
        assert (result.status, result.body) == (200, OK.decode()), result
        assert api.values("authorization") == [[f"Bearer {secret}"]]
        assert other.values("authorization") == [[f"Bearer {PLACEHOLDER}"]]
        assert secret not in other.text() and secret not in repr(result)
        # The other host (allowed whole, passed through) was a tunnel decided on its own name.
        wait_for(lambda: any(x["host"] == "other.test" for x in proxy.decisions()), what="its line")
        assert credential_lines(proxy) == [("allow", f"{REDIRECT}{target}", "api")]
        (tunnel,) = [x for x in proxy.decisions() if x["host"] == "other.test"]
        assert tunnel["decision"] == "allow" and "credential" not in tunnel
        assert_nowhere(secret, everything_written(proxy, tmp_path))
