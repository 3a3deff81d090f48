"""Figures from samples: percentiles, medians, and ratios taken within each round.

A sample is one configuration measured once in one round: a dict with "config", "round" and
nested figures. A ratio to the baseline (direct) is taken between the samples of the same
round, then the median over rounds is reported, so a noisy moment of a shared machine that
slows one round slows both sides of its ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN when there are none)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * p // 100))
    return sorted_values[int(rank) - 1]


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def dig(sample: Any, path: Sequence[str]) -> Any:
    """sample[path[0]][path[1]]...; None where a key is missing or a value is not a dict."""
    value = sample
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def number(value: Any) -> float | None:
    """`value` when it is a finite number (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def ratios_by_round(
    mine: Sequence[Mapping[str, Any]],
    theirs: Sequence[Mapping[str, Any]],
    path: Sequence[str],
    their_path: Sequence[str] | None = None,
) -> list[float]:
    """figure(mine) / figure(theirs) for every round both have (paired by "round"); theirs at
    `their_path` when it is another figure than mine."""
    by_round = {s.get("round"): number(dig(s, their_path or path)) for s in theirs}
    out = []
    for sample in mine:
        a, b = number(dig(sample, path)), by_round.get(sample.get("round"))
        if a is not None and b:
            out.append(a / b)
    return out


def summarise(
    samples: Mapping[str, Sequence[Mapping[str, Any]]],
    figures: Mapping[str, Sequence[str]],
    baseline: str | None = "direct",
) -> dict[str, dict[str, float | None]]:
    """Per configuration: the median of every figure over its rounds and, when the baseline
    configuration has samples, `<figure>_vs_<baseline>`: the median of the per-round ratios."""
    out: dict[str, dict[str, float | None]] = {}
    base = samples.get(baseline, []) if baseline else []
    for config, rounds in samples.items():
        row: dict[str, float | None] = {}
        for name, path in figures.items():
            row[name] = median(number(dig(s, path)) for s in rounds)
            if base:
                row[f"{name}_vs_{baseline}"] = median(ratios_by_round(rounds, base, path))
        out[config] = row
    return out


def latency_summary(latencies: Iterable[float]) -> dict[str, float] | None:
    """p50/p90/p99/max/mean of latencies (any unit), None when there are none."""
    ordered = sorted(latencies)
    if not ordered:
        return None
    return {
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }
