"""Whom the probes run as: the agent's user, never root by mistake (a probe as root proves
nothing about the agent)."""

from __future__ import annotations

import os

from proxy.boundary.probes.result import oserror
from proxy.common.errors import ProxyError
from proxy.common.listeners import decimal
from proxy.common.refusals import shown


def parse_user(text: str) -> tuple[int, int]:
    """`UID:GID` → (uid, gid); root is refused (a probe as root proves nothing about the agent)."""
    uid_text, sep, gid_text = text.partition(":")
    uid, gid = decimal(uid_text), decimal(gid_text)
    if not sep or uid is None or gid is None:
        raise ProxyError("usage", f"--as-user {shown(text)!r}: write UID:GID (numbers)")
    if not 0 < uid < 2**32 - 1 or not 0 < gid < 2**32 - 1:
        raise ProxyError(
            "usage", f"--as-user {shown(text)!r}: UID and GID must be non-root (1 to 4294967294)"
        )
    return uid, gid


def drop_privileges(uid: int, gid: int) -> None:
    """Become uid:gid for good (no supplementary groups), and check root cannot be regained.
    Already being exactly that user is fine; anything else without root is an error."""
    if os.getresuid() == (uid, uid, uid) and os.getresgid() == (gid, gid, gid):
        if os.getgroups() and os.geteuid() != 0:
            # Supplementary groups cannot be dropped without root; they carry no capability,
            # but ping_group_range can admit them: say so instead of probing as someone else.
            extra = set(os.getgroups()) - {gid}
            if extra:
                raise ProxyError(
                    "privileges",
                    f"running as {uid}:{gid} with supplementary groups {sorted(extra)}, "
                    "which cannot be dropped without root",
                )
        return
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except PermissionError as exc:
        raise ProxyError(
            "privileges", f"cannot become {uid}:{gid} ({oserror(exc)}): --as-user needs root"
        ) from None
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise ProxyError("privileges", f"still able to regain root after becoming {uid}:{gid}")
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise ProxyError("privileges", f"did not become exactly {uid}:{gid}")
