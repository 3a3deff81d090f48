"""Credential injection inside interception: the engine's side of proxy/decide/injection.py,
on mitmproxy's request, whatever HTTP version it came in (HTTP/1.1 or HTTP/2: its header
fields are the same list; HTTP/2's names are lowercase).

    injector = CredentialInjector(config.credentials, metrics)
    name = injector.apply(flow.request, destination.host)   # after the request is allowed
    injector.configure(Update(config=new))                  # a reload (a rotated secret)

`RequestGate` (proxy/l7/addons.py) calls `apply` once a request is allowed, before its allow
line, which names what was put in; the request then goes only to the checked addresses of its
connection's host (the SNI's, which its Host or :authority names: rules.check_request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from proxy.decide.injection import counted, inject

if TYPE_CHECKING:
    from mitmproxy import http

    from proxy.common.settings import Credential
    from proxy.decide.events import MetricsSink
    from proxy.decide.planes import Update


class CredentialInjector:
    """The operator's credentials for the engine; swapped whole by a reload."""

    def __init__(self, credentials: Sequence[Credential], metrics: MetricsSink | None) -> None:
        self.credentials = tuple(credentials)
        self.metrics = metrics

    def configure(self, update: Update) -> list[str]:
        """A reload (proxy/decide/planes.py): later requests get the reloaded config's
        credentials, their secrets read again (a rotation). It holds no connection: closes none."""
        if update.config is not None:
            self.credentials = tuple(update.config.credentials)
        return []

    def apply(self, request: http.Request, host: str) -> str | None:
        """Puts `host`'s credentials into an allowed request; the audit line's `credential`
        (None: nothing was put in)."""
        if not self.credentials:
            return None
        fields, applied = inject(
            self.credentials,
            host,
            list(request.headers.fields),
            plain_http=False,
            lowercase=request.is_http2 or request.is_http3,
        )
        if not applied:
            return None
        request.headers.fields = tuple(fields)
        return counted(self.metrics, applied)
