"""The PNG plots of a run (matplotlib): one per workload that has figures, every bar annotated
with its ratio (to direct, to squid, or to the smallest policy) or its value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cells import label, ratio

Series = tuple[str, Sequence[float | None], Sequence[float | None]]
SHORT = {"mitmdump": "mitmdump", "direct": "direct"}


def _bars(
    ax: Any,
    configs: Sequence[str],
    series: Sequence[Series],
    title: str,
    ylabel: str,
    *,
    log: bool = False,
    value_format: str | None = None,
) -> None:
    """Grouped bars: one group per config, one bar per series (name, values, ratios); each bar
    is annotated with its ratio, or without one with its value (`value_format`). A series
    without any value is left out."""
    series = [x for x in series if any(v is not None for v in x[1])]
    width = 0.8 / max(1, len(series))
    for i, (name, values, ratios) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(configs))]
        heights = [v if v is not None else 0.0 for v in values]
        drawn = ax.bar(xs, heights, width * 0.95, label=name if len(series) > 1 else None)
        for rect, value, r in zip(drawn, values, ratios, strict=True):
            if value is None:
                continue
            text = (
                ratio(r) if r is not None else format(value, value_format) if value_format else None
            )
            if text is None:
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


@dataclass(frozen=True)
class Panel:
    """One chart: its rows (config -> figures), and per series (name, figure, ratio to whom)."""

    rows: Mapping[str, Mapping[str, Any]]
    title: str
    series: Sequence[tuple[str, str, str | None]]
    ylabel: str
    log: bool = False
    value_format: str | None = None

    def draw(self, ax: Any) -> None:
        configs = list(self.rows)
        series: list[Series] = []
        for name, figure, vs in self.series:
            values = [self.rows[c].get(figure) for c in configs]
            ratios = [self.rows[c].get(f"{figure}_vs_{vs}") if vs else None for c in configs]
            series.append((name, values, ratios))
        _bars(
            ax,
            configs,
            series,
            self.title,
            self.ylabel,
            log=self.log,
            value_format=self.value_format,
        )


def _proxies(rows: Mapping[str, Any]) -> dict[str, Any]:
    return {c: r for c, r in rows.items() if c != "direct"}


def _tunnels(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    rows = summary.get("tunnels") or {}
    levels = [1, *settings["concurrency"]]
    return [
        Panel(
            rows,
            "New tunnels/s (ratio to direct)",
            [(f"@{c}", f"tunnels_per_s_{c}", "direct") for c in levels],
            "tunnels/s (log)",
            log=True,
        ),
        Panel(
            _proxies(rows),
            "Proxy CPU per tunnel",
            [(f"@{c}", f"proxy_cpu_us_per_tunnel_{c}", None) for c in levels],
            "µs (log)",
            log=True,
            value_format=",.0f",
        ),
    ]


def _bulk(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    rows = summary.get("bulk") or {}
    n = settings["parallel_tunnels"]
    kinds = {"up": "1 up", "down": "1 down", "parallel_up": f"{n} up", "parallel_down": f"{n} down"}
    return [
        Panel(
            rows,
            "Bulk MB/s (ratio to direct)",
            [(name, f"{k}_mb_s", "direct") for k, name in kinds.items()],
            "MB/s",
        ),
        Panel(
            _proxies(rows),
            "Proxy CPU per GiB",
            [(name, f"{k}_proxy_cpu_s_per_gib", None) for k, name in kinds.items()],
            "CPU s/GiB",
            value_format=".2f",
        ),
    ]


def _http(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    rows = {c: r for c, r in (summary.get("http") or {}).items() if r.get("requests_per_s")}
    return [
        Panel(
            rows,
            "Plain HTTP requests/s (ratio to direct)",
            [("req/s", "requests_per_s", "direct")],
            "requests/s (log)",
            log=True,
        ),
        Panel(
            _proxies(rows),
            "Proxy CPU per request",
            [("", "proxy_cpu_us_per_request", None)],
            "µs",
            value_format=",.0f",
        ),
    ]


def _sessions(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    sessions = summary.get("sessions") or {}
    rows = {
        c: {**r, "pss_session": (sessions.get(c) or {}).get("pss_mb_per_session")}
        for c, r in _proxies(summary.get("memory") or {}).items()
    }
    series = [
        ("idle RSS", "idle_rss_mb", None),
        ("largest RSS after traffic", "worst_rss_mb", None),
        ("PSS per session, side by side", "pss_session", None),
    ]
    return [Panel(rows, "Memory per proxy (MB)", series, "MB", value_format=".1f")]


def _scale(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    rows = dict(sorted((summary.get("scale") or {}).items(), key=lambda kv: int(kv[0])))
    vs = next(iter(rows), None)
    return [
        Panel(rows, "Ready (/readyz 200)", [("ready", "ready_s", vs)], "s"),
        Panel(rows, "Idle memory", [("RSS", "idle_rss_mb", vs), ("PSS", "idle_pss_mb", vs)], "MB"),
        Panel(
            rows,
            "New tunnel latency",
            [("p50", "latency_p50_ms", vs), ("p99", "latency_p99_ms", vs)],
            "ms",
        ),
    ]


def _dns(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Panel]:
    series = [(f"{k} {p}", f"{k}_{p}_ms", None) for k in ("warm", "cold") for p in ("p50", "p99")]
    return [
        Panel(
            summary.get("dns") or {},
            "Tunnel latency, cold and warm resolver cache",
            series,
            "ms",
            value_format=".2f",
        )
    ]


PLOTS = {
    "tunnels.png": _tunnels,
    "bulk.png": _bulk,
    "http.png": _http,
    "sessions.png": _sessions,
    "scale.png": _scale,
    "dns.png": _dns,
}


def plot_all(document: Mapping[str, Any], out: Path) -> list[str]:
    """Writes one PNG per workload that has figures; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    for name, panels_of in PLOTS.items():
        panels = [p for p in panels_of(document["summary"], document["settings"]) if p.rows]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            panel.draw(ax)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written
