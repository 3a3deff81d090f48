"""The parser and entry point of `egress-proxy sandbox`: the command line read into Options
(proxy/boundary/sandbox/options.py), then the sandbox itself (proxy/boundary/sandbox/
session.py, loaded only when it runs)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO, TypeVar, overload

from proxy.boundary.sandbox.options import (
    DEFAULT_POOL4_TEXT,
    DEFAULT_READY_TIMEOUT,
    MAX_READY_TIMEOUT,
    Options,
    resolve_user,
    usage_error,
)
from proxy.common.listeners import parse_listen

_N = TypeVar("_N")


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
    modes = p.add_mutually_exclusive_group()
    modes.add_argument(
        "--learn",
        action="store_true",
        help="the session proxy runs in learning mode (run --learn): what only a manifest "
        "entry would allow is let through and audited as would_deny",
    )
    modes.add_argument(
        "--ask",
        action="store_true",
        help="the session proxy runs in asking mode (run --ask): what only a manifest entry "
        "would allow waits for a person's answer, given from another terminal with the "
        "'egress-proxy ask' command printed on stderr (its token is out of COMMAND's reach)",
    )
    p.add_argument("command_argv", nargs="*", metavar="COMMAND", help="after '--': what to run")
    _command_after_double_dash(p)


def _command_after_double_dash(parser: argparse.ArgumentParser) -> None:
    """Everything after the first `--` is COMMAND, untouched, wherever the options stand
    (`sandbox MANIFEST --user x -- curl -sS URL`). argparse alone cannot say this: once
    MANIFEST is matched, a `*` positional is consumed empty and the words after `--` are
    refused, and REMAINDER would swallow the options written after MANIFEST. The parser is
    reached through the subcommand dispatch, so its own parse_known_args is wrapped."""
    parse = parser.parse_known_args

    # The overloads are ArgumentParser.parse_known_args's own: this replaces it on one parser.
    @overload
    def parse_known_args(
        args: Iterable[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(args: Iterable[str] | None, namespace: _N) -> tuple[_N, list[str]]: ...
    @overload
    def parse_known_args(*, namespace: _N) -> tuple[_N, list[str]]: ...
    def parse_known_args(
        args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
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

    # Deliberate: the subcommand dispatch calls this one parser's method, which no public
    # argparse hook replaces (splitting argv at `--` in main() would make this unneeded).
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def options_from(args: argparse.Namespace, environ: dict[str, str]) -> Options:
    """The sandbox's Options from its command line; PolicyError('usage') for what cannot be."""
    command = list(args.command_argv)
    if not command:
        raise usage_error("no COMMAND; write: egress-proxy sandbox MANIFEST [options] -- COMMAND")
    for name in ("manifest", "ceiling", "config"):
        if getattr(args, name) == "-":
            # Standard input belongs to COMMAND, and the proxy re-reads its files on SIGHUP.
            shown = "MANIFEST" if name == "manifest" else f"--{name}"
            raise usage_error(f"{shown} must be a file: standard input is COMMAND's")
    timeout = args.ready_timeout
    if not 0 < timeout <= MAX_READY_TIMEOUT:
        raise usage_error(f"--ready-timeout must be more than 0 and at most {MAX_READY_TIMEOUT:g}")
    admin = parse_listen(args.admin) if args.admin else ("127.0.0.1", 0)
    from proxy.boundary.sandbox import net as sandbox_net

    subnet4 = sandbox_net.parse_subnet(args.subnet4, 4, "--subnet4") if args.subnet4 else None
    subnet6 = sandbox_net.parse_subnet(args.subnet6, 6, "--subnet6") if args.subnet6 else None
    return Options(
        manifest=os.path.abspath(args.manifest),
        ceiling=_absolute(args.ceiling),
        config=_absolute(args.config),
        format=args.format,
        run_as=resolve_user(args.user, environ),
        subnet4=subnet4,
        subnet6=subnet6,
        session_id=args.session_id,
        audit_log=_absolute(args.audit_log),
        admin=admin,
        ready_timeout=timeout,
        nft=args.nft or "nft",
        status_file=_absolute(args.status_file),
        quiet=args.quiet,
        command=tuple(command),
        learn=args.learn,
        ask=args.ask,
    )


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


def cmd_sandbox(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """Parse, compile the policy (a manifest that does not compile stops everything before
    anything is created, reported by the CLI as `check` and `run` do), check privileges, run."""
    from proxy.app import inputs
    from proxy.boundary.sandbox.outcome import EXIT_PRIVILEGES, PREFIX
    from proxy.boundary.sandbox.preflight import missing_capabilities
    from proxy.boundary.sandbox.session import Sandbox

    err = err or sys.stderr
    options = options_from(args, dict(os.environ))
    compiled = inputs.compile_inputs(
        inputs.read_inputs(
            options.manifest, ceiling=options.ceiling, config=options.config,
            format=options.format,
        )
    )  # fmt: skip
    if options.learn:
        inputs.refuse_forbidden(compiled.config, "learn")
    if options.ask:
        inputs.refuse_forbidden(compiled.config, "ask")
    missing = missing_capabilities()
    if missing:
        err.write(
            f"{PREFIX}: error: missing {', '.join(missing)}: run it as root (sudo) or "
            "grant them; nothing was created\n"
        )
        return EXIT_PRIVILEGES
    return Sandbox(options, err, compiled).run()
