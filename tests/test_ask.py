"""Asking a person (`egress-proxy run --ask`): a refusal a manifest entry would lift is held on
its plane until someone answers on the admin listener with the token; everything else is decided
as ever. The real `egress-proxy run` process (tests/support/running.py), the tests' own DNS
server, and real clients (curl, requests, dnspython) on loopback only; a harness answers
through the API, a person is simulated on `egress-proxy ask`'s terminal. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme
from dns import message as dnsmessage
from dns import query as dnsquery
from dns import rcode as dnsrcode
from support.dns_server import DNSServer
from support.running import (
    CURL,
    LOOPBACK,
    ROOT,
    CurlResult,
    RunningProxy,
    curl,
    http_upstream,
    metric_value,
    wait_for,
)
from support.tls import tls_context
from support.upstreams import TLS_BODY, TLSUpstream, recording_upstream, tls_upstream

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [allowed.test]\n"
HOSTS = ("allowed.test", "asked.test", "tls.test", "other.test", "cut.test")
# Long enough for a harness to answer on a loaded machine; the timeout test sets its own.
ASK_TIMEOUT = "limits:\n  ask_timeout: 20s\n"

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for host in HOSTS:
        dns.set(host, a=[LOOPBACK])
    return dns


def asking(
    tmp_path: Path,
    dns: DNSServer,
    *,
    manifest: str = MANIFEST,
    extra: str = ASK_TIMEOUT,
    args: tuple[str, ...] = (),
    ceiling: str | None = None,
    listen: str = f"{LOOPBACK}:0",
) -> RunningProxy:
    token = tmp_path / "ask-token"
    return RunningProxy(
        tmp_path / "proxy",
        manifest,
        dns=dns,
        ceiling=ceiling,
        config_extra=extra,
        listen=listen,
        args=("--ask", "--ask-token", str(token), *args),
    )


def token_of(proxy: RunningProxy) -> str:
    return (Path(proxy.directory).parent / "ask-token").read_text().strip()


def admin(proxy: RunningProxy, path: str) -> Any:
    status, body = proxy.admin_get(path)
    assert status == 200, (path, status, body)
    return json.loads(body)


def post(
    proxy: RunningProxy,
    path: str,
    body: bytes,
    *,
    token: str | None = "",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """POST to the admin listener: (status, JSON body or text). `token=""`: the proxy's own."""
    request = urllib.request.Request(
        f"http://{LOOPBACK}:{proxy.admin_port}{path}", data=body, method="POST"
    )
    request.add_header("Content-Type", "application/json")
    if token == "":
        token = token_of(proxy)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def answer(proxy: RunningProxy, ask: str, decision: str) -> tuple[int, Any]:
    return post(proxy, f"/asks/{ask}", json.dumps({"decision": decision}).encode())


def wait_asks(proxy: RunningProxy, count: int = 1, held: int = 1) -> list[dict[str, Any]]:
    """The pending asks, once there are `count` with `held` connections on the first."""
    found: list[dict[str, Any]] = []

    def ready() -> bool:
        nonlocal found
        found = admin(proxy, "/asks")["asks"]
        return len(found) >= count and found[0]["held"] >= held

    wait_for(ready, 15, f"{count} ask(s) with {held} held")
    return found


def later(work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    return _pool.submit(work)


def curl_later(proxy: RunningProxy, url: str, *args: str) -> concurrent.futures.Future[CurlResult]:
    return later(lambda: curl(proxy.port, url, *args, timeout=30))


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[TLSUpstream]:
    with tls_upstream(tmp_path) as upstream:
        yield upstream


def https_later(
    proxy: RunningProxy, tls: TLSUpstream, path: str = "/"
) -> concurrent.futures.Future[CurlResult]:
    url = f"https://tls.test:{tls.port}{path}"
    return curl_later(proxy, url, "--cacert", str(tls.ca_file))


def test_allow_once_lets_the_held_connect_through_and_asks_again(
    tmp_path: Path, dns: DNSServer, tls: TLSUpstream
) -> None:
    with asking(tmp_path, dns) as proxy:
        held = https_later(proxy, tls)
        (ask,) = wait_asks(proxy)
        assert ask["host"] == "tls.test" and ask["port"] == tls.port
        assert ask["path"] is None and ask["protocol"] == "connect" and ask["plane"] == "l4"
        assert ask["reason"] == "not_allowed" and ask["entry"] == "tls.test"
        assert ask["held"] == 1 and ask["since"].endswith("Z")
        assert tls.snapshot()[0] == 0  # nothing went upstream while held
        status, done = answer(proxy, ask["id"], "allow-once")
        assert status == 200 and done["decision"] == "allow-once" and done["grant"] is None
        assert done["ask"]["id"] == ask["id"]
        result = held.result(30)
        assert (result.connect_status, result.body) == (200, TLS_BODY.decode()), result
        assert admin(proxy, "/asks")["asks"] == []
        # Once: the next connection is asked again.
        again = https_later(proxy, tls)
        (second,) = wait_asks(proxy)
        assert second["id"] != ask["id"]
        assert answer(proxy, second["id"], "deny")[0] == 200
        refused = again.result(30)
        assert refused.connect_status == 403
        assert refused.headers.get("x-egress-denied", "").startswith("ask_denied")
        lines = [line for line in proxy.audit() if line["event"] == "ask"]
        assert [line["action"] for line in lines] == ["asked", "answered", "asked", "answered"]
        allow = [d for d in proxy.decisions() if d["decision"] == "allow"]
        assert allow and allow[0]["rule"] == f"ask:{ask['id']}"
        denied = [d for d in proxy.decisions() if d["decision"] == "deny"]
        assert denied[-1]["reason"] == "ask_denied"
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_asks_total", outcome="allow-once") == 1
        assert metric_value(metrics, "egress_asks_total", outcome="deny") == 1


def test_allow_session_answers_every_held_connection_and_later_ones(
    tmp_path: Path, dns: DNSServer, tls: TLSUpstream
) -> None:
    with asking(tmp_path, dns) as proxy:
        # Two clients, one question: one ask, both held on it.
        first, second = https_later(proxy, tls), https_later(proxy, tls, "/two")
        (ask,) = wait_asks(proxy, held=2)
        assert ask["held"] == 2
        status, done = answer(proxy, ask["id"], "allow-session")
        assert status == 200 and done["grant"]["entry"] == "tls.test"
        for held in (first, second):
            assert held.result(30).body == TLS_BODY.decode()
        # Later connections, on any port of the host, pass without asking.
        assert https_later(proxy, tls).result(30).body == TLS_BODY.decode()
        assert admin(proxy, "/asks")["asks"] == []
        (grant,) = admin(proxy, "/grants")["grants"]
        assert set(grant) == {"entry", "host", "port", "path", "decision", "ask", "time"}
        assert grant["decision"] == "allow-session" and grant["ask"] == ask["id"]
        assert grant["host"] == "tls.test" and grant["entry"] == "tls.test"
        allows = [d for d in proxy.decisions() if d["decision"] == "allow"]
        assert [d["rule"] for d in allows] == ["session.grants[0]"] * 3
        actions = [line["action"] for line in proxy.audit() if line["event"] == "ask"]
        assert actions == ["asked", "answered", "granted"]
        # A reload keeps the grant.
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in proxy.stderr(), 15, "the reload")
        assert admin(proxy, "/grants")["grants"] == [grant]
        assert https_later(proxy, tls).result(30).body == TLS_BODY.decode()
        assert metric_value(proxy.metrics(), "egress_asks_total", outcome="allow-session") == 1
        # suggest turns the session's lines into a manifest that allows what it saw.
        found = subprocess.run(
            [sys.executable, "-m", "proxy", "suggest", "--json", str(proxy.files.audit)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert found.returncode == 0, found.stderr
        assert [e["entry"] for e in json.loads(found.stdout)["entries"]] == ["tls.test"]


def test_deny_session_refuses_identical_questions_without_asking(
    tmp_path: Path, dns: DNSServer, tls: TLSUpstream
) -> None:
    with asking(tmp_path, dns) as proxy:
        held = https_later(proxy, tls)
        (ask,) = wait_asks(proxy)
        assert answer(proxy, ask["id"], "deny-session")[0] == 200
        assert held.result(30).connect_status == 403
        again = curl(proxy.port, f"https://tls.test:{tls.port}/", "--cacert", str(tls.ca_file))
        assert again.connect_status == 403
        assert again.headers["x-egress-denied"].startswith("ask_denied")
        assert admin(proxy, "/asks")["asks"] == []
        denied = [d for d in proxy.decisions() if d["decision"] == "deny"]
        assert [d["rule"] for d in denied] == ["session.grants[0]"] * 2
        assert admin(proxy, "/grants")["grants"][0]["decision"] == "deny-session"


def test_nobody_answers_timeout(tmp_path: Path, dns: DNSServer, tls: TLSUpstream) -> None:
    with asking(tmp_path, dns, extra="limits:\n  ask_timeout: 1s\n") as proxy:
        started = time.monotonic()
        result = https_later(proxy, tls).result(30)
        assert result.connect_status == 403, result
        assert result.headers["x-egress-denied"].startswith("ask_timeout")
        assert 0.9 < time.monotonic() - started < 15
        assert tls.snapshot()[0] == 0
        actions = [line["action"] for line in proxy.audit() if line["event"] == "ask"]
        assert actions == ["asked", "timeout"]
        assert metric_value(proxy.metrics(), "egress_asks_total", outcome="timeout") == 1


def test_overloaded_refuses_without_asking(tmp_path: Path, dns: DNSServer) -> None:
    extra = "limits:\n  ask_timeout: 20s\n  max_asks: 1\n"
    with asking(tmp_path, dns, extra=extra) as proxy:
        held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
        (ask,) = wait_asks(proxy)
        over = curl(proxy.port, "https://other.test/")
        assert over.connect_status == 403
        assert over.headers["x-egress-denied"].startswith("ask_overloaded")
        assert answer(proxy, ask["id"], "deny")[0] == 200
        assert held.result(30).connect_status == 403
        assert metric_value(proxy.metrics(), "egress_asks_total", outcome="overloaded") == 1


def test_never_asked(tmp_path: Path, dns: DNSServer) -> None:
    manifest = "network:\n  egress: [allowed.test, cut.test]\n"
    ceiling = "egress: [allowed.test, asked.test]\n"
    with asking(tmp_path, dns, manifest=manifest, ceiling=ceiling) as proxy:
        for url, reason in (
            ("https://cut.test/", "outside_ceiling"),  # declared, cut by the ceiling
            ("https://other.test/", "not_allowed"),  # undeclared, outside the ceiling
            ("https://127.0.0.2/", "ip_literal"),
            ("https://printer.local/", "internal_name"),
        ):
            result = curl(proxy.port, url)
            assert result.connect_status == 403, url
            assert result.headers["x-egress-denied"].startswith(reason), url
        assert admin(proxy, "/asks")["asks"] == []
        assert not [line for line in proxy.audit() if line["event"] == "ask"]


def test_the_answer_needs_the_token_an_id_and_a_body(tmp_path: Path, dns: DNSServer) -> None:
    with asking(tmp_path, dns) as proxy:
        held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
        (ask,) = wait_asks(proxy)
        path = f"/asks/{ask['id']}"
        good = json.dumps({"decision": "deny"}).encode()
        assert post(proxy, path, good, token=None)[0] == 401
        assert post(proxy, path, good, token="not-the-token-at-all")[0] == 401
        assert (
            post(proxy, path, good, token=None, headers={"Authorization": "Basic eA=="})[0] == 401
        )
        assert post(proxy, "/asks/0123456789abcdef", good)[0] == 404
        assert post(proxy, "/asks/../../etc", good)[0] == 404
        for body in (
            b"",
            b"not json",
            b"[]",
            b'{"decision": "yes"}',
            b'{"decision": "deny", "more": 1}',
            b'{"decision": ["deny"]}',
            b"[" * 900,
            b'{"decision": "deny"}' + b" " * 5000,
        ):
            status, reply = post(proxy, path, body)
            assert status == 400 and "error" in reply, body[:40]
        # Still pending after all of that; GET /asks stays open without the token.
        assert [a["id"] for a in admin(proxy, "/asks")["asks"]] == [ask["id"]]
        status, _ = proxy.admin_get(path)
        assert status == 405
        assert post(proxy, path, good)[0] == 200
        assert post(proxy, path, good)[0] == 404  # answered: no longer pending
        assert held.result(30).connect_status == 403
        assert "Traceback" not in proxy.stderr()


def test_the_stream_says_each_new_ask(tmp_path: Path, dns: DNSServer) -> None:
    with asking(tmp_path, dns) as proxy:
        events: list[dict[str, Any]] = []

        def listen() -> None:
            with socket.create_connection((LOOPBACK, proxy.admin_port), timeout=20) as sock:
                sock.sendall(b"GET /asks/stream HTTP/1.1\r\nHost: x\r\n\r\n")
                seen = b""
                while b"\ndata: " not in seen or not seen.endswith(b"\n\n"):
                    chunk = sock.recv(4096)
                    assert chunk, seen
                    seen += chunk
                head, _, body = seen.partition(b"\r\n\r\n")
                assert b"Content-Type: text/event-stream" in head
                events.append(json.loads(body.split(b"data: ", 1)[1]))

        # Whichever comes first, the stream or the ask: a new subscriber is sent the pending
        # asks first, so no wait is needed here.
        stream = later(listen)
        held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
        stream.result(20)
        (ask,) = wait_asks(proxy)
        assert events[0]["id"] == ask["id"] and events[0]["host"] == "asked.test"
        assert set(events[0]) == set(ask)
        answer(proxy, ask["id"], "deny")
        held.result(30)


def test_socks5_and_plain_http_are_held_and_answered(
    tmp_path: Path, dns: DNSServer, tls: TLSUpstream
) -> None:
    with (
        http_upstream() as upstream,
        asking(tmp_path, dns, args=("--listen", f"socks5://{LOOPBACK}:0")) as proxy,
    ):
        socks_port = _socks_port(proxy)
        socks = later(
            lambda: subprocess.run(
                [CURL, "-sS", "--max-time", "30", "--socks5-hostname", f"{LOOPBACK}:{socks_port}",
                 "--cacert", str(tls.ca_file), f"https://tls.test:{tls.port}/"],
                capture_output=True, text=True, timeout=40,
            )
        )  # fmt: skip
        (ask,) = wait_asks(proxy)
        assert ask["protocol"] == "socks5"
        answer(proxy, ask["id"], "allow-once")
        assert socks.result(40).stdout == TLS_BODY.decode()
        # Plain HTTP, through requests: held before it is forwarded.
        url = f"http://asked.test:{upstream.port}/plain"
        proxies = {"http": f"http://{LOOPBACK}:{proxy.port}"}
        plain = later(lambda: requests.get(url, proxies=proxies, timeout=30))
        (ask,) = wait_asks(proxy)
        assert ask["protocol"] == "http" and ask["host"] == "asked.test"
        assert upstream.requests == []
        answer(proxy, ask["id"], "allow-session")
        response = plain.result(30)
        assert response.status_code == 200 and upstream.requests == ["/plain"]


def _socks_port(proxy: RunningProxy) -> int:
    found = re.search(r"socks5://127\.0\.0\.1:(\d+)", proxy.stderr())
    assert found, proxy.stderr()
    return int(found[1])


def test_a_dns_query_is_held_and_answered(tmp_path: Path, dns: DNSServer) -> None:
    with asking(tmp_path, dns, args=("--dns-listen", f"{LOOPBACK}:0")) as proxy:
        dns_port = _dns_port(proxy)
        query = dnsmessage.make_query("asked.test", "A")
        reply = later(lambda: dnsquery.udp(query, LOOPBACK, port=dns_port, timeout=20))
        (ask,) = wait_asks(proxy)
        assert ask["protocol"] == "dns" and ask["port"] is None
        answer(proxy, ask["id"], "allow-once")
        response = reply.result(30)
        assert response.rcode() == dnsrcode.NOERROR
        assert [r.address for rrset in response.answer for r in rrset] == [LOOPBACK]
        refused = later(lambda: dnsquery.udp(query, LOOPBACK, port=dns_port, timeout=20))
        (ask,) = wait_asks(proxy)
        answer(proxy, ask["id"], "deny")
        assert refused.result(30).rcode() == dnsrcode.REFUSED


def _dns_port(proxy: RunningProxy) -> int:
    found = re.search(r"dns(?:://| on )?127\.0\.0\.1:(\d+)", proxy.stderr())
    assert found, proxy.stderr()
    return int(found[1])


def test_a_reload_decides_held_connections_and_grants_never_pass_the_ceiling(
    tmp_path: Path, dns: DNSServer
) -> None:
    ceiling = "egress: [allowed.test, asked.test, other.test]\n"
    with asking(tmp_path, dns, ceiling=ceiling) as proxy:
        granted = curl_later(proxy, "https://other.test/", "--max-time", "30")
        (ask,) = wait_asks(proxy)
        answer(proxy, ask["id"], "allow-session")
        granted.result(30)
        held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
        wait_asks(proxy)
        proxy.files.ceiling.write_text("egress: [allowed.test]\n")  # narrowed
        proxy.send_signal(signal.SIGHUP)
        result = held.result(30)
        assert result.connect_status == 403
        assert result.headers["x-egress-denied"].startswith("not_allowed")
        assert admin(proxy, "/asks")["asks"] == []
        # The grant is kept, but the ceiling now refuses the host: no grant passes it.
        assert len(admin(proxy, "/grants")["grants"]) == 1
        after = curl(proxy.port, "https://other.test/")
        assert after.connect_status == 403 and admin(proxy, "/asks")["asks"] == []
        actions = [line["action"] for line in proxy.audit() if line["event"] == "ask"]
        assert actions[-1] == "reconsidered"


def test_a_client_that_goes_away_is_forgotten(tmp_path: Path, dns: DNSServer) -> None:
    with asking(tmp_path, dns) as proxy:
        client = subprocess.Popen(
            [CURL, "-sS", "-x", f"http://{LOOPBACK}:{proxy.port}", "https://asked.test/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            (ask,) = wait_asks(proxy)
        finally:
            client.kill()
            client.wait(10)
        wait_for(lambda: admin(proxy, "/asks")["asks"][0]["held"] == 0, 10, "held 0")
        closes = proxy.closes()
        assert closes and closes[-1]["reason"] == "client_closed"
        # The ask stays for a person to answer (a grant helps the client's retry).
        assert answer(proxy, ask["id"], "allow-session")[0] == 200


def test_ask_forbidden_and_token_files(tmp_path: Path, dns: DNSServer) -> None:
    forbidden = asking(tmp_path / "f", dns, extra="ask: forbid\n")
    forbidden.wait = False
    with forbidden:
        assert forbidden.wait_exit() == 2
    assert "forbidden" in forbidden.stderr() and "'ask'" in forbidden.stderr()
    assert "listening" not in forbidden.stderr()
    (tmp_path / "f").mkdir(exist_ok=True)
    assert not (tmp_path / "f" / "ask-token").exists()  # refused before anything was made
    # Created 0600 with a fresh token before the proxy is ready.
    with asking(tmp_path / "c", dns) as proxy:
        token = tmp_path / "c" / "ask-token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token_of(proxy)) >= 32
        assert proxy.admin_get("/readyz") == (200, "ready\nask: true\n")
    # A file group or others can read is refused, with a clear message.
    (tmp_path / "o").mkdir()
    loose = tmp_path / "o" / "ask-token"
    loose.write_text("a-token-others-can-read-0123456789\n")
    loose.chmod(0o644)
    refused = asking(tmp_path / "o", dns)
    refused.wait = False
    with refused:
        assert refused.wait_exit() == 2
    assert "chmod 600" in refused.stderr() and "Traceback" not in refused.stderr()
    for flags in (("--ask",), ("--ask", "--learn", "--ask-token", str(loose))):
        result = subprocess.run(
            [sys.executable, "-m", "proxy", "run", "m.yaml", *flags],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr, flags


def test_a_person_answers_on_the_ask_terminal(
    tmp_path: Path, dns: DNSServer, tls: TLSUpstream
) -> None:
    with asking(tmp_path, dns) as proxy:
        prompt = subprocess.Popen(
            [sys.executable, "-m", "proxy", "ask", "--admin", f"{LOOPBACK}:{proxy.admin_port}",
             "--token", str(tmp_path / "ask-token")],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1,
        )  # fmt: skip
        assert prompt.stdin is not None and prompt.stdout is not None
        try:
            results = []
            for key, expected in (("y", 200), ("n", 403), ("a", 200)):
                held = https_later(proxy, tls)
                line = prompt.stdout.readline()
                while "ask " not in line:  # the prompt and the "answer y, a, n or N" come first
                    assert line, "the prompt ended"
                    line = prompt.stdout.readline()
                assert "tls.test" in line and "not_allowed" in line and "entry: tls.test" in line
                prompt.stdin.write("what?\n")  # not an answer: asked again
                prompt.stdin.write(key + "\n")
                results.append((held.result(30).connect_status, expected))
            assert all(got == want for got, want in results), results
            # `a` made a grant: no more asks for tls.test; N for another host.
            assert https_later(proxy, tls).result(30).connect_status == 200
            held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
            wait_asks(proxy)
            prompt.stdin.write("N\n")
            assert held.result(30).connect_status == 403
            decisions = [g["decision"] for g in admin(proxy, "/grants")["grants"]]
            assert decisions == ["allow-session", "deny-session"]
            prompt.stdin.close()
            assert prompt.wait(20) == 0
        finally:
            if prompt.poll() is None:
                prompt.kill()
                prompt.wait(10)


def test_the_ask_terminal_speaks_json(tmp_path: Path, dns: DNSServer) -> None:
    with asking(tmp_path, dns) as proxy:
        held = curl_later(proxy, "https://asked.test/", "--max-time", "30")
        wait_asks(proxy)
        result = subprocess.run(
            [sys.executable, "-m", "proxy", "ask", "--admin", f"{LOOPBACK}:{proxy.admin_port}",
             "--token", str(tmp_path / "ask-token"), "--json"],
            cwd=ROOT, input="n\n", capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        ask, outcome = (json.loads(line) for line in result.stdout.splitlines())
        assert ask["host"] == "asked.test" and outcome["status"] == 200
        assert held.result(30).connect_status == 403
        bad = subprocess.run(
            [sys.executable, "-m", "proxy", "ask", "--admin", f"{LOOPBACK}:{proxy.admin_port}",
             "--token", str(tmp_path / "missing")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_inside_interception_a_request_is_held_on_its_path(tmp_path: Path, dns: DNSServer) -> None:
    ca = trustme.CA()
    upstream_ca = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(upstream_ca))
    dns.set("paths.test", a=[LOOPBACK])
    with recording_upstream(tls_context(ca, "paths.test")) as (port, seen):
        manifest = f"network_access:\n  allowed: ['https://paths.test:{port}/api/']\n"
        extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {upstream_ca}\n"
        with asking(tmp_path, dns, manifest=manifest, extra=ASK_TIMEOUT + extra) as proxy:
            trust = tmp_path / "client.pem"
            trust.write_bytes((tmp_path / "ca" / "session-ca.pem").read_bytes())
            url = f"https://paths.test:{port}/other/x"
            held = curl_later(proxy, url, "--cacert", str(trust))
            (ask,) = wait_asks(proxy)
            assert (ask["plane"], ask["protocol"], ask["path"]) == ("l7", "https", "/other/")
            assert ask["reason"] == "path_not_allowed"
            assert ask["entry"] == f"https://paths.test:{port}/other/"
            assert seen.heads == []
            assert answer(proxy, ask["id"], "allow-session")[0] == 200
            assert held.result(30).status == 200
            # The grant is the URL prefix: inside it passes, outside it is asked again.
            inside = curl(proxy.port, f"https://paths.test:{port}/other/y", "--cacert", str(trust))
            assert inside.status == 200 and admin(proxy, "/asks")["asks"] == []
            (grant,) = admin(proxy, "/grants")["grants"]
            assert grant["path"] == "/other/" and grant["entry"] == ask["entry"]
    assert [line.split()[1] for line, _ in seen.heads] == ["/other/x", "/other/y"]
