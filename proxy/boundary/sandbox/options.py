"""The options of `egress-proxy sandbox` (read from its command line in proxy/cli/sandbox.py)
and the user COMMAND runs as. Light on imports (the CLI builds every parser at start); the
sandbox itself (proxy/boundary/sandbox/session.py: namespaces, nftables, processes) is loaded
only when it runs.

    egress-proxy sandbox MANIFEST [--ceiling F] [--config F] [--user NAME|UID[:GID]]
        [--subnet4 CIDR] [--subnet6 CIDR] [--audit-log F] [--status-file F] [--learn | --ask]
        -- COMMAND [ARGS...]
"""

from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy import PolicyError
from policy.manifests import Format
from proxy.common.listeners import decimal

if TYPE_CHECKING:
    from proxy.boundary.sandbox.net import IPNetwork

DEFAULT_READY_TIMEOUT = 30.0
MAX_READY_TIMEOUT = 600.0
DEFAULT_POOL4_TEXT = "169.254.240.0/20"  # net.py DEFAULT_POOL4, without importing it


# -- options -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunAs:
    uid: int
    gid: int
    name: str | None  # from the password database, when the UID has an entry
    home: str | None

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def __str__(self) -> str:
        return f"{self.name or self.uid} ({self.uid}:{self.gid})"


@dataclass(frozen=True, slots=True)
class Options:
    manifest: str
    ceiling: str | None
    config: str | None
    format: Format | None
    run_as: RunAs
    subnet4: IPNetwork | None
    subnet6: IPNetwork | None
    session_id: str | None
    audit_log: str | None
    admin: tuple[str, int]
    ready_timeout: float
    nft: str
    status_file: str | None
    quiet: bool
    command: tuple[str, ...]
    learn: bool = False  # the session proxy runs with --learn
    ask: bool = False  # the session proxy runs with --ask


def usage_error(message: str) -> PolicyError:
    return PolicyError("usage", f"sandbox: {message}")


def resolve_user(text: str | None, environ: dict[str, str]) -> RunAs:
    """`--user NAME|UID[:GID]`; without it the user who ran sudo (SUDO_UID/SUDO_GID, unless
    that is root), else `nobody`."""
    if text is None:
        sudo_uid = decimal(environ.get("SUDO_UID", ""))
        sudo_gid = decimal(environ.get("SUDO_GID", ""))
        if sudo_uid is not None and sudo_gid is not None and sudo_uid != 0:
            return _run_as(sudo_uid, sudo_gid)
        text = "nobody"
    name, sep, group = text.partition(":")
    if sep and not group:
        raise usage_error(f"--user {text[:40]!r}: write NAME, UID or UID:GID")
    uid = decimal(name)
    if uid is not None:
        entry = _pwnam(None, uid)
        default_gid = entry.pw_gid if entry else None
    else:
        entry = _pwnam(name, None)
        if entry is None:
            raise usage_error(f"--user {name[:40]!r}: no such user")
        uid, default_gid = entry.pw_uid, entry.pw_gid
    if group:
        gid = decimal(group)
        if gid is None:
            gid = _group(group)
    elif default_gid is None:
        raise usage_error(f"--user {text[:40]!r}: UID {uid} has no password entry; add :GID")
    else:
        gid = default_gid
    if not 0 <= uid < 2**32 - 1 or not 0 <= gid < 2**32 - 1:
        raise usage_error(f"--user {text[:40]!r}: UID and GID must be below 4294967295")
    return _run_as(uid, gid)


def _pwnam(name: str | None, uid: int | None) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name) if name is not None else pwd.getpwuid(uid or 0)
    except (KeyError, OverflowError):
        return None


def _group(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise usage_error(f"--user: no such group {name[:40]!r}") from None


def _run_as(uid: int, gid: int) -> RunAs:
    entry = _pwnam(None, uid)
    return RunAs(uid, gid, entry.pw_name if entry else None, entry.pw_dir if entry else None)
