"""REPORT.md and the PNG plots of a benchmark harness run, from its bench.json.

    .venv/bin/python -m benchmarks.harness.report benchmarks/results/bench.json [--out DIR]

The harness (main.py) calls `write()` at the end of a run; this script writes them again from a
saved run (e.g. after a change to the report). Plots need matplotlib (`make bench-deps`, the
`bench` extra); without it the report says so and has the tables only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .cells import cell, label, ratio, table, with_unit

Row = Mapping[str, Any]


# --------------------------------------------------------------------------------------------
# Sections


def targets_section(rows: Sequence[Row], rounds: int) -> list[str]:
    head = ["target", "goal", "configuration", "measured", "squid", "ratio to squid", "met"]
    head += ["tinyproxy (ratio)", "load generator"]
    out = []
    for r in rows:
        unit = r["unit"]
        if r.get("goal_text"):
            goal = r["goal_text"]
        elif r["goal"] is None:
            goal = "reported"
        elif r["absolute"]:
            goal = f"{r['op']} {with_unit(r['goal'], unit)}"
        else:
            goal = f"{r['op']} {r['goal']:g}x squid"
        met = "-" if r["met"] is None else "met" if r["met"] else "**NOT MET**"
        if r["why_not"] and r["met"] is None:
            met = r["why_not"]
        loadgen = "-"
        if r["loadgen"] is not None:
            loadgen = f"{r['loadgen_label']}: {with_unit(r['loadgen'], unit)}"
        tiny = with_unit(r["tinyproxy"], unit)
        if r["tinyproxy_ratio"] is not None:
            tiny += f" ({ratio(r['tinyproxy_ratio'])})"
        out.append(
            [
                r["name"],
                goal,
                r["config"],
                with_unit(r["value"], unit),
                with_unit(r["squid"], unit),
                "-" if r["absolute"] else ratio(r["ratio"]),
                met,
                tiny,
                loadgen,
            ]
        )
    judged = [r for r in rows if r["met"] is not None]
    if not any(r["squid"] is not None for r in rows):
        out.append(["(squid did not run: no ratio can be judged)", *["-"] * (len(head) - 1)])
    count = sum(1 for r in judged if r["met"])
    return [
        table(head, out),
        "",
        f"{count} of {len(judged)} judged targets met. A ratio is the median over {rounds} "
        "round(s) of the configuration's figure divided by squid's in the same round; "
        "'load generator' is direct's figure for a rate (the load generator alone, without a "
        "proxy: the most any configuration could reach) or the client's and upstream's own CPU "
        "per unit in the same phases. CPU per unit is the figure of record: on 2 shared CPUs "
        "the client, the upstream and the proxy compete, so every rate understates the proxy.",
    ]


Column = tuple[str, str, str]  # header, figure, format ("x": a ratio)


def figure_table(summary: Mapping[str, Row], columns: Sequence[Column]) -> str:
    """One row per configuration, one cell per column: its figure formatted, or its ratio."""
    head = ["", *(c[0] for c in columns)]
    rows = [
        [label(config)]
        + [ratio(r.get(key)) if fmt == "x" else cell(r.get(key), fmt) for _, key, fmt in columns]
        for config, r in summary.items()
    ]
    return table(head, rows)


def ab_section(rows: Sequence[Row]) -> list[str]:
    head = ["figure", "configuration", "this tree", "baseline tree", "ratio", "rounds"]
    body = [
        [
            r["name"],
            r["config"],
            with_unit(r["value"], r["unit"]),
            with_unit(r["baseline_value"], r["unit"]),
            ratio(r["ratio"]),
            str(r["rounds"]),
        ]
        for r in rows
        if r["value"] is not None or r["baseline_value"] is not None
    ]
    return [
        table(head, body),
        "",
        "Each ratio is the median over rounds of this tree's figure divided by the baseline "
        "tree's in the same round (both run side by side, interleaved).",
    ]


def tunnels_section(summary: Mapping[str, Row], settings: Mapping[str, Any]) -> list[str]:
    levels = [1, *settings["concurrency"]]
    columns: list[Column] = [("p50 ms @1", "latency_p50_ms", ".3f")]
    columns.append(("p99 ms @1", "latency_p99_ms", ".3f"))
    for c in levels:
        columns += [(f"tunnels/s @{c}", f"tunnels_per_s_{c}", ",.0f")]
        columns += [("vs direct", f"tunnels_per_s_{c}_vs_direct", "x")]
    columns += [
        (f"proxy CPU µs/tunnel @{c}", f"proxy_cpu_us_per_tunnel_{c}", ",.0f") for c in levels
    ]
    columns += [
        (f"{w} µs/tunnel @16", f"{w}_cpu_us_per_tunnel_16", ",.0f") for w in ("client", "upstream")
    ]
    check = loadgen_check(summary, "tunnels_per_s_16", "tunnels/s at 16 clients")
    return [figure_table(summary, columns), "", check]


def opaque_check_section(checks: Mapping[str, Row]) -> list[str]:
    """Issue 18's check, one line per egress-proxy configuration: an opaque stream must cost no
    more proxy CPU than a TLS tunnel (16 clients, ratios within rounds), and the ratios beside."""
    out = []
    for config, r in checks.items():
        opaque_vs_tls = r.get("opaque_vs_tls")
        verdict = "-" if opaque_vs_tls is None else "met" if opaque_vs_tls <= 1.0 else "**NOT MET**"
        out.append(
            f"- {label(config)}: proxy CPU per tunnel at 16 clients, opaque (SSH first flight) "
            f"/ TLS (ClientHello), CONNECT: **{ratio(opaque_vs_tls)}** (goal <= 1.0x: {verdict}); "
            f"SOCKS5 opaque / TLS: {ratio(r.get('socks5_opaque_vs_tls'))}; opaque "
            f"{label(config)} / squid: {ratio(r.get('opaque_vs_squid'))} (TLS: "
            f"{ratio(r.get('tls_vs_squid'))}); transparent, attributed by DNS / decided on the "
            f"SNI: {ratio(r.get('attributed_vs_sni'))}; attributed by DNS / CONNECT TLS: "
            f"{ratio(r.get('attributed_vs_connect_tls'))}."
        )
    return [
        *out,
        "",
        "Each ratio is the median over rounds of two figures of the same round: the same proxy "
        "process's (opaque against TLS) or squid's in that round. '-': a side was not measured.",
    ]


def attributed_section(
    ssh: Mapping[str, Row], tls: Mapping[str, Row], settings: Mapping[str, Any]
) -> list[str]:
    out = []
    for title, summary in (
        ("SSH first flight, no name: attributed by the proxy's DNS answer", ssh),
        ("TLS ClientHello on the same listener: decided on its SNI", tls),
    ):
        if summary:
            out += [f"{title}:", "", *tunnels_section(summary, settings), ""]
    return out


def loadgen_check(summary: Mapping[str, Row], figure: str, what: str) -> str:
    """The sentence that shows the load generator was not the limit (or that it was close)."""
    direct = (summary.get("direct") or {}).get(figure)
    others = [(r[figure], c) for c, r in summary.items() if c != "direct" and r.get(figure)]
    if not direct or not others:
        return ""
    best, who = max(others)
    verdict = (
        "the load generator is not what limits the proxies' figures"
        if direct >= 1.5 * best
        else "the load generator is close to the fastest proxy: read its CPU per unit, not its rate"
    )
    return (
        f"Load generator check: without a proxy it made {direct:,.0f} {what}, {direct / best:.1f}x "
        f"the fastest proxy ({label(who)}, {best:,.0f}): {verdict}."
    )


def bulk_section(summary: Mapping[str, Row], settings: Mapping[str, Any]) -> list[str]:
    n = settings["parallel_tunnels"]
    kinds = {"up": "1 up", "down": "1 down", "parallel_up": f"{n} up", "parallel_down": f"{n} down"}
    columns: list[Column] = []
    for kind, name in kinds.items():
        columns += [
            (f"{name} MB/s", f"{kind}_mb_s", ",.0f"),
            ("vs direct", f"{kind}_mb_s_vs_direct", "x"),
        ]
    columns += [
        (f"proxy CPU s/GiB {name}", f"{k}_proxy_cpu_s_per_gib", ".2f") for k, name in kinds.items()
    ]
    columns += [
        (f"client+upstream s/GiB {d}", f"{d}_loadgen_s_per_gib", ".2f") for d in ("up", "down")
    ]
    rows = {
        config: {
            **r,
            **{
                f"{d}_loadgen_s_per_gib": _sum(
                    r.get(f"{d}_client_cpu_s_per_gib"), r.get(f"{d}_upstream_cpu_s_per_gib")
                )
                for d in ("up", "down")
            },
        }
        for config, r in summary.items()
    }
    check = loadgen_check(summary, "up_mb_s", "MB/s up through one tunnel")
    return [figure_table(rows, columns), "", check]


def _sum(*values: Any) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def http_section(summary: Mapping[str, Row], samples: Sequence[Row]) -> list[str]:
    columns: list[Column] = [
        ("requests/s", "requests_per_s", ",.0f"),
        ("vs direct", "requests_per_s_vs_direct", "x"),
        ("p50 ms", "latency_p50_ms", ".3f"),
        ("p99 ms", "latency_p99_ms", ".3f"),
        ("proxy CPU µs/request", "proxy_cpu_us_per_request", ",.0f"),
        ("origin µs/request", "origin_cpu_us_per_request", ",.1f"),
        ("wrk µs/request", "client_cpu_us_per_request", ",.1f"),
    ]
    out = [
        figure_table(summary, columns),
        "",
        loadgen_check(summary, "requests_per_s", "requests/s"),
    ]
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


def socks5_section(summary: Mapping[str, Row], tunnels: Mapping[str, Row]) -> list[str]:
    columns: list[Column] = [
        ("tunnels/s @16", "tunnels_per_s", ",.0f"),
        ("p50 ms", "latency_p50_ms", ".3f"),
        ("p99 ms", "latency_p99_ms", ".3f"),
        ("proxy CPU µs/tunnel", "proxy_cpu_us_per_tunnel", ",.0f"),
        ("CONNECT at 16: proxy CPU µs/tunnel", "connect_cpu", ",.0f"),
        ("client µs/tunnel", "client_cpu_us_per_tunnel", ",.0f"),
        ("upstream µs/tunnel", "upstream_cpu_us_per_tunnel", ",.0f"),
    ]
    rows = {
        c: {**r, "connect_cpu": (tunnels.get(c) or {}).get("proxy_cpu_us_per_tunnel_16")}
        for c, r in summary.items()
    }
    out = [figure_table(rows, columns)]
    direct = (tunnels.get("direct") or {}).get("tunnels_per_s_16")
    if direct:
        out += [
            "",
            f"The same client without a proxy (CONNECT workload, direct): {direct:,.0f} tunnels/s.",
        ]
    return out


def dns_listen_section(summary: Mapping[str, Row]) -> list[str]:
    columns: list[Column] = [
        ("queries/s", "queries_per_s", ",.0f"),
        ("p50 ms", "latency_p50_ms", ".3f"),
        ("p99 ms", "latency_p99_ms", ".3f"),
        ("proxy CPU µs/query", "proxy_cpu_us_per_query", ",.0f"),
        ("client CPU µs/query", "client_cpu_us_per_query", ",.0f"),
    ]
    return [figure_table(summary, columns)]


def inspect_section(summary: Mapping[str, Row]) -> list[str]:
    columns: list[Column] = [
        ("new tunnels/s", "tunnels_per_s", ",.0f"),
        ("vs direct", "tunnels_per_s_vs_direct", "x"),
        ("p50 ms", "tunnel_p50_ms", ".3f"),
        ("proxy CPU µs/tunnel", "proxy_cpu_us_per_tunnel", ",.0f"),
        ("requests/s", "requests_per_s", ",.0f"),
        ("vs direct", "requests_per_s_vs_direct", "x"),
        ("p50 ms", "request_p50_ms", ".3f"),
        ("proxy CPU µs/request", "proxy_cpu_us_per_request", ",.0f"),
        ("client µs/request", "client_cpu_us_per_request", ",.0f"),
        ("origin µs/request", "origin_cpu_us_per_request", ",.0f"),
    ]
    check = loadgen_check(summary, "requests_per_s", "HTTPS requests/s")
    return [figure_table(summary, columns), "", check]


def memory_section(
    memory: Mapping[str, Row], sessions: Mapping[str, Row], wanted: int
) -> list[str]:
    from .summary import CHECKPOINTS

    head = ["", "ready s", "first CONNECT s", "start-up CPU s"]
    head += [f"RSS MB {c.replace('_', ' ')}" for c in CHECKPOINTS]
    head += ["largest RSS", "idle PSS MB", f"PSS MB/session, {wanted} side by side", "vs squid"]
    rows = []
    for config, r in memory.items():
        if config == "direct":
            continue
        s = sessions.get(config, {})
        count = s.get("sessions")
        note = "" if count is None or count == wanted else f" ({count:.0f} started)"
        rows.append(
            [
                label(config),
                cell(r.get("ready_s"), ".3f"),
                cell(r.get("first_connect_s"), ".3f"),
                cell(r.get("startup_cpu_s"), ".2f"),
                *(cell(r.get(f"{c}_rss_mb"), ".1f") for c in CHECKPOINTS),
                cell(r.get("worst_rss_mb"), ".1f"),
                cell(r.get("idle_pss_mb"), ".1f"),
                cell(s.get("pss_mb_per_session"), ".1f") + note,
                ratio(s.get("pss_mb_per_session_vs_squid")),
            ]
        )
    return [table(head, rows)]


def scale_section(summary: Mapping[str, Row]) -> list[str]:
    smallest = min(summary, key=int) if summary else "10"
    columns: list[Column] = [
        ("ready s", "ready_s", ".3f"),
        ("vs smallest", f"ready_s_vs_{smallest}", "x"),
        ("first CONNECT s", "first_connect_s", ".3f"),
        ("start-up CPU s", "startup_cpu_s", ".2f"),
        ("idle RSS MB", "idle_rss_mb", ".1f"),
        ("idle PSS MB", "idle_pss_mb", ".1f"),
        ("tunnel p50 ms", "latency_p50_ms", ".3f"),
        ("p99 ms", "latency_p99_ms", ".3f"),
        ("proxy CPU µs/tunnel", "proxy_cpu_us_per_tunnel", ",.0f"),
    ]
    return [figure_table(dict(sorted(summary.items(), key=lambda kv: int(kv[0]))), columns)]


def dns_section(summary: Mapping[str, Row], direct: Row | None) -> list[str]:
    columns: list[Column] = [
        ("cold p50 ms", "cold_p50_ms", ".3f"),
        ("cold p99 ms", "cold_p99_ms", ".3f"),
        ("warm p50 ms", "warm_p50_ms", ".3f"),
        ("warm p99 ms", "warm_p99_ms", ".3f"),
        ("cold - warm p50 ms", "gap", ".3f"),
        ("lookup ms cold (proxy's metric)", "cold_lookup_ms", ".3f"),
        ("warm", "warm_lookup_ms", ".3f"),
        ("proxy CPU µs/tunnel cold", "cold_proxy_cpu_us_per_tunnel", ",.0f"),
        ("warm", "warm_proxy_cpu_us_per_tunnel", ",.0f"),
    ]
    rows = {
        c: {
            **r,
            "gap": None
            if r.get("cold_p50_ms") is None or r.get("warm_p50_ms") is None
            else r["cold_p50_ms"] - r["warm_p50_ms"],
        }
        for c, r in summary.items()
    }
    out = [figure_table(rows, columns)]
    if direct and direct.get("latency_p50_ms") is not None:
        out += [
            "",
            "For reference, a tunnel without a proxy (direct, workload 1): p50 "
            f"{direct['latency_p50_ms']:.3f} ms, "
            f"p99 {cell(direct.get('latency_p99_ms'), '.3f')} ms.",
        ]
    return out


def configurations(document: Mapping[str, Any]) -> list[str]:
    lines = [
        f"- `{name}`: {c['description']}." for name, c in document.get("egress_configs", {}).items()
    ]
    return lines


def render(document: Mapping[str, Any], plots: Sequence[str], plot_note: str | None) -> str:
    from .method import method

    m = document["machine"]
    s = document["settings"]
    summary = document["summary"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    configs = ", ".join(f"`{c}`" for c in s["configs"])
    lines = ["# Benchmark report: egress-proxy against squid and its peers", ""]
    if profile := document.get("profile"):
        lines += [
            f"**Not figures of record**: this run was {profile.get('why')}. Where the CPU "
            f"went: `{profile.get('summary')}`.",
            "",
        ]
    lines += [
        f"{document['mode'].capitalize()} run of {document['date']}, "
        f"{document['elapsed_s']:.0f} s: `{document['command']}`. {s['rounds']} interleaved "
        f"round(s) of {configs}, in that order each round; medians over rounds.",
        "",
        f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}), "
        f"{cell(m.get('memory_mb'), ',.0f')} MB RAM, Linux {m.get('kernel')}, "
        f"{m.get('implementation')} {m.get('python')}, git {m.get('git')}, load average "
        f"{' '.join(m.get('loadavg_at_start') or [])} at start, "
        f"{' '.join(m.get('loadavg_at_end') or [])} at the end. Everything on loopback, on the "
        "same CPUs as the load generators: every rate is the whole machine's.",
        "",
        f"Versions: {versions}.",
        "",
        "egress-proxy configurations:",
        *configurations(document),
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

    def section(title: str, body: list[str], plot: str | None = None) -> None:
        lines.extend(["", f"## {title}", "", *[b for b in body if b is not None]])
        if plot in plots:
            lines.extend(["", f"![{title}]({plot})"])

    if summary.get("targets"):
        section(
            "Targets (ratios to squid, same run)", targets_section(summary["targets"], s["rounds"])
        )
    if summary.get("ab"):
        section("A/B: this tree against the baseline tree", ab_section(summary["ab"]))
    if summary.get("opaque_check"):
        title = "Issue 18: an opaque stream costs no more proxy CPU than a TLS tunnel"
        section(title, opaque_check_section(summary["opaque_check"]))
    if summary.get("tunnels"):
        section("1. New CONNECT tunnels", tunnels_section(summary["tunnels"], s), "tunnels.png")
    if summary.get("opaque"):
        title = "1b. Opaque streams in new CONNECT tunnels (SSH first flight, a non-TLS port)"
        section(title, tunnels_section(summary["opaque"], s))
    if summary.get("opaque_socks5"):
        body = socks5_section(summary["opaque_socks5"], summary.get("opaque", {}))
        section("1c. Opaque streams in new SOCKS5 tunnels", body)
    if summary.get("attributed_ssh") or summary.get("attributed_tls"):
        body = attributed_section(
            summary.get("attributed_ssh", {}), summary.get("attributed_tls", {}), s
        )
        section("1d. Transparent connections in a network namespace (attributed by DNS)", body)
    if summary.get("bulk"):
        section("2. Bulk through tunnels", bulk_section(summary["bulk"], s), "bulk.png")
    if summary.get("http"):
        title = "3. Plain HTTP, 16 keep-alive connections (wrk, absolute form)"
        section(
            title, http_section(summary["http"], document["samples"].get("main", [])), "http.png"
        )
    if summary.get("socks5"):
        section("4. SOCKS5 tunnels", socks5_section(summary["socks5"], summary.get("tunnels", {})))
    if summary.get("dns_listen"):
        section(
            "5. DNS listener (--dns-listen), dnspython client",
            dns_listen_section(summary["dns_listen"]),
        )
    if summary.get("inspect"):
        section("6. Intercepted HTTPS (TLS inspection)", inspect_section(summary["inspect"]))
    if summary.get("memory"):
        body = memory_section(summary["memory"], summary.get("sessions", {}), s["sessions"])
        section("7. Start-up and memory per session", body, "sessions.png")
    if summary.get("scale"):
        section("8. Policy scale (egress-proxy)", scale_section(summary["scale"]), "scale.png")
    if summary.get("dns"):
        body = dns_section(summary["dns"], (summary.get("tunnels") or {}).get("direct"))
        section("9. The proxy's resolver: cold and warm cache", body, "dns.png")
    lines += ["", "## Method", "", *method(document)]
    return "\n".join(lines) + "\n"


def write(document: Mapping[str, Any], out: Path) -> str:
    """Writes REPORT.md and the plots into `out`; returns the report's text."""
    out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    note = None
    try:
        from .plots import plot_all

        plots = plot_all(document, out)
    except ImportError:
        note = "No plots: matplotlib is not installed (`make bench-deps` installs it)."
    text = render(document, plots, note)
    (out / "REPORT.md").write_text(text)
    return text


def resummarised(document: Mapping[str, Any]) -> dict[str, Any]:
    """The summary computed again from the run's samples (the report follows the harness's
    current summary, never a mix of runs)."""
    from .egress import EgressConfig
    from .summary import summaries

    egress = {}
    for name, fields in document.get("egress_configs", {}).items():
        tree = fields.get("tree")
        egress[name] = EgressConfig(
            **{
                **fields,
                "args": tuple(fields.get("args", ())),
                "tree": Path(tree) if tree else None,
            }
        )
    return summaries(document["samples"], egress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="a bench.json written by benchmarks/bench.py")
    parser.add_argument("--out", type=Path, help="where to write (default: beside the JSON)")
    args = parser.parse_args(argv)
    try:
        document = json.loads(args.json.read_text())
        document["summary"] = resummarised(document)
        text = write(document, args.out or args.json.parent)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"benchmarks.harness.report: cannot report {args.json}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
