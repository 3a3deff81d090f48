"""The close line of a client connection and the metrics of its close, one way for both planes:
the front door's connections (proxy/dataplane/connection.py, plane `l4`) and the connections the
interception engine serves (proxy/l7/engine.py, plane `l7`). Each calls it exactly once per
connection, with the connection's `CloseEvent`; the `connection_opened` it pairs with is the
caller's.

    close_line(metrics, audit, CloseEvent(plane=Plane.L4, ..., duration=seconds, reason=reason))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.decide.events import AuditSink, CloseEvent, MetricsSink

__all__ = ["close_line"]


def close_line(metrics: MetricsSink | None, audit: AuditSink | None, event: CloseEvent) -> None:
    """`connection_closed` to the metrics (from the event's plane, bytes and duration), then
    the event to the audit log."""
    if metrics is not None and event.plane is not None:
        metrics.connection_closed(
            event.plane, event.bytes_up, event.bytes_down, event.duration or 0.0
        )
    if audit is not None:
        audit.closed(event)
