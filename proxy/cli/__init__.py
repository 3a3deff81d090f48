"""The `egress-proxy` command line. Its options, output and exit codes are a contract that
scripts outside this repo rely on.

Exit codes: 0 success, 1 findings (check) or a manifest that cannot be compiled, 2 unreadable
or unparsable input or a usage error, 70 an internal error (a bug: reported without a
traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from policy import PolicyError
from proxy import __version__
from proxy.cli.ask import add_ask_parser, cmd_ask
from proxy.cli.boundary import add_boundary_parser, cmd_boundary
from proxy.cli.check import add_check_parsers, cmd_check, cmd_classify, cmd_explain
from proxy.cli.output import (
    EXIT_FINDINGS,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    MAX_TABLE_ROWS,
    more,
    print_json,
)
from proxy.cli.run import add_run_parser, cmd_run
from proxy.cli.sandbox import add_sandbox_parser, cmd_sandbox
from proxy.cli.suggest import add_suggest_parser, cmd_suggest
from proxy.cli.trust import add_trust_parser, cmd_trust
from proxy.common.terminal import printable


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="egress-proxy", description="Session-scoped egress enforcement proxy.")
    # What an installer (pipx, uv tool) or an image is checked with: the installed release.
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    add_check_parsers(sub)
    add_run_parser(sub)
    add_boundary_parser(sub)
    add_sandbox_parser(sub)
    add_suggest_parser(sub)
    add_trust_parser(sub)
    add_ask_parser(sub)
    return parser


COMMANDS = {
    "check": cmd_check,
    "explain": cmd_explain,
    "classify": cmd_classify,
    "run": cmd_run,
    "boundary": cmd_boundary,
    "sandbox": cmd_sandbox,
    "suggest": cmd_suggest,
    "trust": cmd_trust,
    "ask": cmd_ask,
}


_HEADLINES = {
    "invalid_manifest": "invalid manifest",
    "invalid_ceiling": "invalid ceiling",
    "invalid_config": "invalid config",
}


def _report(exc: PolicyError, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    if exc.details:
        # The exception's own message lists only the first few problems, run together; a
        # person fixing the file wants every one, one per line.
        where = f"{exc.source}: " if exc.source else ""
        headline = _HEADLINES.get(exc.reason, exc.reason.replace("_", " "))
        count = len(exc.details)
        err.write(printable(f"egress-proxy: {where}{headline}, {count} problem(s):") + "\n")
        for detail in exc.details[:MAX_TABLE_ROWS]:
            # The path first (what scripts and people grep for), then file:line:column where
            # the place is known, as editors read it.
            at = ""
            if detail.line is not None:
                at = f"at {detail.file or exc.source}:{detail.line}:{detail.column}: "
            err.write(printable(f"  {detail.path}: {at}{detail.message}") + "\n")
        more(exc.details, "problems", err)
    else:
        err.write(printable(f"egress-proxy: {exc}") + "\n")
    if getattr(args, "json", False):
        print_json(
            {
                "ok": False,
                "error": {
                    "reason": exc.reason,
                    "message": exc.message,
                    "file": exc.source,
                    "line": exc.line,
                    "column": exc.column,
                    "details": [d.to_json() for d in exc.details],
                },
            },
            out,
        )


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run one command; returns the exit code (usage errors too, so callers in-process need
    not catch SystemExit). `out` and `err` default to the process's stdout and stderr."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    try:
        return COMMANDS[args.command](args, out)
    except PolicyError as exc:
        _report(exc, args, out, err)
        # A manifest that parses but does not compile is a findings problem, not bad input.
        return EXIT_FINDINGS if exc.reason == "invalid_manifest" else EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if out is sys.stdout:
            # The reader went away (`| head`): stop Python's exit-time flush from failing again
            # and printing a traceback-like "Exception ignored" to stderr.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        err.write(
            printable(
                f"egress-proxy: internal error ({type(exc).__name__}: {str(exc)[:200]}); "
                "please report it with the input that caused it"
            )
            + "\n"
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
