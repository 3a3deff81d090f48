"""The closed sets a decision line carries beside its reason code (policy/dimensions.py: Verdict,
Stage, Plane, Protocol): what users read in the audit log is one of their values, the page that
documents the log (docs/observability.md) lists every value and no other, and the source never
spells one as a literal where the typed value belongs."""

from __future__ import annotations

import ast
import io
import json
import re
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from support.dns_server import DNSServer
from support.front_door import curl_socks
from support.in_process import PROXY_CA, Upstream, curl, serving, started, tls_serving
from support.real_servers import free_port

from policy import compile_policy, load_manifest
from policy.dimensions import Plane, Protocol, Stage, Verdict
from proxy.app.config import load_config
from proxy.common.listeners import Listener
from proxy.common.refusals import Refused
from proxy.decide.vetting import Peer, Vetter
from proxy.dns_responder.responder import DnsQuery, DnsQuestion, DnsResponder
from proxy.ops.audit import AuditLog

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "policy").rglob("*.py"), *(ROOT / "proxy").rglob("*.py")])
DIMENSIONS: tuple[type[StrEnum], ...] = (Verdict, Stage, Plane, Protocol)
# Each dimension's field: all four on decision lines, plane and protocol on close lines.
FIELDS: dict[str, type[StrEnum]] = {
    "decision": Verdict,
    "stage": Stage,
    "plane": Plane,
    "protocol": Protocol,
}
ON_CLOSE = ("plane", "protocol")
# Keyword arguments and attributes that take a dimension's value.
TYPED_NAMES = ("stage", "plane", "protocol")
# Literals that stay for now, each with the work that removes it (none left: the composition
# root's `_vetter("l4", ...)` is no keyword of these names, and Vetter makes its value a Plane).
# A test below fails once an entry no longer exists.
KNOWN_LITERALS: set[tuple[str, str, str]] = set()


def values(dimension: type[StrEnum]) -> set[str]:
    return {member.value for member in dimension}


def check_lines(lines: Iterable[dict[str, Any]]) -> list[str]:
    """The problems of decision and close lines: a dimension that is not one of its values."""
    problems = []
    for line in lines:
        event = line["event"]
        fields = FIELDS if event == "decision" else ON_CLOSE if event == "close" else ()
        for field in fields:
            if line.get(field) not in values(FIELDS[field]):
                problems.append(f"{event} line: {field} {line.get(field)!r}")
    return problems


# -- the sets themselves -----------------------------------------------------------------------


@pytest.mark.parametrize("dimension", DIMENSIONS, ids=lambda d: d.__name__)
def test_each_dimension_is_a_set_of_code_shaped_values(dimension: type[StrEnum]) -> None:
    shown = [member.value for member in dimension]
    assert len(shown) == len(set(shown))
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", value) for value in shown)
    for member in dimension:
        # A StrEnum is its bare value wherever it is written: text, JSON, a label.
        assert member == member.value and str(member) == member.value
        assert f"{member}" == member.value and json.dumps(member) == f'"{member.value}"'


def documented(field: str) -> set[str]:
    """The values docs/observability.md lists in the table row of an audit `field`: its first
    row, a decision line's (an ask line's `decision` is a person's answer, another set)."""
    text = (ROOT / "docs" / "observability.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(f"| `{field}` |")]
    assert rows, f"docs/observability.md has no row for {field}"
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", rows[0].split("|")[2]))


@pytest.mark.parametrize(("field", "dimension"), FIELDS.items(), ids=list(FIELDS))
def test_the_audit_page_lists_every_value_and_no_other(
    field: str, dimension: type[StrEnum]
) -> None:
    assert documented(field) == values(dimension)


# -- the source --------------------------------------------------------------------------------


def literals() -> set[tuple[str, str, str]]:
    """(file, name, value) of every string literal passed as a `stage=`, `plane=` or
    `protocol=` argument, or assigned to such a name or attribute, in policy/ and proxy/."""
    found = set()
    for path in SOURCES:
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            pairs: list[tuple[str | None, ast.expr | None]] = []
            if isinstance(node, ast.keyword):
                pairs.append((node.arg, node.value))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = target.id if isinstance(target, ast.Name) else None
                    name = target.attr if isinstance(target, ast.Attribute) else name
                    pairs.append((name, node.value))
            for name, value in pairs:
                if (
                    name in TYPED_NAMES
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    found.add((where, name, value.value))
    return found


def test_no_literal_where_a_dimension_belongs() -> None:
    assert literals() - KNOWN_LITERALS == set()


def test_every_known_literal_still_exists() -> None:
    assert literals() >= KNOWN_LITERALS, "a known literal is gone: drop it from KNOWN_LITERALS"


# -- lines as the planes write them --------------------------------------------------------------


class _Answer:
    addresses = ("192.0.2.10",)
    cname_chain = ()


class _Resolver:
    """Every name answers 192.0.2.10 (no sockets: the Vetter's and the responder's own steps)."""

    async def resolve(self, host: str) -> _Answer:
        return _Answer()


@pytest.mark.asyncio
async def test_the_vetters_and_the_dns_responders_lines_carry_documented_values() -> None:
    operator = load_config("addresses:\n  allow: [192.0.2.0/24]\n").operator
    policy = compile_policy(load_manifest("network:\n  egress: [ok.test]\n"), None, operator)
    stream = io.StringIO()
    audit = AuditLog(stream=stream, session="s")
    peer = Peer(("127.0.0.1", 40000), "c1")
    vetter = Vetter(policy, _Resolver(), None, audit, plane=Plane.L4)
    learning = Vetter(policy, _Resolver(), None, audit, plane=Plane.L4, learn=True)
    await vetter.vet("ok.test:443", 443, peer, Protocol.CONNECT, inspecting=False)
    with pytest.raises(Refused):
        await vetter.vet("no.test:443", 443, peer, Protocol.SOCKS5, inspecting=False)
    await learning.vet("no.test:443", 443, peer, Protocol.CONNECT, inspecting=False)
    responder = DnsResponder(vetter)
    for name, qtype in (("ok.test", 1), ("ok.test", 16), ("no.test", 1)):
        await responder.answer(DnsQuery(0, (DnsQuestion(name, qtype, 1),)), peer)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert check_lines(lines) == []
    assert {line["decision"] for line in lines} == values(Verdict)
    assert {line["protocol"] for line in lines} == {"connect", "socks5", "dns"}
    assert {line["stage"] for line in lines} == {"name", "address", "request"}


@pytest.fixture
def dns(dns: DNSServer) -> DNSServer:
    for name in ("up.test", "tls.test"):
        dns.set(name, a=["127.0.0.1"])
    return dns


@pytest.mark.integration
@pytest.mark.asyncio
async def test_every_audit_line_of_both_planes_carries_documented_values(
    dns: DNSServer,
) -> None:
    """Plain HTTP, CONNECT and SOCKS5 tunnels, requests inside interception, allowed and
    refused: every decision and close line of the front door and the engine."""
    socks = free_port()
    listeners = [Listener("http", "127.0.0.1", 0), Listener("socks5", "127.0.0.1", socks)]
    async with (
        started(dns, listeners=listeners) as proxy,
        serving(Upstream()) as plain,
        tls_serving(Upstream()) as secure,
    ):
        assert (await curl(proxy, f"http://up.test:{plain.port}/"))[0] == 200
        assert (await curl(proxy, f"http://denied.test:{plain.port}/"))[0] == 403
        url = f"https://tls.test:{secure.port}/"
        assert (await curl(proxy, url, "--cacert", PROXY_CA))[0] == 200
        code, _, _ = await curl_socks(socks, url, "--cacert", PROXY_CA)
        assert code == 0
        # Two plain-HTTP connections (l4), two tunnels the engine served and closed (l7).
        await proxy.wait_closes(4)
        lines = proxy.lines()
    assert len([line for line in lines if line["event"] == "close"]) == 4
    assert check_lines(lines) == []
    assert {line["plane"] for line in lines} == values(Plane)
    protocols = {line["protocol"] for line in lines}
    assert {"http", "connect", "socks5", "https"} <= protocols
    assert {line["decision"] for line in lines if line["event"] == "decision"} == {"allow", "deny"}
