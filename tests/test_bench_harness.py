"""The benchmark harness's own logic (benchmarks/bench*.py): what a user of its report relies
on. Peer configurations are checked by the peers themselves (a real start and a CONNECT through
each, allowed and denied), the statistics on known samples, the HTTP verification on made-up
wrk results, a missing peer is a note and not an error, and a report renders from a run with
holes in it. Peers that are not installed are skipped with the harness's own note.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from running import tcp_server

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
bench = importlib.import_module("bench")
peers = importlib.import_module("bench_peers")
stats = importlib.import_module("bench_stats")
report = importlib.import_module("bench_report")

GREETING = b"hello from upstream"


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
    peer = peers.start_peer(status, tmp_path / name, ["bench.test"])
    try:
        allowed = connect_through(peer.port, "bench.test", upstream)
        assert allowed.split(b"\r\n", 1)[0].split(b" ")[1] == b"200", allowed[:200]
        assert GREETING in allowed
        denied = connect_through(peer.port, "denied.test", upstream)
        assert denied.split(b"\r\n", 1)[0].split(b" ")[1] == b"403", denied[:200]
        assert GREETING not in denied
        # The harness reads CPU and memory of this one pid: the peer must not fork helpers.
        assert bench.descendants(peer.pid) == []
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


def test_nginx_origin_counts_requests_and_wrk_goes_through_the_proxy(
    tmp_path: Path, upstream: int
) -> None:
    nginx, wrk, squid = available("nginx"), available("wrk"), available("squid")
    tmp_path.chmod(0o755)
    origin = peers.start_origin(nginx.binary, tmp_path / "origin", 64)
    proxy = peers.start_peer(squid, tmp_path / "squid", ["bench.test"])
    try:
        run = bench.Run(
            settings=bench.QUICK, workloads=["http"], tmp=tmp_path, dns=None, bench=None,
            env=dict(os.environ), statuses={}, origin=origin, wrk=wrk.binary, log=print,
        )  # fmt: skip
        result = bench.http_workload(run, proxy)
        assert result["requests"] > 0
        assert result["keep_alive"] is True
        assert bench.http_problems(result) == []
        assert result["proxy_cpu_s"] > 0  # the proxy did the work
        # A request the origin never sees through the proxy: the count check would catch it.
        assert peers.origin_requests(origin.port) >= result["origin_requests"] > 0
    finally:
        proxy.stop()
        origin.stop()


# -- statistics ---------------------------------------------------------------------------------


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
    assert bench.http_problems(wrk_result()) == []
    assert bench.http_problems({"error": "wrk failed"}) == []  # reported where it failed
    # Requests the origin did not see (not through the proxy), or more than wrk sent.
    assert bench.http_problems(wrk_result(origin_requests=500))
    assert bench.http_problems(wrk_result(origin_requests=1100))
    assert bench.http_problems(wrk_result(requests=0, origin_requests=0))
    non_2xx = {"connect": 0, "read": 0, "write": 0, "status": 12, "timeout": 0}
    assert bench.http_problems(wrk_result(errors=non_2xx))


def test_http_problems_accepts_reconnects_of_a_proxy_without_keep_alive() -> None:
    reads = {"connect": 0, "read": 1000, "write": 0, "status": 0, "timeout": 0}
    assert bench.http_problems(wrk_result(keep_alive=False, errors=reads)) == []
    # The same closes from a proxy that keeps connections alive are failures.
    assert bench.http_problems(wrk_result(keep_alive=True, errors=reads))


# -- missing peers ------------------------------------------------------------------------------


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
    configs, notes = bench.runnable(["direct", "fast", "squid", "tinyproxy"], ["http"], statuses)
    assert configs == ["direct", "fast", "tinyproxy"]
    assert status.note in notes
    assert any("http workload skipped" in n and "nginx" in n for n in notes)


def test_report_renders_a_run_with_holes(tmp_path: Path) -> None:
    samples = {
        "main": [
            {"config": "direct", "round": 0, "tunnels": {"1": {"latency_ms": {"p50": 0.2}}}},
            {"config": "fast", "round": 0, "tunnels": {"1": {"latency_ms": {"p50": 1.0}}}},
            {"config": "squid", "round": 0, "error": "did not start"},
        ]
    }
    document = bench.build_document(
        bench.QUICK, True, ["direct", "fast", "squid"], ["tunnels"],
        {"nproc": 2, "cpu_model": "Test CPU", "kernel": "6.0", "python": "3.13.0",
         "implementation": "CPython", "git": "abc", "loadavg_at_start": ["0.1"]},
        {}, ["privoxy not installed (`make bench-deps` installs it): skipped"],
        ["round 1 squid: did not start"], samples, 12.0,
    )  # fmt: skip
    text = report.render(document, [], None)
    assert "Test CPU" in text and document["date"] in text  # machine and date
    assert "privoxy not installed" in text
    assert "round 1 squid: did not start" in text
    assert "| egress-proxy fast path | 1.000 |" in text
    assert "5.00x" in text  # the ratio of fast's p50 to direct's in the same round
