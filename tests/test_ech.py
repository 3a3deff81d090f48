"""ECH and ESNI at the SNI gate (issue 11): a ClientHello carrying `encrypted_client_hello`
(0xfe0d) or draft ESNI (0xffce) may be served under another name than its SNI. With the operator
setting `tls.ech: allow` (the default) such a tunnel passes, its decision and close lines say
`"ech": true` and `egress_tls_ech_total` counts it; with `tls.ech: refuse` it is closed at the
gate as `ech_refused`, before the upstream receives a byte, on every plane that gates a tunnel.

Real loopback sockets throughout: the in-process front door of tests/test_frontdoor.py for
CONNECT (and its hand-off to the engine), one of our own for SOCKS5, the real `egress-proxy`
process for the config refusal and the SIGHUP reload. The hellos are built here, with the
extensions chosen (tests/test_clienthello.py's builders): a GREASE-shaped ECH extension (the
kind browsers send when the server has no ECH config), a draft-ESNI one, and a control hello
with GREASE extension types but neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from support.dns_server import DNSServer
from support.front_door import Door, opened, received, socks_door
from support.hellos import alpn_ext, records, sni_ext, vec8, vec16
from support.hellos import handshake as handshake_message
from support.hellos import hello_body as build_body
from support.in_process import Upstream, closed_by_peer, connect, serving
from support.running import RunningProxy, eventually, make_config, metric_value, wait_for
from support.tls import trusted_ca

from policy.reasons import Reason
from proxy.app.config import load_config
from proxy.cli import main
from proxy.common.errors import ProxyError
from proxy.common.settings import ECH_ALLOW, ECH_REFUSE
from proxy.decide.clienthello import ENCRYPTED_CLIENT_HELLO, ESNI, parse_client_hello
from proxy.decide.events import CloseEvent, DecisionEvent
from proxy.decide.planes import Update
from proxy.decide.sni_gate import check_hello, read_hello

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

MANIFEST = "network:\n  egress: [tls.test, up.test]\n"
REFUSE = "tls:\n  ech: refuse\n"
NO_INSPECTION = "inspection:\n  enabled: false\n"
GREASE_TYPES = (0x0A0A, 0x3A3A)  # RFC 8701 GREASE extension types: never ECH


# -- hellos --------------------------------------------------------------------------------------


def grease_ech() -> tuple[int, bytes]:
    """An `encrypted_client_hello` extension shaped as GREASE ECH (RFC 9849 §6.2): an outer
    ECHClientHello with a real HPKE suite, a random config id, a 32-byte X25519 `enc` and a
    random payload, since a server without ECH keys cannot tell it from real ECH."""
    body = b"\x00"  # ECHClientHelloType outer
    body += struct.pack("!HH", 0x0001, 0x0001)  # HKDF-SHA256, AES-128-GCM
    body += b"\x5a"  # config_id
    body += vec16(bytes(range(32)))  # enc
    body += vec16(bytes((7 * i) & 0xFF for i in range(176)))  # payload
    return ENCRYPTED_CLIENT_HELLO, body


def draft_esni() -> tuple[int, bytes]:
    """A draft-ESNI (draft-ietf-tls-esni-02..06) `encrypted_server_name` extension: cipher
    suite, key share, record digest, encrypted SNI."""
    body = struct.pack("!H", 0x1301)
    body += struct.pack("!H", 0x001D) + vec16(b"\x42" * 32)  # KeyShareEntry (x25519)
    body += vec16(b"\x24" * 32)  # record_digest
    body += vec16(b"\x99" * 260)  # encrypted_sni
    return ESNI, body


def hello(sni: str | None, *extra: tuple[int, bytes]) -> bytes:
    """A TLS 1.3 ClientHello for `sni` (None: no server_name) with `extra` extensions after
    the usual ones, as one record."""
    extensions = [
        (GREASE_TYPES[0], b""),
        *([sni_ext(sni.encode())] if sni is not None else []),
        alpn_ext(b"h2", b"http/1.1"),
        (43, vec8(b"\x03\x04\x03\x03")),  # supported_versions
        (51, vec16(b"\x00\x1d" + vec16(b"\x42" * 32))),  # key_share
        *extra,
        (GREASE_TYPES[1], b"\x00"),
    ]
    return records(handshake_message(build_body(extensions)))


HIDDEN = {"ech": grease_ech, "esni": draft_esni}


# -- the parser and the gate, without sockets ------------------------------------------------------


def test_the_parser_names_the_extension_that_hides_the_name() -> None:
    plain = parse_client_hello(hello("tls.test"))
    assert plain is not None and plain.hidden_name is None
    assert GREASE_TYPES[0] in plain.extensions  # GREASE types are listed, never taken for ECH
    for kind, build in ((ENCRYPTED_CLIENT_HELLO, grease_ech), (ESNI, draft_esni)):
        parsed = parse_client_hello(hello("tls.test", build()))
        assert parsed is not None and parsed.hidden_name == kind and parsed.sni == "tls.test"
    both = parse_client_hello(hello("tls.test", draft_esni(), grease_ech()))
    assert both is not None and both.hidden_name == ESNI  # the first in the client's order


@pytest.mark.parametrize("kind", sorted(HIDDEN))
def test_the_gate_marks_ech_and_refuses_it_only_when_told(kind: str) -> None:
    data = hello("tls.test", HIDDEN[kind]())
    allowed = check_hello(data, "tls.test")
    assert allowed is not None and allowed.refused is None and allowed.ech
    refused = check_hello(data, "tls.test", ech=ECH_REFUSE)
    assert refused is not None and refused.refused is not None and refused.ech
    assert refused.refused.reason == Reason.ECH_REFUSED == "ech_refused"
    assert refused.refused.status == 403
    assert ("ECH (0xfe0d)" if kind == "ech" else "ESNI (0xffce)") in refused.refused.message
    # The transparent listener's form of the gate (no host to compare with) refuses it too.
    transparent = read_hello(data, ech=ECH_REFUSE)
    assert transparent is not None and transparent.refused is not None
    assert (transparent.refused.reason, transparent.host) == (Reason.ECH_REFUSED, "tls.test")
    # An ordinary hello is untouched by refuse.
    plain = check_hello(hello("tls.test"), "tls.test", ech=ECH_REFUSE)
    assert plain is not None and plain.refused is None and not plain.ech


def test_the_sni_checks_come_first_and_still_mark_ech() -> None:
    mismatch = check_hello(hello("up.test", grease_ech()), "tls.test", ech=ECH_REFUSE)
    assert mismatch is not None and mismatch.refused is not None
    assert (mismatch.refused.reason, mismatch.ech) == (Reason.SNI_MISMATCH, True)
    missing = check_hello(hello(None, grease_ech()), "tls.test", ech=ECH_ALLOW)
    assert missing is not None and missing.refused is not None
    assert (missing.refused.reason, missing.ech) == (Reason.SNI_MISSING, True)


def test_lines_carry_ech_only_when_set() -> None:
    marked = json.loads(
        DecisionEvent("allow", "allowed", sni="tls.test", ech=True).line(session=None, now=0)
    )
    plain = json.loads(DecisionEvent("allow", "allowed", sni="tls.test").line(session=None, now=0))
    assert marked["ech"] is True and "ech" not in plain
    assert list(marked).index("ech") == list(marked).index("sni") + 1
    close = json.loads(CloseEvent(sni="tls.test", ech=True).line(session=None, now=0))
    assert close["ech"] is True
    assert "ech" not in json.loads(CloseEvent(sni="tls.test").line(session=None, now=0))


# -- CONNECT ------------------------------------------------------------------------------------


async def tunnel(
    door: Door, upstream: Upstream, data: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT to tls.test answered 200, then `data` sent through it."""
    status, _, reader, writer = await connect(door, f"tls.test:{upstream.port}")
    assert status == 200  # the upstream is dialled before the 200, the gate runs after it
    writer.write(data)
    await writer.drain()
    return reader, writer


def ech_count(door: Door, decision: str, protocol: str = "connect") -> float | None:
    return door.metric("egress_tls_ech_total", decision=decision, protocol=protocol)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(HIDDEN))
async def test_allow_passes_the_tunnel_and_marks_both_of_its_lines(
    dns: DNSServer, kind: str
) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    data = hello("tls.test", HIDDEN[kind]())
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        _, writer = await tunnel(door, upstream, data)
        assert await received(upstream, len(data)) == data  # relayed as sent
        writer.close()
        (close,) = await door.wait_closes(1)
    (decision,) = door.decisions()
    assert (decision["stage"], decision["decision"], decision["ech"]) == ("sni", "allow", True)
    assert decision["sni"] == "tls.test"
    assert (close["ech"], close["sni"], close["bytes_up"]) == (True, "tls.test", len(data))
    assert ech_count(door, "allow") == 1 and ech_count(door, "deny") == 0


@pytest.mark.asyncio
async def test_a_hello_without_either_extension_has_no_marker(dns: DNSServer) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    data = hello("tls.test")
    async with serving(Upstream(raw=True)) as upstream, opened(dns, REFUSE) as door:
        _, writer = await tunnel(door, upstream, data)
        assert await received(upstream, len(data)) == data  # refuse leaves plain TLS alone
        writer.close()
        (close,) = await door.wait_closes(1)
    (decision,) = door.decisions()
    assert decision["decision"] == "allow" and "ech" not in decision and "ech" not in close
    assert ech_count(door, "allow") == 0 and ech_count(door, "deny") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(HIDDEN))
async def test_refuse_closes_the_tunnel_before_any_upstream_byte(dns: DNSServer, kind: str) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    async with serving(Upstream(raw=True)) as upstream, opened(dns, REFUSE) as door:
        reader, writer = await tunnel(door, upstream, hello("tls.test", HIDDEN[kind]()))
        assert await closed_by_peer(reader)
        writer.close()
        (close,) = await door.wait_closes(1)
        await upstream.wait_closed(1)
        assert upstream.connections == 1  # dialled before the 200...
        assert upstream.received == b""  # ...and never sent a byte
    (denied,) = door.decisions()  # one decision, one line
    assert (denied["stage"], denied["decision"], denied["reason"]) == ("sni", "deny", "ech_refused")
    assert (denied["ech"], denied["sni"], denied["host"]) == (True, "tls.test", "tls.test")
    assert denied["pinned"] == ["127.0.0.1"]  # what vetting found is on the line
    assert (close["reason"], close["ech"], close["bytes_up"]) == ("ech_refused", True, 0)
    assert ech_count(door, "deny") == 1 and ech_count(door, "allow") == 0
    assert door.metric("egress_decisions_total", reason="ech_refused", stage="sni") == 1


@pytest.mark.asyncio
async def test_a_reload_changes_the_setting_for_the_next_tunnel(dns: DNSServer) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    data = hello("tls.test", grease_ech())
    async with serving(Upstream(raw=True)) as upstream, opened(dns) as door:
        _, first = await tunnel(door, upstream, data)
        assert await received(upstream, len(data)) == data
        door.door.configure(Update(config=load_config(make_config(dns, extra=REFUSE))))
        # The limits stay those of the start: only tls.ech changes while running.
        assert door.door.door.config.limits == door.config.limits
        reader, second = await tunnel(door, upstream, data)
        assert await closed_by_peer(reader)
        # Nothing must arrive: no event says so, a short wait gives a stray byte its chance.
        await asyncio.sleep(0.05)
        assert bytes(upstream.received) == data  # the second tunnel sent nothing
        first.close()
        second.close()
        await door.wait_closes(2)
    reasons = sorted(x["reason"] for x in door.decisions())
    assert reasons == ["allowed", "ech_refused"]


@pytest.mark.asyncio
async def test_an_intercepted_tunnel_carries_the_marker_into_the_engine(
    dns: DNSServer, tmp_path: Path
) -> None:
    # A host whose rules decide paths goes to the interception engine after the gate: its
    # close line is the engine's, and says `ech` too. The hello is a built one, so the
    # engine's TLS handshake fails; the lines are what is checked.
    dns.set("paths.test", a=["127.0.0.1"])
    _, bundle = trusted_ca(tmp_path)
    manifest = "schema_version = 1\n[network_access]\nallowed = ['https://paths.test/api/']\n"
    extra = f"inspection:\n  ca_dir: {tmp_path / 'ca'}\n  upstream_ca: {bundle}\n"
    async with opened(dns, extra, manifest=manifest, source="agent.toml", header_timeout=2) as door:
        status, _, _, writer = await connect(door, "paths.test:443")
        assert status == 200
        writer.write(hello("paths.test", grease_ech()))
        await writer.drain()
        await eventually(
            lambda: any(x["stage"] == "sni" for x in door.decisions()), what="the gate's line"
        )  # the gate passed, the engine has it
        writer.close()  # the engine's handshake ends with the client gone
        (close,) = await door.wait_closes(1, timeout=10)
    gate = next(x for x in door.decisions() if x["stage"] == "sni")
    assert (gate["decision"], gate["ech"]) == ("allow", True)
    assert (close["plane"], close["ech"], close["sni"]) == ("l7", True, "paths.test")
    assert ech_count(door, "allow") == 1


# -- SOCKS5 ---------------------------------------------------------------------------------------


async def socks_tunnel(port: int, upstream: int, data: bytes) -> asyncio.StreamReader:
    """A SOCKS5 CONNECT to tls.test:`upstream` that succeeded, then `data` sent through it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    name = b"tls.test"
    writer.write(b"\x05\x01\x00" + b"\x05\x01\x00\x03" + vec8(name) + struct.pack("!H", upstream))
    answer = await asyncio.wait_for(reader.readexactly(12), 5)
    assert answer[:4] == b"\x05\x00\x05\x00", answer  # greeted, then succeeded (IPv4 bound)
    writer.write(data)
    await writer.drain()
    return reader


def audit_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def socks_closes(stream: io.StringIO, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        closes = [x for x in audit_lines(stream) if x["event"] == "close"]
        if len(closes) >= count:
            return closes
        await asyncio.sleep(0.02)
    raise AssertionError(stream.getvalue())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(HIDDEN))
async def test_socks5_refuse_closes_before_any_upstream_byte(dns: DNSServer, kind: str) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    async with (
        serving(Upstream(raw=True)) as upstream,
        socks_door(dns, REFUSE + NO_INSPECTION, MANIFEST) as served,
    ):
        port, stream, metrics = served.port, served.audit, served.metrics
        reader = await socks_tunnel(port, upstream.port, hello("tls.test", HIDDEN[kind]()))
        assert await closed_by_peer(reader)
        (close,) = await socks_closes(stream, 1)
        await asyncio.sleep(0.05)  # nothing must arrive: a stray byte gets its chance
        assert upstream.connections == 1 and upstream.received == b""
    (denied,) = [x for x in audit_lines(stream) if x["event"] == "decision"]
    assert (denied["protocol"], denied["stage"], denied["reason"]) == (
        "socks5",
        "sni",
        "ech_refused",
    )
    assert denied["ech"] is True and denied["decision"] == "deny"
    assert (close["reason"], close["ech"]) == ("ech_refused", True)
    text = metrics.render()[0].decode()
    assert metric_value(text, "egress_tls_ech_total", decision="deny", protocol="socks5") == 1


@pytest.mark.asyncio
async def test_socks5_allow_passes_and_marks(dns: DNSServer) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    data = hello("tls.test", grease_ech())
    async with (
        serving(Upstream(raw=True)) as upstream,
        socks_door(dns, NO_INSPECTION, MANIFEST) as served,
    ):
        port, stream, metrics = served.port, served.audit, served.metrics
        await socks_tunnel(port, upstream.port, data)
        assert await received(upstream, len(data)) == data
    (allowed,) = [x for x in audit_lines(stream) if x["event"] == "decision"]
    (close,) = [x for x in audit_lines(stream) if x["event"] == "close"]
    assert (allowed["decision"], allowed["ech"], close["ech"]) == ("allow", True, True)
    text = metrics.render()[0].decode()
    assert metric_value(text, "egress_tls_ech_total", decision="allow", protocol="socks5") == 1


# -- the operator config -------------------------------------------------------------------------


def test_the_setting_reads_allow_or_refuse_and_defaults_to_allow() -> None:
    assert load_config("{}").tls_ech == "allow"
    assert load_config("tls:\n  ech: refuse\n").tls_ech == "refuse"
    assert load_config("tls:\n  ech: allow\n").tls_ech == "allow"
    assert load_config('{"tls": {"ech": "refuse"}}', source="c.json").tls_ech == "refuse"
    assert load_config('[tls]\nech = "refuse"\n', source="c.toml").tls_ech == "refuse"


@pytest.mark.parametrize("value", ["maybe", "Refuse", "", "null", "true", "[refuse]"])
def test_another_value_is_refused_at_its_line_and_column(value: str) -> None:
    text = f"dns:\n  timeout: 2s\ntls:\n  ech: {value}\n"
    with pytest.raises(ProxyError) as info:
        load_config(text, source="ops.yaml")
    (found,) = info.value.details
    assert (found.path, found.reason, found.line, found.column) == (
        "tls.ech",
        "invalid_value",
        4,
        3,
    )
    assert "'allow', 'refuse'" in found.message
    assert (info.value.line, info.value.column) == (4, 3)


def test_an_unknown_key_under_tls_is_named() -> None:
    with pytest.raises(ProxyError) as info:
        load_config("tls:\n  ech: allow\n  esni: refuse\n", source="ops.yaml")
    (found,) = info.value.details
    assert (found.path, found.reason, found.line, found.column) == ("tls.esni", "unknown_key", 3, 3)


def test_check_exits_2_naming_the_key_and_its_place(tmp_path: Path) -> None:
    manifest = tmp_path / "agent.yaml"
    manifest.write_text(MANIFEST)
    config = tmp_path / "config.yaml"
    config.write_text("inspection:\n  enabled: false\ntls:\n  ech: maybe\n")
    out, err = io.StringIO(), io.StringIO()
    assert main(["check", str(manifest), "--config", str(config)], out=out, err=err) == 2
    said = f"  tls.ech: at {config}:4:3: 'maybe' is not one of 'allow', 'refuse'\n"
    assert said in err.getvalue()


def test_run_exits_2_naming_the_key_and_its_place(tmp_path: Path, dns: DNSServer) -> None:
    proxy = RunningProxy(
        tmp_path, MANIFEST, dns=dns, config_extra="tls:\n  ech: maybe\n", wait=False
    )
    with proxy:
        assert proxy.wait_exit(timeout=30) == 2
    # make_config writes the dns and addresses sections first: the line is found in the file.
    line = proxy.files.config.read_text().splitlines().index("  ech: maybe") + 1
    assert line > 2
    assert f"tls.ech: at {proxy.files.config}:{line}:3: " in proxy.stderr()
    assert "'maybe' is not one of 'allow', 'refuse'" in proxy.stderr()


# -- the real process: SIGHUP ---------------------------------------------------------------


def raw_upstream() -> tuple[socket.socket, list[bytes]]:
    """A listening socket whose accepted connections' bytes are collected (by `collect`)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, []


def send_through(proxy_port: int, upstream: int, data: bytes) -> bytes:
    """CONNECT tls.test:`upstream` through the proxy, send `data`; what the proxy sent back
    after the 200 until it closed or 1 s passed."""
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=5) as sock:
        sock.sendall(f"CONNECT tls.test:{upstream} HTTP/1.1\r\nHost: tls.test\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        sock.sendall(data)
        sock.settimeout(1)
        rest = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := sock.recv(4096):
                rest += chunk
        return rest


def accept_bytes(listener: socket.socket, size: int) -> bytes:
    """The bytes of the next connection accepted on `listener`, up to `size` or its close."""
    listener.settimeout(5)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(2)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while len(data) < size and (chunk := conn.recv(65536)):
                data += chunk
        return data


def test_sighup_from_allow_to_refuse_applies_to_the_next_tunnel(
    tmp_path: Path, dns: DNSServer
) -> None:
    dns.set("tls.test", a=["127.0.0.1"])
    data = hello("tls.test", grease_ech())
    listener, _ = raw_upstream()
    upstream = listener.getsockname()[1]
    with listener, RunningProxy(tmp_path, MANIFEST, dns=dns) as proxy:
        send_through(proxy.port, upstream, data)
        assert accept_bytes(listener, len(data)) == data  # allow: relayed
        # A broken value on SIGHUP: the reload fails and the old setting stays.
        proxy.files.config.write_text(make_config(dns, extra="tls:\n  ech: maybe\n"))
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in proxy.stderr())
        assert "tls.ech" in proxy.stderr()
        proxy.files.config.write_text(make_config(dns, extra=REFUSE))
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in proxy.stderr())
        send_through(proxy.port, upstream, data)
        assert accept_bytes(listener, len(data)) == b""  # dialled, closed, sent nothing
        wait_for(lambda: len(proxy.closes()) == 2)
        metrics = proxy.metrics()
    reasons = [x["reason"] for x in proxy.decisions()]
    assert reasons == ["allowed", "ech_refused"]
    assert all(x["ech"] is True for x in proxy.audit())
    assert metric_value(metrics, "egress_tls_ech_total", decision="allow", protocol="connect") == 1
    assert metric_value(metrics, "egress_tls_ech_total", decision="deny", protocol="connect") == 1
