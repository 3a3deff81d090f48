"""The denial feed: the ring (proxy/ops/denials.py) fed by the audit log, `/denials` on the
admin listener over real sockets, and the feed of the real `egress-proxy run` process next to
its audit lines (a denied CONNECT, a denied plain-HTTP request, a DNS responder refusal).
Everything talks to loopback only; the proxy's nameserver is the tests' own DNS server."""

from __future__ import annotations

import asyncio
import io
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from dns import message as dnsmessage
from dns import query as dnsquery
from dns import rcode as dnsrcode
from support.admin import all_ready
from support.dns_server import DNSServer
from support.running import LOOPBACK, RunningProxy, curl, http_upstream, wait_for

from proxy.decide.events import MAX_FIELD, CloseEvent, DecisionEvent
from proxy.ops.admin import AdminServer
from proxy.ops.audit import AuditLog
from proxy.ops.denials import Denials

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

FIELDS = ("seq", "time", "host", "port", "reason", "rule", "message", "plane", "protocol")
# The fields an entry shares with its audit line (all but `seq`).
SHARED = FIELDS[1:]


def deny(host: str, **fields: Any) -> DecisionEvent:
    fields.setdefault("reason", "not_allowed")
    fields.setdefault("port", 443)
    fields.setdefault("plane", "l4")
    fields.setdefault("protocol", "connect")
    fields.setdefault("message", f"{host} is not in the allowed list")
    return DecisionEvent("deny", host=host, **fields)


def seqs(page: dict[str, Any]) -> list[int]:
    return [entry["seq"] for entry in page["denials"]]


# ---- the ring


def test_audit_log_feeds_every_denial_and_no_allow() -> None:
    ring = Denials()
    out = io.StringIO()
    log = AuditLog(stream=out, session="s", denials=ring, clock=lambda: 1_700_000_000.1234)
    log.decision(DecisionEvent("allow", "allowed", host="ok.test", port=443, plane="l4"))
    log.decision(deny("no.test", rule="network.egress[0]", stage="name"))
    log.closed(CloseEvent(host="ok.test", port=443, plane="l4", reason="client_closed"))
    log.decision(deny("ip.test", reason="address_denied", port=80, protocol="http"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    denied = [line for line in lines if line.get("decision") == "deny"]
    page = ring.page()
    assert seqs(page) == [1, 2] and page["next"] == 3 and "dropped" not in page
    assert set(page["denials"][0]) == set(FIELDS)
    # Each entry shows what its audit line shows, its time included.
    for entry, line in zip(page["denials"], denied, strict=True):
        assert {key: entry[key] for key in SHARED} == {key: line[key] for key in SHARED}
    assert page["denials"][0]["time"] == "2023-11-14T22:13:20.123Z"
    assert page["denials"][0]["rule"] == "network.egress[0]"


def test_a_denial_whose_write_fails_is_still_in_the_ring(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", denials=(ring := Denials()))
    log.close()  # every later write fails (counted), the denial still happened
    log.decision(deny("no.test"))
    assert log.write_errors == 1 and seqs(ring.page()) == [1]


def test_ring_is_bounded_and_pages_by_since() -> None:
    ring = Denials(capacity=5, per_request=3)
    assert ring.page() == {"denials": [], "next": 0}
    for n in range(1, 9):
        ring.add(deny(f"h{n}.test"), 1_700_000_000.0 + n)
    assert len(ring) == 5 and ring.next_seq == 9  # seqs 1-3 dropped, 4-8 kept
    # From the start: what is left, capped per request, and how many were dropped.
    first = ring.page(0)
    assert seqs(first) == [4, 5, 6] and first["next"] == 7 and first["dropped"] == 3
    assert [entry["host"] for entry in first["denials"]] == ["h4.test", "h5.test", "h6.test"]
    # `next` continues exactly after the last entry returned.
    second = ring.page(first["next"])
    assert seqs(second) == [7, 8] and second["next"] == 9 and "dropped" not in second
    # Nothing new: nothing, and the same `since` to ask with.
    assert ring.page(9) == {"denials": [], "next": 9}
    # Dropped counts only the denials from `since` on that left the ring.
    assert ring.page(2)["dropped"] == 2 and seqs(ring.page(2)) == [4, 5, 6]
    assert "dropped" not in ring.page(4) and seqs(ring.page(4)) == [4, 5, 6]
    assert seqs(ring.page(6)) == [6, 7, 8]
    # A `since` beyond anything assigned (e.g. kept across a restart): next is the next seq.
    assert ring.page(2**63) == {"denials": [], "next": 9}
    # The next denial is what `since=next` then returns.
    ring.add(deny("h9.test"), 1_700_000_100.0)
    assert seqs(ring.page(9)) == [9] and ring.page(9)["next"] == 10
    assert len(ring) == 5
    with pytest.raises(ValueError):
        ring.page(-1)
    with pytest.raises(ValueError):
        Denials(capacity=0)


@pytest.mark.parametrize(
    "host", ["a\nb.test", "\u2028x.test", "\x1b[31mred", "\u00e9\U0001f600.test", 'q"\\.test']
)
def test_client_hosts_stay_valid_ascii_json(host: str) -> None:
    ring = Denials()
    ring.add(deny(host, message=f"{host} is not allowed"), 1.0)
    body = ring.render()
    assert body.isascii() and body.endswith(b"\n") and body.count(b"\n") == 1
    entry = json.loads(body)["denials"][0]
    assert entry["host"] == host and entry["message"] == f"{host} is not allowed"


def test_long_values_are_capped_and_a_full_page_stays_bounded() -> None:
    ring = Denials()
    huge = "\U0001f600" * 5000  # escapes to 12 bytes a character
    for _ in range(1500):
        ring.add(deny(huge, message=huge, rule=huge), 1.0)
    body = ring.render()
    page = json.loads(body)
    assert len(page["denials"]) == 200 and page["next"] == 701 and page["dropped"] == 500
    entry = page["denials"][0]
    assert entry["host"] == huge[:MAX_FIELD] and len(entry["message"]) == MAX_FIELD
    # 200 entries of three capped fields each, whatever the clients sent.
    assert len(body) < 200 * (3 * MAX_FIELD * 12 + 500)


def test_text_values_are_written_as_the_audit_line_writes_them() -> None:
    ring = Denials()
    ring.add(DecisionEvent("deny", "not_allowed", host=b"b\xffytes", port="junk"), 1.0)  # type: ignore[arg-type]
    entry = ring.page()["denials"][0]
    assert entry["host"] == "b\\xffytes" and entry["port"] == "junk"
    assert entry["rule"] is None and entry["plane"] is None


# ---- /denials on the admin listener


def no_metrics() -> tuple[bytes, str]:
    return b"", "text/plain; version=0.0.4; charset=utf-8"


class Admin:
    def __init__(self, server: AdminServer, ring: Denials, port: int) -> None:
        self.server, self.ring, self.port = server, ring, port

    async def request(self, target: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        """One raw request over a real socket: (status, headers, body)."""
        reader, writer = await asyncio.open_connection(LOOPBACK, self.port)
        try:
            writer.write(f"{method} {target} HTTP/1.1\r\nHost: admin\r\n\r\n".encode())
            writer.write_eof()
            async with asyncio.timeout(5):
                response = await reader.read()
        finally:
            writer.close()
        head, _, body = response.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(lines[0].split(" ")[1]), headers, body


@pytest_asyncio.fixture
async def admin() -> AsyncIterator[Admin]:
    ring = Denials(capacity=10, per_request=4)
    for n in range(1, 13):
        ring.add(deny(f"h{n}.test"), 1_700_000_000.0 + n)
    server = AdminServer(all_ready(), no_metrics, denials=ring)
    _, port = await server.start(LOOPBACK, 0)
    try:
        yield Admin(server, ring, port)
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_denials_endpoint_pages_the_ring(admin: Admin) -> None:
    status, headers, body = await admin.request("/denials")
    assert status == 200 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body) and headers["connection"] == "close"
    page = json.loads(body)
    assert seqs(page) == [3, 4, 5, 6] and page["next"] == 7 and page["dropped"] == 2
    assert page == admin.ring.page(0)
    page = json.loads((await admin.request(f"/denials?since={page['next']}"))[2])
    assert seqs(page) == [7, 8, 9, 10] and page["next"] == 11 and "dropped" not in page
    # The empty query, leading zeros, the largest since, an absolute-form target.
    assert json.loads((await admin.request("/denials?"))[2]) == admin.ring.page(0)
    assert seqs(json.loads((await admin.request("/denials?since=0011"))[2])) == [11, 12]
    assert json.loads((await admin.request(f"/denials?since={2**63}"))[2])["denials"] == []
    status, _, body = await admin.request("http://admin/denials?since=12")
    assert status == 200 and seqs(json.loads(body)) == [12]
    # HEAD: the headers of the GET, no body.
    status, headers, body = await admin.request("/denials?since=3", "HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "query",
    [
        "since=-1",
        "since=abc",
        "since=1e3",
        "since=" + "1" * 30,
        f"since={2**63 + 1}",
        "since=",
        "since=1&since=2",
        "since=%31",
        "since=+1",
        "since=1&x=2",
        "from=1",
        "SINCE=1",
    ],
)
async def test_bad_since_is_400_with_a_json_error(admin: Admin, query: str) -> None:
    status, headers, body = await admin.request(f"/denials?{query}")
    assert status == 400 and headers["content-type"] == "application/json"
    # One of two fixed texts: nothing of the request is echoed back.
    assert json.loads(body)["error"] in {
        "bad request: the only parameter is since=SEQ",
        "bad request: since must be at most 2**63",
    }


@pytest.mark.asyncio
async def test_other_paths_and_methods(admin: Admin) -> None:
    for path in ("/denials/", "/denials/1", "/Denials", "/denial"):
        assert (await admin.request(path))[0] == 404
    status, headers, _ = await admin.request("/denials", "POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    # The other endpoints still ignore a query string.
    assert (await admin.request("/healthz?since=abc"))[0] == 200


@pytest.mark.asyncio
async def test_without_a_ring_denials_is_404() -> None:
    server = AdminServer(all_ready(), no_metrics)
    _, port = await server.start(LOOPBACK, 0)
    try:
        status, _, _ = await Admin(server, Denials(), port).request("/denials")
        assert status == 404
    finally:
        await server.stop()


@pytest.mark.asyncio
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_denials_with_curl(admin: Admin) -> None:
    process = await asyncio.create_subprocess_exec(
        "curl", "--noproxy", "*", "-sS", "--max-time", "5", "-w", "\n%{http_code}",
        f"http://{LOOPBACK}:{admin.port}/denials?since=9",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, err
    body, _, code = out.decode().rpartition("\n")
    assert code == "200" and seqs(json.loads(body)) == [9, 10, 11, 12]


# ---- the real `egress-proxy run`

MANIFEST = "network:\n  egress: [up.test]\n"


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    dns.set("up.test", a=["127.0.0.1"])
    dns.set("denied.test", a=["127.0.0.1"])
    return dns


def feed(proxy: RunningProxy, since: int | None = None) -> dict[str, Any]:
    status, body = proxy.admin_get("/denials" if since is None else f"/denials?since={since}")
    assert status == 200, body
    return json.loads(body)


def denied_lines(proxy: RunningProxy) -> list[dict[str, Any]]:
    return [line for line in proxy.decisions() if line["decision"] == "deny"]


def shared(entries: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [tuple(entry[key] for key in SHARED) for entry in entries]


def test_the_running_proxy_feeds_its_denials(tmp_path: Path, dns: DNSServer) -> None:
    args = ("--dns-listen", f"{LOOPBACK}:0")
    with http_upstream() as upstream, RunningProxy(tmp_path, MANIFEST, dns=dns, args=args) as proxy:
        found = re.search(rf"dns://{re.escape(LOOPBACK)}:(\d+)", proxy.stderr())
        assert found, proxy.stderr()
        dns_port = int(found[1])
        # Allowed traffic (plain HTTP and a DNS answer) is never in the feed.
        assert curl(proxy.port, f"http://up.test:{upstream.port}/").status == 200
        ok = dnsquery.udp(dnsmessage.make_query("up.test", "A"), LOOPBACK, port=dns_port, timeout=5)
        assert dnsrcode.to_text(ok.rcode()) == "NOERROR"
        assert feed(proxy) == {"denials": [], "next": 0}

        # A denied CONNECT, a denied plain-HTTP request, a refused DNS query.
        assert curl(proxy.port, "https://denied.test/").connect_status == 403
        assert curl(proxy.port, f"http://denied.test:{upstream.port}/x").status == 403
        refused = dnsquery.udp(
            dnsmessage.make_query("dns-denied.test", "A"), LOOPBACK, port=dns_port, timeout=5
        )
        assert dnsrcode.to_text(refused.rcode()) == "REFUSED"
        wait_for(lambda: len(denied_lines(proxy)) == 3, what="three deny audit lines")

        page = feed(proxy)
        assert seqs(page) == [1, 2, 3] and page["next"] == 4 and "dropped" not in page
        # One entry per deny audit line, in order, with the same fields and time.
        lines = denied_lines(proxy)
        assert shared(page["denials"]) == shared(lines)
        seen = [(e["host"], e["port"], e["plane"], e["protocol"]) for e in page["denials"]]
        assert seen == [
            ("denied.test", 443, "l4", "connect"),
            ("denied.test", upstream.port, "l4", "http"),
            ("dns-denied.test", None, "l4", "dns"),  # a DNS question names no port
        ]
        assert all(e["reason"] == "not_allowed" for e in page["denials"])
        assert all(e["message"].startswith(e["host"]) for e in page["denials"])
        assert not any(e["host"] == "up.test" for e in page["denials"])

        # Nothing new until the next denial, which is then all `since=next` returns.
        assert feed(proxy, 4) == {"denials": [], "next": 4}
        assert curl(proxy.port, f"http://up.test:{upstream.port}/again").status == 200
        assert feed(proxy, 4) == {"denials": [], "next": 4}
        assert curl(proxy.port, "http://other.test/").status == 403
        page = feed(proxy, 4)
        assert seqs(page) == [4] and page["next"] == 5
        assert shared(page["denials"]) == shared(denied_lines(proxy)[3:])
        assert page["denials"][0]["host"] == "other.test"
