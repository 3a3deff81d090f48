"""The secrets of the operator's credentials (proxy/app/credentials_config.py), read from their
files or variables: the one place they are read, used by start-up and by every reload (a rotation),
through proxy/app/inputs.py's `compile_inputs`. A value that cannot be used is described, never
shown."""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Final

from policy.findings import Finding
from proxy.common.errors import ProxyError
from proxy.common.settings import Config, Credential, Secret

# Far above any API token or key; a file larger than this is not one.
MAX_SECRET: Final = 16 * 1024


def load_secrets(config: Config, environ: dict[str, str] | None = None) -> Config:
    """`config` with each credential's secret read from its file or variable, now. The one
    place secrets are read: start-up, and every reload (a rotation). Any that cannot be read
    raises ProxyError('credential_unreadable') naming each entry and where it looked; nothing
    is half applied."""
    if not config.credentials:
        return config
    environ = dict(os.environ) if environ is None else environ
    problems: list[Finding] = []
    loaded: list[Credential] = []
    for credential in config.credentials:
        try:
            secret = _read(credential, environ)
        except ValueError as exc:
            key = "value_file" if credential.value_file is not None else "value_env"
            message = f"credential {credential.name!r}: {exc}"
            path = f"{credential.path}.{key}"
            reason = "credential_unreadable"
            problems.append(Finding(path, None, reason, message, "error", config.source))
            continue
        loaded.append(dataclasses.replace(credential, secret=secret))
    if problems:
        listed = "; ".join(f"{f.path}: {f.message}" for f in problems)
        raise ProxyError(
            "credential_unreadable", listed, source=config.source, details=tuple(problems)
        )
    return dataclasses.replace(config, credentials=tuple(loaded))


def _read(credential: Credential, environ: dict[str, str]) -> Secret:
    if credential.value_file is not None:
        value = _read_file(credential.value_file)
    else:
        name = credential.value_env
        assert name is not None
        text = environ.get(name)
        if text is None:
            raise ValueError(f"the variable {name} is not set")
        try:
            value = text.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError(
                f"the variable {name} holds non-ASCII characters, which a header value "
                "cannot carry as they are"
            ) from None
    _check_secret(value, credential.source)
    return Secret(value)


def _read_file(path: str) -> bytes:
    where = f"the file {path}"
    try:
        # O_NONBLOCK: a FIFO put in a secret's place would block the proxy; it is refused below.
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot read {where}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file")
        if info.st_size > MAX_SECRET:
            raise ValueError(f"{where} is larger than {MAX_SECRET} bytes, too large for one")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_SECRET + 2)
    except OSError as exc:
        raise ValueError(f"cannot read {where}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET + 1:
        raise ValueError(f"{where} is larger than {MAX_SECRET} bytes, too large for one")
    # One trailing newline is how files end, not part of the secret (CRLF from Windows too).
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


def _check_secret(value: bytes, source: str) -> None:
    """A secret goes into a header value as it is: a CR, LF or NUL in it would split the
    request (header injection), other controls are refused by servers, and whitespace at its
    edges is dropped by them. Described, never shown."""
    if not value:
        raise ValueError(f"{source}: the value is empty")
    if any(b in value for b in (b"\r", b"\n", b"\0")):
        raise ValueError(
            f"{source}: the value holds a CR, LF or NUL (beyond one trailing newline), "
            "which would split the request's head"
        )
    if any(byte < 0x20 or byte > 0x7E for byte in value):
        raise ValueError(
            f"{source}: the value holds control or non-ASCII bytes; a header value carries "
            "visible ASCII characters and spaces"
        )
    if value != value.strip(b" "):
        raise ValueError(f"{source}: the value starts or ends with a space")
