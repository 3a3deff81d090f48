"""The `egress-proxy` command line. Its options, output and exit codes are a contract that
scripts outside this repo rely on.

Exit codes: 0 success, 1 findings (check) or a manifest that cannot be compiled, 2 unreadable
or unparsable input or a usage error, 70 an internal error (a bug: reported without a
traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from policy import (
    Ceiling,
    Finding,
    Manifest,
    Policy,
    PolicyError,
    check_manifest,
    classify,
    compile_policy,
    parse_address,
)
from policy.hostnames import normalize_host, parse_ip_literal
from policy.manifests import FORMATS
from policy.urls import parse_target
from proxy.boundary import add_boundary_parser, cmd_boundary
from proxy.config import Config, load_config
from proxy.inputs import load_inputs, read_input, source_name
from proxy.sandbox_cli import add_sandbox_parser, cmd_sandbox
from proxy.terminal import printable

EXIT_OK, EXIT_FINDINGS, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 70


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="egress-proxy", description="Session-scoped egress enforcement proxy.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def inputs(p: argparse.ArgumentParser, manifest: bool = True) -> None:
        if manifest:
            p.add_argument(
                "manifest", metavar="MANIFEST", help="agent.yaml or agent.toml ('-': stdin)"
            )
            p.add_argument("--ceiling", metavar="FILE", help="the tenant ceiling (YAML or JSON)")
            p.add_argument("--format", choices=FORMATS, help="override format detection")
        p.add_argument("--config", metavar="FILE", help="operator config (YAML or JSON)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    check = sub.add_parser("check", help="validate a manifest against the grammar and ceiling")
    inputs(check)
    explain = sub.add_parser("explain", help="decide targets as the running proxy would")
    inputs(explain)
    explain.add_argument(
        "--resolve",
        action="append",
        default=[],
        metavar="HOST=ADDR[,ADDR...]",
        help="check these addresses for HOST (no DNS is sent); repeatable",
    )
    explain.add_argument(
        "targets",
        nargs="+",
        metavar="TARGET",
        help="host, host:port, [v6]:port or URL ('--' before one starting with -)",
    )
    classify_p = sub.add_parser("classify", help="classify IP addresses")
    inputs(classify_p, manifest=False)
    classify_p.add_argument("addresses", nargs="+", metavar="ADDRESS")
    run = sub.add_parser("run", help="run the session proxy (SIGTERM drains, SIGHUP reloads)")
    run.add_argument("manifest", metavar="MANIFEST", help="agent.yaml or agent.toml ('-': stdin)")
    run.add_argument(
        "--ceiling", metavar="FILE", help="the tenant ceiling (YAML or JSON; re-read on SIGHUP)"
    )
    run.add_argument("--format", choices=FORMATS, help="override format detection")
    run.add_argument(
        "--config", metavar="FILE", help="operator config (YAML or JSON; re-read on SIGHUP)"
    )
    run.add_argument(
        "--listen",
        metavar="[SCHEME://]HOST:PORT",
        action="append",
        help="proxy listener; repeat for several; SCHEME http (default), socks5 or transparent "
        "(connections redirected to it by netfilter) (default: 127.0.0.1:3128)",
    )
    run.add_argument(
        "--dns-listen",
        metavar="HOST:PORT",
        action="append",
        help="DNS responder (UDP and TCP) answering A/AAAA for the names the policy allows, "
        "REFUSED for the others, never forwarding; repeat for several",
    )
    run.add_argument(
        "--admin", metavar="HOST:PORT", default="127.0.0.1:9901", help="/healthz /readyz /metrics"
    )
    run.add_argument(
        "--mode",
        choices=("explicit", "transparent"),
        default="explicit",
        help="explicit: clients name the proxy (HTTP, SOCKS5); transparent: every --listen "
        "without a scheme is transparent://, serving connections redirected to it by netfilter, "
        "decided on their SNI or Host header",
    )
    run.add_argument(
        "--engine-only",
        action="store_true",
        help="serve every connection with the L7 engine (no fast path); for comparisons",
    )
    run.add_argument("--session-id", metavar="ID", help="session id written on every audit line")
    run.add_argument("--audit-log", metavar="FILE", help="append audit lines here (default stdout)")
    add_boundary_parser(sub)
    add_sandbox_parser(sub)
    return parser


def _load_config(args: argparse.Namespace) -> Config:
    if not args.config:
        return Config()
    return load_config(read_input(args.config), source=source_name(args.config))


def _check_stdin(args: argparse.Namespace) -> None:
    named = [
        f"--{name}" if name != "manifest" else "MANIFEST"
        for name in ("manifest", "ceiling", "config")
        if getattr(args, name, None) == "-"
    ]
    if len(named) > 1:
        # The second reader would see an empty stream and report a misleading "empty document".
        raise PolicyError(
            "usage", f"only one input can come from stdin ('-'), not {' and '.join(named)}"
        )


def _load_inputs(args: argparse.Namespace) -> tuple[Manifest, Ceiling | None, Config]:
    _check_stdin(args)
    return load_inputs(
        read_input(args.manifest),
        source_name(args.manifest),
        format=args.format,
        ceiling_path=args.ceiling,
        config_path=args.config,
    )


def _print_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# A person reads the tables; a hostile or generated document can hold a million findings or
# rules, which `--json` still lists in full.
MAX_TABLE_ROWS = 1000


def _more(items: Sequence[Any], what: str, out: TextIO) -> None:
    if len(items) > MAX_TABLE_ROWS:
        hidden = len(items) - MAX_TABLE_ROWS
        out.write(f"  … and {hidden} more {what} (--json lists them all)\n")


def _table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "  ") -> None:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out.write(indent + "  ".join([*cells, row[-1]]).rstrip() + "\n")


# -- check ---------------------------------------------------------------------------------


_INDEX = re.compile(r"(\d+)")


def _document_order(finding: Finding) -> list[Any]:
    """Findings sorted as their places appear in the document: `egress[2]` before `egress[10]`."""
    return [int(part) if part.isdigit() else part for part in _INDEX.split(finding.path)]


def cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    manifest, ceiling, config = _load_inputs(args)
    rules: list[dict[str, Any]] = []
    if manifest.ok:
        policy = compile_policy(manifest, ceiling, config.operator)
        found, rules = policy.findings, policy.rules_json()
    else:
        found = check_manifest(manifest, ceiling, config.operator)
    findings = sorted(found, key=_document_order)
    ok = not any(f.is_error for f in findings)
    if args.json:
        _print_json(
            {
                "ok": ok,
                "format": manifest.format,
                "mode": manifest.mode,
                "findings": [f.to_json() for f in findings],
                "rules": rules,
            },
            out,
        )
        return EXIT_OK if ok else EXIT_FINDINGS
    errors = sum(f.is_error for f in findings)
    warnings = len(findings) - errors
    verdict = "valid" if ok else "INVALID"
    out.write(
        f"{printable(manifest.source)} ({manifest.format}, egress mode {manifest.mode}): "
        f"{verdict}, {errors} error(s), {warnings} warning(s)\n"
    )
    if findings:
        out.write("findings:\n")
        _table(
            [("SEVERITY", "PATH", "REASON", "MESSAGE")]
            + [(f.severity, f.path, f.reason, f.message) for f in findings[:MAX_TABLE_ROWS]],
            out,
        )
        _more(findings, "findings", out)
    if rules:
        out.write("effective rules:\n")
        _table(
            [("ACTION", "KIND", "HOST", "RULE", "CEILING")]
            + [
                (r["action"], r["kind"], _rule_target(r), r["rule"], r.get("ceiling") or "-")
                for r in rules[:MAX_TABLE_ROWS]
            ],
            out,
        )
        _more(rules, "rules", out)
    elif manifest.ok:
        out.write("effective rules: none (every destination but platform routes is refused)\n")
    return EXIT_OK if ok else EXIT_FINDINGS


def _rule_target(rule: dict[str, Any]) -> str:
    if rule["kind"] == "address":
        return rule.get("network", rule["pattern"])
    if rule["kind"] == "url":
        return f"{rule['scheme']}://{rule['host']}:{rule['port']}{rule['path']}"
    host = rule.get("host") or "*"
    return f"{host} (+ subdomains)" if rule["kind"] == "subtree" and host != "*" else host


# -- explain -------------------------------------------------------------------------------


def _parse_resolve(values: Sequence[str]) -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for value in values:
        shown = repr(value[:100])
        host, sep, answer = value.partition("=")
        if not sep or not host or not answer:
            raise PolicyError("usage", f"--resolve {shown}: write HOST=ADDR[,ADDR...]")
        literal = parse_ip_literal(host)
        try:
            key = str(literal) if literal is not None else normalize_host(host)
        except PolicyError as exc:
            raise PolicyError("usage", f"--resolve {shown}: {exc.message}") from None
        addresses = [a.strip() for a in answer.split(",")]
        # A DNS answer only ever holds addresses: anything else here is a typo, and checking it
        # would report a refusal the running proxy could never make.
        bad = next((a for a in addresses if parse_address(a) is None), None)
        if bad is not None:
            raise PolicyError(
                "usage",
                f"--resolve {shown}: {bad!r} is not an IP address; write HOST=ADDR[,ADDR...]",
            )
        table.setdefault(key, []).extend(addresses)
    return table


def explain_target(policy: Policy, target: str, resolved: dict[str, list[str]]) -> dict[str, Any]:
    decision = policy.decide(target)
    result: dict[str, Any] = {"target": target, **decision.to_json(), "addresses": None}
    if not decision.allowed:
        return result
    addresses = resolved.get(decision.host)
    literal = parse_ip_literal(parse_target(target).host)
    if addresses is None and literal is not None:
        addresses = [str(literal)]  # an allowed literal is its own answer
    if addresses is None:
        return result
    checked = policy.check_addresses(decision.host, addresses).to_json()
    result.update(
        allowed=checked["allowed"],
        stage="address",
        # An accepted answer adds nothing to why the name was admitted (`platform_destination`
        # says more than `allowed`); a refused one is the reason.
        reason=checked["reason"] if not checked["allowed"] else decision.reason,
        message=checked["message"] if not checked["allowed"] else decision.message,
        addresses=checked["addresses"],
    )
    if checked["rule"] and not checked["allowed"]:
        result["rule"] = checked["rule"]
    return result


def cmd_explain(args: argparse.Namespace, out: TextIO) -> int:
    manifest, ceiling, config = _load_inputs(args)
    resolved = _parse_resolve(args.resolve)
    policy = compile_policy(manifest, ceiling, config.operator)
    results = [explain_target(policy, t, resolved) for t in args.targets]
    if args.json:
        _print_json(results, out)
        return EXIT_OK
    rows = [("DECISION", "TARGET", "STAGE", "REASON", "RULE", "WHY")]
    for r in results:
        decision = "allow" if r["allowed"] else "DENY"
        if r["allowed"] and r["needs_inspection"]:
            decision = "allow+inspect"
        rows.append(
            (decision, r["target"], r["stage"], r["reason"], r["rule"] or "-", r["message"])
        )
    _table(rows, out, indent="")
    return EXIT_OK


# -- classify ------------------------------------------------------------------------------


def cmd_classify(args: argparse.Namespace, out: TextIO) -> int:
    config = _load_config(args)
    verdicts = [classify(a, config.operator.addresses) for a in args.addresses]
    results = [
        {
            "address": a,
            "public": v.public,
            "reason": v.reason,
            "range": v.range,
            "name": v.name,
            "rfc": v.rfc,
        }
        for a, v in zip(args.addresses, verdicts, strict=True)
    ]
    if args.json:
        _print_json(results, out)
        return EXIT_OK
    rows = [("ADDRESS", "PUBLIC", "REASON", "RANGE", "WHAT")]
    for r in results:
        what = f"{r['name']} ({r['rfc']})" if r["rfc"] else r["name"]
        rows.append(
            (r["address"], "yes" if r["public"] else "no", r["reason"], r["range"] or "-", what)
        )
    _table(rows, out, indent="")
    return EXIT_OK


# -- run -----------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, out: TextIO) -> int:
    # Imported here: check, explain and classify never load mitmproxy.
    from proxy import runtime
    from proxy.admin import parse_listen
    from proxy.listen import check_listeners, parse_dns_listener, parse_listener

    # `--mode transparent` is sugar: a listener written without a scheme is transparent.
    bare = "transparent" if args.mode == "transparent" else "http"
    listen = [parse_listener(text, bare=bare) for text in args.listen or ["127.0.0.1:3128"]]
    dns_listen = [parse_dns_listener(text) for text in args.dns_listen or []]
    check_listeners([*listen, *dns_listen], engine_only=args.engine_only)
    if args.engine_only and any(x.scheme == "transparent" for x in listen):
        # The engine alone has no SNI gate for redirected TLS: the front door decides it.
        raise PolicyError(
            "usage", "run: --engine-only serves explicit listeners only (http://, socks5://)"
        )
    admin = parse_listen(args.admin)
    # Everything is read and compiled before anything listens: a problem exits here.
    inputs = runtime.read_inputs(
        args.manifest, ceiling=args.ceiling, config=args.config, format=args.format
    )
    compiled = runtime.compile_inputs(inputs)
    return runtime.run(
        inputs,
        compiled,
        listen=listen,
        admin=admin,
        session_id=args.session_id,
        audit_log=args.audit_log,
        engine_only=args.engine_only,
        dns_listen=dns_listen,
    )


COMMANDS = {"check": cmd_check, "explain": cmd_explain, "classify": cmd_classify, "run": cmd_run}
COMMANDS["boundary"] = cmd_boundary
COMMANDS["sandbox"] = cmd_sandbox


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
            err.write(printable(f"  {detail.path}: {detail.message}") + "\n")
        _more(exc.details, "problems", err)
    else:
        err.write(printable(f"egress-proxy: {exc}") + "\n")
    if getattr(args, "json", False):
        _print_json(
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
