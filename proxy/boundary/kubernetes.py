"""The Kubernetes sidecar's boundary, `egress-proxy boundary apply|verify` (parsed in
proxy/cli/boundary.py): the two halves of the Kubernetes sidecar's activation
(DESIGN 6). `apply` (an init container with NET_ADMIN) loads the pod rule set and reads it back;
`verify` (an init container running as the agent's UID, after the proxy is ready) tries every
way out and fails the pod if one works.

Exit codes: apply 0 loaded and read back as rendered, 1 nft refused it or the read-back differed
(the table was removed again), 2 bad input; verify 0 every probe held, 1 a bypass works (each
failed probe is named), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from proxy.errors import ProxyError
from proxy.terminal import printable

# Documentation ranges (RFC 5737, RFC 3849): nothing answers there, so a probe that is not
# redirected to the proxy goes unanswered instead of reaching someone.
DEFAULT_PROBE_V4 = "192.0.2.1"
DEFAULT_PROBE_V6 = "2001:db8::1"
DEFAULT_PROBE_PORTS = (80, 443)
DEFAULT_DENIED_NAME = "egress-boundary-probe.invalid"
# UDP 443 is QUIC: the datagram a real client would try first.
UDP_PROBE_PORT = 443


def apply(args: argparse.Namespace, out: TextIO) -> int:
    from proxy.boundary.nft.chains import BOUNDARY_FAILED
    from proxy.boundary.nft.compare import expected_chains
    from proxy.boundary.nft.load import apply_ruleset, read_back
    from proxy.boundary.nft.pod import pod_ruleset

    if args.ruleset is not None:
        given = [
            name
            for name in ("transparent_port", "dns_port", "explicit_port", "admin_port")
            if getattr(args, name) is not None
        ]
        if given:
            raise ProxyError(
                "usage",
                f"boundary apply: --ruleset takes no --{given[0].replace('_', '-')}",
            )
        from proxy.app.inputs import read_input

        try:
            text = read_input(args.ruleset).decode("utf-8")
        except UnicodeDecodeError:
            raise ProxyError(
                "usage", f"--ruleset {args.ruleset[:80]!r} is not UTF-8 text"
            ) from None
    else:
        missing = [
            f"--{name.replace('_', '-')}"
            for name in ("transparent_port", "dns_port")
            if getattr(args, name) is None
        ]
        if missing:
            raise ProxyError("usage", f"boundary apply: {' and '.join(missing)} required")
        text = pod_ruleset(
            args.proxy_uid,
            args.transparent_port,
            args.dns_port,
            args.explicit_port,
            args.table,
            admin_port=args.admin_port,
        )
    if args.print:
        expected_chains(text, args.table)  # what is printed must be what apply loads
        out.write(text)
        return 0
    try:
        apply_ruleset(text, args.table)
    except ProxyError as exc:
        if exc.reason != BOUNDARY_FAILED:
            raise
        sys.stderr.write(
            printable(f"egress-proxy: boundary not applied (no rules left in place): {exc}") + "\n"
        )
        return 1
    chains = read_back(args.table)
    rules = sum(len(chain.rules) for chain in chains.values())
    out.write(
        f"egress-proxy: boundary applied: table inet {args.table}, {len(chains)} chains, "
        f"{rules} rules, read back as rendered\n"
    )
    return 0


def verify(args: argparse.Namespace, out: TextIO) -> int:
    import dns.exception
    import dns.name

    from proxy.boundary.probes.privileges import drop_privileges, parse_user
    from proxy.boundary.probes.runner import report, run_probes

    # Privileges go first: not one probe runs as root by mistake.
    if args.as_user is not None:
        drop_privileges(*parse_user(args.as_user))
    elif os.geteuid() == 0:
        raise ProxyError(
            "usage",
            "boundary verify probes as the agent's user; as root it proves nothing "
            "(run it as that user, or give --as-user UID:GID)",
        )
    if not 0 < args.timeout <= 60:
        raise ProxyError("usage", "boundary verify: --timeout must be more than 0 and at most 60")
    try:
        dns.name.from_text(args.denied_name)
    except dns.exception.DNSException as exc:
        raise ProxyError("usage", f"--denied-name {args.denied_name[:80]!r}: {exc}") from None
    spec = verify_spec(
        probe_v4=args.probe_v4,
        probe_v6=args.probe_v6,
        ports=tuple(args.probe_port or DEFAULT_PROBE_PORTS),
        proxy_port=args.proxy_port,
        denied_name=args.denied_name,
        timeout=args.timeout,
    )
    results = run_probes(spec)
    passed = all(r.passed for r in results)
    if args.json:
        out.write(json.dumps(report(results), indent=2) + "\n")
    else:
        for result in results:
            verdict = "held  " if result.passed else "BYPASS"
            out.write(printable(f"{verdict} {result.name}: {result.detail}") + "\n")
        failed = [r.name for r in results if not r.passed]
        summary = (
            f"boundary held ({len(results)} probes)"
            if passed
            else f"boundary NOT held: {', '.join(failed)}"
        )
        out.write(f"egress-proxy: {summary}\n")
    return 0 if passed else 1


def verify_spec(
    *,
    probe_v4: str,
    probe_v6: str | None,
    ports: tuple[int, ...],
    proxy_port: int | None,
    denied_name: str,
    timeout: float,
) -> Any:
    """The probes `boundary verify` runs: TCP to each probe address (must reach the proxy),
    UDP and ICMP to each (must be refused locally), a DNS query for a denied name sent to the
    IPv4 probe address (redirected: must be refused), and the explicit proxy port if given."""
    from proxy.boundary.probes.spec import DnsProbe, IcmpProbe, ProbeSpec, TcpProbe, UdpProbe

    families = [("v4", probe_v4)] + ([("v6", probe_v6)] if probe_v6 is not None else [])
    tcp = [
        TcpProbe(f"tcp_{family}_direct_{port}", address, port)
        for family, address in families
        for port in dict.fromkeys(ports)
    ]
    if proxy_port is not None:
        tcp.append(TcpProbe("tcp_explicit_proxy", "127.0.0.1", proxy_port))
    return ProbeSpec(
        tcp=tuple(tcp),
        udp=tuple(UdpProbe(f"udp_{f}", a, UDP_PROBE_PORT, "local_refusal") for f, a in families),
        icmp=tuple(IcmpProbe(f"icmp_{f}", a, "local_refusal") for f, a in families),
        dns=(DnsProbe("dns_denied_name", probe_v4, 53, denied_name),),
        timeout=timeout,
    )
