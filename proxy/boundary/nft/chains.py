"""A rule set as chains, the checks of what goes into one, and its nft text: what the pod and
the sandbox rule sets share."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.common.errors import ProxyError
from proxy.common.listeners import is_port

DEFAULT_TABLE = "egress_boundary"
INVALID_BOUNDARY = "invalid_boundary"  # bad operator input: nothing was tried
BOUNDARY_FAILED = "boundary_failed"  # nft refused, or what loaded is not what was rendered

_TABLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    type: str  # "nat" or "filter"
    hook: str  # "output", "input", "prerouting" or "forward"
    priority: int
    policy: str  # "accept" or "drop"
    rules: tuple[str, ...]


def checked_uid(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**32 - 1:
        raise ProxyError(
            INVALID_BOUNDARY,
            f"{what} {value!r} is not a non-root UID (1 to 4294967294); root is never exempt",
        )
    return value


def checked_port(value: object, what: str) -> int:
    if not is_port(value):
        raise ProxyError(INVALID_BOUNDARY, f"{what} {value!r} is not a port number (1 to 65535)")
    return value


def check_distinct_ports(tcp: dict[str, int | None]) -> None:
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


def port_set(ports: Iterable[int]) -> str:
    """The ports as an nft match value: one port alone, several as an anonymous set."""
    values = sorted(set(ports))
    return str(values[0]) if len(values) == 1 else "{ " + ", ".join(map(str, values)) + " }"


def check_table_name(table: object) -> str:
    if not isinstance(table, str) or not _TABLE_NAME.fullmatch(table):
        raise ProxyError(
            INVALID_BOUNDARY,
            f"table name {str(table)[:40]!r} must be a letter then up to 31 letters, digits or _",
        )
    return table


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
