"""The parser and entry point of `egress-proxy sandbox`; the options are
proxy/boundary/sandbox/options.py and the sandbox itself proxy/boundary/sandbox/session.py
(loaded only when it runs)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from proxy.boundary.sandbox.options import (
    DEFAULT_POOL4_TEXT,
    DEFAULT_READY_TIMEOUT,
    parse_options,
)


def add_sandbox_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sandbox",
        help="run COMMAND in a network namespace whose only way out is the session proxy",
        description="Run COMMAND in a network namespace whose only way out is the session "
        "proxy: TCP redirected to it, DNS answered by it, everything else dropped. Needs root "
        "(or CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID, CAP_KILL, CAP_DAC_OVERRIDE).",
    )
    p.add_argument("manifest", metavar="MANIFEST", help="agent.yaml or agent.toml (a file)")
    p.add_argument("--ceiling", metavar="FILE", help="the tenant ceiling (YAML or JSON)")
    p.add_argument("--config", metavar="FILE", help="operator config (YAML or JSON)")
    p.add_argument("--format", choices=("agent.yaml", "agent.toml"), help="override detection")
    p.add_argument(
        "--user",
        metavar="NAME|UID[:GID]",
        help="run COMMAND as this user (default: the user who ran sudo, else nobody); "
        "root is allowed but not contained",
    )
    p.add_argument("--subnet4", metavar="CIDR", help="IPv4 subnet of the veth pair "
                   f"(default: a free /30 in {DEFAULT_POOL4_TEXT})")  # fmt: skip
    p.add_argument("--subnet6", metavar="CIDR", help="IPv6 subnet of the veth pair "
                   "(default: a random ULA /64)")  # fmt: skip
    p.add_argument("--session-id", metavar="ID", help="audit session id (default sandbox-XXXX)")
    p.add_argument("--audit-log", metavar="FILE", help="append audit lines here (default stderr)")
    p.add_argument(
        "--admin", metavar="HOST:PORT", help="the proxy's admin listener (default 127.0.0.1:free)"
    )
    p.add_argument(
        "--ready-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_READY_TIMEOUT,
        help=f"how long the proxy may take to be ready (default {DEFAULT_READY_TIMEOUT:g})",
    )
    p.add_argument("--nft", metavar="PATH", help="the nft program (default: nft on PATH)")
    p.add_argument(
        "--status-file",
        metavar="FILE",
        help="write {outcome, exit_status, command_status, message} as JSON here at the end",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no line when COMMAND starts")
    p.add_argument("command_argv", nargs="*", metavar="COMMAND", help="after '--': what to run")
    _command_after_double_dash(p)


def _command_after_double_dash(parser: argparse.ArgumentParser) -> None:
    """Everything after the first `--` is COMMAND, untouched, wherever the options stand
    (`sandbox MANIFEST --user x -- curl -sS URL`). argparse alone cannot say this: once
    MANIFEST is matched, a `*` positional is consumed empty and the words after `--` are
    refused, and REMAINDER would swallow the options written after MANIFEST. The parser is
    reached through the subcommand dispatch, so its own parse_known_args is wrapped."""
    parse = parser.parse_known_args

    def parse_known_args(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        if "--" not in words:
            return parse(words, namespace)
        cut = words.index("--")
        parsed, extra = parse(words[:cut], namespace)
        if parsed.command_argv:
            before = " ".join(parsed.command_argv)[:60]
            parser.error(f"write COMMAND after '--' only (found {before!r} before)")
        parsed.command_argv = words[cut + 1 :]
        return parsed, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def cmd_sandbox(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """Parse, compile the policy (a manifest that does not compile stops everything before
    anything is created, reported by the CLI as `check` and `run` do), check privileges, run."""
    from proxy.app import inputs
    from proxy.boundary.sandbox import session as sandbox

    err = err or sys.stderr
    options = parse_options(args, dict(os.environ))
    inputs.compile_inputs(
        inputs.read_inputs(
            options.manifest, ceiling=options.ceiling, config=options.config,
            format=options.format,  # type: ignore[arg-type]
        )
    )  # fmt: skip
    missing = sandbox.missing_capabilities()
    if missing:
        err.write(
            f"{sandbox.PREFIX}: error: missing {', '.join(missing)}: run it as root (sudo) or "
            "grant them; nothing was created\n"
        )
        return sandbox.EXIT_PRIVILEGES
    return sandbox.Sandbox(options, err).run()
