"""The `egress-proxy` command line. Its options, output and exit codes are a contract that
scripts outside this repo rely on.

Exit codes: 0 success, 1 findings (check) or a manifest that cannot be compiled, 2 unreadable
or unparsable input or a usage error, 70 an internal error (a bug: reported without a
traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from policy import (
    Ceiling,
    Manifest,
    Policy,
    PolicyError,
    check_manifest,
    classify,
    compile_policy,
    load_ceiling,
    load_manifest,
)
from policy.documents import MAX_DOCUMENT_BYTES
from policy.hostnames import normalize_host, parse_ip_literal
from policy.manifests import FORMATS
from policy.urls import parse_target
from proxy.config import Config, load_config

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
        p.add_argument("--config", metavar="FILE", help="operator config (YAML)")
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
    return parser


def read_input(path: str) -> bytes:
    """A file's bytes, bounded: a hostile 50 MB manifest is refused without reading it all."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1)
        else:
            with open(path, "rb") as handle:
                data = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise PolicyError(
            "unreadable", f"cannot read: {exc.strerror or exc}", source=path
        ) from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise PolicyError(
            "too_large", f"larger than the limit of {MAX_DOCUMENT_BYTES} bytes", source=path
        )
    return data


def _source(path: str) -> str:
    return "<stdin>" if path == "-" else path


def _load_config(args: argparse.Namespace) -> Config:
    if not args.config:
        return Config()
    return load_config(read_input(args.config), source=args.config)


def _load_inputs(args: argparse.Namespace) -> tuple[Manifest, Ceiling | None, Config]:
    config = _load_config(args)
    suffixes = config.operator.internal_suffixes
    manifest = load_manifest(
        read_input(args.manifest),
        source=_source(args.manifest),
        format=args.format,
        internal_suffixes=suffixes,
    )
    ceiling = None
    if args.ceiling:
        ceiling = load_ceiling(
            read_input(args.ceiling), source=args.ceiling, internal_suffixes=suffixes
        )
    return manifest, ceiling, config


def _print_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out.write(indent + "  ".join([*cells, row[-1]]).rstrip() + "\n")


# -- check ---------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    manifest, ceiling, config = _load_inputs(args)
    findings = check_manifest(manifest, ceiling, config.operator)
    ok = not any(f.is_error for f in findings)
    rules: list[dict[str, Any]] = []
    if manifest.ok:
        rules = compile_policy(manifest, ceiling, config.operator).rules_json()
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
        f"{manifest.source} ({manifest.format}, egress mode {manifest.mode}): {verdict}, "
        f"{errors} error(s), {warnings} warning(s)\n"
    )
    if findings:
        out.write("findings:\n")
        _table(
            [("SEVERITY", "PATH", "REASON", "MESSAGE")]
            + [(f.severity, f.path, f.reason, f.message) for f in findings],
            out,
        )
    if rules:
        out.write("effective rules:\n")
        _table(
            [("ACTION", "KIND", "HOST", "RULE", "CEILING")]
            + [
                (r["action"], r["kind"], _rule_target(r), r["rule"], r.get("ceiling") or "-")
                for r in rules
            ],
            out,
        )
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
        host, sep, addresses = value.partition("=")
        if not sep or not host or not addresses:
            raise PolicyError("usage", f"--resolve {value!r}: write HOST=ADDR[,ADDR...]")
        literal = parse_ip_literal(host)
        key = str(literal) if literal is not None else normalize_host(host)
        table.setdefault(key, []).extend(a.strip() for a in addresses.split(","))
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
        reason=checked["reason"],
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


COMMANDS = {"check": cmd_check, "explain": cmd_explain, "classify": cmd_classify}


def _report(exc: PolicyError, args: argparse.Namespace, out: TextIO) -> None:
    sys.stderr.write(f"egress-proxy: {exc}\n")
    for detail in exc.details[1:] if len(exc.details) > 1 else ():
        where = f"{detail.file}: " if detail.file else ""
        sys.stderr.write(f"  {where}{detail.path}: {detail.message}\n")
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


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, out)
    except PolicyError as exc:
        _report(exc, args, out)
        # A manifest that parses but does not compile is a findings problem, not bad input.
        return EXIT_FINDINGS if exc.reason == "invalid_manifest" else EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        sys.stderr.write(
            f"egress-proxy: internal error ({type(exc).__name__}: {exc}); "
            "please report it with the input that caused it\n"
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
