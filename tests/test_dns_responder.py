"""The DNS responder of `egress-proxy run --dns-listen HOST:PORT` as a real process
(tests/running.py), asked with dnspython over UDP and TCP, v4 and v6, on loopback only. The
tests' DNS server (tests/dns_server.py) is the proxy's nameserver and logs every query it gets:
a denied name, and every type but A/AAAA, must never reach it."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import pytest
from dns import flags as dnsflags
from dns import message as dnsmessage
from dns import query as dnsquery
from dns import rcode as dnsrcode
from dns_server import DNSServer
from mitmproxy import dns as mitm_dns
from mitmproxy.connection import Client, Server
from mitmproxy.proxy import mode_specs
from proxy.l7.dns_mode import EgressDnsAddon
from running import LOOPBACK, RunningProxy, metric_value, wait_for

from proxy.cli import main

MANIFEST = "network:\n  egress: [ok.test, priv.test, gone.test, other.test]\n"
CEILING = "egress: [ok.test, priv.test, gone.test, other.test]\n"
ALLOW = ("192.0.2.0/24", "2001:db8::/32")
# mitmproxy drops a quiet UDP client after 20 s by default, and mitmproxy_rs then ignores that
# address for as long as it keeps sending (proxy/dns_mode.py): a socket quiet for longer than
# this must still be answered.
QUIET = 22.0


def dns_port(proxy: RunningProxy, host: str = LOOPBACK) -> int:
    shown = f"[{host}]" if ":" in host else host
    match = re.search(rf"dns://{re.escape(shown)}:(\d+)", proxy.stderr())
    assert match, proxy.stderr()
    return int(match[1])


def ask(
    port: int,
    name: str,
    rdtype: str = "A",
    *,
    tcp: bool = False,
    host: str = LOOPBACK,
    sock: socket.socket | None = None,
) -> dnsmessage.Message:
    query = dnsmessage.make_query(name, rdtype)
    if tcp:
        return dnsquery.tcp(query, host, port=port, timeout=5)
    return dnsquery.udp(query, host, port=port, timeout=5, sock=sock)


def addresses(response: dnsmessage.Message) -> list[str]:
    return sorted(rdata.address for rrset in response.answer for rdata in rrset)


def rcode(response: dnsmessage.Message) -> str:
    return dnsrcode.to_text(response.rcode())


def test_the_dns_responder_answers_only_what_the_policy_allows(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("ok.test", a=["192.0.2.10", "192.0.2.11"], aaaa=["2001:db8::10"])
    dns.set("priv.test", a=["10.0.0.1"])
    dns.set("other.test", a=["192.0.2.30"])
    dns.set("denied.test", a=["192.0.2.99"])
    dns.nxdomain("gone.test")
    dns.set("big.ok.test", a=[f"192.0.2.{n}" for n in range(100, 140)])
    args = ("--dns-listen", f"{LOOPBACK}:0", "--dns-listen", "[::1]:0")
    with RunningProxy(
        tmp_path, MANIFEST, ceiling=CEILING, dns=dns, allow=ALLOW, args=args
    ) as proxy:
        port, port6 = dns_port(proxy), dns_port(proxy, "::1")
        assert proxy.admin_get("/readyz")[0] == 200
        quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        quiet.bind((LOOPBACK, 0))
        quiet.setblocking(False)  # dnspython's timeout needs it
        first = ask(port, "ok.test", sock=quiet)
        quiet_since = time.monotonic()

        # Allowed A and AAAA, UDP and TCP, v4 and v6 listeners: the checked addresses.
        assert rcode(first) == "NOERROR"
        assert addresses(first) == ["192.0.2.10", "192.0.2.11"]
        assert first.answer[0].ttl <= 30
        assert addresses(ask(port, "ok.test", "AAAA", tcp=True)) == ["2001:db8::10"]
        assert addresses(ask(port6, "ok.test", host="::1")) == ["192.0.2.10", "192.0.2.11"]
        assert addresses(ask(port6, "ok.test", "AAAA", host="::1", tcp=True)) == ["2001:db8::10"]
        # Resolved once (A and AAAA together) by the proxy's resolver, then from its cache.
        assert dns.count("ok.test", "A") == 1 and dns.count("ok.test", "AAAA") == 1

        # A name outside the policy: REFUSED, whatever the type, and never asked upstream.
        for rdtype, tcp in (("A", False), ("AAAA", True), ("TXT", False), ("MX", True)):
            assert rcode(ask(port, "denied.test", rdtype, tcp=tcp)) == "REFUSED"
        assert dns.count("denied.test") == 0
        # Other types of an allowed name: no records, nothing forwarded.
        for rdtype, tcp in (("TXT", False), ("HTTPS", True), ("MX", False)):
            response = ask(port, "txt.ok.test", rdtype, tcp=tcp)
            assert (rcode(response), response.answer) == ("NOERROR", [])
        assert dns.count("txt.ok.test") == 0
        # Too big for UDP: truncated (TC, no records), complete over TCP.
        big = ask(port, "big.ok.test")
        assert big.flags & dnsflags.TC and big.answer == []
        assert len(addresses(ask(port, "big.ok.test", tcp=True))) == 40
        # A private answer is refused; NXDOMAIN stays NXDOMAIN.
        assert rcode(ask(port, "priv.test")) == "REFUSED"
        assert rcode(ask(port, "gone.test", tcp=True)) == "NXDOMAIN"
        # An IP literal as a name, a class other than IN.
        assert rcode(ask(port, "192.0.2.10")) == "REFUSED"
        chaos = dnsmessage.make_query("version.bind", "TXT", "CH")
        assert rcode(dnsquery.udp(chaos, LOOPBACK, port=port, timeout=5)) == "REFUSED"

        # Garbage and a response sent as a query: no crash, no forward; FORMERR where the
        # header could be read, and the same socket is answered afterwards.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.settimeout(5)
            raw.sendto(b"\x12\x34\x01\x00" + b"\xff" * 40, (LOOPBACK, port))
            formerr = dnsmessage.from_wire(raw.recv(4096))
            assert formerr.id == 0x1234 and formerr.rcode() == dnsrcode.FORMERR
            raw.sendto(b"\x00", (LOOPBACK, port))  # not even a header: dropped
            reply = dnsmessage.make_response(dnsmessage.make_query("ok.test", "A"))
            raw.sendto(reply.to_wire(), (LOOPBACK, port))  # QR set: never answered
            raw.settimeout(0.5)
            with pytest.raises(TimeoutError):
                raw.recv(4096)
            raw.setblocking(False)
            response = ask(port, "ok.test", sock=raw)
            assert addresses(response) == ["192.0.2.10", "192.0.2.11"]
        # On TCP, garbage ends that connection only.
        with socket.create_connection((LOOPBACK, port), timeout=5) as conn:
            conn.sendall(b"\x00\x10" + b"\xff" * 16)
            assert conn.recv(4096) == b""
        assert addresses(ask(port, "ok.test", tcp=True)) == ["192.0.2.10", "192.0.2.11"]

        # Audit lines (protocol dns, the query type in `method`) and metrics.
        wait_for(lambda: any(x["reason"] == "dns_not_a_query" for x in proxy.decisions()))
        lines = [x for x in proxy.decisions() if x["protocol"] == "dns"]
        seen = {(x["host"], x["method"], x["decision"], x["reason"]) for x in lines}
        assert ("ok.test", "A", "allow", "allowed") in seen
        assert ("denied.test", "TXT", "deny", "not_allowed") in seen
        assert ("txt.ok.test", "HTTPS", "deny", "dns_qtype_not_served") in seen
        assert ("priv.test", "A", "deny", "private") in seen
        assert ("gone.test", "A", "deny", "dns_nxdomain") in seen
        assert (None, None, "deny", "dns_malformed") in seen
        assert all(x["session"] == "test-session" and x["client"] for x in lines)
        metrics = proxy.metrics()
        assert metric_value(metrics, "egress_dns_queries_total", qtype="A", rcode="REFUSED") == 3
        assert metric_value(metrics, "egress_dns_queries_total", qtype="TXT", rcode="NOERROR") == 1
        assert metric_value(metrics, "egress_dns_queries_total", rcode="FORMERR") == 1
        # dropped: the header-less datagram, the response, the TCP garbage.
        assert metric_value(metrics, "egress_dns_queries_total", rcode="dropped") == 3
        assert metric_value(metrics, "egress_engine_loaded") == 1
        # DNS clients are not proxy connections: no connection lines or metrics of their own.
        assert proxy.closes() == []

        # SIGHUP with a narrowed ceiling: the next answers follow the new policy.
        proxy.files.ceiling.write_text("egress: [other.test]\n")
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in proxy.stderr())
        assert rcode(ask(port, "ok.test")) == "REFUSED"
        assert rcode(ask(port6, "ok.test", "AAAA", host="::1", tcp=True)) == "REFUSED"
        assert addresses(ask(port, "other.test")) == ["192.0.2.30"]
        wait_for(lambda: any(x["reason"] == "outside_ceiling" for x in proxy.decisions()))

        # The first socket, quiet for longer than mitmproxy's own UDP timeout: still answered.
        time.sleep(max(0.0, QUIET - (time.monotonic() - quiet_since)))
        assert rcode(ask(port, "other.test", sock=quiet)) == "NOERROR"
        quiet.close()
        assert dns.count("denied.test") == 0
    assert proxy.returncode == 0


def test_dns_listen_port_in_use_exits_2_naming_it(tmp_path: Path, dns: DNSServer) -> None:
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proxy = RunningProxy(
            tmp_path, MANIFEST, dns=dns, args=("--dns-listen", f"{LOOPBACK}:{port}"), wait=False
        )
        with proxy:
            assert proxy.wait_exit() == 2
        assert f"dns://{LOOPBACK}:{port}" in proxy.stderr()
        assert "Traceback" not in proxy.stderr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dns-listen", "dns.example:53"], "not an IP address"),
        (["--dns-listen", "udp://127.0.0.1:53"], "write HOST:PORT"),
        (["--dns-listen", "127.0.0.1:70000"], "port '70000'"),
        (["--dns-listen", ":5353", "--listen", "127.0.0.1:5353"], "use the same address"),
        (["--dns-listen", "127.0.0.1:0", "--dns-listen", ":0"], "give each its own port"),
    ],
)
def test_bad_dns_listen_exits_2_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "examples/agent.yaml", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


# -- the mitmproxy side, in process --------------------------------------------------------------


class ExplodingResponder:
    """A DnsResponder whose every call raises."""

    async def answer(self, *args: object) -> object:
        raise RuntimeError("boom")

    def refuse_message(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")


def dns_client(port: int = 5000, mode: str = "dns") -> Client:
    return Client(
        peername=(LOOPBACK, port),
        sockname=(LOOPBACK, 53),
        transport_protocol="udp",
        proxy_mode=mode_specs.ProxyMode.parse(mode),
    )


@pytest.mark.asyncio
async def test_an_exception_in_the_dns_hook_is_servfail_never_a_forward() -> None:
    flow = mitm_dns.DNSFlow(dns_client(), Server(address=None))
    flow.request = mitm_dns.DNSMessage.unpack(dnsmessage.make_query("ok.test", "A").to_wire())
    await EgressDnsAddon(ExplodingResponder()).dns_request(flow)  # type: ignore[arg-type]
    assert flow.response is not None
    assert flow.response.response_code == dnsrcode.SERVFAIL and flow.response.answers == []
    assert flow.server_conn.address is None  # nowhere to forward to


def test_dns_clients_beyond_the_cap_are_refused() -> None:
    addon = EgressDnsAddon(ExplodingResponder(), max_clients=1)  # type: ignore[arg-type]
    first, second, proxied = dns_client(5000), dns_client(5001), dns_client(5002, "regular")
    addon.client_connected(first)
    addon.client_connected(proxied)  # not a DNS client: not counted, not refused
    addon.client_connected(second)
    assert first.error is None and proxied.error is None
    assert second.error  # refused (and its audit line failing did not let it in)
    addon.client_disconnected(first)
    third = dns_client(5003)
    addon.client_connected(third)
    assert third.error is None
