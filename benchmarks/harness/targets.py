"""The targets the data plane is judged by (issue 12; its CPU and memory goals as issue 20 set
them again), as ratios to squid measured in the same
run: each a figure of the main rounds, a goal, and for every egress-proxy configuration the
median over rounds of its figure divided by squid's in the same round, met or not. tinyproxy's
ratio is reported beside, and the load generator's own figure (its rate against direct, its CPU
per unit) so that a reader sees it was not the limit. Two are absolute: ready within 0.3 s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .egress import EgressConfig
from .stats import dig, median, number, ratios_by_round

Samples = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Target:
    key: str
    name: str
    path: tuple[str, ...]  # the figure in a main-round sample
    op: str  # "<=" or ">="
    goal: float  # a ratio to squid's figure, or (absolute) the figure itself
    unit: str
    squid_path: tuple[str, ...] | None = None  # squid's figure, when not the same one
    absolute: bool = False
    # The load generator beside it: its rate against direct (a rate), or its CPU per unit.
    loadgen: tuple[tuple[str, ...], ...] = ()
    loadgen_direct: bool = False  # loadgen paths are read from direct's samples (rates)
    loadgen_label: str = "client + upstream"
    needs_passthrough: bool = False
    excludes_engine: bool = False  # not judged for a configuration that needs the engine
    goal_text: str | None = None  # the goal as the report words it, when not "OP GOALx squid"


T16 = ("tunnels", "16")


def _bulk(direction: str) -> tuple[Target, Target]:
    """The CPU per GiB and MB/s targets of one tunnel's bulk `direction`."""
    return (
        Target(
            f"cpu_per_gib_{direction}",
            f"proxy CPU per GiB, 1 tunnel {direction}",
            ("bulk", direction, "proxy_cpu_s_per_gib"),
            "<=",
            0.4,
            "s/GiB",
            loadgen=(
                ("bulk", direction, "client_cpu_s_per_gib"),
                ("bulk", direction, "upstream_cpu_s_per_gib"),
            ),
            needs_passthrough=True,
        ),
        Target(
            f"bulk_{direction}",
            f"bulk MB/s, 1 tunnel {direction}",
            ("bulk", direction, "mb_per_s"),
            ">=",
            1.3,
            "MB/s",
            loadgen=(("bulk", direction, "mb_per_s"),),
            loadgen_direct=True,
            needs_passthrough=True,
        ),
    )


TARGETS = (
    Target(
        "cpu_per_tunnel",
        "proxy CPU per tunnel, 16 clients (audit log and metrics on)",
        (*T16, "proxy_cpu_us_per_tunnel"),
        "<=",
        1.4,
        "µs",
        loadgen=((*T16, "client_cpu_us_per_tunnel"), (*T16, "upstream_cpu_us_per_tunnel")),
        needs_passthrough=True,
    ),
    Target(
        "tunnels_per_s",
        "new tunnels/s, 16 clients",
        (*T16, "tunnels_per_s"),
        ">=",
        0.8,
        "/s",
        loadgen=((*T16, "tunnels_per_s"),),
        loadgen_direct=True,
        needs_passthrough=True,
    ),
    Target(
        "cpu_per_request",
        "proxy CPU per plain-HTTP request (wrk, 16 connections)",
        ("http", "proxy_cpu_us_per_request"),
        "<=",
        1.2,
        "µs",
        loadgen=(("http", "client_cpu_us_per_request"), ("http", "origin_cpu_us_per_request")),
        loadgen_label="wrk + nginx",
    ),
    Target(
        "requests_per_s",
        "plain-HTTP requests/s, 16 keep-alive connections",
        ("http", "requests_per_s"),
        ">=",
        1.3,
        "/s",
        loadgen=(("http", "requests_per_s"),),
        loadgen_direct=True,
    ),
    *_bulk("up"),
    *_bulk("down"),
    Target(
        "idle_rss",
        "idle RSS, the largest of: at start, after CONNECT, plain HTTP, SOCKS5, DNS",
        ("worst_rss_mb",),
        "<=",
        1.2,
        "MB",
        squid_path=("memory", "idle", "rss_mb"),
        excludes_engine=True,
        goal_text="<= 1.2x squid's RSS at start",
    ),
    Target("ready", "ready: exec to /readyz 200", ("ready_s",), "<=", 0.3, "s", absolute=True),
    Target(
        "first_connect",
        "ready: exec to the first CONNECT answered 200",
        ("first_connect_s",),
        "<=",
        0.3,
        "s",
        absolute=True,
    ),
)


def _values(samples: Samples, path: Sequence[str]) -> float | None:
    return median(number(dig(s, path)) for s in samples)


def _loadgen(target: Target, mine: Samples, direct: Samples) -> float | None:
    """The load generator's figure beside a target: direct's rate (rates), or the client's plus
    the upstream's (or origin's) CPU per unit in the same phases (CPU)."""
    if not target.loadgen:
        return None
    source = direct if target.loadgen_direct else mine
    parts = [_values(source, path) for path in target.loadgen]
    return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)


def evaluate(
    main: Mapping[str, Samples],
    egress: Mapping[str, EgressConfig],
    sessions: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per (target, egress-proxy configuration of the run): its value, squid's and
    tinyproxy's, the ratio to squid (median of per-round ratios), the load generator's figure,
    and met (None when it cannot be judged: no squid, no figure)."""
    squid, tiny, direct = main.get("squid", []), main.get("tinyproxy", []), main.get("direct", [])
    rows: list[dict[str, Any]] = []
    for config, chosen in egress.items():
        mine = main.get(config, [])
        for t in TARGETS:
            row: dict[str, Any] = {
                "target": t.key,
                "name": t.name,
                "config": config,
                "op": t.op,
                "goal_text": t.goal_text,
                "goal": t.goal,
                "unit": t.unit,
                "absolute": t.absolute,
                "value": _values(mine, t.path),
                "squid": _values(squid, t.squid_path or t.path),
                "tinyproxy": _values(tiny, t.path),
                "loadgen": _loadgen(t, mine, direct),
                "loadgen_label": "direct" if t.loadgen_direct else t.loadgen_label,
                "rounds": len(mine),
                "ratio": None,
                "tinyproxy_ratio": None,
                "met": None,
                "why_not": None,
            }
            if t.needs_passthrough and not chosen.passthrough:
                row["why_not"] = "not measured: this configuration intercepts bench.test"
            elif t.excludes_engine and chosen.needs_engine:
                row["why_not"] = "no goal: it needs the interception engine (loaded at start)"
            if not t.absolute:
                paired = ratios_by_round(mine, squid, t.path, t.squid_path)
                row["ratio"] = median(paired)
                row["rounds"] = len(paired)
                row["tinyproxy_ratio"] = median(ratios_by_round(tiny, squid, t.path, t.squid_path))
            judged = row["value"] if t.absolute else row["ratio"]
            if judged is not None and row["why_not"] is None:
                # A ratio exactly at its goal is met, whatever the float rounding of it.
                slack = t.goal * 1e-9
                row["met"] = judged <= t.goal + slack if t.op == "<=" else judged >= t.goal - slack
            rows.append(row)
        if sessions is not None:
            rows.append(_pss_row(config, sessions))
    return rows


def ab(main: Mapping[str, Samples], egress: Mapping[str, EgressConfig]) -> list[dict[str, Any]]:
    """For every configuration run from a baseline tree too: each target's figure of this tree
    over the baseline's, within rounds (the median of the per-round ratios)."""
    rows: list[dict[str, Any]] = []
    for name, chosen in egress.items():
        twin = f"{name}-baseline"
        if chosen.tree is not None or twin not in egress:
            continue
        for t in TARGETS:
            paired = ratios_by_round(main.get(name, []), main.get(twin, []), t.path)
            rows.append(
                {
                    "config": name,
                    "baseline": twin,
                    "target": t.key,
                    "name": t.name,
                    "unit": t.unit,
                    "value": _values(main.get(name, []), t.path),
                    "baseline_value": _values(main.get(twin, []), t.path),
                    "ratio": median(paired),
                    "rounds": len(paired),
                }
            )
    return rows


def _pss_row(config: str, sessions: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """PSS per session with N side by side: reported, no goal."""
    mine = (sessions.get(config) or {}).get("pss_mb_per_session")
    squid = (sessions.get("squid") or {}).get("pss_mb_per_session")
    tiny = (sessions.get("tinyproxy") or {}).get("pss_mb_per_session")
    return {
        "target": "pss_per_session",
        "name": "PSS per session, sessions side by side",
        "config": config,
        "op": None,
        "goal": None,
        "unit": "MB",
        "absolute": False,
        "value": mine,
        "squid": squid,
        "tinyproxy": tiny,
        "loadgen": None,
        "loadgen_label": None,
        "rounds": 1 if mine is not None else 0,
        "ratio": mine / squid if mine is not None and squid else None,
        "tinyproxy_ratio": tiny / squid if tiny is not None and squid else None,
        "met": None,
        "why_not": "reported, no goal",
    }
