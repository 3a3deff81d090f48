"""The output of benchmarks/policy_decide.py: the machine and the command, a summary of each
case, the Markdown table with what each column covers, the goals met or missed, and the JSON
document of every sample."""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .measure import BUDGET_S, Case, Settings, median, variants_of

ROOT = Path(__file__).resolve().parents[2]
GOAL_DECISION_RATIO = 2.0
GOAL_COMPILE_MS = 1_000.0
MIB = 1024 * 1024


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "git": commit,
    }


def command() -> str:
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(Path.cwd()))
    except ValueError:
        shown = str(exe)
    return shlex.join([shown, *sys.argv])


def summary(case: Case) -> dict[str, Any]:
    trie_ns = median(case.trie_wall_ns)
    linear_ns = median(case.linear_wall_ns)
    return {
        "variant": case.variant,
        "rules": case.size,
        "grants": case.grants,
        "load_validate_ms": {
            "median": median(case.load_ms),
            "samples": case.load_ms,
            "manifest_samples": case.manifest_load_ms,
            "ceiling_samples": case.ceiling_load_ms,
        },
        "compile_ms": {"median": median(case.compile_ms), "samples": case.compile_ms},
        "compile_cpu_ms": {"median": median(case.compile_cpu_ms), "samples": case.compile_cpu_ms},
        "compile_in_gc_ms": {"median": median(case.compile_gc_ms), "samples": case.compile_gc_ms},
        "compile_memory": {
            "method": case.memory_method,
            "peak_mib": None if case.peak_bytes is None else case.peak_bytes / MIB,
            "retained_mib": case.retained_bytes / MIB,
        },
        "trie": {
            "decisions_per_s": 1e9 / trie_ns,
            "wall_ns_per_decision": {"median": trie_ns, "rounds": case.trie_wall_ns},
            "cpu_ns_per_decision": {
                "median": median(case.trie_cpu_ns),
                "rounds": case.trie_cpu_ns,
            },
            "ratio_to_smallest": {"median": median(case.ratio), "rounds": case.ratio},
            "passes_per_sample": case.trie_reps,
            "decisions_per_pass": len(case.mix),
        },
        "linear": {
            "decisions_per_s": 1e9 / linear_ns,
            "wall_ns_per_decision": {"median": linear_ns, "rounds": case.linear_wall_ns},
            "cpu_ns_per_decision": {
                "median": median(case.linear_cpu_ns),
                "rounds": case.linear_cpu_ns,
            },
            "passes_per_sample": case.linear_reps,
        },
        "trie_speedup": linear_ns / trie_ns,
    }


def _memory_cell(mem: dict[str, Any]) -> str:
    if mem["peak_mib"] is None:
        # RSS moves in pages and reuses freed arenas: below a MiB it says nothing.
        return f"{mem['retained_mib']:,.1f}" if mem["retained_mib"] >= 1 else "< 1"
    return f"{mem['peak_mib']:,.2f} ({mem['retained_mib']:,.2f})"


def table(rows: list[dict[str, Any]], traced: bool) -> str:
    memory = "compile MiB peak (kept)" if traced else "compile MiB (RSS growth)"
    head = (
        f"| manifest | rules | load+validate ms | compile ms | {memory} "
        "| trie decisions/s | wall µs/dec | CPU µs/dec | vs smallest | linear decisions/s "
        "| trie speed-up |"
    )
    out = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        t, lin = r["trie"], r["linear"]
        out.append(
            f"| {r['variant']} | {r['rules']:,} "
            f"| {r['load_validate_ms']['median']:,.1f} "
            f"| {r['compile_ms']['median']:,.1f} "
            f"| {_memory_cell(r['compile_memory'])} "
            f"| {t['decisions_per_s']:,.0f} "
            f"| {t['wall_ns_per_decision']['median'] / 1e3:.2f} "
            f"| {t['cpu_ns_per_decision']['median'] / 1e3:.2f} "
            f"| {t['ratio_to_smallest']['median']:.2f}x "
            f"| {lin['decisions_per_s']:,.0f} "
            f"| {r['trie_speedup']:,.1f}x |"
        )
    return "\n".join(out)


def notes(settings: Settings, cases: Sequence[Case], smallest: int) -> str:
    mix = "/".join(sorted({str(len(c.mix)) for c in cases}, key=int))
    if settings.tracemalloc:
        memory = (
            "tracemalloc peak during one compile_policy() (a separate, untimed run), and in\n"
            "  brackets what is still allocated when it returns: the Policy's own size."
        )
    else:
        memory = (
            "growth of the process RSS over the timed compile_policy() (--quick skips\n"
            "  the slower tracemalloc run); close to the Policy's own size."
        )
    return f"""\
What each figure covers:
- load+validate: load_manifest() on the generated text (document parse + the entry grammar and
  its findings); for agent.yaml+ceiling plus load_ceiling() on the ceiling. Median of
  {settings.load_reps} (fewer past {BUDGET_S:g} s). Not part of the compile goal.
- compile: compile_policy() alone on the loaded manifest (deploy-time checks, ceiling
  intersection, building the tries), cyclic GC on as in production. Median of
  {settings.compile_reps} (fewer past {BUDGET_S:g} s). The goal of < 1 000 ms is for this
  figure; the goal lines below add its CPU time and the part spent in GC collections.
- compile MiB: {memory}
- trie decisions/s: Policy.decide() over a fixed mix of {mix} targets (host, host:port, URLs;
  hits deep and shallow, subdomains of hits, misses), median of {settings.rounds} rounds of
  perf_counter_ns samples (~{settings.sample_ms:g} ms each) interleaved across all policies; GC
  paused while sampling. CPU µs/dec: time.process_time_ns over the same samples.
- vs smallest: wall time per decision over that of the {smallest}-rule policy of the same
  manifest in the same round, median over rounds (goal: <= {GOAL_DECISION_RATIO:.2f}x).
- linear decisions/s: the same Policy.decide() with every SuffixTrie swapped for a flat list
  scanned with is_under()/== ({settings.linear_rounds} of the same rounds); it gives identical
  Decisions on the mix (checked). trie speed-up = linear time / trie time."""


def goals(rows: list[dict[str, Any]], largest: int, smallest: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["rules"] != largest:
            continue
        ratio = r["trie"]["ratio_to_smallest"]["median"]
        compile_ms = r["compile_ms"]["median"]
        out.append(
            {
                "variant": r["variant"],
                "rules": largest,
                "smallest": smallest,
                "decision_ratio": ratio,
                "decision_goal_met": ratio <= GOAL_DECISION_RATIO,
                "compile_ms": compile_ms,
                "compile_cpu_ms": r["compile_cpu_ms"]["median"],
                "compile_goal_met": compile_ms < GOAL_COMPILE_MS,
                "compile_in_gc_ms": r["compile_in_gc_ms"]["median"],
            }
        )
    return out


def goal_line(g: dict[str, Any]) -> str:
    return (
        f"- {g['variant']}: a decision at {g['rules']:,} rules takes {g['decision_ratio']:.2f}x "
        f"that at {g['smallest']} (goal <= {GOAL_DECISION_RATIO:g}x): "
        f"{'met' if g['decision_goal_met'] else 'MISSED'}; compile {g['compile_ms']:,.0f} ms "
        f"(goal < {GOAL_COMPILE_MS:,.0f} ms): {'met' if g['compile_goal_met'] else 'MISSED'} "
        f"[{g['compile_cpu_ms']:,.0f} ms CPU; {g['compile_in_gc_ms']:,.0f} ms of the wall time "
        "inside cyclic-GC collections]"
    )


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished run: its cases, how it ran, and their summaries and goals."""

    cases: Sequence[Case]
    settings: Settings
    quick: bool
    seed: int
    info: dict[str, Any]
    elapsed: float
    rows: list[dict[str, Any]]
    met: list[dict[str, Any]]


def text(run: Finished) -> str:
    """The run as Markdown: the machine, the table, what it covers, the goals, the mix."""
    smallest = min(c.size for c in run.cases)
    info = run.info
    out = [
        f"# policy_decide ({'quick' if run.quick else 'full'})\n",
        f"Command: `{command()}`  ",
        f"Machine: {info['nproc']} CPUs usable ({info['cpu_count']} online), {info['cpu_model']}; "
        f"{info['python']}; {info['platform']}  ",
        f"Load average at start: {' '.join(info['loadavg_at_start'])}; git {info['git']}; "
        f"seed {run.seed}; run took {run.elapsed:.1f} s\n",
        table(run.rows, run.settings.tracemalloc),
        "",
        notes(run.settings, run.cases, smallest),
        "\nGoals:",
        *(goal_line(g) for g in run.met),
        "\nDecision mix (same targets and answers at every size):",
    ]
    for variant in variants_of(run.cases):
        first = next(c for c in run.cases if c.variant == variant)
        shown = ", ".join(f"{t} {'✓' if ok else '✗ ' + why}" for t, ok, why in first.outcomes)
        out.append(f"- {variant}: {shown}")
    return "\n".join(out)


def document(run: Finished) -> dict[str, Any]:
    """Every sample, the medians, the goals, the mix with its answers, settings and machine."""
    return {
        "benchmark": "policy_decide",
        "schema": 1,
        "command": command(),
        "quick": run.quick,
        "seed": run.seed,
        "sizes": sorted({c.size for c in run.cases}),
        "settings": dataclasses.asdict(run.settings),
        "machine": run.info,
        "elapsed_s": run.elapsed,
        "goals": run.met,
        "results": run.rows,
        "mix": {
            v: [
                {"target": t, "allowed": ok, "reason": why}
                for t, ok, why in next(c for c in run.cases if c.variant == v).outcomes
            ]
            for v in variants_of(run.cases)
        },
    }
