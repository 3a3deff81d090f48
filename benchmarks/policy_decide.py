"""Benchmark of the policy decision core: decisions per second, load and compile time, and
compile memory for policies of 10, 1 000 and 100 000 rules; the suffix trie against a linear scan.

    .venv/bin/python benchmarks/policy_decide.py            # full run (make bench-policy)
    .venv/bin/python benchmarks/policy_decide.py --quick    # one load and compile per set
    .venv/bin/python benchmarks/policy_decide.py --json results.json

Goals (from the issue): a decision on a 100 000-rule policy within 2x of a 10-rule one, and
compile_policy on 100 000 rules under 1 s. Everything is generated from a seed; no network, no
files read except /proc for the machine description.

The parts are in benchmarks/decisions/: generate (the seeded rule sets and the decision mix),
measure (load, compile, memory, decisions, the linear-scan baseline) and report (table, goals,
JSON); this file holds the options and the order of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Measure this checkout's policy/, not whatever an installed copy points at; and find the
# package `benchmarks` (run as a script, Python puts benchmarks/ first, not the root).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.decisions import generate, measure, report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions: one load and one compile per rule set, 5 decision rounds",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in generate.DEFAULT_SIZES),
        help="comma-separated rule counts, each >= 10 (default: %(default)s)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(generate.VARIANTS),
        help="comma-separated manifests to run (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=generate.DEFAULT_SEED)
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < 10 or sizes[-1] > 1_000_000:
        parser.error("--sizes: each size must be between 10 and 1 000 000")
    settings = measure.QUICK if args.quick else measure.FULL
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in generate.VARIANTS for v in variants):
        parser.error(f"--variants: choose from {', '.join(generate.VARIANTS)}")

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    info = report.machine()
    log(f"generating rule sets (seed {args.seed}, sizes {', '.join(map(str, sizes))})")
    cases = [
        measure.Case(r.variant, r.size, r.manifest_text, r.ceiling_text, r.mix)
        for r in generate.rule_sets(sizes, args.seed, variants)
    ]
    log("load, compile, memory, and a check of the linear scan against the trie")
    measure.measure_builds(cases, settings, log)
    measure.measure_decisions(cases, settings, log)

    rows = [report.summary(c) for c in cases]
    met = report.goals(rows, sizes[-1], sizes[0])
    elapsed = time.perf_counter() - started
    results = report.Finished(cases, settings, args.quick, args.seed, info, elapsed, rows, met)
    print(report.text(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.document(results), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
