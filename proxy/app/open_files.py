"""The open-files limit (RLIMIT_NOFILE), raised at start-up before anything listens.

systemd and many container runtimes start a process with a soft limit of 1024 (kept low for
programs that still use select(2)) and a far higher hard one. Each tunnel holds two descriptors
(the client's and the upstream's), so at 1024 the proxy would fail its connections at about
500 tunnels, long before `limits.max_connections`. The event loop uses epoll, never select, so
the soft limit is raised to the hard one; when even that is below what `max_connections` needs,
one line says so.
"""

from __future__ import annotations

import contextlib
import math
import resource
from dataclasses import dataclass

__all__ = ["OpenFiles", "raise_open_files_limit"]

# Descriptors besides the tunnels': listeners, the audit log, DNS sockets (the resolver's and
# the responder's), admin connections, the CA's files and mitmproxy's own.
SPARE = 128


@dataclass(frozen=True, slots=True)
class OpenFiles:
    """The limits after start-up: `soft` is what the process may open."""

    soft: int
    hard: int
    needed: int  # what `limits.max_connections` tunnels need, spare included

    @property
    def limit(self) -> float:
        """The soft limit as a number (`math.inf`: unlimited), for the metric."""
        return math.inf if self.soft == resource.RLIM_INFINITY else self.soft

    def warning(self) -> str | None:
        """The line that says the limit stays too low, or None when it is high enough."""
        if self.limit >= self.needed:
            return None
        tunnels = max(0, (self.soft - SPARE) // 2)
        return (
            f"warning: the open-files limit (RLIMIT_NOFILE) stays at {self.soft} (hard limit "
            f"{_shown(self.hard)}), below the {self.needed} limits.max_connections needs: "
            f"about {tunnels} tunnels at once; raise the hard limit (systemd LimitNOFILE=, "
            "docker --ulimit nofile=, ulimit -Hn) or lower limits.max_connections"
        )


def _shown(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def raise_open_files_limit(max_connections: int) -> OpenFiles:
    """Raise the soft RLIMIT_NOFILE to the hard one (never lower it) and say where it ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        # It fails where the kernel's own ceiling (fs.nr_open) is lower: the warning tells.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OpenFiles(soft, hard, 2 * max_connections + SPARE)
