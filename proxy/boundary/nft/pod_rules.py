"""The nftables rule set of a pod's shared network namespace (the Kubernetes sidecar shape,
docs/deployment.md): every connection of the agent goes through the session proxy, which runs
in the same namespace under its own UID.

What the rules say (table `inet egress_boundary`, IPv4 and IPv6 alike):
- the proxy's UID (`meta skuid`) is exempt: it is the one way out;
- every other TCP connection is redirected to the proxy's transparent port, except to the
  explicit proxy port on loopback (so `HTTPS_PROXY=http://127.0.0.1:E` works);
- DNS (port 53, UDP and TCP, any server) is redirected to the proxy's DNS port, where the
  proxy's DNS listener answers both transports;
- everything else the agent sends (other UDP, ICMP, any other protocol, loopback to other
  ports) meets the output filter's drop policy, so the send fails at once with EPERM;
- the output filter accepts packets in the reply direction of a tracked connection, never the
  original direction of one it did not accept itself: a UDP socket bound to the source port of
  the proxy's finished upstream query must not ride that query's conntrack entry;
- inbound, only loopback, tracked replies and the admin port (kubelet probes, metrics) are
  accepted, so nobody outside can open a connection the agent would answer.

    text = pod_ruleset(proxy_uid=1337, transparent_port=15001, dns_port=15053, explicit_port=3128)
    apply_ruleset(text, "egress_boundary")        # proxy/boundary/nft/load.py
"""

from __future__ import annotations

from proxy.boundary.nft.chains import (
    DEFAULT_TABLE,
    Chain,
    check_distinct_ports,
    checked_port,
    checked_uid,
    port_set,
    render,
)

# Neighbour discovery and MLD: IPv6 does not work without them, and only the kernel (or a
# process with CAP_NET_RAW, which the agent never has) can send them.
_ICMPV6_OUT = "nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, mld2-listener-report"
_ICMPV6_IN = "nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect"


def pod_chains(
    proxy_uid: int,
    transparent_port: int,
    dns_port: int,
    explicit_port: int | None = None,
    admin_port: int | None = None,
) -> tuple[Chain, ...]:
    """The chains of the pod rule set (see the module doc). Raises
    ProxyError('invalid_boundary') for a root or malformed UID or port, or TCP ports that
    collide."""
    uid = checked_uid(proxy_uid, "proxy UID")
    transparent = checked_port(transparent_port, "transparent port")
    dns = checked_port(dns_port, "DNS port")
    explicit = None if explicit_port is None else checked_port(explicit_port, "explicit port")
    admin = None if admin_port is None else checked_port(admin_port, "admin port")
    check_distinct_ports(
        {
            "transparent port": transparent,
            "explicit port": explicit,
            "admin port": admin,
            "DNS port": dns,
        }
    )
    loopback_tcp = port_set(p for p in (transparent, explicit, dns) if p is not None)
    nat = [f"meta skuid {uid} return"]
    if explicit is not None:
        nat += [
            f"ip daddr 127.0.0.1 tcp dport {explicit} return",
            f"ip6 daddr ::1 tcp dport {explicit} return",
        ]
    nat += [
        f"meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}",
        f"meta l4proto tcp redirect to :{transparent}",
    ]
    # After a redirect the destination is the loopback address, but `oifname` still names the
    # interface of the original route: the filter matches the rewritten address instead. A
    # packet to 127.0.0.1 or ::1 never leaves the host.
    output = [
        f"meta skuid {uid} accept",
        "ct direction reply accept",
        f"ip daddr 127.0.0.1 tcp dport {loopback_tcp} accept",
        f"ip6 daddr ::1 tcp dport {loopback_tcp} accept",
        f"ip daddr 127.0.0.1 udp dport {dns} accept",
        f"ip6 daddr ::1 udp dport {dns} accept",
        f"icmpv6 type {{ {_ICMPV6_OUT} }} accept",
    ]
    inbound = [
        'iifname "lo" accept',
        "ct state established,related accept",
        *([f"tcp dport {admin} accept"] if admin is not None else []),
        f"icmpv6 type {{ {_ICMPV6_IN} }} accept",
    ]
    return (
        Chain("nat_output", "nat", "output", -100, "accept", tuple(nat)),
        Chain("filter_output", "filter", "output", 0, "drop", tuple(output)),
        Chain("filter_input", "filter", "input", 0, "drop", tuple(inbound)),
    )


def pod_ruleset(
    proxy_uid: int,
    transparent_port: int,
    dns_port: int,
    explicit_port: int | None = None,
    table: str = DEFAULT_TABLE,
    *,
    admin_port: int | None = None,
) -> str:
    """The pod rule set as nft text (see the module doc). `admin_port` opens the proxy's admin
    listener to inbound connections (kubelet probes); without it nothing new gets in."""
    return render(
        pod_chains(proxy_uid, transparent_port, dns_port, explicit_port, admin_port), table
    )
