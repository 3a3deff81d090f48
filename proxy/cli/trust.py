"""`egress-proxy trust`: the session's trust files and the variables that point tools at them,
for shapes that start the agent themselves (a container, a CI job, a shell). `run` says the
same at start; `sandbox` and the Kubernetes sidecar set the variables themselves.

    egress-proxy trust [--config F] [--dir DIR] [--format shell|env|json]

It creates the inspection CA when there is none (as `run` would, in `inspection.ca_dir`),
publishes the bundle (system roots + session CA) and the CA's certificate into DIR (default
`inspection.trust_dir`, else the CA directory), and prints the variables: `shell` as `export`
lines to eval, `env` as NAME=VALUE lines for `docker run --env-file`, `json` with the files."""

from __future__ import annotations

import argparse
import shlex
from typing import Any, TextIO

from proxy.cli.output import EXIT_OK, print_json

FORMATS = ("shell", "env", "json")


def add_trust_parser(sub: Any) -> None:
    trust = sub.add_parser(
        "trust",
        help="publish the trust bundle (system roots + inspection CA) and print the variables "
        "that point common tools at it",
    )
    trust.add_argument("--config", metavar="FILE", help="operator config (its inspection section)")
    trust.add_argument(
        "--dir",
        metavar="DIR",
        help="where to write the bundle and CA certificate (default: inspection.trust_dir, "
        "else the CA directory)",
    )
    trust.add_argument("--format", choices=FORMATS, default="shell", help="default: shell")


def cmd_trust(args: argparse.Namespace, out: TextIO) -> int:
    from proxy.app.inputs import read_config
    from proxy.common.errors import ProxyError
    from proxy.tls.bundle import TRUST_VARIABLES, publish
    from proxy.tls.ca import ensure_ca

    config = read_config(args.config)
    if not config.operator.inspection_enabled:
        raise ProxyError(
            "inspection_disabled",
            f"{args.config}: inspection.enabled is false: nothing is intercepted, so clients "
            "need no CA and their own trust store is right",
            source=args.config,
        )
    ca = ensure_ca(config.ca_dir)
    files = publish(ca, args.dir or config.trust_dir)
    environment = files.environment()
    if args.format == "json":
        print_json(
            {
                "bundle": str(files.bundle),
                "ca": str(files.ca),
                "ca_created": ca.created,
                "roots": files.roots,
                "roots_source": files.roots_source,
                "environment": environment,
                "readers": {name: readers for name, _, readers in TRUST_VARIABLES},
            },
            out,
        )
        return EXIT_OK
    for name, value in environment.items():
        if args.format == "env":
            out.write(f"{name}={value}\n")  # --env-file takes the rest of the line verbatim
        else:
            out.write(f"export {name}={shlex.quote(value)}\n")
    return EXIT_OK
