"""What `run` says on stderr besides its errors: the listening line with a command to try, the
learning-mode warning, and log records made safe for a terminal."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.common.listeners import Listener, format_listen
from proxy.common.terminal import printable

LEARNING = (
    "LEARNING MODE (--learn): connections the manifest does not allow are LET THROUGH and "
    "audited as would_deny; address rules, blocked entries, the SNI gate and the operator's "
    "ports still hold. Not for production: turn the audit log into a manifest with "
    "'egress-proxy suggest'"
)


class PrintableFormatter(logging.Formatter):
    """Log lines (tracebacks included) can carry client text: escaped for the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(printable(line) for line in super().format(record).splitlines())


def listening(listeners: Sequence[Listener]) -> str:
    """`127.0.0.1:3128` for the usual single HTTP proxy; every other listener with its
    scheme (`127.0.0.1:3128 and socks5://127.0.0.1:1080 and dns://127.0.0.1:5353`; a DNS
    listener serves UDP and TCP on its port)."""
    first, *rest = listeners
    shown = [format_listen(first.host, first.port) if first.scheme == "http" else str(first)]
    return " and ".join(shown + [str(x) for x in rest])


def try_it(listener: Listener) -> str:
    where = format_listen(listener.host, listener.port)
    if listener.scheme == "transparent":
        return f"redirect the session's TCP to {where} (nft ... tcp dport {{80, 443}} redirect)"
    option = "-x http://" if listener.scheme == "http" else "--socks5-hostname "
    return f"curl {option}{where} https://pypi.org/simple/"


def asking(admin: str, token: str) -> str:
    """What `run --ask` says at start: that refusals wait for a person, and how to answer."""
    return (
        "ASK MODE (--ask): connections the manifest does not allow are HELD until a person "
        f"answers; answer with: egress-proxy ask --admin {admin} --token {token}"
    )
