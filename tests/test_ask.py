"""Asking a person (`egress-proxy run --ask`): a refusal a manifest entry would lift is held on
its plane until someone answers on the admin listener with the token; everything else is decided
as ever. The real `egress-proxy run` process (tests/running.py), the tests' own DNS server, and
real clients (curl, requests, dnspython) on loopback only; a harness answers through the API, a
person is simulated on `egress-proxy ask`'s terminal. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dns_server import DNSServer
from running import (
    LOOPBACK,
    CurlResult,
    RunningProxy,
    curl,
    metric_value,
    wait_for,
)
from test_clients import TLS_BODY, TLSUpstream, tls_upstream

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
