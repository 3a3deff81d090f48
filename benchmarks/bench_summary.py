"""The figures of each workload (name -> path into a sample), their summary over rounds
(medians, ratios to direct within rounds), and the run's JSON document."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import bench_targets
from bench_context import Settings
from bench_egress import EgressConfig
from bench_proc import command
from bench_stats import summarise

Figures = dict[str, tuple[str, ...]]
LEVELS = (1, 16, 64)
WHO = ("proxy", "client", "upstream")

TUNNEL_FIGURES: Figures = {
    "latency_p50_ms": ("tunnels", "1", "latency_ms", "p50"),
    "latency_p99_ms": ("tunnels", "1", "latency_ms", "p99"),
}
for _c in LEVELS:
    TUNNEL_FIGURES[f"tunnels_per_s_{_c}"] = ("tunnels", str(_c), "tunnels_per_s")
    for _who in WHO:
        TUNNEL_FIGURES[f"{_who}_cpu_us_per_tunnel_{_c}"] = (
            "tunnels",
            str(_c),
            f"{_who}_cpu_us_per_tunnel",
        )
BULK_KINDS = ("up", "down", "parallel_up", "parallel_down")
BULK_FIGURES: Figures = {}
for _k in BULK_KINDS:
    BULK_FIGURES[f"{_k}_mb_s"] = ("bulk", _k, "mb_per_s")
    for _who in WHO:
        BULK_FIGURES[f"{_k}_{_who}_cpu_s_per_gib"] = ("bulk", _k, f"{_who}_cpu_s_per_gib")
HTTP_FIGURES: Figures = {
    "requests_per_s": ("http", "requests_per_s"),
    "latency_p50_ms": ("http", "latency_ms", "p50"),
    "latency_p99_ms": ("http", "latency_ms", "p99"),
    **{
        f"{w}_cpu_us_per_request": ("http", f"{w}_cpu_us_per_request")
        for w in ("proxy", "origin", "client")
    },
}
SOCKS5_FIGURES: Figures = {
    "tunnels_per_s": ("socks5", "tunnels_per_s"),
    "latency_p50_ms": ("socks5", "latency_ms", "p50"),
    "latency_p99_ms": ("socks5", "latency_ms", "p99"),
    **{f"{w}_cpu_us_per_tunnel": ("socks5", f"{w}_cpu_us_per_tunnel") for w in WHO},
}
DNS_LISTEN_FIGURES: Figures = {
    "queries_per_s": ("dns_listen", "queries_per_s"),
    "latency_p50_ms": ("dns_listen", "latency_ms", "p50"),
    "latency_p99_ms": ("dns_listen", "latency_ms", "p99"),
    "proxy_cpu_us_per_query": ("dns_listen", "proxy_cpu_us_per_query"),
    "client_cpu_us_per_query": ("dns_listen", "client_cpu_us_per_query"),
}
INSPECT_FIGURES: Figures = {}
for _unit in ("tunnel", "request"):
    INSPECT_FIGURES[f"{_unit}s_per_s"] = ("inspect", _unit, f"{_unit}s_per_s")
    INSPECT_FIGURES[f"{_unit}_p50_ms"] = ("inspect", _unit, "latency_ms", "p50")
    INSPECT_FIGURES[f"{_unit}_p99_ms"] = ("inspect", _unit, "latency_ms", "p99")
    for _who in ("proxy", "client", "origin"):
        INSPECT_FIGURES[f"{_who}_cpu_us_per_{_unit}"] = (
            "inspect",
            _unit,
            f"{_who}_cpu_us_per_{_unit}",
        )
CHECKPOINTS = ("idle", "after_connect", "after_http", "after_socks5", "after_dns", "after_inspect")
MEMORY_FIGURES: Figures = {
    "ready_s": ("ready_s",),
    "first_connect_s": ("first_connect_s",),
    "startup_cpu_s": ("startup_cpu_s",),
    "idle_pss_mb": ("memory", "idle", "pss_mb"),
    "idle_uss_mb": ("memory", "idle", "uss_mb"),
    "worst_rss_mb": ("worst_rss_mb",),
    **{f"{c}_rss_mb": ("memory", c, "rss_mb") for c in CHECKPOINTS},
}
SCALE_FIGURES: Figures = {
    "ready_s": ("ready_s",),
    "first_connect_s": ("first_connect_s",),
    "startup_cpu_s": ("startup_cpu_s",),
    "idle_rss_mb": ("idle", "rss_mb"),
    "idle_pss_mb": ("idle", "pss_mb"),
    "latency_p50_ms": ("tunnels", "latency_ms", "p50"),
    "latency_p99_ms": ("tunnels", "latency_ms", "p99"),
    "proxy_cpu_us_per_tunnel": ("tunnels", "proxy_cpu_us_per_tunnel"),
}
DNS_FIGURES: Figures = {}
for _k in ("cold", "warm"):
    DNS_FIGURES[f"{_k}_p50_ms"] = (_k, "latency_ms", "p50")
    DNS_FIGURES[f"{_k}_p99_ms"] = (_k, "latency_ms", "p99")
    DNS_FIGURES[f"{_k}_proxy_cpu_us_per_tunnel"] = (_k, "proxy_cpu_us_per_tunnel")
    DNS_FIGURES[f"{_k}_lookup_ms"] = (_k, "dns_lookup_ms_mean")
SESSION_FIGURES: Figures = {
    key: (key,)
    for key in (
        "sessions",
        "rss_mb_sum",
        "pss_mb_sum",
        "pss_mb_per_session",
        "rss_mb_per_session",
        "uss_mb_per_session",
        "startup_cpu_s_per_session",
        "start_wall_s",
    )
}
MAIN_WORKLOADS: dict[str, Figures] = {
    "tunnels": TUNNEL_FIGURES,
    "bulk": BULK_FIGURES,
    "http": HTTP_FIGURES,
    "socks5": SOCKS5_FIGURES,
    "dns_listen": DNS_LISTEN_FIGURES,
    "inspect": INSPECT_FIGURES,
    "memory": MEMORY_FIGURES,
}


def by_config(samples: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for sample in samples:
        out.setdefault(sample["config"], []).append(sample)
    return out


def _present(rows: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """Only the configurations that have some figure of the workload."""
    return {c: r for c, r in rows.items() if any(v is not None for v in r.values())}


def summaries(
    samples: Mapping[str, Sequence[Mapping[str, Any]]], egress: Mapping[str, EgressConfig]
) -> dict[str, Any]:
    """Medians over rounds and ratios within rounds, per workload; and the targets."""
    main = by_config(samples.get("main", []))
    out: dict[str, Any] = {}
    for workload, figures in MAIN_WORKLOADS.items():
        out[workload] = _present(summarise(main, figures))
    scale = by_config(samples.get("scale", []))
    smallest = min(scale, key=int) if scale else None
    out["scale"] = summarise(scale, SCALE_FIGURES, baseline=smallest)
    out["dns"] = summarise(by_config(samples.get("dns", [])), DNS_FIGURES, baseline=None)
    out["sessions"] = summarise(
        by_config(samples.get("sessions", [])), SESSION_FIGURES, baseline="squid"
    )
    sessions = out["sessions"] if samples.get("sessions") else None
    out["targets"] = bench_targets.evaluate(main, egress, sessions)
    out["ab"] = bench_targets.ab(main, egress)
    return out


def build_document(
    settings: Settings,
    quick: bool,
    configs: Sequence[str],
    egress: Mapping[str, EgressConfig],
    workloads: Sequence[str],
    info: dict[str, Any],
    peers: Mapping[str, Any],
    notes: Sequence[str],
    problems: Sequence[str],
    samples: Mapping[str, Sequence[Mapping[str, Any]]],
    elapsed: float,
) -> dict[str, Any]:
    return {
        "benchmark": "bench",
        "command": command(),
        "mode": "quick" if quick else "full",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "machine": info,
        "settings": {
            **dataclasses.asdict(settings),
            "configs": list(configs),
            "workloads": list(workloads),
        },
        "egress_configs": {
            name: {**dataclasses.asdict(c), "tree": str(c.tree) if c.tree else None}
            for name, c in egress.items()
        },
        "peers": dict(peers),
        "notes": list(notes),
        "problems": list(problems),
        "summary": summaries(samples, egress),
        "samples": {k: list(v) for k, v in samples.items()},
    }
