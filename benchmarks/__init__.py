"""The benchmarks: the harness package (`harness/`, run by `bench.py`), the decision core's
(`policy_decide.py`, with `decisions/`), and single-purpose measurements (benchmarks/README.md).
A package so that each command imports its parts as `benchmarks.…` from the repository root."""
