"""The parser of `egress-proxy boundary apply|verify`; the work is proxy/boundary/kubernetes.py,
given the options as ApplyOptions and VerifyOptions."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable
from typing import Any, TextIO

from proxy.boundary import kubernetes
from proxy.boundary.kubernetes import (
    DEFAULT_DENIED_NAME,
    DEFAULT_PROBE_PORTS,
    DEFAULT_PROBE_V4,
    DEFAULT_PROBE_V6,
    DEFAULT_VERIFY_TIMEOUT,
    ApplyOptions,
    VerifyOptions,
)
from proxy.boundary.nft.chains import DEFAULT_TABLE
from proxy.common.listeners import decimal, is_port


def _port(text: str) -> int:
    port = decimal(text)
    if not is_port(port):
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a port number (1 to 65535)")
    return port


def _uid(text: str) -> int:
    uid = decimal(text)
    if uid is None or not 0 < uid < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a non-root UID")
    return uid


def _address(version: int, allow_none: bool = False) -> Callable[[str], str | None]:
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
    _add_apply_parser(actions)
    _add_verify_parser(actions)


def _add_apply_parser(actions: Any) -> None:
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
    ports = {
        "--transparent-port": "where every other TCP connection is redirected (the proxy's "
        "transparent listener)",
        "--dns-port": "where DNS (port 53, UDP and TCP) is redirected (the proxy's --dns-listen)",
        "--explicit-port": "the explicit proxy port on loopback (not redirected: HTTPS_PROXY "
        "works)",
        "--admin-port": "the proxy's admin port: open to inbound connections (kubelet probes)",
    }
    for option, text in ports.items():
        apply.add_argument(option, type=_port, metavar="PORT", help=text)
    apply.add_argument(
        "--table",
        default=DEFAULT_TABLE,
        metavar="NAME",
        help=f"the nftables table (inet family) to replace (default {DEFAULT_TABLE})",
    )
    apply.add_argument(
        "--print", action="store_true", help="print the rule set and load nothing (no root needed)"
    )


def _add_verify_parser(actions: Any) -> None:
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
    defaults = " and ".join(map(str, DEFAULT_PROBE_PORTS))
    verify.add_argument(
        "--probe-port",
        type=_port,
        action="append",
        metavar="PORT",
        help=f"TCP port to probe on each address; repeatable (default {defaults})",
    )
    verify.add_argument(
        "--denied-name",
        default=DEFAULT_DENIED_NAME,
        metavar="NAME",
        help="a name outside the policy: a DNS query for it must be refused",
    )
    verify.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_VERIFY_TIMEOUT,
        metavar="SECONDS",
        help=f"per probe (default {DEFAULT_VERIFY_TIMEOUT:g})",
    )
    verify.add_argument(
        "--as-user",
        metavar="UID:GID",
        help="drop to this user first (needs root); without it verify refuses to run as root",
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")


def apply_options(args: argparse.Namespace) -> ApplyOptions:
    return ApplyOptions(
        table=args.table,
        proxy_uid=args.proxy_uid,
        ruleset=args.ruleset,
        transparent_port=args.transparent_port,
        dns_port=args.dns_port,
        explicit_port=args.explicit_port,
        admin_port=args.admin_port,
        print_only=args.print,
    )


def verify_options(args: argparse.Namespace) -> VerifyOptions:
    return VerifyOptions(
        probe_v4=args.probe_v4,
        probe_v6=args.probe_v6,
        probe_ports=tuple(args.probe_port or DEFAULT_PROBE_PORTS),
        proxy_port=args.proxy_port,
        denied_name=args.denied_name,
        timeout=args.timeout,
        as_user=args.as_user,
        json=args.json,
    )


def cmd_boundary(args: argparse.Namespace, out: TextIO) -> int:
    if args.boundary_command == "apply":
        return kubernetes.apply(apply_options(args), out)
    return kubernetes.verify(verify_options(args), out)
