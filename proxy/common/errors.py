"""The one error type of the proxy package."""

from __future__ import annotations

from policy.errors import PolicyError


class ProxyError(PolicyError):
    """A runtime or operator-input problem, with a stable reason code. It shares PolicyError's
    shape (reason, message, source, line, column, path, details) so one handler reports both."""
