"""The close line of a client connection and the metrics of its close, one way for both planes:
the front door's connections (proxy/dataplane/connection.py, plane `l4`) and the connections the
interception engine serves (proxy/l7/engine.py, plane `l7`). Each calls it exactly once per
connection; the `connection_opened` it pairs with is the caller's.

    close_line(metrics, audit, plane=Plane.L4, opened=opened, up=up, down=down, reason=reason,
               peer=peer, protocol=Protocol.CONNECT, host=host, port=443, sni=sni, ech=False,
               upstream=upstream, pinned=pinned)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from policy.dimensions import Plane, Protocol
from proxy.decide.events import CloseEvent

if TYPE_CHECKING:
    from proxy.decide.events import AuditSink, MetricsSink
    from proxy.decide.vetting import Peer

__all__ = ["close_line"]


def close_line(
    metrics: MetricsSink | None,
    audit: AuditSink | None,
    *,
    plane: Plane,
    opened: float,
    up: int,
    down: int,
    reason: str,
    peer: Peer,
    protocol: Protocol,
    host: str | None,
    port: int | None,
    sni: str | None,
    ech: bool,
    upstream: str | None,
    pinned: tuple[str, ...],
    attribution: str | None = None,
    attributed: tuple[str, ...] | None = None,
) -> None:
    """`connection_closed` to the metrics, then the close line to the audit log. `opened`: the
    connection's `time.monotonic()` at accept; `up`, `down`: bytes from and to the client."""
    duration = time.monotonic() - opened
    if metrics is not None:
        metrics.connection_closed(plane, up, down, duration)
    if audit is not None:
        audit.closed(
            CloseEvent(
                host=host,
                port=port,
                plane=plane,
                protocol=protocol,
                client=peer.client,
                connection=peer.connection,
                sni=sni,
                ech=ech,
                upstream=upstream,
                bytes_up=up,
                bytes_down=down,
                duration=duration,
                reason=reason,
                pinned=pinned or None,
                attribution=attribution,
                attributed=attributed,
            )
        )
