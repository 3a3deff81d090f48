"""What a reload changes in a running plane, and the one way every plane takes it: a
`Configurable` plane has one method, `configure(update)`, as a mitmproxy addon has
`configure(updated)`; each plane's Vetter takes its part with `Vetter.configure`.

    update = Update(policy=compiled.policy, resolver=resolver, config=compiled.config)
    closed = [id for plane in planes for id in plane.configure(update)]

The runtime (proxy/app/runtime.py) builds one `Update` per reload, and one when the operator
config stops learning or asking, and gives it to every plane that runs, in one loop: the front
door (proxy/dataplane/frontdoor.py), the interception engine (proxy/l7/engine.py, which hands
it on to its credential injector, proxy/l7/injector.py) and the DNS listeners
(proxy/dns_responder/server.py). A plane takes what it uses and ignores the rest; a field left
at its default is unchanged. Each returns the ids of the live connections it closed because
the update no longer allows them (a DNS answer is over once sent: the DNS listeners close none).

The update is checked whole before any plane sees it (a reload that cannot be applied is refused
before: proxy/app/reload.py), so no plane is left half-configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from policy import Policy
    from proxy.common.settings import Config
    from proxy.decide.resolving import Resolves

__all__ = ["Configurable", "Update"]


@dataclass(frozen=True, slots=True)
class Update:
    """What changed. `policy`: every later decision uses it, and live connections are decided
    again under it. `resolver`: later lookups use it (a changed DNS configuration). `config`:
    the operator config, as far as a running plane takes it (`tls.ech`, the credentials with
    their secrets read again, the attribution grace; the rest applies from start-up only).
    `stop_learning`, `stop_asking`: learning mode or asking mode off for the rest of the
    session (a reload may turn them off, never on), and live connections decided again without
    it."""

    policy: Policy | None = None
    resolver: Resolves | None = None
    config: Config | None = None
    stop_learning: bool = False
    stop_asking: bool = False

    @property
    def redecides(self) -> bool:
        """Whether live connections must be decided again: whatever lets a connection through
        may have changed (a policy, learning, a person's answers). A new resolver or config
        does not: the addresses a connection went to were checked, and stay so."""
        return self.policy is not None or self.stop_learning or self.stop_asking


class Configurable(Protocol):
    """A running plane: takes an update, returns the ids of the live connections it closed."""

    def configure(self, update: Update) -> list[str]: ...
