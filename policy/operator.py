"""What the operator of a session adds to a policy: address rules, platform destinations,
a port allow-list, inspection, and extra internal name suffixes."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy.addresses import AddressRules
from policy.rules import Network


@dataclass(frozen=True, slots=True)
class PlatformDestination:
    """A route the platform itself needs (model gateway, connector routes): always allowed on
    its ports, never declarable in a manifest. With `cidrs`, its addresses must fall in them,
    and there only the non-public-address rule gives way (never metadata or operator deny)."""

    id: str  # "platform_destinations[0]"
    host: str
    ports: frozenset[int]
    cidrs: tuple[Network, ...] = ()


@dataclass(frozen=True, slots=True)
class OperatorRules:
    addresses: AddressRules = field(default_factory=AddressRules)
    platform_destinations: tuple[PlatformDestination, ...] = ()
    ports: frozenset[int] | None = None  # None: any destination port
    # Ports where a stream that is neither TLS nor HTTP (SSH, a database, SMTP) may pass. None:
    # every port but 80 and 443 (of those `ports` allows), where TLS and HTTP are what clients
    # speak and anything else is likelier a tunnel out than a protocol the agent needs.
    opaque_ports: frozenset[int] | None = None
    inspection_enabled: bool = True
    internal_suffixes: tuple[str, ...] = ()

    def opaque_allowed(self, port: int) -> bool:
        """Whether an opaque stream (neither TLS nor HTTP) may pass on `port` (the port itself
        is decided by `ports`, before)."""
        if self.opaque_ports is None:
            return port not in WEB_PORTS
        return port in self.opaque_ports


# Where only TLS and HTTP pass by default.
WEB_PORTS = frozenset({80, 443})
