"""The network side of `egress-proxy sandbox`: the session's names, its addresses, and the
namespace with its veth pair (created and deleted with `ip`).

    names = SessionNames.new(taken=existing_session_names())
    plan = plan_addresses(None, None, in_use=networks_in_use(ip))
    create_namespace(ip, names, plan)        # addresses on both ends, links still down
    bring_up(ip, names, plan)                 # after the host-side rules are in place
    delete_host_link(ip, names); delete_namespace(ip, names)

The session's addresses can route nowhere but the host side of its own veth: by default an IPv4
/30 from link-local space (never forwarded by a router) and a random IPv6 ULA /64. The namespace
reaches only the host side; the host-side nftables rules (proxy/boundary/nft/sandbox_rules.py)
decide what of that is answered.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from policy import classify
from proxy.common.errors import ProxyError

# IPv4 link-local space: a router never forwards it, so a leaked packet goes nowhere. The top
# /20 keeps clear of the cloud metadata addresses (169.254.169.254, 169.254.170.2, ...) and of
# the low addresses that zeroconf hands out first.
DEFAULT_POOL4 = ipaddress.IPv4Network("169.254.240.0/20")
PREFIX4, PREFIX6 = 30, 64
# Interface names are at most 15 bytes: "egsb" + 8 hex + "h"/"n" is 13.
SUFFIX_HEX = 8
NETNS_PREFIX, LINK_PREFIX, TABLE_PREFIX = "egress-sb-", "egsb", "egress_sb_"
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")
IP_TIMEOUT = 30.0
_PICK_TRIES = 64

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class SandboxError(ProxyError):
    """A step of setting up or tearing down the sandbox failed; the message says which."""


@dataclass(frozen=True, slots=True)
class SessionNames:
    """Every name one session creates, from one random suffix."""

    suffix: str

    @classmethod
    def new(cls, taken: Iterable[str] = ()) -> SessionNames:
        taken = set(taken)
        for _ in range(_PICK_TRIES):
            names = cls(secrets.token_hex(SUFFIX_HEX // 2))
            if names.netns not in taken:
                return names
        raise SandboxError("sandbox_setup", "no free session name (too many sandboxes?)")

    @property
    def netns(self) -> str:
        return f"{NETNS_PREFIX}{self.suffix}"

    @property
    def host_link(self) -> str:
        return f"{LINK_PREFIX}{self.suffix}h"

    @property
    def ns_link(self) -> str:
        return f"{LINK_PREFIX}{self.suffix}n"

    @property
    def table(self) -> str:
        return f"{TABLE_PREFIX}{self.suffix}"

    @property
    def etc_dir(self) -> Path:
        return NETNS_ETC / self.netns


@dataclass(frozen=True, slots=True)
class AddressPlan:
    """The veth's addresses: the host side is the first address of each subnet, the namespace
    side the second."""

    subnet4: ipaddress.IPv4Network
    subnet6: ipaddress.IPv6Network

    @property
    def host4(self) -> ipaddress.IPv4Address:
        return self.subnet4.network_address + 1

    @property
    def ns4(self) -> ipaddress.IPv4Address:
        return self.subnet4.network_address + 2

    @property
    def host6(self) -> ipaddress.IPv6Address:
        return self.subnet6.network_address + 1

    @property
    def ns6(self) -> ipaddress.IPv6Address:
        return self.subnet6.network_address + 2


# -- addresses -------------------------------------------------------------------------------


def parse_subnet(text: str, version: int, option: str) -> IPNetwork:
    """`--subnet4` / `--subnet6`: a network address with its prefix, room for two hosts, and
    not globally reachable (the host would route that space to the sandbox instead of the
    world). Raises ProxyError('usage')."""
    shown = repr(text[:60])
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ProxyError(
            "usage", f"{option} {shown}: {exc}; write e.g. {_example(version)}"
        ) from None
    if network.version != version:
        raise ProxyError("usage", f"{option} {shown} is not an IPv{version} network")
    longest = 30 if version == 4 else 126
    if network.prefixlen > longest:
        raise ProxyError(
            "usage",
            f"{option} {shown}: too small, the veth needs two addresses (/{longest} at most)",
        )
    first, second = network.network_address + 1, network.network_address + 2
    for address in (first, second):
        if address.is_loopback or address.is_multicast or address.is_unspecified:
            raise ProxyError("usage", f"{option} {shown}: {address} cannot be a veth address")
        if classify(address).public:
            raise ProxyError(
                "usage",
                f"{option} {shown} holds the public address {address}: the host would route it "
                "to the sandbox; pick link-local, private, documentation or ULA space",
            )
    return network


def _example(version: int) -> str:
    return "169.254.240.0/30" if version == 4 else "fd12:3456:789a:1::/64"


def networks_in_use(ip: str) -> list[IPNetwork]:
    """Every address (as its network) and route destination on the host, from `ip -j`."""
    found: list[IPNetwork] = []
    for interface in _ip_json(ip, "addr", "show"):
        infos = interface.get("addr_info")
        for info in infos if isinstance(infos, list) else []:
            if not isinstance(info, dict):
                continue
            local, prefix = info.get("local"), info.get("prefixlen")
            if isinstance(local, str) and isinstance(prefix, int):
                try:
                    found.append(ipaddress.ip_network(f"{local}/{prefix}", strict=False))
                    found.append(ipaddress.ip_network(local))
                except ValueError:
                    continue
    for family in ("-4", "-6"):
        for route in _ip_json(ip, family, "route", "show", "table", "all"):
            dst = route.get("dst")
            if not isinstance(dst, str) or dst == "default":
                continue
            try:
                found.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                continue
    return found


def conflicts(subnet: IPNetwork, in_use: Sequence[IPNetwork]) -> list[IPNetwork]:
    """What on the host clashes with `subnet`: a network inside it (an address, a more specific
    route, another sandbox), or an interface network equal to it. A wider route that merely
    contains it (169.254.0.0/16 on eth0) does not: the session's /30 is more specific."""
    return [
        other
        for other in in_use
        if other.version == subnet.version and other.subnet_of(subnet)  # type: ignore[arg-type]
    ]


def plan_addresses(
    subnet4: IPNetwork | None, subnet6: IPNetwork | None, *, in_use: Sequence[IPNetwork]
) -> AddressPlan:
    """The given subnets (refused when something on the host uses them) or free random ones."""
    for given, option in ((subnet4, "--subnet4"), (subnet6, "--subnet6")):
        if given is not None and (clash := conflicts(given, in_use)):
            raise ProxyError(
                "usage", f"{option} {given} is in use on this host ({clash[0]}); pick another"
            )
    chosen4 = subnet4 or _free_subnet4(in_use)
    chosen6 = subnet6 or _free_subnet6(in_use)
    assert isinstance(chosen4, ipaddress.IPv4Network)
    assert isinstance(chosen6, ipaddress.IPv6Network)
    return AddressPlan(chosen4, chosen6)


def _free_subnet4(in_use: Sequence[IPNetwork]) -> ipaddress.IPv4Network:
    """A /30 of the pool nothing on the host uses: every one is tried, from a random start (a
    busy host is not refused by bad luck)."""
    size = 1 << (32 - PREFIX4)
    count = DEFAULT_POOL4.num_addresses // size
    start = secrets.randbelow(count)
    for index in range(count):
        base = DEFAULT_POOL4.network_address + ((start + index) % count) * size
        subnet = ipaddress.IPv4Network(f"{base}/{PREFIX4}")
        if not conflicts(subnet, in_use):
            return subnet
    raise SandboxError(
        "sandbox_setup", f"every /{PREFIX4} of {DEFAULT_POOL4} is in use; give one with --subnet4"
    )


def _free_subnet6(in_use: Sequence[IPNetwork]) -> ipaddress.IPv6Network:
    """A random ULA /64 (RFC 4193: fd00::/8, a 40-bit global id, a 16-bit subnet id); with 2^56
    of them a clash is a matter of a retry."""
    for _ in range(_PICK_TRIES):
        value = (0xFD << 120) | (secrets.randbits(56) << 64)
        subnet = ipaddress.IPv6Network((value, PREFIX6))
        if not conflicts(subnet, in_use):
            return subnet
    raise SandboxError("sandbox_setup", "no free ULA /64 found; give one with --subnet6")


# -- ip --------------------------------------------------------------------------------------


def run_ip(ip: str, *args: str, what: str) -> str:
    """Run `ip ARGS`; SandboxError naming `what` with ip's own message when it fails."""
    try:
        done = subprocess.run(
            [ip, *args],
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError("sandbox_setup", f"{what}: {exc}") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise SandboxError(
            "sandbox_setup", f"{what}: ip {' '.join(args)}: {message[0] if message else 'failed'}"
        )
    return done.stdout


def _ip_json(ip: str, *args: str) -> list[dict[str, object]]:
    text = run_ip(ip, "-j", *args, what="reading the host's addresses and routes")
    try:
        value = json.loads(text or "[]")
    except ValueError:
        raise SandboxError("sandbox_setup", f"ip -j {' '.join(args)}: not JSON") from None
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def existing_session_names() -> set[str]:
    """Namespace names in use, and those with a /etc/netns directory (a session killed before
    its teardown leaves one): a new session takes neither."""
    names: set[str] = set()
    for directory in (NETNS_RUN, NETNS_ETC):
        with contextlib.suppress(OSError):
            names.update(os.listdir(directory))
    return names


def write_resolv_conf(names: SessionNames, plan: AddressPlan) -> None:
    """/etc/netns/NAME/resolv.conf: `ip netns exec` bind-mounts it over /etc/resolv.conf, so
    resolvers in the namespace ask the host side (whose port 53 leads to the proxy's DNS)."""
    try:
        names.etc_dir.mkdir(parents=True, mode=0o755, exist_ok=False)
        (names.etc_dir / "resolv.conf").write_text(
            f"# egress-proxy sandbox {names.suffix}: the session proxy's DNS\n"
            f"nameserver {plan.host4}\nnameserver {plan.host6}\n"
        )
        os.chmod(names.etc_dir / "resolv.conf", 0o644)
    except OSError as exc:
        raise SandboxError(
            "sandbox_setup", f"cannot write {names.etc_dir}/resolv.conf: {exc.strerror or exc}"
        ) from None


def remove_resolv_conf(names: SessionNames) -> None:
    if names.etc_dir.exists():
        shutil.rmtree(names.etc_dir)


def create_namespace(ip: str, names: SessionNames, plan: AddressPlan) -> None:
    """The namespace and the veth pair with both ends addressed; links stay down (and the
    namespace has no route) until `bring_up`, after the rules are in place."""
    ns = names.netns
    run_ip(ip, "netns", "add", ns, what="creating the network namespace")
    run_ip(
        ip, "link", "add", names.host_link, "type", "veth", "peer", "name", names.ns_link,
        "netns", ns, what="creating the veth pair",
    )  # fmt: skip
    # nodad: duplicate address detection would hold the addresses back for a second or two,
    # and nothing else lives on this link.
    run_ip(ip, "addr", "add", f"{plan.host4}/{plan.subnet4.prefixlen}", "dev", names.host_link,
           what="addressing the host side")  # fmt: skip
    run_ip(ip, "-6", "addr", "add", f"{plan.host6}/{plan.subnet6.prefixlen}", "dev",
           names.host_link, "nodad", what="addressing the host side")  # fmt: skip
    run_ip(ip, "-n", ns, "addr", "add", f"{plan.ns4}/{plan.subnet4.prefixlen}", "dev",
           names.ns_link, what="addressing the namespace side")  # fmt: skip
    run_ip(ip, "-n", ns, "-6", "addr", "add", f"{plan.ns6}/{plan.subnet6.prefixlen}", "dev",
           names.ns_link, "nodad", what="addressing the namespace side")  # fmt: skip


def bring_up(ip: str, names: SessionNames, plan: AddressPlan) -> None:
    ns = names.netns
    run_ip(ip, "link", "set", names.host_link, "up", what="bringing the host side up")
    run_ip(ip, "-n", ns, "link", "set", "lo", "up", what="bringing the namespace's lo up")
    run_ip(ip, "-n", ns, "link", "set", names.ns_link, "up", what="bringing the namespace side up")
    run_ip(ip, "-n", ns, "route", "add", "default", "via", str(plan.host4),
           what="routing the namespace's IPv4")  # fmt: skip
    run_ip(ip, "-n", ns, "-6", "route", "add", "default", "via", str(plan.host6),
           what="routing the namespace's IPv6")  # fmt: skip


def _gone(message: str) -> bool:
    return any(
        text in message
        for text in ("No such file", "Cannot find device", "does not exist", "not found")
    )


def delete_host_link(ip: str, names: SessionNames) -> None:
    """Deleting one end deletes the pair: the namespace is cut off even if a process in it
    survived. Already gone is fine."""
    try:
        run_ip(ip, "link", "delete", names.host_link, what="deleting the veth pair")
    except SandboxError as exc:
        if not _gone(exc.message):
            raise


def delete_namespace(ip: str, names: SessionNames) -> None:
    if not (NETNS_RUN / names.netns).exists():
        return
    try:
        run_ip(ip, "netns", "delete", names.netns, what="deleting the network namespace")
    except SandboxError as exc:
        if not _gone(exc.message):
            raise


def namespace_pids(names: SessionNames) -> list[int]:
    """Processes whose network namespace is the session's (what `ip netns pids` lists)."""
    try:
        target = os.stat(NETNS_RUN / names.netns)
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            info = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue  # gone, or not ours to look at
        if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            pids.append(int(entry))
    return pids
