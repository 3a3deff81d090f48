"""A session's inputs read from files: bounded reads, then the manifest, ceiling and config
parsed as one set. The CLI's commands and `run` (at start-up and on every reload) share it."""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass

from policy import (
    Ceiling,
    Manifest,
    Policy,
    PolicyError,
    compile_policy,
    load_ceiling,
    load_manifest,
)
from policy.documents import MAX_DOCUMENT_BYTES, too_large
from policy.manifests import Format
from proxy.app.config import Config, load_config
from proxy.app.credentials_config import check_credentials
from proxy.app.secrets import load_secrets
from proxy.common.errors import ProxyError
from proxy.common.settings import FORBID


def read_input(path: str) -> bytes:
    """A file's bytes, bounded: a hostile 50 MB manifest is refused without reading it all."""
    source = source_name(path)
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1)
        else:
            with open(path, "rb") as handle:
                info = os.fstat(handle.fileno())
                if stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(21, "Is a directory")
                # A regular file says its size: refuse a big one before reading a byte of it.
                if stat.S_ISREG(info.st_mode) and info.st_size > MAX_DOCUMENT_BYTES:
                    raise too_large(source, info.st_size)
                data = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise PolicyError(
            "unreadable", f"cannot read: {exc.strerror or exc}", source=source
        ) from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise too_large(source, None)
    return data


def source_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def read_config(path: str | None) -> Config:
    """The operator config at `path` (the defaults without one). Raises PolicyError."""
    if not path:
        return Config()
    return load_config(read_input(path), source=source_name(path))


def load_inputs(
    manifest_bytes: bytes,
    manifest_source: str,
    *,
    format: Format | None = None,
    ceiling_path: str | None = None,
    config_path: str | None = None,
) -> tuple[Manifest, Ceiling | None, Config]:
    """The manifest (already read: `run` keeps the bytes of start-up), with the ceiling and the
    config read from their files. Raises PolicyError for unusable input."""
    config = read_config(config_path)
    suffixes = config.operator.internal_suffixes
    # Standard input has no file name to imply a syntax: --format agent.toml means TOML there.
    stdin_toml = manifest_source == "<stdin>" and format == "agent.toml"
    manifest = load_manifest(
        manifest_bytes,
        source=manifest_source,
        format=format,
        syntax="toml" if stdin_toml else None,
        internal_suffixes=suffixes,
    )
    ceiling = None
    if ceiling_path:
        ceiling = load_ceiling(
            read_input(ceiling_path), source=source_name(ceiling_path), internal_suffixes=suffixes
        )
    return manifest, ceiling, config


@dataclass(frozen=True, slots=True)
class Inputs:
    """What a policy is compiled from. The manifest is kept as the bytes read at start-up."""

    manifest_bytes: bytes
    manifest_source: str
    manifest_format: Format | None
    ceiling_path: str | None
    config_path: str | None


@dataclass(frozen=True, slots=True)
class Compiled:
    policy: Policy
    config: Config


def read_inputs(
    manifest: str,
    *,
    ceiling: str | None = None,
    config: str | None = None,
    format: Format | None = None,
) -> Inputs:
    for name, value in (("--ceiling", ceiling), ("--config", config)):
        if value == "-":
            # SIGHUP re-reads these files; standard input cannot be read twice.
            raise PolicyError("usage", f"run: {name} must be a file (it is re-read on SIGHUP)")
    return Inputs(read_input(manifest), source_name(manifest), format, ceiling, config)


def compile_inputs(inputs: Inputs) -> Compiled:
    """Read the config and ceiling files, parse the manifest and compile, then check each
    credential's host against the policy and read the secrets (start-up and every reload:
    a rotated secret is read again). Raises PolicyError (invalid_manifest for a manifest that
    does not compile; other reasons for bad input, credential_unreadable for a secret)."""
    manifest, ceiling, config = load_inputs(
        inputs.manifest_bytes,
        inputs.manifest_source,
        format=inputs.manifest_format,
        ceiling_path=inputs.ceiling_path,
        config_path=inputs.config_path,
    )
    policy = compile_policy(manifest, ceiling, config.operator)
    check_credentials(policy, config)
    return Compiled(policy, load_secrets(config))


def refuse_forbidden(config: Config, mode: str) -> None:
    """A session mode (`learn` for `--learn`, `ask` for `--ask`) where the operator config's
    key of that name says `forbid`: ProxyError naming the key, before anything is started."""
    if getattr(config, mode) == FORBID:
        where = f" ({config.source})" if config.source else ""
        raise ProxyError(
            f"{mode}_forbidden",
            f"--{mode} is forbidden by the operator config{where}: its key '{mode}' is '{FORBID}'",
            source=config.source,
        )
