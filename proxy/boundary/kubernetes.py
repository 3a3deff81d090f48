"""The Kubernetes sidecar's boundary, `egress-proxy boundary apply|verify` (parsed in
proxy/cli/boundary.py): the two halves of the Kubernetes sidecar's activation
(docs/deployment.md). `apply` (an init container with NET_ADMIN) loads the pod rule set and
reads it back; `verify` (an init container running as the agent's UID, after the proxy is
ready) tries every way out and fails the pod if one works.

Exit codes: apply 0 loaded and read back as rendered, 1 nft refused it or the read-back differed
(the table was removed again), 2 bad input; verify 0 every probe held, 1 a bypass works (each
failed probe is named), 2 bad input.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from proxy.common.errors import ProxyError
from proxy.common.terminal import printable

if TYPE_CHECKING:
    from proxy.boundary.probes.spec import ProbeSpec

# Documentation ranges (RFC 5737, RFC 3849): nothing answers there, so a probe that is not
# redirected to the proxy goes unanswered instead of reaching someone.
DEFAULT_PROBE_V4 = "192.0.2.1"
DEFAULT_PROBE_V6 = "2001:db8::1"
DEFAULT_PROBE_PORTS = (80, 443)
DEFAULT_DENIED_NAME = "egress-boundary-probe.invalid"
DEFAULT_VERIFY_TIMEOUT = 5.0
MAX_VERIFY_TIMEOUT = 60.0
# UDP 443 is QUIC: the datagram a real client would try first.
UDP_PROBE_PORT = 443


@dataclass(frozen=True, slots=True)
class ApplyOptions:
    """What `boundary apply` was asked: a rule set to render (proxy_uid and the ports) or one
    to load as it is (ruleset, a file); ports the command line already checked."""

    table: str
    proxy_uid: int | None = None
    ruleset: str | None = None
    transparent_port: int | None = None
    dns_port: int | None = None
    explicit_port: int | None = None
    admin_port: int | None = None
    print_only: bool = False  # print the rule set, load nothing

    def rendering_ports(self) -> dict[str, int | None]:
        """The ports that go into a rendered rule set, by their option's name."""
        return {
            "--transparent-port": self.transparent_port,
            "--dns-port": self.dns_port,
            "--explicit-port": self.explicit_port,
            "--admin-port": self.admin_port,
        }


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    """What `boundary verify` was asked; addresses and ports the command line already checked."""

    probe_v4: str = DEFAULT_PROBE_V4
    probe_v6: str | None = DEFAULT_PROBE_V6  # None: an IPv4-only pod
    probe_ports: tuple[int, ...] = DEFAULT_PROBE_PORTS
    proxy_port: int | None = None
    denied_name: str = DEFAULT_DENIED_NAME
    timeout: float = DEFAULT_VERIFY_TIMEOUT
    as_user: str | None = None  # UID:GID to drop to first
    json: bool = False


def apply(options: ApplyOptions, out: TextIO) -> int:
    from proxy.boundary.nft.chains import BOUNDARY_FAILED
    from proxy.boundary.nft.compare import expected_chains
    from proxy.boundary.nft.load import apply_ruleset, read_back

    text = _ruleset_text(options)
    if options.print_only:
        expected_chains(text, options.table)  # what is printed must be what apply loads
        out.write(text)
        return 0
    try:
        apply_ruleset(text, options.table)
    except ProxyError as exc:
        if exc.reason != BOUNDARY_FAILED:
            raise
        sys.stderr.write(
            printable(f"egress-proxy: boundary not applied (no rules left in place): {exc}") + "\n"
        )
        return 1
    chains = read_back(options.table)
    rules = sum(len(chain.rules) for chain in chains.values())
    out.write(
        f"egress-proxy: boundary applied: table inet {options.table}, {len(chains)} chains, "
        f"{rules} rules, read back as rendered\n"
    )
    return 0


def _ruleset_text(options: ApplyOptions) -> str:
    """The rule set `apply` loads: the file given, read whole, or the pod rule set rendered."""
    ports = options.rendering_ports()
    if options.ruleset is not None:
        given = [name for name, port in ports.items() if port is not None]
        if given:
            raise ProxyError("usage", f"boundary apply: --ruleset takes no {given[0]}")
        from proxy.app.inputs import read_input

        try:
            return read_input(options.ruleset).decode("utf-8")
        except UnicodeDecodeError:
            raise ProxyError(
                "usage", f"--ruleset {options.ruleset[:80]!r} is not UTF-8 text"
            ) from None
    from proxy.boundary.nft.pod_rules import pod_ruleset

    transparent, dns = options.transparent_port, options.dns_port
    if transparent is None or dns is None:
        missing = [name for name in ("--transparent-port", "--dns-port") if ports[name] is None]
        raise ProxyError("usage", f"boundary apply: {' and '.join(missing)} required")
    if options.proxy_uid is None:
        raise ProxyError("usage", "boundary apply: --proxy-uid or --ruleset required")
    return pod_ruleset(
        options.proxy_uid,
        transparent,
        dns,
        options.explicit_port,
        options.table,
        admin_port=options.admin_port,
    )


def verify(options: VerifyOptions, out: TextIO) -> int:
    import dns.exception
    import dns.name

    from proxy.boundary.probes.privileges import drop_privileges, parse_user
    from proxy.boundary.probes.runner import report, run_probes

    # Privileges go first: not one probe runs as root by mistake.
    if options.as_user is not None:
        drop_privileges(*parse_user(options.as_user))
    elif os.geteuid() == 0:
        raise ProxyError(
            "usage",
            "boundary verify probes as the agent's user; as root it proves nothing "
            "(run it as that user, or give --as-user UID:GID)",
        )
    if not 0 < options.timeout <= MAX_VERIFY_TIMEOUT:
        raise ProxyError(
            "usage",
            f"boundary verify: --timeout must be more than 0 and at most {MAX_VERIFY_TIMEOUT:g}",
        )
    try:
        dns.name.from_text(options.denied_name)
    except dns.exception.DNSException as exc:
        raise ProxyError("usage", f"--denied-name {options.denied_name[:80]!r}: {exc}") from None
    results = run_probes(verify_spec(options))
    passed = all(r.passed for r in results)
    if options.json:
        out.write(json.dumps(report(results), indent=2) + "\n")
        return 0 if passed else 1
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


def verify_spec(options: VerifyOptions) -> ProbeSpec:
    """The probes `boundary verify` runs: TCP to each probe address (must reach the proxy, and
    an SSH stream to it must be refused by the proxy as naming no host),
    UDP and ICMP to each (must be refused locally), a DNS query for a denied name sent to the
    IPv4 probe address (redirected: must be refused), and the explicit proxy port if given."""
    from proxy.boundary.probes.spec import DnsProbe, IcmpProbe, ProbeSpec, TcpProbe, UdpProbe

    families = [("v4", options.probe_v4)]
    if options.probe_v6 is not None:
        families.append(("v6", options.probe_v6))
    tcp = [
        TcpProbe(f"tcp_{family}_direct_{port}", address, port)
        for family, address in families
        for port in dict.fromkeys(options.probe_ports)
    ]
    # A stream that names no host (SSH) to an address never resolved through the proxy.
    tcp += [
        TcpProbe(f"tcp_{family}_direct_ssh", address, 22, "ssh") for family, address in families
    ]
    if options.proxy_port is not None:
        tcp.append(TcpProbe("tcp_explicit_proxy", "127.0.0.1", options.proxy_port))
    return ProbeSpec(
        tcp=tuple(tcp),
        udp=tuple(UdpProbe(f"udp_{f}", a, UDP_PROBE_PORT, "local_refusal") for f, a in families),
        icmp=tuple(IcmpProbe(f"icmp_{f}", a, "local_refusal") for f, a in families),
        dns=(DnsProbe("dns_denied_name", options.probe_v4, 53, options.denied_name),),
        timeout=options.timeout,
    )
