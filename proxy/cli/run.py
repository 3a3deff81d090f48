"""`egress-proxy run`: its options; the proxy itself is proxy/app/runtime.py."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from policy import PolicyError
from policy.manifests import FORMATS


def add_run_parser(sub: Any) -> None:
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
    run.add_argument("--session-id", metavar="ID", help="session id written on every audit line")
    run.add_argument("--audit-log", metavar="FILE", help="append audit lines here (default stdout)")
    modes = run.add_mutually_exclusive_group()
    modes.add_argument(
        "--learn",
        action="store_true",
        help="learning mode: let through (audited as would_deny) what only a manifest entry "
        "would allow, for 'egress-proxy suggest'; refused where the config says 'learn: forbid'",
    )
    modes.add_argument(
        "--ask",
        action="store_true",
        help="asking mode: hold what only a manifest entry would allow until a person answers "
        "on the admin listener (egress-proxy ask); needs --ask-token; refused where the config "
        "says 'ask: forbid'",
    )
    run.add_argument(
        "--ask-token",
        metavar="FILE",
        help="with --ask: the file holding the token that answers asks (created 0600 with a "
        "fresh token when absent; refused when group or others can read it)",
    )


def cmd_run(args: argparse.Namespace, out: TextIO) -> int:
    # Imported here: check, explain and classify never load mitmproxy.
    from proxy.app import inputs, runtime
    from proxy.common.listeners import (
        check_listeners,
        parse_dns_listener,
        parse_listen,
        parse_listener,
    )

    if args.ask != bool(args.ask_token):
        raise PolicyError(
            "usage",
            "run: --ask needs --ask-token FILE (the token that answers asks)"
            if args.ask
            else "run: --ask-token is for --ask",
        )
    # `--mode transparent` is sugar: a listener written without a scheme is transparent.
    bare = "transparent" if args.mode == "transparent" else "http"
    listen = [parse_listener(text, bare=bare) for text in args.listen or ["127.0.0.1:3128"]]
    dns_listen = [parse_dns_listener(text) for text in args.dns_listen or []]
    check_listeners([*listen, *dns_listen])
    admin = parse_listen(args.admin)
    # Everything is read and compiled before anything listens: a problem exits here.
    read = inputs.read_inputs(
        args.manifest, ceiling=args.ceiling, config=args.config, format=args.format
    )
    compiled = inputs.compile_inputs(read)
    return runtime.run(
        read,
        compiled,
        listen=listen,
        admin=admin,
        session_id=args.session_id,
        audit_log=args.audit_log,
        dns_listen=dns_listen,
        learn=args.learn,
        ask_token=os.path.abspath(args.ask_token) if args.ask else None,
    )
