"""`egress-proxy suggest AUDIT_LOG...`: the manifest entries that would have allowed every
connection the logs saw. The files are read and the result printed here; what is counted and
chosen is policy/suggest.py's (pure), with the Public Suffix List injected for `--group`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TextIO

from policy import Ceiling, PolicyError, load_ceiling
from policy.manifests import FORMATS
from policy.suggest import Collector, Outside, Suggested, Suggestion, Unsuggested
from proxy.app.inputs import read_input, source_name
from proxy.cli.output import EXIT_OK, print_json
from proxy.common.terminal import printable

# An audit line is capped well below this (every field has its cap); a longer one is not ours.
MAX_LINE = 256 * 1024
_CHUNK = 64 * 1024


def add_suggest_parser(sub: Any) -> None:
    p = sub.add_parser(
        "suggest",
        help="the manifest entries that would have allowed every connection in audit logs",
        description="Read audit logs (of 'run', with or without --learn) and print the "
        "smallest set of manifest entries that would have allowed every connection they saw "
        "(allow and would_deny lines, the denials a manifest entry lifts: not_allowed, "
        "path_not_allowed, unanswered asks, and the grants of an asking session): host "
        "entries, with connections, first and last time; --ceiling lists apart what the "
        "ceiling refuses.",
    )
    p.add_argument("logs", nargs="+", metavar="AUDIT_LOG", help="audit log files ('-': stdin)")
    p.add_argument(
        "--format", choices=FORMATS, default="agent.yaml", help="entry grammar (default agent.yaml)"
    )
    p.add_argument(
        "--ceiling", metavar="FILE", help="list apart the entries this tenant ceiling refuses"
    )
    p.add_argument(
        "--group",
        action="store_true",
        help="fold names under one registrable domain into one entry for it (Public Suffix "
        "List: never a public suffix such as co.uk or github.io)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_suggest(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    err = err or sys.stderr
    if args.logs.count("-") > 1:
        raise PolicyError("usage", "suggest: standard input ('-') can be read once")
    ceiling = _ceiling(args.ceiling)
    registrable = _registrable() if args.group else None
    collector = Collector()
    # Every file is opened before any is read: a missing one stops the command at once.
    with contextlib.ExitStack() as stack:
        streams = [(path, stack.enter_context(_open(path))) for path in args.logs]
        for _, stream in streams:
            for line in _lines(stream):
                if line is None:
                    collector.skipped += 1
                else:
                    collector.add(line)
    found = collector.suggest(args.format, registrable=registrable, ceiling=ceiling)
    if found.skipped:
        err.write(
            f"egress-proxy: suggest: skipped {found.skipped} line(s) that are not audit lines "
            "(truncated or corrupt)\n"
        )
    if args.json:
        print_json(found.to_json(), out)
    else:
        _print(found, len(args.logs), out)
    return EXIT_OK


# -- reading ---------------------------------------------------------------------------------


def _ceiling(path: str | None) -> Ceiling | None:
    if not path:
        return None
    return load_ceiling(read_input(path), source=source_name(path))


def _registrable() -> Callable[[str], str | None]:
    """The registrable domain of a name, from the list publicsuffixlist ships (read from its
    own file, never fetched); private-section suffixes such as github.io count as public."""
    from publicsuffixlist import PublicSuffixList

    psl = PublicSuffixList()

    def registrable(host: str) -> str | None:
        found = psl.privatesuffix(host)
        return found if isinstance(found, str) else None

    return registrable


@contextlib.contextmanager
def _open(path: str) -> Iterator[BinaryIO]:
    if path == "-":
        yield sys.stdin.buffer
        return
    try:
        stream = open(path, "rb")  # noqa: SIM115 (closed below, after every file is open)
    except OSError as exc:
        raise PolicyError(
            "unreadable", f"cannot read: {exc.strerror or exc}", source=path
        ) from None
    with stream:
        yield stream


def _lines(stream: BinaryIO) -> Iterator[str | None]:
    """Each line as text; None for one that cannot be an audit line (not UTF-8, or longer than
    MAX_LINE: the rest of it is read past, never held)."""
    while True:
        try:
            raw = stream.readline(MAX_LINE + 1)
        except OSError as exc:
            raise PolicyError("unreadable", f"cannot read: {exc.strerror or exc}") from None
        if not raw:
            return
        if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
            while (more := stream.readline(_CHUNK)) and not more.endswith(b"\n"):
                pass
            yield None
            continue
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            yield None


# -- printing --------------------------------------------------------------------------------


def _print(found: Suggestion, logs: int, out: TextIO) -> None:
    """Pasteable: the block in the format's own syntax, everything else as comments."""
    count = len(found.entries)
    out.write(
        f"# egress-proxy suggest: {count} {'entry' if count == 1 else 'entries'} for "
        f"{found.connections} connection(s) (allow, would_deny and lifted deny lines) in "
        f"{logs} log(s)\n"
    )
    if found.format == "agent.toml":
        _print_toml(found.entries, out)
    else:
        _print_yaml(found.entries, out)
    _print_outside(found.outside_ceiling, out)
    _print_unsuggested(found.not_suggested, out)
    if found.dns_lines:
        out.write(
            f"# {found.dns_lines} DNS responder line(s) left out (a query is no connection)\n"
        )


def _covers(entry: Suggested) -> str:
    return f"{entry.connections} connection(s), {entry.first} to {entry.last}"


def _print_yaml(entries: tuple[Suggested, ...], out: TextIO) -> None:
    out.write("network:\n")
    if not entries:
        out.write("  egress: []\n")
        return
    out.write("  egress:\n")
    for entry in entries:
        out.write(f"    - {entry.entry}  # {_covers(entry)}\n")


def _print_toml(entries: tuple[Suggested, ...], out: TextIO) -> None:
    out.write("[network_access]\n")
    if not entries:
        out.write("allowed = []\n")
        return
    out.write("allowed = [\n")
    for entry in entries:
        out.write(f'  "{entry.entry}",  # {_covers(entry)}\n')
    out.write("]\n")


def _print_outside(outside: tuple[Outside, ...], out: TextIO) -> None:
    if not outside:
        return
    out.write(
        "# outside the ceiling (left out above: check --ceiling would refuse them; the "
        "administrator must widen the ceiling):\n"
    )
    for item in outside:
        line = f"#   {item.suggested.entry}: {item.message} ({_covers(item.suggested)})"
        out.write(printable(line) + "\n")


def _print_unsuggested(unsuggested: tuple[Unsuggested, ...], out: TextIO) -> None:
    if not unsuggested:
        return
    total = sum(item.connections for item in unsuggested)
    out.write(
        f"# not suggested, {total} connection(s): refused (deny lines), or allowed by what no "
        "manifest entry names:\n"
    )
    for item in unsuggested:
        line = f"#   {item.host or '-'}  {item.decision}  {item.reason}  ({item.connections})"
        out.write(printable(line) + "\n")
