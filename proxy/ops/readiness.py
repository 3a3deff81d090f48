"""What `/readyz` reports: the conditions the proxy sets as it starts, reloads and drains
(proxy/ops/admin.py serves them)."""

from __future__ import annotations

from proxy.common.terminal import one_line

__all__ = ["CONDITIONS", "Readiness"]

# The order is the order of the lines in a 503 body. `draining` is the one condition that must be
# False for the proxy to be ready; the others must be True.
CONDITIONS: tuple[str, ...] = (
    "policy_compiled",
    "listeners_bound",
    "boundary_verified",
    "draining",
)
_UNMET_TEXT = {
    "policy_compiled": "policy not compiled",
    "listeners_bound": "listeners not bound",
    "boundary_verified": "boundary not verified",
    "draining": "draining",
}
_READY_WHEN = {"policy_compiled": True, "listeners_bound": True, "boundary_verified": True,
               "draining": False}  # fmt: skip
_MAX_DETAIL = 200


class Readiness:
    """The conditions `/readyz` reports, updated by the proxy as it starts, reloads and drains.

    `set(name, ok, detail)` records the value of the named condition: for `policy_compiled`,
    `listeners_bound` and `boundary_verified` True means the condition holds; for `draining`,
    True means the proxy is draining (SIGTERM), which makes it not ready at once. Initially the
    first three are False and `draining` is False. It lives on the proxy's event loop (signal
    handlers installed with `loop.add_signal_handler` run there too)."""

    def __init__(self) -> None:
        self._values: dict[str, bool] = {name: False for name in CONDITIONS}
        self._details: dict[str, str] = {name: "" for name in CONDITIONS}
        # Learning mode (`run --learn`) does not change readiness, but must never go unseen:
        # `/readyz` says `learn: true` while it lasts.
        self.learning = False
        # Asking mode (`run --ask`): `/readyz` says `ask: true` while it lasts.
        self.asking = False

    def set(self, name: str, ok: bool, detail: str = "") -> None:
        if name not in self._values:
            raise ValueError(
                f"unknown readiness condition {name!r}; known: {', '.join(CONDITIONS)}"
            )
        self._values[name] = bool(ok)
        self._details[name] = one_line(detail, _MAX_DETAIL)

    def get(self, name: str) -> bool:
        return self._values[name]

    def notes(self) -> list[str]:
        """Lines `/readyz` adds after its answer, ready or not: the modes a session runs in."""
        notes = ["learn: true"] if self.learning else []
        return notes + (["ask: true"] if self.asking else [])

    def ready(self) -> tuple[bool, list[str]]:
        """(True, []) when every condition holds, else (False, one line per unmet condition)."""
        unmet: list[str] = []
        for name in CONDITIONS:
            if self._values[name] != _READY_WHEN[name]:
                line = f"not ready: {_UNMET_TEXT[name]}"
                if self._details[name]:
                    line += f" ({self._details[name]})"
                unmet.append(line)
        return not unmet, unmet
