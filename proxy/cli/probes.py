"""`python -m proxy.probes --spec JSON [--as-user UID:GID]` (proxy/probes.py runs this): the
probes of proxy/boundary/probes/ from the agent's position, one JSON object printed. The
Kubernetes manifests and the sandbox canary run it by that name.

Exit codes: 0 every probe held, 1 one did not (each is in the output), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from proxy.boundary.probes.privileges import drop_privileges, parse_user
from proxy.boundary.probes.runner import report, run_probes
from proxy.boundary.probes.spec import INVALID_SPEC, parse_spec
from proxy.common.errors import ProxyError
from proxy.common.refusals import shown


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m proxy.probes",
        description="Probe an egress boundary from the agent's position; print one JSON object.",
    )
    parser.add_argument("--spec", required=True, metavar="JSON", help="the probes (a JSON object)")
    parser.add_argument(
        "--as-user", metavar="UID:GID", help="drop to this user before probing (needs root)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        # Privileges go first: not one probe (or spec parse) runs as root by mistake.
        if args.as_user is not None:
            drop_privileges(*parse_user(args.as_user))
        try:
            document = json.loads(args.spec)
        except ValueError as exc:
            raise ProxyError(INVALID_SPEC, f"--spec is not JSON: {exc}") from None
        spec = parse_spec(document)
    except ProxyError as exc:
        sys.stderr.write(f"egress-proxy probes: {shown(exc.message)}\n")
        return 2
    results = run_probes(spec)
    sys.stdout.write(json.dumps(report(results)) + "\n")
    return 0 if all(r.passed for r in results) else 1
