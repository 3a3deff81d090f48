"""The parts of benchmarks/policy_decide.py: generate, measure, report."""
