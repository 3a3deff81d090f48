"""The admin listener's readiness as the tests set it up."""

from __future__ import annotations

from proxy.ops.readiness import Readiness


def all_ready() -> Readiness:
    """Readiness with every check passed (the policy compiled, listeners bound, boundary
    verified): /readyz answers 200."""
    readiness = Readiness()
    for name in ("policy_compiled", "listeners_bound", "boundary_verified"):
        readiness.set(name, True)
    return readiness
