"""The nftables rules of one `egress-proxy sandbox` session: the host side of its veth, in the
host namespace (out of reach of root inside the sandbox)."""

from __future__ import annotations

import ipaddress
import re

from proxy.boundary.nft.chains import (
    INVALID_BOUNDARY,
    Chain,
    check_distinct_ports,
    checked_port,
    port_set,
    render,
)
from proxy.common.errors import ProxyError

_INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def sandbox_chains(
    host_link: str,
    host4: str,
    host6: str,
    *,
    explicit_port: int,
    transparent_port: int,
    dns_port: int,
) -> tuple[Chain, ...]:
    """The host-side chains of one `egress-proxy sandbox` session. They match only packets that
    arrive on the session's veth (`iifname`), so they live in the host namespace, out of reach
    of root inside the sandbox, and touch nothing else on the host:
    - TCP to the explicit proxy port on the host side's addresses is taken as it is;
    - every other TCP, to any address and port, is DNATed to the transparent listener on the
      host side (SO_ORIGINAL_DST there still gives the original destination);
    - DNS (port 53, UDP and TCP, any address) is DNATed to the proxy's DNS listener (which
      serves both on one port), so it is answered by the proxy or not at all;
    - input from the veth accepts those ports on the host side's addresses and IPv6
      neighbour discovery (without it IPv6 to the host side does not work; hop limit 255 keeps
      it to the link), and drops everything else: other UDP, ICMP, other host ports, any other
      protocol;
    - nothing is ever forwarded to or from the veth.
    DNAT to the host side's address, not `redirect`: older kernels pick the link-local address
    of the interface for an IPv6 redirect, where nothing listens."""
    if not _INTERFACE_NAME.fullmatch(host_link):
        raise ProxyError(INVALID_BOUNDARY, f"interface name {host_link[:40]!r} is not valid")
    v4, v6 = ipaddress.IPv4Address(host4), ipaddress.IPv6Address(host6)
    explicit = checked_port(explicit_port, "explicit port")
    transparent = checked_port(transparent_port, "transparent port")
    dns = checked_port(dns_port, "DNS port")
    check_distinct_ports(
        {"explicit port": explicit, "transparent port": transparent, "DNS port": dns}
    )
    link = f'iifname "{host_link}"'
    link_only = "ip6 hoplimit 255"  # a routed packet arrives with less
    tcp = port_set((explicit, transparent, dns))
    nat = (
        f"{link} ip daddr {v4} tcp dport {explicit} accept",
        f"{link} ip6 daddr {v6} tcp dport {explicit} accept",
        f"{link} meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {v4}:{dns}",
        f"{link} meta nfproto ipv6 meta l4proto {{ tcp, udp }} th dport 53 dnat ip6 to "
        f"[{v6}]:{dns}",
        f"{link} meta nfproto ipv4 meta l4proto tcp dnat ip to {v4}:{transparent}",
        f"{link} meta nfproto ipv6 meta l4proto tcp dnat ip6 to [{v6}]:{transparent}",
    )
    inbound = (
        f"{link} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} {link_only} accept",
        f"{link} ip daddr {v4} tcp dport {tcp} accept",
        f"{link} ip6 daddr {v6} tcp dport {tcp} accept",
        f"{link} ip daddr {v4} udp dport {dns} accept",
        f"{link} ip6 daddr {v6} udp dport {dns} accept",
        f"{link} drop",
    )
    forward = (f"{link} drop", f'oifname "{host_link}" drop')
    return (
        Chain("prerouting", "nat", "prerouting", -100, "accept", nat),
        Chain("input", "filter", "input", 0, "accept", inbound),
        Chain("forward", "filter", "forward", 0, "accept", forward),
    )


def sandbox_ruleset(
    table: str,
    host_link: str,
    host4: str,
    host6: str,
    *,
    explicit_port: int,
    transparent_port: int,
    dns_port: int,
) -> str:
    """The sandbox session's host-side rule set as nft text (see `sandbox_chains`)."""
    chains = sandbox_chains(
        host_link,
        host4,
        host6,
        explicit_port=explicit_port,
        transparent_port=transparent_port,
        dns_port=dns_port,
    )
    return render(chains, table)
