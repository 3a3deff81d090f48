"""The options of `egress-proxy sandbox` (parsed in proxy/cli/sandbox.py) and the user COMMAND
runs as. Light on imports (the CLI builds every parser at start); the sandbox itself
(proxy/boundary/sandbox/session.py: namespaces, nftables, processes) is loaded only when it runs.

    egress-proxy sandbox MANIFEST [--ceiling F] [--config F] [--user NAME|UID[:GID]]
        [--subnet4 CIDR] [--subnet6 CIDR] [--audit-log F] [--status-file F] -- COMMAND [ARGS...]
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy import PolicyError

if TYPE_CHECKING:
    from proxy.boundary.sandbox.net import IPNetwork

DEFAULT_READY_TIMEOUT = 30.0
MAX_READY_TIMEOUT = 600.0
DEFAULT_POOL4_TEXT = "169.254.240.0/20"  # proxy/sandbox_net.py DEFAULT_POOL4, without importing it


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
    format: str | None
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


def _usage(message: str) -> PolicyError:
    return PolicyError("usage", f"sandbox: {message}")


def resolve_user(text: str | None, environ: dict[str, str]) -> RunAs:
    """`--user NAME|UID[:GID]`; without it the user who ran sudo (SUDO_UID/SUDO_GID, unless
    that is root), else `nobody`."""
    if text is None:
        uid, gid = environ.get("SUDO_UID", ""), environ.get("SUDO_GID", "")
        if uid.isdigit() and gid.isdigit() and int(uid) != 0:
            return _run_as(int(uid), int(gid))
        text = "nobody"
    name, sep, group = text.partition(":")
    if sep and not group:
        raise _usage(f"--user {text[:40]!r}: write NAME, UID or UID:GID")
    if name.isdigit():
        uid = int(name)
        entry = _pwnam(None, uid)
        default_gid = entry.pw_gid if entry else None
    else:
        entry = _pwnam(name, None)
        if entry is None:
            raise _usage(f"--user {name[:40]!r}: no such user")
        uid, default_gid = entry.pw_uid, entry.pw_gid
    if group:
        gid = int(group) if group.isdigit() else _group(group)
    elif default_gid is None:
        raise _usage(f"--user {text[:40]!r}: UID {uid} has no password entry; add :GID")
    else:
        gid = default_gid
    if not 0 <= uid < 2**32 - 1 or not 0 <= gid < 2**32 - 1:
        raise _usage(f"--user {text[:40]!r}: UID and GID must be below 4294967295")
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
        raise _usage(f"--user: no such group {name[:40]!r}") from None


def _run_as(uid: int, gid: int) -> RunAs:
    entry = _pwnam(None, uid)
    return RunAs(uid, gid, entry.pw_name if entry else None, entry.pw_dir if entry else None)


def parse_options(args: argparse.Namespace, environ: dict[str, str]) -> Options:
    command = list(args.command_argv)
    if not command:
        raise _usage("no COMMAND; write: egress-proxy sandbox MANIFEST [options] -- COMMAND")
    for name in ("manifest", "ceiling", "config"):
        if getattr(args, name) == "-":
            # Standard input belongs to COMMAND, and the proxy re-reads its files on SIGHUP.
            shown = "MANIFEST" if name == "manifest" else f"--{name}"
            raise _usage(f"{shown} must be a file: standard input is COMMAND's")
    timeout = args.ready_timeout
    if not 0 < timeout <= MAX_READY_TIMEOUT:
        raise _usage(f"--ready-timeout must be more than 0 and at most {MAX_READY_TIMEOUT:g}")
    from proxy.netaddr import parse_listen  # asyncio comes with it: only when sandboxing

    admin = parse_listen(args.admin) if args.admin else ("127.0.0.1", 0)
    from proxy.boundary.sandbox import net as sandbox_net

    subnet4 = sandbox_net.parse_subnet(args.subnet4, 4, "--subnet4") if args.subnet4 else None
    subnet6 = sandbox_net.parse_subnet(args.subnet6, 6, "--subnet6") if args.subnet6 else None
    return Options(
        manifest=os.path.abspath(args.manifest),
        ceiling=os.path.abspath(args.ceiling) if args.ceiling else None,
        config=os.path.abspath(args.config) if args.config else None,
        format=args.format,
        run_as=resolve_user(args.user, environ),
        subnet4=subnet4,
        subnet6=subnet6,
        session_id=args.session_id,
        audit_log=os.path.abspath(args.audit_log) if args.audit_log else None,
        admin=admin,
        ready_timeout=timeout,
        nft=args.nft or "nft",
        status_file=os.path.abspath(args.status_file) if args.status_file else None,
        quiet=args.quiet,
        command=tuple(command),
    )
