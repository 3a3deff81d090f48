"""The "Method" section of REPORT.md: how each figure of this run was measured, with this run's
own counts and limits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def method(document: Mapping[str, Any]) -> list[str]:
    s = document["settings"]
    levels = ", ".join(str(c) for c in [1, *s["concurrency"]])
    mib = 2**20
    return [
        f"- Rounds: {s['rounds']}; every configuration once per round in the same order "
        "(A B C, A B C, ...), each a fresh process per round"
        + (
            ", the first round after an untimed start and stop of every proxy"
            if s.get("warm_pass") == "all"
            else ", the first round after an untimed start and stop of every egress-proxy "
            "configuration (its bytecode cache)"
        )
        + ". Figures are medians over rounds; a ratio (to direct in the workload tables, to squid "
        "in the targets) is taken within each round, then the median. Proxy CPU: utime + stime "
        "of the proxy process from /proc/PID/stat over the phase (all threads), from the "
        "release of the load generator to 0.2 s after its result; every proxy runs as one "
        "process (checked each round).",
        "- Load generators: benchmarks/harness/loadgen.c, built by the harness with gcc (epoll for "
        "tunnels, a thread per tunnel for bulk and HTTPS), and its own upstream (epoll; it "
        "answers one byte once it has read the whole ClientHello record); wrk for plain HTTP "
        "against nginx; dnspython for the DNS listener. A tunnel's ClientHello is what Python's "
        "ssl (OpenSSL) sends for bench.test, generated once per run. Each phase's client warms "
        "up before it is released, and reports its own CPU; the upstream's and the origin's "
        "CPU are read from /proc like the proxy's.",
        f"- Tunnels: TCP connect, CONNECT bench.test:PORT, 200, the ClientHello, the upstream's "
        f"answer, close. One client one tunnel at a time ({s['latency_count']:,} tunnels or "
        f"{s['latency_s']:g} s after {s['warmup']} warm-up ones): latency p50/p99 and tunnels/s "
        f"@1; then {levels} concurrent clients ({s['rate_count']:,} tunnels or {s['rate_s']:g} s "
        "each). Direct: the same client straight to the upstream.",
        "- Opaque streams: the tunnels above with an SSH identification line "
        "(`SSH-2.0-bench\\r\\n`) as the first flight instead of the ClientHello, to the "
        "upstream's opaque port (neither 80 nor 443; it answers one byte once it has read the "
        "line), through CONNECT (every proxy whose configuration allows CONNECT to that port: "
        "squid's and tinyproxy's here restrict no CONNECT port) and egress-proxy's SOCKS5 "
        "listener (at 16 clients).",
        "- Attributed (root only): in a network namespace the harness creates, egress-proxy with "
        "a transparent listener beside its usual ones, resolving with a DNS server of the "
        "harness's in the namespace; nftables there redirects the client's (user nobody) TCP to "
        "127.0.0.5, bench.test's address, to the transparent listener, and root's (the proxy "
        "dialling that address; direct's client) to the upstream on 127.0.0.1. The client "
        "resolves bench.test once through the proxy's DNS listener, then opens the tunnels "
        "above to that address without a proxy request: an SSH first flight (no name: "
        "attributed by the DNS answer, relayed opaque to that address) and a TLS ClientHello "
        "(decided on its SNI). The audit log must show every SSH stream attributed by DNS.",
        f"- Bulk: {s['bulk_bytes'] / mib:,.0f} MiB each way through one tunnel, and "
        f"{s['parallel_bytes'] / mib:,.0f} MiB in all through {s['parallel_tunnels']} tunnels "
        "at once, each after a warm-up transfer on a tunnel of its own; MB/s from the first "
        f"transfer's start to the last one's end (at most {s['bulk_s']:g} s). MB = 10^6 bytes.",
        f"- Plain HTTP: wrk, 2 threads, 16 keep-alive connections, {s['http_s']:g} s"
        + (f" after a {s['http_warmup_s']:g} s warm-up run" if s["http_warmup_s"] else "")
        + "; absolute-form requests (`GET http://bench.test:PORT/`) to the proxy's port (wrk "
        "has no proxy option), to nginx answering 256 bytes. nginx's own request count must "
        "match wrk's on every sample: every request reached the origin, and only through the "
        "proxy. wrk runs closed-loop, so latencies are those of a saturated proxy.",
        f"- SOCKS5 (egress-proxy's `--listen socks5://`): the tunnels above at 16 clients "
        f"({s['socks_count']:,} or {s['socks_s']:g} s), SOCKS5 greeting, CONNECT by name, reply.",
        f"- DNS listener (`--dns-listen`): {s['dnsq_cold']} fresh names once each (untimed), "
        f"then {s['dnsq_count']:,} queries of bench.test or {s['dnsq_s']:g} s, one in flight "
        "over UDP; every answer parsed (dnspython) and checked.",
        f"- Intercepted HTTPS (configurations whose policy inspects a host): "
        f"{s['inspect_clients']} concurrent tunnels, a TLS handshake through the proxy "
        "(verified against the session CA) and one GET per tunnel (per-tunnel cost), then "
        f"keep-alive GETs in long-lived tunnels (per-request cost), {s['inspect_s']:g} s each; "
        "the origin is nginx over HTTPS with a certificate of the harness's test CA, which the "
        "proxy trusts (`inspection.upstream_ca`). Direct: the same client straight to nginx.",
        "- Memory: VmRSS, PSS and USS from /proc/PID/smaps_rollup, each read "
        f"{s['settle_s']:g} s after the proxy went idle: at start, and after each kind of "
        "traffic (CONNECT tunnels and bulk, plain HTTP, SOCKS5, DNS, intercepted HTTPS). The "
        "idle RSS target takes the largest of them against squid's RSS at start. Sessions: "
        f"{s['sessions']} proxies of one configuration running at once (started two at a time, "
        "bounded in time): PSS adds up across processes, RSS does not.",
        "- Ready: from just before exec to /readyz answering 200 (egress-proxy) or to the first "
        "accepted TCP connection (peers), and to the first CONNECT answered 200 (every proxy); "
        "each polled every 2 ms on a thread of its own. egress-proxy's listeners are on ports "
        "the harness picked, so nothing is read from its output.",
        f"- Scale: egress-proxy with {', '.join(f'{n:,}' for n in s['scale_sizes'])} `egress` "
        f"names (benchmarks/decisions/generate.py), {s['scale_rounds']} round(s), "
        f"{s['scale_count']} sequential tunnels each.",
        f"- The proxy's resolver: {s['dns_count']} sequential tunnels to fresh names (each new "
        "to the proxy: cold), then as many to one resolved name (warm); the harness's DNS "
        "server checks that every cold name reached it and no warm one did.",
        "- Peers: each a child of the harness with a configuration of its own in a temp dir, on "
        "127.0.0.1 and a free port, access logging and caching off, an allow-list of bench.test "
        "and its subdomains (mitmdump: none, `--ignore-hosts '.*'`). tinyproxy, privoxy and "
        "mitmdump run in a private mount namespace whose /etc/hosts maps the test names to "
        "127.0.0.1 and whose resolv.conf names only 127.0.0.1; squid gets the same through "
        "`hosts_file` and `dns_nameservers`. egress-proxy writes its audit log to a file (checked "
        "non-empty every round) and serves /metrics (scraped every round), as a sidecar does; it "
        "resolves with the harness's DNS server on 127.0.0.1.",
    ]
