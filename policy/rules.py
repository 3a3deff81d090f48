"""Rules: one admitted or refused destination, named as written in its document."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["allow", "block"]
# subtree: the host and every name under it; exact: the host alone; url: scheme + host + port +
# path prefix (a blocked one: host + path prefix, `scheme` and `port` None, as it holds on every
# scheme and port); address: an IP address or CIDR (agent.toml).
Kind = Literal["subtree", "exact", "url", "address"]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Rule:
    id: str  # where it is written: "network.egress[2]", "access.github", "ceiling.egress[0]"
    pattern: str  # the text as written
    action: Action
    kind: Kind
    source: str  # "manifest", "access.github", "ceiling", "platform", "default"
    host: str | None = None
    scheme: str | None = None
    port: int | None = None
    path: str | None = None
    network: Network | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rule": self.id,
            "pattern": self.pattern,
            "action": self.action,
            "kind": self.kind,
            "source": self.source,
        }
        if self.host is not None:
            out["host"] = self.host
        if self.kind == "url":
            out.update(scheme=self.scheme, port=self.port, path=self.path)
        if self.network is not None:
            out["network"] = str(self.network)
        return out
