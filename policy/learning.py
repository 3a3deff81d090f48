"""Learning mode (`egress-proxy run --learn`): which refusals a manifest author can lift, so that
a learning session lets them through (audited as `would_deny`) while every other rule holds.

Only the name stage's "the manifest does not say so" refusals are learnable: the host is not
declared (`not_allowed`), declared but cut by the tenant ceiling (`outside_ceiling`: the entry
still belongs in the manifest, the ceiling is the operator's to widen), or declared for other
paths (`path_not_allowed`). Everything a manifest entry cannot change stays a refusal: blocked
entries, IP literals and internal names, the operator's ports, every address-stage reason, the
SNI gate, malformed requests.

Pure: no I/O. `Policy.learn` (policy/compiler.py) applies it to one decision.
"""

from __future__ import annotations

from policy.reasons import Reason

__all__ = ["LEARNABLE", "learnable"]

LEARNABLE: frozenset[str] = frozenset(
    {Reason.NOT_ALLOWED, Reason.OUTSIDE_CEILING, Reason.PATH_NOT_ALLOWED}
)


def learnable(reason: str) -> bool:
    """Whether a refusal for `reason` is one a learning session lets through."""
    return reason in LEARNABLE
