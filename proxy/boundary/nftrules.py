"""The nftables rule set of a pod's shared network namespace (the Kubernetes sidecar shape,
DESIGN 6): every connection of the agent goes through the session proxy, which runs in the same
namespace under its own UID. Rendered here, loaded atomically with `nft -f -`, read back and
compared; a rule set that does not load exactly as rendered is removed again, never left half in
place.

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
    apply_ruleset(text, "egress_boundary")
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import ProxyError

DEFAULT_TABLE = "egress_boundary"
INVALID_BOUNDARY = "invalid_boundary"  # bad operator input: nothing was tried
BOUNDARY_FAILED = "boundary_failed"  # nft refused, or what loaded is not what was rendered

_TABLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
_NFT_TIMEOUT = 30.0
# Neighbour discovery and MLD: IPv6 does not work without them, and only the kernel (or a
# process with CAP_NET_RAW, which the agent never has) can send them.
_ICMPV6_OUT = "nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, mld2-listener-report"
_ICMPV6_IN = "nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect"


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    type: str  # "nat" or "filter"
    hook: str  # "output" or "input"
    priority: int
    policy: str  # "accept" or "drop"
    rules: tuple[str, ...]


def _uid(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**32 - 1:
        raise ProxyError(
            INVALID_BOUNDARY,
            f"{what} {value!r} is not a non-root UID (1 to 4294967294); root is never exempt",
        )
    return value


def _port(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ProxyError(INVALID_BOUNDARY, f"{what} {value!r} is not a port number (1 to 65535)")
    return value


def check_table_name(table: object) -> str:
    if not isinstance(table, str) or not _TABLE_NAME.fullmatch(table):
        raise ProxyError(
            INVALID_BOUNDARY,
            f"table name {str(table)[:40]!r} must be a letter then up to 31 letters, digits or _",
        )
    return table


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
    uid = _uid(proxy_uid, "proxy UID")
    transparent = _port(transparent_port, "transparent port")
    dns = _port(dns_port, "DNS port")
    explicit = None if explicit_port is None else _port(explicit_port, "explicit port")
    admin = None if admin_port is None else _port(admin_port, "admin port")
    _check_ports(
        {
            "transparent port": transparent,
            "explicit port": explicit,
            "admin port": admin,
            "DNS port": dns,
        }
    )
    loopback_tcp = _set(p for p in (transparent, explicit, dns) if p is not None)
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


def _check_ports(tcp: dict[str, int | None]) -> None:
    """Refuses TCP ports that collide (the "DNS port" is a TCP port too: the proxy's DNS
    listener answers both transports there) and a DNS port of 53."""
    named = [(what, port) for what, port in tcp.items() if port is not None]
    for index, (what, port) in enumerate(named):
        for other, other_port in named[index + 1 :]:
            if port == other_port:
                raise ProxyError(
                    INVALID_BOUNDARY,
                    f"the {what} and the {other} are both {port}: they must differ",
                )
    if tcp.get("DNS port") == 53:
        # A redirect of port 53 to itself would let the agent's queries reach any server.
        raise ProxyError(INVALID_BOUNDARY, "the DNS port must not be 53 (it is what is redirected)")


def _set(ports: Iterable[int]) -> str:
    values = sorted(set(ports))
    return str(values[0]) if len(values) == 1 else "{ " + ", ".join(map(str, values)) + " }"


def render(chains: Sequence[Chain], table: str = DEFAULT_TABLE) -> str:
    """nft text that replaces `table` atomically: `nft -f` runs it as one transaction, and the
    first two lines (create if missing, then delete) make a reload replace instead of merge."""
    check_table_name(table)
    lines = [
        "# egress-proxy boundary rules (rendered by `egress-proxy boundary apply`)",
        f"table inet {table}",
        f"delete table inet {table}",
        f"table inet {table} {{",
    ]
    for chain in chains:
        lines.append(f"\tchain {chain.name} {{")
        lines.append(
            f"\t\ttype {chain.type} hook {chain.hook} priority {chain.priority}; "
            f"policy {chain.policy};"
        )
        lines += [f"\t\t{rule}" for rule in chain.rules]
        lines.append("\t}")
    lines.append("}")
    return "\n".join(lines) + "\n"


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


# -- the one-machine sandbox: the host side of a session's veth --------------------------------


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
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", host_link):
        raise ProxyError(INVALID_BOUNDARY, f"interface name {host_link[:40]!r} is not valid")
    v4, v6 = ipaddress.IPv4Address(host4), ipaddress.IPv6Address(host6)
    explicit = _port(explicit_port, "explicit port")
    transparent = _port(transparent_port, "transparent port")
    dns = _port(dns_port, "DNS port")
    _check_ports({"explicit port": explicit, "transparent port": transparent, "DNS port": dns})
    link = f'iifname "{host_link}"'
    link_only = "ip6 hoplimit 255"  # a routed packet arrives with less
    tcp = _set((explicit, transparent, dns))
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


# -- what a rule set promises, and what the kernel holds --------------------------------------


@dataclass(frozen=True, slots=True)
class RuleKey:
    """The statements of one rule that decide what it does: its verdict, and the UID, ports and
    interface it matches. Compared between the rendered text and the read-back."""

    verdict: str  # accept, drop, return, redirect
    redirect_port: int | None
    skuid: int | None
    dports: frozenset[int]
    interface: str | None
    nat_address: str | None = None  # the address of a `dnat ... to ADDRESS:PORT` (sandbox)


@dataclass(frozen=True, slots=True)
class ChainKey:
    type: str
    hook: str
    priority: int
    policy: str
    rules: tuple[RuleKey, ...]


_CHAIN_OPEN = re.compile(r"chain\s+([A-Za-z][A-Za-z0-9_]*)\s*\{")
_CHAIN_HEAD = re.compile(
    r"type\s+(\w+)\s+hook\s+(\w+)\s+priority\s+(-?\d+)\s*;\s*policy\s+(accept|drop)\s*;"
)
_VERDICT = re.compile(r"(?:\b(accept|drop|return)|\bredirect\s+to\s+:(\d+))\s*$")
_DNAT = re.compile(r"\bdnat\s+ip6?\s+to\s+\[?([0-9A-Fa-f:.]+?)\]?:(\d+)\s*$")
_SKUID = re.compile(r"\bmeta\s+skuid\s+(\d+)\b")
_DPORT = re.compile(r"\bdport\s+(\d+|\{[^}]*\})")
_INTERFACE = re.compile(r'\b[io]ifname\s+"([^"]+)"')


def _rule_key_from_text(line: str, where: str) -> RuleKey:
    verdict = _VERDICT.search(line)
    dnat = _DNAT.search(line)
    if verdict is None and dnat is None:
        raise ProxyError(BOUNDARY_FAILED, f"{where}: no verdict in rule {line[:80]!r}")
    skuid = _SKUID.search(line)
    interface = _INTERFACE.search(line)
    dports: set[int] = set()
    for match in _DPORT.finditer(line):
        dports.update(int(p) for p in re.findall(r"\d+", match.group(1)))
    if dnat is not None:
        return RuleKey(
            verdict="dnat",
            redirect_port=int(dnat.group(2)),
            skuid=int(skuid.group(1)) if skuid else None,
            dports=frozenset(dports),
            interface=interface.group(1) if interface else None,
            nat_address=str(ipaddress.ip_address(dnat.group(1))),
        )
    assert verdict is not None
    return RuleKey(
        verdict="redirect" if verdict.group(2) else verdict.group(1),
        redirect_port=int(verdict.group(2)) if verdict.group(2) else None,
        skuid=int(skuid.group(1)) if skuid else None,
        dports=frozenset(dports),
        interface=interface.group(1) if interface else None,
    )


def expected_chains(text: str, table: str) -> dict[str, ChainKey]:
    """What a rule set in the form `render` writes promises for `table`, chain by chain. Raises
    ProxyError('boundary_failed') for text in another form: nothing we cannot check is loaded."""
    check_table_name(table)
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    opening = f"table inet {table} {{"
    if opening not in lines:
        raise ProxyError(BOUNDARY_FAILED, f"the rule set has no block {opening!r}")
    chains: dict[str, ChainKey] = {}
    index = lines.index(opening) + 1
    while index < len(lines) and lines[index] != "}":
        opened = _CHAIN_OPEN.fullmatch(lines[index])
        head = _CHAIN_HEAD.fullmatch(lines[index + 1]) if index + 1 < len(lines) else None
        if opened is None or head is None:
            raise ProxyError(
                BOUNDARY_FAILED,
                f"rule set line {lines[index][:80]!r}: expected `chain NAME {{` and its "
                "`type ... hook ... priority ...; policy ...;` line",
            )
        name = opened.group(1)
        index += 2
        rules = []
        while index < len(lines) and lines[index] != "}":
            rules.append(_rule_key_from_text(lines[index], f"chain {name}"))
            index += 1
        if index >= len(lines):
            raise ProxyError(BOUNDARY_FAILED, f"chain {name} is not closed")
        chains[name] = ChainKey(
            head.group(1), head.group(2), int(head.group(3)), head.group(4), tuple(rules)
        )
        index += 1
    if index >= len(lines) or not chains:
        raise ProxyError(BOUNDARY_FAILED, f"table {table} is not closed or holds no chain")
    return chains


def _match_values(right: Any) -> set[int]:
    if isinstance(right, int) and not isinstance(right, bool):
        return {right}
    if isinstance(right, dict) and isinstance(right.get("set"), list):
        return {v for v in right["set"] if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _rule_key_from_json(expressions: list[Any]) -> RuleKey:
    verdict, redirect_port, skuid, interface, nat_address = "", None, None, None, None
    dports: set[int] = set()
    for expression in expressions:
        if not isinstance(expression, dict) or len(expression) != 1:
            continue
        (kind, value), *_ = expression.items()
        if kind in ("accept", "drop", "return"):
            verdict = kind
        elif kind == "redirect":
            verdict = "redirect"
            redirect_port = value.get("port") if isinstance(value, dict) else None
        elif kind == "dnat" and isinstance(value, dict):
            verdict = "dnat"
            redirect_port = value.get("port")
            nat_address = _canonical_address(value.get("addr"))
        elif kind == "match" and isinstance(value, dict):
            left, right = value.get("left"), value.get("right")
            if not isinstance(left, dict):
                continue
            meta = left.get("meta", {}).get("key") if isinstance(left.get("meta"), dict) else None
            payload = left.get("payload") if isinstance(left.get("payload"), dict) else {}
            if meta == "skuid" and isinstance(right, int):
                skuid = right
            elif meta in ("oifname", "iifname") and isinstance(right, str):
                interface = right
            elif payload.get("field") == "dport":
                dports |= _match_values(right)
    return RuleKey(verdict, redirect_port, skuid, frozenset(dports), interface, nat_address)


def _canonical_address(value: Any) -> str | None:
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
    except ValueError:
        return value


def loaded_chains(listing: Any, table: str) -> dict[str, ChainKey]:
    """What `nft -j list table inet TABLE` says is loaded, in the same form as
    `expected_chains`. Sets, maps and other objects in the table are reported as chains of
    their own kind so a comparison notices them."""
    items = listing.get("nftables") if isinstance(listing, dict) else None
    if not isinstance(items, list):
        raise ProxyError(BOUNDARY_FAILED, "nft -j list did not return an nftables listing")
    heads: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[RuleKey]] = {}
    for item in items:
        if not isinstance(item, dict) or len(item) != 1:
            continue
        (kind, value), *_ = item.items()
        if kind in ("metainfo", "table") or not isinstance(value, dict):
            continue
        if value.get("table") != table or value.get("family") != "inet":
            continue
        if kind == "chain":
            heads[str(value.get("name"))] = value
        elif kind == "rule":
            rules.setdefault(str(value.get("chain")), []).append(
                _rule_key_from_json(value.get("expr") or [])
            )
        else:
            heads[f"{kind}:{value.get('name')}"] = {"type": kind}
    chains: dict[str, ChainKey] = {}
    for name, head in heads.items():
        prio = head.get("prio")
        chains[name] = ChainKey(
            str(head.get("type", "")),
            str(head.get("hook", "")),
            prio if isinstance(prio, int) else 0,
            str(head.get("policy", "")),
            tuple(rules.get(name, [])),
        )
    for orphan in sorted(set(rules) - set(heads)):
        chains[orphan] = ChainKey("", "", 0, "", tuple(rules[orphan]))
    return chains


def compare_chains(expected: dict[str, ChainKey], loaded: dict[str, ChainKey]) -> list[str]:
    """Every difference between the promised and the loaded chains, one line each; empty when
    they agree."""
    problems = []
    for name in sorted(set(expected) - set(loaded)):
        problems.append(f"chain {name} is missing")
    for name in sorted(set(loaded) - set(expected)):
        problems.append(f"{name} is loaded but was not rendered")
    for name in sorted(set(expected) & set(loaded)):
        want, got = expected[name], loaded[name]
        for field in ("type", "hook", "priority", "policy"):
            if getattr(want, field) != getattr(got, field):
                problems.append(
                    f"chain {name}: {field} is {getattr(got, field)!r}, "
                    f"expected {getattr(want, field)!r}"
                )
        if len(want.rules) != len(got.rules):
            problems.append(
                f"chain {name}: {len(got.rules)} rules loaded, {len(want.rules)} rendered"
            )
            continue
        for position, (rule, held) in enumerate(zip(want.rules, got.rules, strict=True), 1):
            if rule != held:
                problems.append(f"chain {name} rule {position}: loaded {held}, rendered {rule}")
    return problems


# -- running nft ------------------------------------------------------------------------------


def _nft(nft: str, args: Sequence[str], text: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [nft, *args],
            input=text,
            capture_output=True,
            text=True,
            timeout=_NFT_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        raise ProxyError(BOUNDARY_FAILED, f"{nft!r} not found: install nftables") from None
    except subprocess.TimeoutExpired:
        raise ProxyError(
            BOUNDARY_FAILED, f"{nft} {' '.join(args)} took over {_NFT_TIMEOUT:g}s"
        ) from None
    except OSError as exc:
        raise ProxyError(BOUNDARY_FAILED, f"cannot run {nft!r}: {exc.strerror or exc}") from None


def _first_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines[:count])[:400] or "no message"


def table_exists(table: str, *, nft: str = "nft") -> bool:
    check_table_name(table)
    return _nft(nft, ["list", "table", "inet", table]).returncode == 0


def remove_table(table: str, *, nft: str = "nft") -> bool:
    """Delete `table` if it exists; True when it was there. Raises ProxyError('boundary_failed')
    when it exists and cannot be deleted."""
    check_table_name(table)
    if not table_exists(table, nft=nft):
        return False
    done = _nft(nft, ["delete", "table", "inet", table])
    if done.returncode != 0 and table_exists(table, nft=nft):
        raise ProxyError(
            BOUNDARY_FAILED, f"cannot delete table inet {table}: {_first_lines(done.stderr)}"
        )
    return True


def read_back(table: str, *, nft: str = "nft") -> dict[str, ChainKey]:
    done = _nft(nft, ["-j", "list", "table", "inet", table])
    if done.returncode != 0:
        raise ProxyError(
            BOUNDARY_FAILED, f"cannot read table inet {table} back: {_first_lines(done.stderr)}"
        )
    try:
        listing = json.loads(done.stdout)
    except ValueError as exc:
        raise ProxyError(BOUNDARY_FAILED, f"nft -j list printed no JSON: {exc}") from None
    return loaded_chains(listing, table)


def apply_ruleset(text: str, table: str = DEFAULT_TABLE, *, nft: str = "nft") -> None:
    """Load `text` with `nft -f -`, read `table` back and compare it with what the text
    promises. On any failure or difference the table is deleted and ProxyError
    ('boundary_failed') raised: a half-applied or altered rule set never stays."""
    expected = expected_chains(text, table)  # before anything is loaded
    try:
        done = _nft(nft, ["-f", "-"], text)
        if done.returncode != 0:
            raise ProxyError(
                BOUNDARY_FAILED, f"nft refused the rule set: {_first_lines(done.stderr)}"
            )
        problems = compare_chains(expected, read_back(table, nft=nft))
        if problems:
            raise ProxyError(
                BOUNDARY_FAILED,
                "the loaded rules differ from the rendered ones: " + "; ".join(problems[:5]),
            )
    except ProxyError as exc:
        try:
            remove_table(table, nft=nft)
        except ProxyError as cleanup:
            raise ProxyError(
                BOUNDARY_FAILED, f"{exc.message}; and removing the table failed: {cleanup.message}"
            ) from None
        raise
