"""The token that answers asks (`run --ask-token FILE`): read from FILE, or made there.

Only someone trusted may answer an ask, and in a Kubernetes pod or a sandbox the agent can
often reach the admin port: what it must not have is this token. So the file is the proxy's
alone. Absent, it is created (0600, a fresh random token) before the proxy is ready; present,
it must be a regular file of the proxy's own user that neither group nor others can read or
write, holding one token. Anything else stops start-up with a message naming the file.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat

from proxy.common.errors import ProxyError

__all__ = ["read_or_create_token"]

MAX_TOKEN_FILE = 4096
# An RFC 6750 bearer token (b64token), long enough not to be guessed.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]{16,1024}=*")


def _refused(path: str, why: str) -> ProxyError:
    return ProxyError("ask_token", f"--ask-token {path}: {why}", source=path)


def read_or_create_token(path: str) -> str:
    """The token in `path`, created there first when the file does not exist."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return _create(path)
    except OSError as exc:
        raise _refused(path, f"cannot open it: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refused(path, "not a regular file")
    with os.fdopen(fd, "rb") as file:
        if info.st_uid != os.geteuid():
            raise _refused(path, f"owned by uid {info.st_uid}, not by the proxy's own user")
        if info.st_mode & 0o077:
            raise _refused(
                path,
                f"group or others have access to it (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"the agent could answer its own asks: chmod 600 {path}",
            )
        data = file.read(MAX_TOKEN_FILE + 1)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        token = ""
    if len(data) > MAX_TOKEN_FILE or not _TOKEN.fullmatch(token):
        raise _refused(
            path,
            "does not hold a token (one line of 16 to 1024 letters, digits or -._~+/); "
            "remove it to have a fresh one made",
        )
    return token


def _create(path: str) -> str:
    token = secrets.token_urlsafe(32)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise _refused(path, f"cannot create it: {exc.strerror or exc}") from None
    try:
        # The mode is set again: a umask cannot widen it, but a filesystem's defaults could.
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode("ascii"))
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise _refused(path, f"cannot write it: {exc.strerror or exc}") from None
    os.close(fd)
    return token
