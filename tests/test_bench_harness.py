"""The benchmark harness's own logic (benchmarks/harness/, its loadgen.c, benchmarks/bench.py): what
a user of its report relies on. Peer configurations are checked by the peers themselves (a real
start and a CONNECT through each, allowed and denied); the C load generator is built and drives a
handful of tunnels (direct, CONNECT, SOCKS5), bulk transfers and HTTPS requests against small
servers on loopback; egress-proxy's configurations are checked by its own CLI, and one is run with
every client of the harness; the statistics and the targets on known samples; the HTTP verification
on made-up wrk results; a missing peer is a note and not an error, and a report renders from a run
with holes in it. No timing is asserted. Peers that are not installed are skipped with the harness's
own note, and the C tests without gcc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from support.running import tcp_server

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# The harness is the package benchmarks.harness, imported from the repository root (not on
# sys.path under a bare `pytest`).
sys.path.insert(0, str(ROOT))
from benchmarks.harness import (  # noqa: E402
    attributed,
    context,
    egress,
    http_bench,
    loadgen,
    peers,
    profiling,
    report,
    stats,
    summary,
    targets,
)
from benchmarks.harness import main as bench  # noqa: E402

GREETING = b"hello from upstream"
# egress-proxy's bytecode, cached where the harness keeps it (gitignored): a start is not a compile.
PYCACHE = BENCHMARKS / "results" / "tmp" / "pycache"


@pytest.fixture
def upstream() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that greets every connection and closes it."""
    with tcp_server(lambda conn: conn.sendall(GREETING)) as port:
        yield port


def available(name: str) -> Any:
    status = peers.peer_status(name)
    if not status.available:
        pytest.skip(status.note)
    return status


def connect_through(port: int, host: str, upstream: int) -> bytes:
    """CONNECT host:upstream through the proxy on `port`; everything it answers until close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            f"CONNECT {host}:{upstream} HTTP/1.1\r\nHost: {host}:{upstream}\r\n\r\n".encode()
        )
        data = b""
        try:
            while len(data) < 65536 and GREETING not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
                # A refusal may keep the connection open (squid): its head is the answer.
                if b"\r\n\r\n" in data and data.split(b" ", 2)[1:2] != [b"200"]:
                    break
        except TimeoutError:
            pass
    return data


# -- peer configurations, checked by the peers ------------------------------------------------


@pytest.mark.parametrize("name", ["tinyproxy", "privoxy", "squid"])
def test_peer_allow_list_admits_the_test_domain_and_refuses_others(
    name: str, upstream: int, tmp_path: Path
) -> None:
    status = available(name)
    hosts_before = Path("/etc/hosts").read_text()
    tmp_path.chmod(0o755)
    peer = peers.start_peer(status, tmp_path / name, ["bench.test"], probe_port=upstream)
    try:
        assert peer.first_connect_s is not None and peer.first_connect_s >= peer.ready_s > 0
        allowed = connect_through(peer.port, "bench.test", upstream)
        assert allowed.split(b"\r\n", 1)[0].split(b" ")[1] == b"200", allowed[:200]
        assert GREETING in allowed
        denied = connect_through(peer.port, "denied.test", upstream)
        assert denied.split(b"\r\n", 1)[0].split(b" ")[1] == b"403", denied[:200]
        assert GREETING not in denied
        # The harness reads CPU and memory of this one pid: the peer must not fork helpers.
        assert bench.proc.descendants(peer.pid) == []
    finally:
        assert peer.stop() is not None
    # The private /etc/hosts was the peer's alone.
    assert Path("/etc/hosts").read_text() == hosts_before


def test_mitmdump_passes_tunnels_through(upstream: int, tmp_path: Path) -> None:
    status = available("mitmdump")
    peer = peers.start_peer(status, tmp_path / "mitmdump", ["bench.test"])
    try:
        assert GREETING in connect_through(peer.port, "bench.test", upstream)
    finally:
        peer.stop()


def test_squid_parses_its_generated_configuration(tmp_path: Path) -> None:
    status = available("squid")
    conf = tmp_path / "squid.conf"
    conf.write_text(peers.squid_config(3128, tmp_path / "hosts", ["bench.test"], "proxy"))
    done = subprocess.run(
        [status.binary, "-k", "parse", "-f", str(conf)], capture_output=True, text=True, timeout=30
    )
    # `squid -k parse` exits 0 even for unknown directives: read what it says.
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    for bad in ("unrecognized", "ERROR", "FATAL", "WARNING"):
        assert bad not in said, said
    conf.write_text(conf.read_text() + "no_such_directive on\n")
    done = subprocess.run(
        [status.binary, "-k", "parse", "-f", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert "unrecognized" in done.stdout + done.stderr


def minimal_run(tmp_path: Path, **changes: Any) -> Any:
    """A Run with what the HTTP and DNS workloads read; the rest unused."""
    fields = dict(
        settings=context.QUICK, workloads=["http"], tmp=tmp_path, dns=None, loadgen=None,
        upstream={}, targets=tmp_path / "none", env=dict(os.environ), statuses={}, egress={},
        base_config={},
    )  # fmt: skip
    return context.Run(**{**fields, **changes})


def test_nginx_origin_counts_requests_and_wrk_goes_through_the_proxy(
    tmp_path: Path, upstream: int
) -> None:
    nginx, wrk, squid = available("nginx"), available("wrk"), available("squid")
    tmp_path.chmod(0o755)
    origin, tls = peers.start_origin(nginx.binary, tmp_path / "origin", 64)
    assert tls is None
    proxy = peers.start_peer(squid, tmp_path / "squid", ["bench.test"])
    try:
        run = minimal_run(tmp_path, origin=origin, wrk=wrk.binary)
        result = http_bench.http_workload(run, proxy)
        assert result["requests"] > 0
        assert result["keep_alive"] is True
        assert http_bench.http_problems(result) == []
        assert result["proxy_cpu_s"] > 0  # the proxy did the work
        # A request the origin never sees through the proxy: the count check would catch it.
        assert peers.origin_requests(origin.port) >= result["origin_requests"] > 0
    finally:
        proxy.stop()
        origin.stop()


# -- the C load generator ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> Any:
    try:
        return loadgen.build()
    except loadgen.Unavailable as exc:
        pytest.skip(f"the C load generator cannot be built here: {exc}")


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Bytes from a to b until EOF, then b's write side closed."""
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)


def tiny_proxy(conn: socket.socket) -> None:
    """A CONNECT and SOCKS5 proxy of the test's own, to 127.0.0.1 only, at the port named."""
    first = conn.recv(3)
    if first[:1] == b"\x05":  # SOCKS5: no authentication, then CONNECT to a domain name
        conn.sendall(b"\x05\x00")
        head = conn.recv(5)
        rest = conn.recv(head[4] + 2)
        port = struct.unpack("!H", rest[-2:])[0]
    else:
        head = first
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        port = int(head.split(b" ")[1].rpartition(b":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as target:
        conn.sendall(
            b"\x05\x00\x00\x01\x7f\x00\x00\x01" + struct.pack("!H", port)
            if first[:1] == b"\x05"
            else b"HTTP/1.1 200 Connection established\r\n\r\n"
        )
        up = threading.Thread(target=_relay, args=(conn, target), daemon=True)
        up.start()
        _relay(target, conn)
        up.join(30)


def phase(command: list[str], tmp_path: Path, pids: dict[str, int]) -> dict[str, Any]:
    result, cpu = loadgen.run_phase(command, pids, 60, tmp_path / "client.txt")
    assert set(cpu) == {f"{who}_cpu_s" for who in pids}
    return result


@pytest.mark.parametrize("proxy", ["none", "connect", "socks5"])
def test_the_c_client_completes_tunnels_and_bulk(built: Any, tmp_path: Path, proxy: str) -> None:
    hosts = ["bench.test", "other.bench.test"]
    target_file = loadgen.write_targets(tmp_path / "targets.bin", hosts)
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(loadgen.upstream(built, tmp_path / "upstream.txt"))
        relay = None if proxy == "none" else stack.enter_context(tcp_server(tiny_proxy))
        tunnels = loadgen.client_args(built, "tunnels", target_file, up["tunnel"], proxy, relay)
        tunnels += ["--concurrency", "4", "--count", "40", "--seconds", "20", "--warmup", "2"]
        result = phase(tunnels, tmp_path, {"upstream": up["pid"]})
        assert result["done"] == 40 and result["errors"] == 0, result["first_errors"]
        assert len(result["latencies_us"]) == 40 and min(result["latencies_us"]) > 0
        for direction in ("up", "down"):
            bulk = loadgen.client_args(built, "bulk", target_file, up["bulk"], proxy, relay)
            bulk += ["--concurrency", "2", "--bytes", str(3 << 20), "--direction", direction]
            result = phase([*bulk, "--seconds", "20"], tmp_path, {"upstream": up["pid"]})
            assert result["first_errors"] == [] and result["bytes"] == 3 << 20


def test_the_c_client_reports_refused_tunnels(built: Any, tmp_path: Path) -> None:
    """A proxy that refuses every CONNECT: the warm-up fails with the reason, nothing hangs."""
    target_file = loadgen.write_targets(tmp_path / "targets.bin", ["bench.test"])
    refuse = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"
    with (
        loadgen.upstream(built, tmp_path / "upstream.txt") as up,
        tcp_server(lambda conn: (conn.recv(4096), conn.sendall(refuse))) as port,
    ):
        command = loadgen.client_args(built, "tunnels", target_file, up["tunnel"], "connect", port)
        with pytest.raises(RuntimeError, match="refused"):
            loadgen.run_phase([*command, "--warmup", "1"], {}, 30, tmp_path / "client.txt")
        # Without a warm-up the phase runs and counts the refusals as errors.
        result = phase([*command, "--count", "5", "--warmup", "0"], tmp_path, {})
        assert result["done"] == 0 and result["errors"] == 5


@pytest.mark.parametrize("proxy", ["none", "connect", "socks5"])
def test_the_c_client_sends_an_opaque_first_flight(built: Any, tmp_path: Path, proxy: str) -> None:
    """The opaque workload's tunnels: an SSH identification line, not a ClientHello, to the
    upstream's opaque port, which answers once it has read the whole line."""
    target_file = loadgen.write_targets(
        tmp_path / "opaque.bin", ["bench.test"], flight=loadgen.SSH_FLIGHT
    )
    assert target_file.read_bytes() == b"\x00\x0abench.test\x00\x0f" + loadgen.SSH_FLIGHT
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(loadgen.upstream(built, tmp_path / "upstream.txt"))
        assert len({up["tunnel"], up["opaque"], up["bulk"]}) == 3
        relay = None if proxy == "none" else stack.enter_context(tcp_server(tiny_proxy))
        command = loadgen.client_args(built, "tunnels", target_file, up["opaque"], proxy, relay)
        command += ["--concurrency", "3", "--count", "30", "--seconds", "20", "--warmup", "2"]
        result = phase(command, tmp_path, {"upstream": up["pid"]})
        assert result["done"] == 30 and result["errors"] == 0, result["first_errors"]
        # Nothing before the end of the line; the ready byte once it is there.
        with socket.create_connection(("127.0.0.1", up["opaque"]), timeout=5) as sock:
            sock.sendall(loadgen.SSH_FLIGHT[:-2])
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(1)
            sock.settimeout(5)
            sock.sendall(b"\r\n")
            assert sock.recv(1) == b"R"


def test_the_c_client_connects_to_loopback_addresses_only(built: Any, tmp_path: Path) -> None:
    target_file = loadgen.write_targets(tmp_path / "t.bin", ["bench.test"])
    base = loadgen.client_args(built, "tunnels", target_file, 9, "none", None)
    for address in ("10.0.0.1", "192.168.1.1", "::1", "127.0.0"):
        done = subprocess.run(
            [*base, "--address", address], capture_output=True, text=True, timeout=10
        )
        assert done.returncode == 2 and "127.0.0.0/8" in done.stderr, (address, done.stderr)


def test_the_attributed_workload_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attributed.os, "geteuid", lambda: 1000)
    assert "needs root" in (attributed.unavailable() or "")
    rules = attributed.nft_rules("127.0.0.5", 15001)
    # root's connections (the proxy's own, direct's) to the upstream; everyone else's to the
    # transparent listener; nothing but that loopback address is touched.
    assert "meta skuid 0 redirect\n" in rules and "redirect to :15001" in rules
    assert rules.count("ip daddr 127.0.0.5") == 2 and "daddr" not in rules.replace(
        "ip daddr 127.0.0.5", ""
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a network namespace")
def test_attributed_connections_in_a_namespace_are_attributed_by_dns(built: Any) -> None:
    """The attributed workload, small: egress-proxy's transparent listener in a namespace of the
    harness's, an SSH first flight attributed by its DNS answer and TLS decided on its SNI, and
    direct's client to the same address; the audit log says how each was attributed."""
    if (why := attributed.unavailable()) is not None:
        pytest.skip(why)
    sys.path.insert(0, str(BENCHMARKS.parent / "tests"))
    small = dataclasses.replace(
        context.QUICK, warmup=2, latency_count=5, latency_s=5.0, rate_count=20, rate_s=5.0,
        concurrency=(2,),
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-test-") as name:
        tmp = Path(name)
        tmp.chmod(0o755)  # the client runs as nobody and reads its targets here
        run = context.Run(
            settings=small,
            workloads=["attributed"],
            tmp=tmp,
            dns=None,
            loadgen=built,
            upstream={},
            targets=loadgen.write_targets(tmp / "t.bin", ["bench.test"]),
            opaque_targets=loadgen.write_targets(
                tmp / "o.bin", ["bench.test"], flight=loadgen.SSH_FLIGHT
            ),
            env=egress.proxy_env(PYCACHE),
            statuses={},
            egress={"egress-proxy": egress.BUILTIN["egress-proxy"]},
            base_config=egress.base_config(("127.0.0.1", 53), tmp / "ca", None),
            log=lambda _: None,
        )
        with attributed.namespace(built, tmp / "namespace") as inside:
            run.namespace = inside
            results = {
                config: attributed.attributed_workload(run, config, tmp / config)
                for config in ("direct", "egress-proxy")
            }
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert inside.name not in names  # removed
    assert run.problems == []
    for config, result in results.items():
        assert result["address"] == attributed.ADDRESS
        for kind in ("ssh", "tls"):
            assert [result[kind][level]["tunnels"] for level in ("1", "2")] == [5, 20], config
    audit = results["egress-proxy"]["audit"]
    # The warm-ups (2 before the first phase, 10 before the others) and the phases: each by DNS.
    assert audit["close ssh dns"] == 2 + 5 + 10 + 20
    assert audit["close tls sni"] == 2 + 5 + 10 + 20
    # Measured (from /proc, in clock ticks: 20 tunnels may take less than one, so 0 is a value).
    cpu = results["egress-proxy"]["ssh"]["2"]["proxy_cpu_us_per_tunnel"]
    assert isinstance(cpu, int | float) and cpu >= 0


def test_the_opaque_check_is_a_ratio_within_rounds() -> None:
    def sample(config: str, n: int, tls: float, opaque: float, **more: Any) -> dict[str, Any]:
        cpu = lambda v: {"16": {"proxy_cpu_us_per_tunnel": v}}  # noqa: E731
        return {"config": config, "round": n, "tunnels": cpu(tls), "opaque": cpu(opaque), **more}

    attributed_sample = {"ssh": {"16": {"proxy_cpu_us_per_tunnel": 150.0}},
                         "tls": {"16": {"proxy_cpu_us_per_tunnel": 300.0}}}  # fmt: skip
    main = {
        "egress-proxy": [
            sample("egress-proxy", 0, 200.0, 180.0, attributed=attributed_sample),
            sample("egress-proxy", 1, 400.0, 440.0),
        ],
        "squid": [sample("squid", 0, 100.0, 90.0), sample("squid", 1, 100.0, 110.0)],
    }
    checks = summary.opaque_checks(main, {"egress-proxy": egress.BUILTIN["egress-proxy"]})
    row = checks["egress-proxy"]
    assert row["opaque_vs_tls"] == pytest.approx((0.9 + 1.1) / 2)
    assert row["opaque_vs_squid"] == pytest.approx((2.0 + 4.0) / 2)
    assert row["attributed_vs_sni"] == pytest.approx(0.5)
    assert row["attributed_vs_connect_tls"] == pytest.approx(0.75)
    assert row["socks5_opaque_vs_tls"] is None
    assert "squid" not in checks  # only egress-proxy configurations are judged
    text = "\n".join(report.opaque_check_section(checks))
    assert "**1.00x** (goal <= 1.0x: met)" in text and "squid: 3.00x" in text


def https_origin(cert: Any, chunked: bool) -> Any:
    """A TLS server answering every request on a connection (keep-alive) with 200 and `ok`."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)

    def handle(conn: socket.socket) -> None:
        with server_context.wrap_socket(conn, server_side=True) as tls:
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    chunk = tls.recv(4096)
                    if not chunk:
                        return
                    buffered += chunk
                head, _, buffered = buffered.partition(b"\r\n\r\n")
                assert head.startswith(b"GET /api/x HTTP/1.1\r\nHost: bench.test:")
                if chunked:
                    tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"1\r\no\r\n1\r\nk\r\n0\r\n\r\n")  # fmt: skip
                else:
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    return tcp_server(handle)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_c_client_makes_https_requests_through_a_tunnel(
    built: Any, tmp_path: Path, chunked: bool
) -> None:
    if not built.tls:
        pytest.skip(built.note)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    target_file = loadgen.write_targets(tmp_path / "t.bin", ["bench.test"], hello=False)
    with (
        https_origin(ca.issue_cert("bench.test"), chunked) as origin,
        tcp_server(tiny_proxy) as relay,
    ):
        for requests, done in ((1, 6), (50, 100)):
            command = loadgen.client_args(built, "https", target_file, origin, "connect", relay)
            command += ["--ca", str(tmp_path / "ca.pem"), "--path", "/api/x", "--requests"]
            command += [
                str(requests),
                "--concurrency",
                "2",
                "--count",
                str(6 if requests == 1 else 2),
            ]
            result = phase([*command, "--seconds", "20", "--warmup", "1"], tmp_path, {})
            assert result["errors"] == 0, result["first_errors"]
            assert result["requests"] == done and len(result["latencies_us"]) == done


def test_the_https_client_refuses_a_certificate_it_cannot_verify(
    built: Any, tmp_path: Path
) -> None:
    if not built.tls:
        pytest.skip(built.note)
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "other-ca.pem"))
    target_file = loadgen.write_targets(tmp_path / "t.bin", ["bench.test"], hello=False)
    with https_origin(trustme.CA().issue_cert("bench.test"), False) as origin:
        command = loadgen.client_args(built, "https", target_file, origin, "none", None)
        command += ["--ca", str(tmp_path / "other-ca.pem"), "--warmup", "1", "--path", "/api/x"]
        with pytest.raises(RuntimeError, match="TLS handshake"):
            loadgen.run_phase(command, {}, 30, tmp_path / "client.txt")


def test_the_load_generator_is_rebuilt_only_when_its_source_changes(built: Any) -> None:
    stamp = json.loads((loadgen.BUILD / "loadgen.stamp").read_text())
    before = loadgen.BINARY.stat().st_mtime_ns
    again = loadgen.build()
    assert again == built and loadgen.BINARY.stat().st_mtime_ns == before
    assert stamp["tls"] is built.tls


def test_without_gcc_the_harness_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing is found on it
    with pytest.raises(loadgen.Unavailable, match="apt-get install gcc"):
        loadgen.build()


# -- egress-proxy through its CLI -------------------------------------------------------------


def test_egress_configs_are_checked_by_the_proxy_under_test(tmp_path: Path) -> None:
    base = egress.base_config(("127.0.0.1", 53), tmp_path / "ca", None)
    env = egress.proxy_env(tmp_path / "pycache")
    default = egress.BUILTIN["egress-proxy"]
    egress.write_inputs(tmp_path / "default", default, base, None)
    assert egress.unsupported(default, tmp_path / "default", env) is None
    future = egress.EgressConfig(
        "future", "a key no egress-proxy has", default.manifest, "agent.yaml",
        {"inspection": {"no_such_key": True}},
    )  # fmt: skip
    egress.write_inputs(tmp_path / "future", future, base, None)
    why = egress.unsupported(future, tmp_path / "future", env)
    assert why is not None and "no_such_key" in why
    flag = egress.EgressConfig("flag", "", default.manifest, "agent.yaml", {}, ("--no-such-flag",))
    egress.write_inputs(tmp_path / "flag", flag, base, None)
    assert "--no-such-flag" in (egress.unsupported(flag, tmp_path / "flag", env) or "")


def test_a_baseline_tree_runs_its_own_code(tmp_path: Path) -> None:
    """--baseline-tree: the other checkout's packages are the ones its launcher imports, and
    the proxy there is asked what it accepts (a copy of this checkout, here)."""
    root = BENCHMARKS.parent
    tree = tmp_path / "baseline"
    for name in ("proxy", "policy"):
        shutil.copytree(root / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", tree)
    twin = egress.baseline_of(egress.BUILTIN["egress-proxy"], tree)
    assert twin.name == "egress-proxy-baseline" and twin.tree == tree
    command, extra = egress.launcher(tree)
    assert extra == {"PYTHONPATH": str(tree)} and "proxy.cli" in command[-1]
    env = {**egress.proxy_env(PYCACHE), **extra}
    assert egress._imports_elsewhere(tree, env) is None
    base = egress.base_config(("127.0.0.1", 53), tmp_path / "ca", None)
    egress.write_inputs(tmp_path / "twin", twin, base, None)
    assert egress.unsupported(twin, tmp_path / "twin", egress.proxy_env(PYCACHE)) is None
    shutil.rmtree(tree / "policy")  # no longer a checkout of its own: refused, and why
    assert "do not import from" in (egress._imports_elsewhere(tree, env) or "")


def test_a_configuration_file_is_read_or_refused_with_its_key(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("name: mine\nconfig: {limits: {idle_timeout: 5m}}\nargs: [--x]\n")
    loaded = egress.load_config_file(good)
    assert loaded.name == "mine" and loaded.args == ("--x",) and loaded.passthrough
    merged = egress.merged({"limits": {"header_timeout": "2s"}}, loaded.config)
    assert merged == {"limits": {"header_timeout": "2s", "idle_timeout": "5m"}}
    for text, word in (
        ("name: mine\ncolour: red\n", "colour"),
        ("name: egress-proxy\n", "name"),
        ("name: Mine!\n", "name"),
        ("name: mine\nargs: --x\n", "args"),
        ("- a list\n", "mapping"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(egress.ConfigError, match=word):
            egress.load_config_file(bad)


def test_egress_proxy_serves_every_client_of_the_harness(
    built: Any, tmp_path: Path, dns: Any
) -> None:
    """The default configuration started as the harness starts it (ports of its choosing,
    ready timed from exec), then a few tunnels through CONNECT and SOCKS5 and DNS queries."""
    dns.set("bench.test", a=["127.0.0.1"])
    default = egress.BUILTIN["egress-proxy"]
    directory = tmp_path / "egress-proxy"
    egress.write_inputs(
        directory, default, egress.base_config(dns.address, tmp_path / "ca", None), None
    )
    target_file = loadgen.write_targets(tmp_path / "targets.bin", ["bench.test"])
    with loadgen.upstream(built, tmp_path / "upstream.txt") as up:
        proxy = egress.start(default, directory, egress.proxy_env(PYCACHE), up["tunnel"])
        try:
            assert proxy.ready_s > 0 and proxy.first_connect_s > 0
            for kind in ("connect", "socks5"):
                port = proxy.port if kind == "connect" else proxy.socks_port
                command = loadgen.client_args(
                    built, "tunnels", target_file, up["tunnel"], kind, port
                )
                result = phase(
                    [*command, "--count", "5", "--concurrency", "2"], tmp_path, {"proxy": proxy.pid}
                )
                assert result["done"] == 5, result["first_errors"]
            job = {
                "port": proxy.dns_port,
                "cold": [],
                "name": "bench.test",
                "count": 5,
                "seconds": 20,
            }
            (tmp_path / "job.json").write_text(json.dumps(job))
            command = [
                sys.executable,
                str(BENCHMARKS / "harness" / "dns_bench.py"),
                "--job",
                str(tmp_path / "job.json"),
            ]
            result = phase(command, tmp_path, {"proxy": proxy.pid})
            assert result["done"] == 5 and result["errors"] == 0, result["first_errors"]
            assert proxy.audit_log.stat().st_size > 0 and proxy.metrics_ok()
        finally:
            assert proxy.stop() == 0


def test_the_dns_client_checks_every_answer(tmp_path: Path, dns: Any) -> None:
    """Against the tests' DNS server: answers of 127.0.0.1 pass, any other address fails."""
    dns.set("bench.test", a=["127.0.0.1"])
    dns.set("elsewhere.test", a=["127.0.0.2"])
    command = [
        sys.executable,
        str(BENCHMARKS / "harness" / "dns_bench.py"),
        "--job",
        str(tmp_path / "job.json"),
    ]
    job = {"port": dns.address[1], "cold": [], "name": "bench.test", "count": 7, "seconds": 20}
    (tmp_path / "job.json").write_text(json.dumps(job))
    result = phase(command, tmp_path, {})
    assert result["done"] == 7 and dns.count("bench.test", "A") == 8  # the checked one first
    (tmp_path / "job.json").write_text(json.dumps({**job, "cold": ["elsewhere.test"]}))
    with pytest.raises(RuntimeError, match=r"elsewhere\.test"):
        loadgen.run_phase(command, {}, 30, tmp_path / "client.txt")


# -- statistics and targets -------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]
    assert stats.percentile(values, 50) == 50.0
    assert stats.percentile(values, 99) == 99.0
    assert stats.percentile(values, 100) == 100.0
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) != stats.percentile([], 50)  # NaN


def test_median_skips_missing_values() -> None:
    assert stats.median([3.0, None, 1.0, 2.0]) == 2.0
    assert stats.median([None, None]) is None
    assert stats.median([]) is None


def test_ratios_pair_samples_of_the_same_round() -> None:
    direct = [
        {"config": "direct", "round": 0, "x": {"rate": 100.0}},
        {"config": "direct", "round": 1, "x": {"rate": 200.0}},
        {"config": "direct", "round": 2, "x": {"rate": 0.0}},  # no ratio from a zero
    ]
    proxy = [
        {"config": "p", "round": 1, "x": {"rate": 50.0}},  # round 0 is missing
        {"config": "p", "round": 0, "x": {"rate": 30.0}},
        {"config": "p", "round": 2, "x": {"rate": 10.0}},
        {"config": "p", "round": 3, "x": {"rate": 10.0}},  # no direct sample in round 3
    ]
    assert sorted(stats.ratios_by_round(proxy, direct, ("x", "rate"))) == [0.25, 0.3]
    other = [{"round": 1, "y": 25.0}]
    assert stats.ratios_by_round(proxy, other, ("x", "rate"), ("y",)) == [2.0]


def test_summarise_gives_medians_and_ratios_to_the_baseline() -> None:
    samples = {
        "direct": [{"round": r, "v": v} for r, v in enumerate([10.0, 20.0, 40.0])],
        "fast": [{"round": r, "v": v} for r, v in enumerate([5.0, 4.0, 20.0])],
        "broken": [{"round": 0, "error": "did not start"}],
    }
    out = stats.summarise(samples, {"v": ("v",)})
    assert out["direct"] == {"v": 20.0, "v_vs_direct": 1.0}
    # Per round 0.5, 0.2, 0.5: the median of the ratios, not the ratio of the medians (0.25).
    assert out["fast"] == {"v": 5.0, "v_vs_direct": 0.5}
    assert out["broken"] == {"v": None, "v_vs_direct": None}
    assert stats.summarise(samples, {"v": ("v",)}, baseline="absent")["fast"] == {"v": 5.0}


def test_latency_summary() -> None:
    summary = stats.latency_summary([3.0, 1.0, 2.0])
    assert summary == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0, "mean": 2.0}
    assert stats.latency_summary([]) is None


def sample(
    config: str, n: int, cpu: float, rate: float, rss: float, ready: float
) -> dict[str, Any]:
    return {
        "config": config, "round": n, "ready_s": ready, "first_connect_s": ready,
        "tunnels": {"16": {"proxy_cpu_us_per_tunnel": cpu, "tunnels_per_s": rate,
                           "client_cpu_us_per_tunnel": 20.0, "upstream_cpu_us_per_tunnel": 10.0}},
        "memory": {"idle": {"rss_mb": rss}}, "worst_rss_mb": rss + 1,
    }  # fmt: skip


def test_targets_are_ratios_to_squid_within_rounds() -> None:
    main = {
        "squid": [sample("squid", 0, 100, 1000, 26, 0.1), sample("squid", 1, 200, 2000, 26, 0.1)],
        "egress-proxy": [sample("egress-proxy", 0, 110, 900, 31, 0.2),
                         sample("egress-proxy", 1, 260, 1500, 31, 0.4)],
        "direct": [sample("direct", 0, 0, 9000, 0, 0), sample("direct", 1, 0, 8000, 0, 0)],
    }  # fmt: skip
    rows = {
        r["target"]: r
        for r in targets.evaluate(main, {"egress-proxy": egress.BUILTIN["egress-proxy"]})
    }
    cpu = rows["cpu_per_tunnel"]
    # Per round 1.1 and 1.3: the median 1.2 is within "at most 1.2x".
    assert cpu["ratio"] == pytest.approx(1.2) and cpu["met"] is True
    assert cpu["loadgen"] == 30.0 and cpu["loadgen_label"] == "client + upstream"
    rate = rows["tunnels_per_s"]
    assert rate["ratio"] == pytest.approx(0.825) and rate["met"] is True  # 0.9 and 0.75
    assert rate["loadgen"] == 8500.0 and rate["loadgen_label"] == "direct"
    # The largest RSS after traffic (32) against squid's idle RSS at start (26): over 1.2x.
    assert rows["idle_rss"]["ratio"] == pytest.approx(32 / 26) and rows["idle_rss"]["met"] is False
    assert rows["ready"]["value"] == pytest.approx(0.3) and rows["ready"]["met"] is True
    assert rows["cpu_per_request"]["met"] is None  # no HTTP figures: not judged
    assert rows["cpu_per_tunnel"]["tinyproxy_ratio"] is None  # no tinyproxy in this run


def test_targets_that_do_not_apply_to_a_configuration_say_why() -> None:
    main = {
        "squid": [sample("squid", 0, 100, 1000, 26, 0.1)],
        "egress-url-prefix": [sample("egress-url-prefix", 0, 100, 1000, 60, 0.1)],
        "egress-inspect-all": [sample("egress-inspect-all", 0, 100, 1000, 60, 0.1)],
    }
    chosen = {n: egress.BUILTIN[n] for n in ("egress-url-prefix", "egress-inspect-all")}
    rows = {(r["config"], r["target"]): r for r in targets.evaluate(main, chosen)}
    rss = rows[("egress-url-prefix", "idle_rss")]
    assert (
        rss["met"] is None and "interception engine" in rss["why_not"] and rss["ratio"] is not None
    )
    tunnels = rows[("egress-inspect-all", "cpu_per_tunnel")]
    assert tunnels["met"] is None and "intercepts" in tunnels["why_not"]


# -- HTTP verification --------------------------------------------------------------------------


def wrk_result(**changes: Any) -> dict[str, Any]:
    result = {
        "requests": 1000,
        "origin_requests": 1003,  # up to one in flight per connection when wrk stops
        "connections": 16,
        "keep_alive": True,
        "errors": {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0},
    }
    return {**result, **changes}


def test_http_problems_flags_what_makes_a_sample_wrong() -> None:
    assert http_bench.http_problems(wrk_result()) == []
    assert http_bench.http_problems({"error": "wrk failed"}) == []  # reported where it failed
    # Requests the origin did not see (not through the proxy), or more than wrk sent.
    assert http_bench.http_problems(wrk_result(origin_requests=500))
    assert http_bench.http_problems(wrk_result(origin_requests=1100))
    assert http_bench.http_problems(wrk_result(requests=0, origin_requests=0))
    non_2xx = {"connect": 0, "read": 0, "write": 0, "status": 12, "timeout": 0}
    assert http_bench.http_problems(wrk_result(errors=non_2xx))


def test_http_problems_accepts_reconnects_of_a_proxy_without_keep_alive() -> None:
    reads = {"connect": 0, "read": 1000, "write": 0, "status": 0, "timeout": 0}
    assert http_bench.http_problems(wrk_result(keep_alive=False, errors=reads)) == []
    # The same closes from a proxy that keeps connections alive are failures.
    assert http_bench.http_problems(wrk_result(keep_alive=True, errors=reads))


# -- missing peers and the report -------------------------------------------------------------


def test_a_missing_peer_is_skipped_with_a_note(tmp_path: Path) -> None:
    status = peers.peer_status("squid", path=str(tmp_path))  # an empty PATH: nothing found
    assert not status.available
    assert "not installed" in status.note
    assert "make bench-deps" in status.note
    statuses = {
        "squid": status,
        "tinyproxy": peers.PeerStatus("tinyproxy", True, "/usr/bin/tinyproxy"),
        "nginx": peers.PeerStatus("nginx", False, note="nginx not installed"),
        "wrk": peers.PeerStatus("wrk", True, "/usr/bin/wrk"),
    }
    configs, notes = bench.runnable(
        ["direct", "egress-proxy", "squid", "tinyproxy"], ["http"], statuses
    )
    assert configs == ["direct", "egress-proxy", "tinyproxy"]
    assert status.note in notes
    assert any("http workload skipped" in n and "nginx" in n for n in notes)


def test_report_renders_a_run_with_holes(tmp_path: Path) -> None:
    samples = {
        "main": [
            {"config": "direct", "round": 0, "tunnels": {"1": {"latency_ms": {"p50": 0.2}}}},
            {"config": "egress-proxy", "round": 0,
             "tunnels": {"1": {"latency_ms": {"p50": 1.0}}}},
            {"config": "squid", "round": 0, "error": "did not start"},
        ]
    }  # fmt: skip
    chosen = {"egress-proxy": egress.BUILTIN["egress-proxy"]}
    document = summary.build_document(
        context.QUICK, True, ["direct", "egress-proxy", "squid"], chosen, ["tunnels"],
        {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6.0", "python": "3.13.0",
         "implementation": "CPython", "git": "abc", "loadavg_at_start": ["0.1"]},
        {}, ["privoxy not installed (`make bench-deps` installs it): skipped"],
        ["round 1 squid: did not start"], samples, 12.0,
    )  # fmt: skip
    json.dumps(document)  # it is written as JSON
    text = report.render(document, [], None)
    assert "Test CPU" in text and document["date"] in text  # machine and date
    assert "privoxy not installed" in text
    assert "round 1 squid: did not start" in text
    assert "| egress-proxy | 1.000 |" in text
    assert "## Targets" in text and "ratio to squid" in text
    # Without squid's figures no target is judged: none is reported met or not met.
    assert "0 of 0 judged targets met" in text
    assert document["summary"]["tunnels"]["egress-proxy"]["tunnels_per_s_1"] is None
    assert document["summary"]["tunnels"]["egress-proxy"]["latency_p50_ms_vs_direct"] == 5.0


def test_the_commands_run_from_anywhere_and_import_nothing_of_the_proxy(tmp_path: Path) -> None:
    """`benchmarks/bench.py` and `python -m benchmarks.harness` are one command; from another
    directory the script still finds its package. The harness measures the proxy from outside:
    none of its modules (the scale workload's generator included) imports policy/ or proxy/."""
    for command, cwd in (
        [[sys.executable, str(BENCHMARKS / "bench.py"), "--help"], tmp_path],
        [[sys.executable, "-m", "benchmarks.harness", "--help"], ROOT],
    ):
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False, cwd=cwd
        )
        assert result.returncode == 0 and "--workloads" in result.stdout, result.stderr
    modules = [path.stem for path in (BENCHMARKS / "harness").glob("*.py")]
    code = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]);"
        "[importlib.import_module('benchmarks.harness.' + m) for m in sys.argv[2:]];"
        "from benchmarks.harness.rounds import scale_manifest; scale_manifest(20);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('policy', 'proxy')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), *(m for m in modules if m != "__main__")],
        capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.stdout.strip() == "[]"


# -- --profile: py-spy's raw files summarised, py-spy attached ----------------------------------

STD = "/py/lib/python3.13"
SITE = "/repo/.venv/lib/python3.13/site-packages"  # a checkout's virtualenv: third-party
LOOP_BASE = (
    "<module> (<string>:1);main (/repo/proxy/cli/__init__.py:10);"
    f"run ({STD}/asyncio/runners.py:194);Runner.run ({STD}/asyncio/runners.py:118)"
)
RAW = f"""{LOOP_BASE} 40
{LOOP_BASE};data_received (/repo/proxy/net/relay.py:50) 20
{LOOP_BASE};data_received (/repo/proxy/net/relay.py:51);write (/repo/proxy/ops/audit.py:7);dumps ({STD}/json/__init__.py:231) 15
{LOOP_BASE};decide (/repo/policy/trie.py:3);decide (/repo/policy/trie.py:4) 10
{LOOP_BASE};handle (/repo/proxy/dataplane/tunnel.py:9);inc ({SITE}/prometheus_client/metrics.py:5) 5
{LOOP_BASE};_step ({STD}/asyncio/tasks.py:1) 4
 3
probe (/repo/proxy/probes.py:1) 3
"""  # noqa: E501
JUNK = [
    "garbage",
    "a frame without a count (/repo/proxy/x.py:1)",
    "f (/repo/proxy/x.py:1) -5",
    "f (/repo/proxy/x.py:1) 0",
    "f (/repo/proxy/x.py:1) x12",
    "f (/repo/proxy/x.py:1) 99999999999999999999",
    ";; 7",
    "no parentheses here;f (/repo/proxy/x.py:1) 3",
    "f () 2",
    "\x00\ufffd\ufffd 1",
    "f (/repo/proxy/x.py:1) ٣",  # a digit, but not an ASCII one
]


def profile_places() -> Any:
    return profiling.Places.of(["/repo"], stdlib=[STD])


def test_a_raw_profile_is_summarised_by_area_and_by_function() -> None:
    """Shares by the leaf frame's area (the event loop's own when the leaf is asyncio.run's
    Runner.run), by the innermost frame of ours above the loop (never the CLI below it), and
    functions by inclusive share (a recursive one counted once a sample) and by self share."""
    summary = profiling.summarise([RAW], profile_places())
    assert summary.samples == 100 and summary.skipped == 0
    loop = profiling.LOOP
    assert dict(summary.by_leaf) == {
        loop: 40, "proxy/net": 20, profiling.STDLIB: 19, "policy": 10,
        profiling.THIRD_PARTY: 5, profiling.NO_FRAME: 3, "proxy": 3,
    }  # fmt: skip
    assert dict(summary.by_ours) == {
        loop: 40, "proxy/net": 20, "proxy/ops": 15, "policy": 10, "proxy/dataplane": 5,
        profiling.STDLIB: 4, profiling.NO_FRAME: 3, "proxy": 3,
    }  # fmt: skip
    assert summary.inclusive["Runner.run (asyncio/runners.py)"] == 94
    assert summary.inclusive["data_received (proxy/net/relay.py)"] == 35  # two lines, one name
    assert summary.inclusive["decide (policy/trie.py)"] == 10  # recursive: once a sample
    assert summary.inclusive["inc (prometheus_client/metrics.py)"] == 5
    assert summary.own["Runner.run (asyncio/runners.py)"] == 40
    assert summary.own["dumps (json/__init__.py)"] == 15
    assert summary.own["decide (policy/trie.py)"] == 10
    text = profiling.render({"egress-proxy": (summary, [("egress-proxy-round1.txt", 100)])})
    assert "Not figures of record" in text
    assert f"| {loop} | 40.0% | 40.0% |" in text
    assert "| standard library | 19.0% | 4.0% |" in text
    assert "| proxy/ops | 0.0% | 15.0% |" in text
    inclusive, own = text.split("by inclusive share")[1].split("by self share")
    # Four frames are on 94 stacks (ties in name order), one of them the loop's leaf.
    assert "| 2 | `Runner.run (asyncio/runners.py)` | 94.0% | 40.0% |" in inclusive
    assert "| 5 | `data_received (proxy/net/relay.py)` | 35.0% | 20.0% |" in inclusive
    assert "| 1 | `Runner.run (asyncio/runners.py)` | 40.0% | 94.0% |" in own
    assert "| 3 | `dumps (json/__init__.py)` | 15.0% | 15.0% |" in own


def test_a_raw_profile_with_junk_lines_skips_them_one_by_one() -> None:
    stacks, skipped = profiling.parse_raw("\n".join([*JUNK, RAW, *JUNK, "", "   "]))
    assert skipped == 2 * len(JUNK)
    assert sum(stacks.values()) == 100
    summary = profiling.summarise(["\n".join(JUNK), RAW, "\x00" * 100], profile_places())
    assert summary.samples == 100 and summary.skipped == len(JUNK) + 1
    text = profiling.render({"egress-proxy": (summary, [])})
    assert f"{len(JUNK) + 1} line(s) of them did not read" in text
    empty = profiling.render({"egress-proxy": (profiling.summarise([""], profile_places()), [])})
    assert "No samples." in empty
    assert "No egress-proxy process was profiled" in profiling.render({})


def fake_pyspy(tmp_path: Path, dump: str) -> str:
    """A py-spy that answers --version and whose dump prints `dump` and fails."""
    script = tmp_path / "py-spy"
    script.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "py-spy 0.4.3"; exit 0; fi\n'
        f"echo '{dump}' >&2\nexit 1\n"
    )
    script.chmod(0o755)
    return str(script)


def test_profile_is_refused_at_start_without_a_py_spy_that_can_read_a_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    denied = fake_pyspy(tmp_path, "Error: Operation not permitted (os error 1)")
    with pytest.raises(profiling.Unavailable, match=r"Operation not permitted.*ptrace"):
        profiling.Profiler.start(tmp_path / "prof", binary=denied)
    for found, said in ((None, "py-spy is not installed"), (denied, "needs ptrace")):
        monkeypatch.setattr(profiling, "find_pyspy", lambda found=found: found)
        code = bench.main(["--configs", "egress-proxy", "--profile", str(tmp_path / "p")])
        err = capsys.readouterr().err
        assert code == 2 and "bench: cannot run: --profile: " in err and said in err
        assert "Traceback" not in err


def test_py_spy_records_a_ready_process_and_its_files_are_summarised(tmp_path: Path) -> None:
    """A real py-spy (the bench extra) on a Python child of the test, as on a proxy: attached,
    waited for once the child exits, its file summarised into PROFILE.md."""
    binary = profiling.find_pyspy()
    if binary is None:
        pytest.skip("py-spy is not installed (`make bench-deps`)")
    try:
        profiler = profiling.Profiler.start(tmp_path / "prof", binary)
    except profiling.Unavailable as exc:
        pytest.skip(str(exc))
    code = (
        "import json, sys, time\nprint('up', flush=True)\nend = time.monotonic() + 1.0\n"
        "while time.monotonic() < end:\n    json.dumps(list(range(200)))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"up\n"
    assert profiler.attach(child.pid, "egress-proxy", "round1") is None
    assert child.wait(timeout=30) == 0
    child.stdout.close()
    assert profiler.finish() == [] and profiler.finish() == []
    files = profiler.files()
    assert [p.name for p in files["egress-proxy"]] == ["egress-proxy-round1.txt"]
    with (profiler.directory / "egress-proxy-round1.txt").open("a") as raw:
        raw.write("junk\n")
    text = profiler.write([ROOT]).read_text()
    assert "## egress-proxy" in text and "`egress-proxy-round1.txt`" in text
    assert "json/encoder.py" in text and "1 line(s) of them did not read" in text


def test_a_profiled_run_says_its_figures_are_not_of_record() -> None:
    profile = {"of_record": False, "why": profiling.NOT_OF_RECORD, "summary": "/p/PROFILE.md"}
    document = summary.build_document(
        context.QUICK, True, ["egress-proxy"], {"egress-proxy": egress.BUILTIN["egress-proxy"]},
        ["tunnels"], {"nproc": 2}, {}, [], [], {"main": []}, 1.0, profile,
    )  # fmt: skip
    assert json.loads(json.dumps(document))["profile"]["of_record"] is False
    head = report.render(document, [], None).split("\n## ")[0]
    assert "**Not figures of record**" in head and "/p/PROFILE.md" in head
