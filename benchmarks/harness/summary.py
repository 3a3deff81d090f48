"""The figures of each workload (name -> path into a sample), their summary over rounds
(medians, ratios to direct within rounds), and the run's JSON document."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from . import targets
from .context import Settings
from .egress import EgressConfig
from .proc import command
from .stats import median, ratios_by_round, summarise

Figures = dict[str, tuple[str, ...]]
LEVELS = (1, 16, 64)
WHO = ("proxy", "client", "upstream")


def tunnel_figures(*at: str) -> Figures:
    """The figures of a tunnels workload's levels (1, 16, 64 clients) at `at` in a sample."""
    figures: Figures = {
        "latency_p50_ms": (*at, "1", "latency_ms", "p50"),
        "latency_p99_ms": (*at, "1", "latency_ms", "p99"),
    }
    for c in LEVELS:
        figures[f"tunnels_per_s_{c}"] = (*at, str(c), "tunnels_per_s")
        for who in WHO:
            figures[f"{who}_cpu_us_per_tunnel_{c}"] = (*at, str(c), f"{who}_cpu_us_per_tunnel")
    return figures


def socks5_figures(at: str) -> Figures:
    """The figures of one 16-client SOCKS5 phase at `at` in a sample."""
    return {
        "tunnels_per_s": (at, "tunnels_per_s"),
        "latency_p50_ms": (at, "latency_ms", "p50"),
        "latency_p99_ms": (at, "latency_ms", "p99"),
        **{f"{w}_cpu_us_per_tunnel": (at, f"{w}_cpu_us_per_tunnel") for w in WHO},
    }


TUNNEL_FIGURES = tunnel_figures("tunnels")
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
SOCKS5_FIGURES = socks5_figures("socks5")
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
    "opaque": tunnel_figures("opaque"),
    "opaque_socks5": socks5_figures("opaque_socks5"),
    "attributed_ssh": tunnel_figures("attributed", "ssh"),
    "attributed_tls": tunnel_figures("attributed", "tls"),
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


# Issue 18's check: an opaque stream costs no more proxy CPU than a TLS tunnel. Each a ratio of
# two figures of the same round (the same proxy process, or squid's in that round): (name,
# figure, the figure it is divided by, whose: None for the same configuration's).
CPU16 = ("16", "proxy_cpu_us_per_tunnel")
OPAQUE_CHECKS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str | None], ...] = (
    ("opaque_vs_tls", ("opaque", *CPU16), ("tunnels", *CPU16), None),
    ("opaque_vs_squid", ("opaque", *CPU16), ("opaque", *CPU16), "squid"),
    ("tls_vs_squid", ("tunnels", *CPU16), ("tunnels", *CPU16), "squid"),
    (
        "socks5_opaque_vs_tls",
        ("opaque_socks5", "proxy_cpu_us_per_tunnel"),
        ("socks5", "proxy_cpu_us_per_tunnel"),
        None,
    ),
    ("attributed_vs_sni", ("attributed", "ssh", *CPU16), ("attributed", "tls", *CPU16), None),
    ("attributed_vs_connect_tls", ("attributed", "ssh", *CPU16), ("tunnels", *CPU16), None),
)


def opaque_checks(
    main: Mapping[str, Sequence[Mapping[str, Any]]], egress: Mapping[str, EgressConfig]
) -> dict[str, dict[str, float | None]]:
    """Per egress-proxy configuration, the median over rounds of each OPAQUE_CHECKS ratio (None
    where a side is missing)."""
    out: dict[str, dict[str, float | None]] = {}
    for config in (c for c in main if c in egress):
        row: dict[str, float | None] = {}
        for name, path, their_path, whose in OPAQUE_CHECKS:
            theirs = main.get(whose, []) if whose else main[config]
            row[name] = median(ratios_by_round(main[config], theirs, path, their_path))
        if any(v is not None for v in row.values()):
            out[config] = row
    return out


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
    out["opaque_check"] = opaque_checks(main, egress)
    out["targets"] = targets.evaluate(main, egress, sessions)
    out["ab"] = targets.ab(main, egress)
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
    profile: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's JSON document. `profile`: a --profile run's (its figures are not of record)."""
    document = {
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
    if profile is not None:
        document["profile"] = dict(profile)
    return document
