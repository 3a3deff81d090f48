"""REPORT.md and the PNG plots of a benchmark harness run, from its bench.json.

    .venv/bin/python benchmarks/bench_report.py benchmarks/results/bench.json [--out DIR]

benchmarks/bench.py calls `write()` at the end of a run; this script writes them again from a
saved run (e.g. after a change to the report). Plots need matplotlib (`make bench-deps`, the
`bench` extra); without it the report says so and has the tables only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, float | None]
LABELS = {
    "direct": "direct",
    "fast": "egress-proxy fast path",
    "engine": "egress-proxy engine only",
    "tinyproxy": "tinyproxy",
    "privoxy": "privoxy",
    "squid": "squid",
    "mitmdump": "mitmdump (no policy)",
}
SHORT = {"fast": "egress fast", "engine": "egress engine", "mitmdump": "mitmdump"}


def cell(value: Any, fmt: str, suffix: str = "") -> str:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if value != value:  # NaN
        return "-"
    return format(value, fmt) + suffix


def ratio(value: Any) -> str:
    """0.012x, 0.53x, 15.4x, 268x: two significant digits at least."""
    if cell(value, "g") == "-":
        return "-"
    digits = 3 if abs(value) < 0.1 else 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{digits}f}x"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def label(config: str) -> str:
    if config.isdigit():
        return f"{int(config):,} rules"
    return LABELS.get(config, config)


# --------------------------------------------------------------------------------------------
# Tables


def tunnels_section(summary: dict[str, Row], settings: dict[str, Any]) -> list[str]:
    levels = [1, *settings["concurrency"]]
    head = ["", "new tunnel p50 ms", "p99 ms", "p50 vs direct"]
    for c in levels:
        head += [f"tunnels/s @{c}", "vs direct"]
    head += [f"proxy CPU µs/tunnel @{c}" for c in levels]
    rows = []
    for config, r in summary.items():
        row = [label(config), cell(r["latency_p50_ms"], ".3f"), cell(r["latency_p99_ms"], ".3f")]
        row.append(ratio(r.get("latency_p50_ms_vs_direct")))
        for c in levels:
            row += [
                cell(r[f"tunnels_per_s_{c}"], ",.0f"),
                ratio(r.get(f"tunnels_per_s_{c}_vs_direct")),
            ]
        row += [cell(r[f"proxy_cpu_us_per_tunnel_{c}"], ",.0f") for c in levels]
        rows.append(row)
    out = [table(head, rows), ""]
    direct = summary.get("direct")
    others = [
        (r[f"tunnels_per_s_{levels[1]}"], c)
        for c, r in summary.items()
        if c != "direct" and r.get(f"tunnels_per_s_{levels[1]}")
    ]
    if direct and direct.get(f"tunnels_per_s_{levels[1]}") and others:
        best, who = max(others)
        rate = direct[f"tunnels_per_s_{levels[1]}"]
        client = direct.get(f"client_cpu_us_per_tunnel_{levels[1]}")
        out.append(
            f"Load generator check: against direct (no proxy), the harness's tunnel client "
            f"made {rate:,.0f} tunnels/s at {levels[1]} clients "
            f"({cell(client, ',.0f')} µs of client CPU per tunnel), "
            f"{rate / best:.1f}x the fastest proxy ({label(who)}, {best:,.0f}/s): the client "
            "is not what limits the proxies' figures."
        )
    return out


def bulk_section(summary: dict[str, Row], settings: dict[str, Any]) -> list[str]:
    n = settings["parallel_tunnels"]
    head = ["", "1 tunnel up MB/s", "vs direct", "down MB/s", "vs direct"]
    head += [f"{n} tunnels up MB/s", "vs direct", f"{n} down MB/s", "vs direct"]
    head += ["proxy CPU s/GiB up / down", f"{n} tunnels up / down"]
    rows = []
    for config, r in summary.items():
        row = [label(config)]
        for kind in ("up", "down", "parallel_up", "parallel_down"):
            row += [cell(r[f"{kind}_mb_s"], ",.0f"), ratio(r.get(f"{kind}_mb_s_vs_direct"))]
        for a, b in (("up", "down"), ("parallel_up", "parallel_down")):
            x, y = r[f"{a}_proxy_cpu_s_per_gib"], r[f"{b}_proxy_cpu_s_per_gib"]
            row.append("-" if x is None and y is None else f"{cell(x, '.2f')} / {cell(y, '.2f')}")
        rows.append(row)
    return [table(head, rows)]


def http_section(summary: dict[str, Row], samples: Sequence[dict[str, Any]]) -> list[str]:
    head = ["", "requests/s", "vs direct", "p50 ms", "p99 ms", "p99 vs direct"]
    head += ["proxy CPU µs/request", "origin CPU µs/request"]
    rows = []
    for config, r in summary.items():
        rows.append(
            [
                label(config),
                cell(r["requests_per_s"], ",.0f"),
                ratio(r.get("requests_per_s_vs_direct")),
                cell(r["latency_p50_ms"], ".3f"),
                cell(r["latency_p99_ms"], ".3f"),
                ratio(r.get("latency_p99_ms_vs_direct")),
                cell(r["proxy_cpu_us_per_request"], ",.0f"),
                cell(r["origin_cpu_us_per_request"], ",.1f"),
            ]
        )
    out = [table(head, rows)]
    closing = sorted(
        {s["config"] for s in samples if (s.get("http") or {}).get("keep_alive") is False}
    )
    if closing:
        out += [
            "",
            f"{', '.join(label(c) for c in closing)}: closes the client connection after every "
            "answer (no client keep-alive), so wrk reconnects for every request (wrk counts "
            "each close as a read error; those are not counted as problems here).",
        ]
    return out


def scale_section(summary: dict[str, Row]) -> list[str]:
    smallest = min(summary, key=int) if summary else "10"
    head = [
        "egress rules",
        "ready s",
        "vs smallest",
        "start-up CPU s",
        "idle RSS MB",
        "idle PSS MB",
    ]
    head += ["tunnel p50 ms", "p99 ms", "p50 vs smallest", "proxy CPU µs/tunnel"]
    rows = []
    for config, r in sorted(summary.items(), key=lambda kv: int(kv[0])):
        rows.append(
            [
                f"{int(config):,}",
                cell(r["ready_s"], ".3f"),
                ratio(r.get(f"ready_s_vs_{smallest}")),
                cell(r["startup_cpu_s"], ".2f"),
                cell(r["idle_rss_mb"], ".1f"),
                cell(r["idle_pss_mb"], ".1f"),
                cell(r["latency_p50_ms"], ".3f"),
                cell(r["latency_p99_ms"], ".3f"),
                ratio(r.get(f"latency_p50_ms_vs_{smallest}")),
                cell(r["proxy_cpu_us_per_tunnel"], ",.0f"),
            ]
        )
    return [table(head, rows)]


def dns_section(summary: dict[str, Row], direct: Row | None) -> list[str]:
    head = ["", "cold p50 ms", "cold p99 ms", "warm p50 ms", "warm p99 ms", "cold - warm p50 ms"]
    head += ["lookup ms cold / warm (proxy's metric)", "proxy CPU µs/tunnel cold / warm"]
    rows = []
    for config, r in summary.items():
        gap = None
        if r["cold_p50_ms"] is not None and r["warm_p50_ms"] is not None:
            gap = r["cold_p50_ms"] - r["warm_p50_ms"]
        rows.append(
            [
                label(config),
                cell(r["cold_p50_ms"], ".3f"),
                cell(r["cold_p99_ms"], ".3f"),
                cell(r["warm_p50_ms"], ".3f"),
                cell(r["warm_p99_ms"], ".3f"),
                cell(gap, ".3f"),
                f"{cell(r['cold_lookup_ms'], '.3f')} / {cell(r['warm_lookup_ms'], '.3f')}",
                f"{cell(r['cold_proxy_cpu_us_per_tunnel'], ',.0f')} / "
                f"{cell(r['warm_proxy_cpu_us_per_tunnel'], ',.0f')}",
            ]
        )
    out = [table(head, rows)]
    if direct and direct.get("latency_p50_ms") is not None:
        out += [
            "",
            f"For reference, a tunnel without a proxy (direct, workload 1): p50 "
            f"{direct['latency_p50_ms']:.3f} ms, p99 {cell(direct['latency_p99_ms'], '.3f')} ms.",
        ]
    return out


def sessions_section(idle: dict[str, Row], sessions: dict[str, Row], wanted: int) -> list[str]:
    head = ["", "ready s", "start-up CPU s", "1 idle: RSS MB", "PSS MB", "USS MB"]
    head += [f"{wanted} side by side: RSS MB (sum)", "PSS MB (sum)", "PSS MB per session"]
    head += ["USS MB per session", "PSS vs fast path"]
    rows = []
    for config, r in idle.items():
        if config == "direct":
            continue
        s = sessions.get(config, {})
        count = s.get("sessions")
        note = "" if count is None or count == wanted else f" ({count:.0f} started)"
        rows.append(
            [
                label(config),
                cell(r["ready_s"], ".3f"),
                cell(r["startup_cpu_s"], ".2f"),
                cell(r["idle_rss_mb"], ".1f"),
                cell(r["idle_pss_mb"], ".1f"),
                cell(r["idle_uss_mb"], ".1f"),
                cell(s.get("rss_mb_sum"), ",.0f") + note,
                cell(s.get("pss_mb_sum"), ",.0f"),
                cell(s.get("pss_mb_per_session"), ".1f"),
                cell(s.get("uss_mb_per_session"), ".1f"),
                ratio(s.get("pss_mb_per_session_vs_fast")),
            ]
        )
    return [table(head, rows)]


def method(document: dict[str, Any]) -> list[str]:
    s = document["settings"]
    rounds = s["rounds"]
    sizes = ", ".join(f"{n:,}" for n in s["scale_sizes"])
    levels = ", ".join(str(c) for c in [1, *s["concurrency"]])
    return [
        f"- Configurations interleaved round by round ({rounds} round(s): A B C ... A B C ...); "
        "each proxy a fresh process per round"
        + (
            ", the first round after an untimed start and stop of every proxy"
            if s.get("warm_pass")
            else " (no warm-up pass: quick)"
        )
        + ". Medians over rounds; a ratio to direct is taken within each round, then "
        "the median. Proxy CPU: utime+stime of the proxy process from /proc/PID/stat over the "
        "phase (all threads; every peer runs as one process, checked per round).",
        f"- Tunnels: TCP connect, CONNECT bench.test:PORT, 200, a real TLS ClientHello, the "
        f"upstream's first byte. Latency: one client, one tunnel at a time ({s['latency_count']:,}"
        f" tunnels or {s['latency_s']:g} s after {s['warmup']} warm-up ones); the same phase "
        f"gives tunnels/s @1. Rates at {levels} concurrent clients ({s['rate_count']:,} tunnels "
        f"or {s['rate_s']:g} s each, in {s['rate_procs']} client processes).",
        f"- Bulk: {s['bulk_bytes'] / 2**20:,.0f} MiB each way through one tunnel, and "
        f"{s['parallel_bytes'] / 2**20:,.0f} MiB in all through {s['parallel_tunnels']} "
        "tunnels at once (one client process, a thread per tunnel), after a warm-up transfer. "
        "MB = 10^6 bytes.",
        f"- HTTP: wrk, {s['http_threads']} threads, {s['http_connections']} keep-alive "
        f"connections, {s['http_s']:g} s after a {s['http_warmup_s']:g} s warm-up run; "
        "requests in absolute form (`GET http://bench.test:PORT/`) sent to the proxy's port "
        f"(wrk has no proxy option), to an nginx origin answering {s['origin_body_bytes']} "
        "bytes. Every sample checks nginx's own request count against wrk's: every request "
        "reached the origin, and only through the proxy. egress-proxy's fast path hands plain "
        "HTTP to its engine (mitmproxy), so `fast` and `engine` serve it alike. wrk runs "
        "closed-loop: each configuration at its own highest rate, so its latencies are those "
        "of a saturated proxy (direct's p99 is nginx and wrk sharing the CPUs at 50,000+/s).",
        f"- Scale: egress-proxy's fast path with manifests of {sizes} "
        "`egress` names (bench.test and names from benchmarks/policy_decide.py's generator), "
        f"{s['scale_rounds']} round(s); ready = process start to /readyz 200; "
        f"{s['scale_count']} sequential tunnels.",
        f"- DNS: {s['dns_count']} sequential tunnels to fresh names (a new name per tunnel, "
        "answered by the harness's DNS server on 127.0.0.1: cold) and as many to one name "
        "already resolved (warm). The lookup column is egress-proxy's own "
        "egress_dns_lookup_seconds histogram over the phase. The peers are not in this "
        "workload: they resolve with the system resolver, which cannot be pointed at a test "
        "server on another port without changing the machine.",
        f"- Sessions: one idle proxy (VmRSS, and PSS/USS from /proc/PID/smaps_rollup, "
        f"{s['settle_s']:g} s after ready), and {s['sessions']} proxies of one configuration "
        "running at once (started two at a time, bounded in time): PSS adds up across "
        "processes (shared pages are split between them), RSS does not.",
        "- Ready: egress-proxy from spawn to /readyz 200; peers from spawn to accepting a TCP "
        "connection.",
        "- Peers: each a child of the harness with a configuration of its own in a temp dir, "
        "on 127.0.0.1 and a free port, access logging and caching off, an allow-list of "
        "bench.test and its subdomains (mitmdump: none, `--ignore-hosts '.*'`). tinyproxy, "
        "privoxy and mitmdump run in a private mount namespace whose /etc/hosts maps the test "
        "names to 127.0.0.1 and whose resolv.conf names only 127.0.0.1; squid gets the same "
        "through `hosts_file` and `dns_nameservers`. egress-proxy (policy `egress: "
        "[bench.test]`) writes its audit log to a file, as it does in use; it resolves with the "
        "harness's DNS server on 127.0.0.1.",
    ]


def render(document: dict[str, Any], plots: Sequence[str], plot_note: str | None) -> str:
    m = document["machine"]
    s = document["settings"]
    summary = document["summary"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    lines = [
        "# Benchmark report: egress-proxy against peers",
        "",
        f"{document['mode'].capitalize()} run of {document['date']}, "
        f"{document['elapsed_s']:.0f} s: `{document['command']}`.",
        "",
        f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}), "
        f"{cell(m.get('memory_mb'), ',.0f')} MB RAM, Linux {m.get('kernel')}, "
        f"{m.get('implementation')} {m.get('python')}, git {m.get('git')}, load average "
        f"{' '.join(m.get('loadavg_at_start') or [])} at start. "
        "Everything on loopback, on the same 2 CPUs as the load generator: every figure is "
        "the whole machine's, not the proxy's alone.",
        "",
        f"Versions: {versions}.",
    ]
    if document["notes"]:
        lines += ["", "Notes:", *(f"- {n}" for n in document["notes"])]
    if document["problems"]:
        lines += [
            "",
            "Problems (measurements that failed):",
            *(f"- {p}" for p in document["problems"]),
        ]
    if plot_note:
        lines += ["", plot_note]

    def section(title: str, body: list[str], plot: str) -> None:
        lines.extend(["", f"## {title}", "", *body])
        if plot in plots:
            lines.extend(["", f"![{title}]({plot})"])

    workloads = s["workloads"]
    if "tunnels" in workloads and summary["tunnels"]:
        section("1. New CONNECT tunnels", tunnels_section(summary["tunnels"], s), "tunnels.png")
    if "bulk" in workloads and summary["bulk"]:
        section("2. Bulk through tunnels", bulk_section(summary["bulk"], s), "bulk.png")
    if "http" in workloads and any(r["requests_per_s"] for r in summary["http"].values()):
        section(
            f"3. Plain HTTP, keep-alive, {s['http_connections']} connections",
            http_section(summary["http"], document["samples"].get("main", [])),
            "http.png",
        )
    if summary["scale"]:
        section(
            "4. Policy scale (egress-proxy fast path)", scale_section(summary["scale"]), "scale.png"
        )
    if summary["dns"]:
        section(
            "5. DNS: cold and warm cache",
            dns_section(summary["dns"], summary["tunnels"].get("direct")),
            "dns.png",
        )
    if summary["idle"]:
        section(
            "6. Cost per session",
            sessions_section(summary["idle"], summary["sessions"], s["sessions"]),
            "sessions.png",
        )
    lines += ["", "## Method", "", *method(document)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots


def plot_all(document: dict[str, Any], out: Path) -> list[str]:
    """Writes one PNG per workload that has figures; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = document["summary"]
    s = document["settings"]
    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def bars(
        ax: Any,
        configs: Sequence[str],
        series: Sequence[tuple[str, Sequence[float | None], Sequence[float | None]]],
        title: str,
        ylabel: str,
        *,
        log: bool = False,
        value_format: str | None = None,
    ) -> None:
        """Grouped bars: one group per config, one bar per series (name, values, ratios);
        each bar is annotated with its ratio, or without one with its value (`value_format`).
        A series without any value is left out."""
        series = [x for x in series if any(v is not None for v in x[1])]
        width = 0.8 / max(1, len(series))
        for i, (name, values, ratios) in enumerate(series):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(configs))]
            heights = [v if v is not None else 0.0 for v in values]
            drawn = ax.bar(xs, heights, width * 0.95, label=name if len(series) > 1 else None)
            for rect, value, r in zip(drawn, values, ratios, strict=True):
                if value is None:
                    continue
                if r is not None:
                    text = ratio(r)
                elif value_format is not None:
                    text = format(value, value_format)
                else:
                    continue
                ax.annotate(
                    text,
                    (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90 if len(series) > 2 else 0,
                )
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([SHORT.get(c, label(c)) for c in configs], rotation=20, ha="right")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.25)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    def column(
        rows: dict[str, Row], configs: Sequence[str], figure: str, vs: str | None = "direct"
    ) -> tuple[list[float | None], list[float | None]]:
        values = [rows[c].get(figure) for c in configs]
        ratios = [rows[c].get(f"{figure}_vs_{vs}") if vs else None for c in configs]
        return values, ratios

    tunnels = summary.get("tunnels") or {}
    if "tunnels" in s["workloads"] and tunnels:
        configs = list(tunnels)
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
        levels = [1, *s["concurrency"]]
        bars(
            axes[0],
            configs,
            [
                (
                    f"{c} client{'s' if c > 1 else ''}",
                    *column(tunnels, configs, f"tunnels_per_s_{c}"),
                )
                for c in levels
            ],
            "New tunnels per second (ratio to direct)",
            "tunnels/s (log)",
            log=True,
        )
        bars(
            axes[1],
            configs,
            [
                ("p50", *column(tunnels, configs, "latency_p50_ms")),
                ("p99", *column(tunnels, configs, "latency_p99_ms")),
            ],
            "New tunnel latency, one client (ratio to direct)",
            "ms (log)",
            log=True,
        )
        proxies = [c for c in configs if c != "direct"]
        bars(
            axes[2],
            proxies,
            [
                (f"@{c}", *column(tunnels, proxies, f"proxy_cpu_us_per_tunnel_{c}", None))
                for c in levels
            ],
            "Proxy CPU per tunnel",
            "µs (log)",
            log=True,
            value_format=",.0f",
        )
        save(fig, "tunnels.png")

    bulk = summary.get("bulk") or {}
    if "bulk" in s["workloads"] and bulk:
        configs = list(bulk)
        n = s["parallel_tunnels"]
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
        names = {"up": "1 tunnel up", "down": "1 tunnel down"}
        names |= {"parallel_up": f"{n} tunnels up", "parallel_down": f"{n} tunnels down"}
        bars(
            axes[0],
            configs,
            [(name, *column(bulk, configs, f"{kind}_mb_s")) for kind, name in names.items()],
            "Bulk throughput (ratio to direct)",
            "MB/s",
        )
        proxies = [c for c in configs if c != "direct"]
        bars(
            axes[1],
            proxies,
            [
                (name, *column(bulk, proxies, f"{kind}_proxy_cpu_s_per_gib", None))
                for kind, name in names.items()
            ],
            "Proxy CPU per GiB moved",
            "CPU s/GiB",
            value_format=".2f",
        )
        save(fig, "bulk.png")

    http = summary.get("http") or {}
    if "http" in s["workloads"] and any(r.get("requests_per_s") for r in http.values()):
        configs = [c for c in http if http[c].get("requests_per_s")]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
        bars(
            axes[0],
            configs,
            [("req/s", *column(http, configs, "requests_per_s"))],
            f"HTTP keep-alive, {s['http_connections']} connections: requests/s (ratio to direct)",
            "requests/s (log)",
            log=True,
        )
        bars(
            axes[1],
            configs,
            [
                ("p50", *column(http, configs, "latency_p50_ms")),
                ("p99", *column(http, configs, "latency_p99_ms")),
            ],
            "Latency (ratio to direct)",
            "ms (log)",
            log=True,
        )
        proxies = [c for c in configs if c != "direct"]
        bars(
            axes[2],
            proxies,
            [("", *column(http, proxies, "proxy_cpu_us_per_request", None))],
            "Proxy CPU per request",
            "µs",
            value_format=",.0f",
        )
        save(fig, "http.png")

    scale = summary.get("scale") or {}
    if scale:
        sizes = sorted(scale, key=int)
        vs = sizes[0]
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.3))
        bars(
            axes[0],
            sizes,
            [("ready", *column(scale, sizes, "ready_s", vs))],
            f"Ready (/readyz 200), ratio to {int(vs):,} rules",
            "s",
        )
        bars(
            axes[1],
            sizes,
            [
                ("RSS", *column(scale, sizes, "idle_rss_mb", vs)),
                ("PSS", *column(scale, sizes, "idle_pss_mb", vs)),
            ],
            "Idle memory",
            "MB",
        )
        bars(
            axes[2],
            sizes,
            [
                ("p50", *column(scale, sizes, "latency_p50_ms", vs)),
                ("p99", *column(scale, sizes, "latency_p99_ms", vs)),
            ],
            "New tunnel latency",
            "ms",
        )
        save(fig, "scale.png")

    dns = summary.get("dns") or {}
    if dns:
        configs = list(dns)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        series = []
        for kind in ("warm", "cold"):
            for p in ("p50", "p99"):
                values = [dns[c].get(f"{kind}_{p}_ms") for c in configs]
                ratios = [
                    (v / dns[c]["warm_p50_ms"])
                    if v is not None and dns[c].get("warm_p50_ms")
                    else None
                    for c, v in zip(configs, values, strict=True)
                ]
                series.append((f"{kind} {p}", values, ratios))
        bars(
            ax,
            configs,
            series,
            "Tunnel latency with a cold / warm DNS cache (ratio to warm p50)",
            "ms",
        )
        direct = (summary.get("tunnels") or {}).get("direct", {}).get("latency_p50_ms")
        if direct:
            ax.axhline(direct, color="grey", linestyle="--", linewidth=1)
            ax.annotate("direct p50", (ax.get_xlim()[0], direct), fontsize=7, va="bottom")
        save(fig, "dns.png")

    idle = summary.get("idle") or {}
    sessions = summary.get("sessions") or {}
    configs = [c for c in idle if c != "direct" and idle[c].get("idle_rss_mb")]
    if configs:
        fig, ax = plt.subplots(figsize=(10, 4.8))

        def vs_fast(values: list[float | None]) -> list[float | None]:
            fast = values[configs.index("fast")] if "fast" in configs else None
            return [v / fast if v is not None and fast else None for v in values]

        series = []
        for name, values in (
            ("1 idle: RSS", [idle[c].get("idle_rss_mb") for c in configs]),
            ("1 idle: PSS", [idle[c].get("idle_pss_mb") for c in configs]),
            (
                f"{s['sessions']} side by side: PSS per session",
                [sessions.get(c, {}).get("pss_mb_per_session") for c in configs],
            ),
        ):
            series.append((name, values, vs_fast(values)))
        bars(
            ax, configs, series, "Memory per session proxy (ratio to egress-proxy fast path)", "MB"
        )
        save(fig, "sessions.png")
    return written


def write(document: dict[str, Any], out: Path) -> str:
    """Writes REPORT.md and the plots into `out`; returns the report's text."""
    out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    note = None
    try:
        plots = plot_all(document, out)
    except ImportError:
        note = "No plots: matplotlib is not installed (`make bench-deps` installs it)."
    text = render(document, plots, note)
    (out / "REPORT.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="a bench.json written by benchmarks/bench.py")
    parser.add_argument("--out", type=Path, help="where to write (default: beside the JSON)")
    args = parser.parse_args(argv)
    try:
        document = json.loads(args.json.read_text())
    except (OSError, ValueError) as exc:
        print(f"bench_report: cannot read {args.json}: {exc}", file=sys.stderr)
        return 2
    write(document, args.out or args.json.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
