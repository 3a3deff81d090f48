"""The parser of `egress-proxy boundary apply|verify`; the work is proxy/boundary/kubernetes.py."""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any, TextIO

from proxy.boundary import kubernetes
from proxy.boundary.kubernetes import (
    DEFAULT_DENIED_NAME,
    DEFAULT_PROBE_V4,
    DEFAULT_PROBE_V6,
)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a port number (1 to 65535)")
    return int(text)


def _uid(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a non-root UID")
    return int(text)


def _address(version: int, allow_none: bool = False) -> Any:
    def parse(text: str) -> str | None:
        if allow_none and text == "none":
            return None
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:60]!r} is not an IP address") from None
        if address.version != version:
            raise argparse.ArgumentTypeError(f"{text[:60]!r} is not an IPv{version} address")
        return str(address)

    return parse


def add_boundary_parser(sub: Any) -> None:
    boundary = sub.add_parser(
        "boundary", help="apply or verify the nftables boundary of a pod (Kubernetes sidecar)"
    )
    actions = boundary.add_subparsers(dest="boundary_command", required=True)
    apply = actions.add_parser(
        "apply", help="render the pod's nftables rules, load them and read them back"
    )
    source = apply.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--proxy-uid", type=_uid, metavar="UID", help="the proxy's UID (exempt from the rules)"
    )
    source.add_argument(
        "--ruleset",
        metavar="FILE",
        help="load this rule set (as --print writes it) instead of rendering one",
    )
    apply.add_argument(
        "--transparent-port",
        type=_port,
        metavar="PORT",
        help="where every other TCP connection is redirected (the proxy's transparent listener)",
    )
    apply.add_argument(
        "--dns-port",
        type=_port,
        metavar="PORT",
        help="where DNS (port 53, UDP and TCP) is redirected (the proxy's --dns-listen)",
    )
    apply.add_argument(
        "--explicit-port",
        type=_port,
        metavar="PORT",
        help="the explicit proxy port on loopback (not redirected: HTTPS_PROXY works)",
    )
    apply.add_argument(
        "--admin-port",
        type=_port,
        metavar="PORT",
        help="the proxy's admin port: open to inbound connections (kubelet probes)",
    )
    apply.add_argument(
        "--table",
        default="egress_boundary",
        metavar="NAME",
        help="the nftables table (inet family) to replace (default egress_boundary)",
    )
    apply.add_argument(
        "--print", action="store_true", help="print the rule set and load nothing (no root needed)"
    )
    verify = actions.add_parser(
        "verify", help="probe the boundary as the agent's user; exit 1 if any way out works"
    )
    verify.add_argument(
        "--proxy-port",
        type=_port,
        metavar="PORT",
        help="the explicit proxy port on 127.0.0.1: must answer too",
    )
    verify.add_argument(
        "--probe-v4",
        type=_address(4),
        default=DEFAULT_PROBE_V4,
        metavar="ADDR",
        help=f"IPv4 address to probe (default {DEFAULT_PROBE_V4}, documentation range)",
    )
    verify.add_argument(
        "--probe-v6",
        type=_address(6, allow_none=True),
        default=DEFAULT_PROBE_V6,
        metavar="ADDR",
        help=f"IPv6 address to probe (default {DEFAULT_PROBE_V6}); 'none' on an IPv4-only pod",
    )
    verify.add_argument(
        "--probe-port",
        type=_port,
        action="append",
        metavar="PORT",
        help="TCP port to probe on each address; repeatable (default 80 and 443)",
    )
    verify.add_argument(
        "--denied-name",
        default=DEFAULT_DENIED_NAME,
        metavar="NAME",
        help="a name outside the policy: a DNS query for it must be refused",
    )
    verify.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="per probe (default 5)"
    )
    verify.add_argument(
        "--as-user",
        metavar="UID:GID",
        help="drop to this user first (needs root); without it verify refuses to run as root",
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_boundary(args: argparse.Namespace, out: TextIO) -> int:
    if args.boundary_command == "apply":
        return kubernetes.apply(args, out)
    return kubernetes.verify(args, out)
