"""`egress-proxy check`, `explain` and `classify`: the policy core on the command line, no
network."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any, TextIO

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
from policy.dimensions import Stage
from policy.hostnames import normalize_host, parse_ip_literal
from policy.manifests import FORMATS
from policy.urls import parse_target
from proxy.app.config import Config
from proxy.app.credentials_config import credential_findings
from proxy.app.inputs import load_inputs, read_config, read_input, source_name
from proxy.cli.output import EXIT_FINDINGS, EXIT_OK, MAX_TABLE_ROWS, more, print_json, table
from proxy.common.terminal import printable


def add_check_parsers(sub: Any) -> None:
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
        help="check these addresses for HOST (no DNS is sent; 'HOST=' is an answer with no "
        "address); once per host, repeatable",
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
        # A credential for a host the session may not reach is a config mistake run refuses.
        found = (*policy.findings, *credential_findings(policy, config))
        rules = policy.rules_json()
    else:
        found = check_manifest(manifest, ceiling, config.operator)
    findings = sorted(found, key=_document_order)
    ok = not any(f.is_error for f in findings)
    if args.json:
        print_json(
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
        table(
            [("SEVERITY", "PATH", "REASON", "MESSAGE")]
            + [(f.severity, f.path, f.reason, f.message) for f in findings[:MAX_TABLE_ROWS]],
            out,
        )
        more(findings, "findings", out)
    if rules:
        out.write("effective rules:\n")
        table(
            [("ACTION", "KIND", "HOST", "RULE", "CEILING")]
            + [
                (r["action"], r["kind"], _rule_target(r), r["rule"], r.get("ceiling") or "-")
                for r in rules[:MAX_TABLE_ROWS]
            ],
            out,
        )
        more(rules, "rules", out)
    elif manifest.ok:
        out.write("effective rules: none (every destination but platform routes is refused)\n")
    return EXIT_OK if ok else EXIT_FINDINGS


def _rule_target(rule: dict[str, Any]) -> str:
    if rule["kind"] == "address":
        return str(rule.get("network", rule["pattern"]))
    if rule["kind"] == "url":
        # A blocked prefix holds on every scheme and port: it has neither.
        scheme, port = rule["scheme"] or "*", rule["port"] or "*"
        return f"{scheme}://{rule['host']}:{port}{rule['path']}"
    host = rule.get("host") or "*"
    return f"{host} (+ subdomains)" if rule["kind"] == "subtree" and host != "*" else host


# -- explain -------------------------------------------------------------------------------


def _parse_resolve(values: Sequence[str]) -> dict[str, list[str]]:
    """`--resolve HOST=ADDR[,ADDR...]` values as the DNS answers they stand for, keyed by the
    normalised host. `HOST=` is an answer with no address (the address stage refuses it);
    anything else that could not come from DNS is a usage error naming the value."""
    table: dict[str, list[str]] = {}
    spelled: dict[str, str] = {}
    for value in values:
        host, sep, answer = value.partition("=")

        def usage(why: str, value: str = value) -> PolicyError:
            return PolicyError(
                "usage", f"--resolve {value[:100]!r}: {why}; write HOST=ADDR[,ADDR...]"
            )

        if not sep:
            raise usage("no '='")
        if not host:
            raise usage("no host before '='")
        if parse_ip_literal(host.removeprefix("[").removesuffix("]")) is not None:
            raise usage(f"{host[:100]!r} is an IP address, which is never resolved")
        try:
            key = normalize_host(host)
        except PolicyError as exc:
            raise usage(exc.message) from None
        if key in table:
            raise usage(
                f"{key} is given twice (also as {spelled[key][:100]!r}); give all of its "
                "addresses in one --resolve"
            )
        addresses = [a.strip() for a in answer.split(",")] if answer else []
        if any(not a for a in addresses):
            raise usage("an empty address in the list")
        # A DNS answer only ever holds addresses: anything else here is a typo, and checking it
        # would report a refusal the running proxy could never make.
        bad = next((a for a in addresses if parse_address(a) is None), None)
        if bad is not None:
            raise usage(f"{bad[:100]!r} is not an IP address")
        table[key] = list(dict.fromkeys(addresses))  # the resolver drops repeats too
        spelled[key] = host
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
        stage=Stage.ADDRESS,
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
        print_json(results, out)
        return EXIT_OK
    rows = [("DECISION", "TARGET", "STAGE", "REASON", "RULE", "WHY")]
    for r in results:
        decision = "allow" if r["allowed"] else "DENY"
        if r["allowed"] and r["needs_inspection"]:
            decision = "allow+inspect"
        rows.append(
            (decision, r["target"], r["stage"], r["reason"], r["rule"] or "-", r["message"])
        )
    table(rows, out, indent="")
    return EXIT_OK


# -- classify ------------------------------------------------------------------------------


def cmd_classify(args: argparse.Namespace, out: TextIO) -> int:
    config = read_config(args.config)
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
        print_json(results, out)
        return EXIT_OK
    rows = [("ADDRESS", "PUBLIC", "REASON", "RANGE", "WHAT")]
    for r in results:
        what = f"{r['name']} ({r['rfc']})" if r["rfc"] else r["name"]
        rows.append(
            (r["address"], "yes" if r["public"] else "no", r["reason"], r["range"] or "-", what)
        )
    table(rows, out, indent="")
    return EXIT_OK


# -- run -----------------------------------------------------------------------------------
