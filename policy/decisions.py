"""The answers of a Policy: a name-stage Decision and an address-stage AddressDecision.

Reason codes are the members of `Reason` (policy/reasons.py, the one catalog): str values shared
by the audit log, metrics and the `X-Egress-Denied` header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy.addresses import Verdict
from policy.dimensions import Stage


@dataclass(frozen=True, slots=True)
class Decision:
    """The name stage: decided on the host (and port, scheme, path) before any DNS."""

    allowed: bool
    reason: str
    message: str
    host: str
    port: int | None = None
    rule: str | None = None  # where the deciding rule is written, e.g. "network.egress[2]"
    ceiling: str | None = None  # the ceiling entry that admitted it, when a ceiling applies
    needs_inspection: bool = False  # paths decide: the connection must go through L7
    stage: Stage = Stage.NAME
    # Learning mode (`run --learn`, Policy.learn): refused for `reason`, let through; its audit
    # line says `would_deny`. Never set by `decide` itself.
    would_deny: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "allowed": self.allowed,
            "stage": self.stage,
            "reason": self.reason,
            "message": self.message,
            "host": self.host,
            "port": self.port,
            "rule": self.rule,
            "ceiling": self.ceiling,
            "needs_inspection": self.needs_inspection,
        }


@dataclass(frozen=True, slots=True)
class AddressDecision:
    """The address stage: every address of one answer checked; refused whole if any fails."""

    allowed: bool
    reason: str
    message: str
    host: str
    verdicts: tuple[Verdict, ...]
    rule: str | None = None
    stage: Stage = Stage.ADDRESS

    @property
    def pinned(self) -> tuple[str, ...]:
        """The checked addresses, in order: the only ones the proxy may connect to."""
        return tuple(v.address for v in self.verdicts) if self.allowed else ()

    def to_json(self) -> dict[str, Any]:
        return {
            "allowed": self.allowed,
            "stage": self.stage,
            "reason": self.reason,
            "message": self.message,
            "host": self.host,
            "rule": self.rule,
            "addresses": [
                {"address": v.address, "public": v.public, "reason": v.reason, "range": v.range}
                for v in self.verdicts
            ],
        }
