"""`egress-proxy suggest`: the smallest set of manifest entries that would have allowed every
connection an audit log saw, from its decision lines. Pure: the caller reads the files and hands
over lines (`Collector.add`), and injects the Public Suffix List lookup (`registrable`), since
loading the list reads a file.

    collector = Collector()
    for line in lines:
        collector.add(line)
    found = collector.suggest("agent.yaml", registrable=psl.privatesuffix, ceiling=ceiling)
    found.entries      # ("api.example.com", 12 connections, first, last), ...

What is read: every connection whose refusal a manifest entry lifts becomes an entry, so that
the manifest printed allows every connection the logs saw: `allow` and `would_deny` decision
lines (a learning session's and a normal one's alike, a connection a person's grant allowed
too), a plain run's `deny` lines for `not_allowed` and `path_not_allowed`, an asking session's
denials nobody answered (`ask_timeout`, `ask_overloaded`), and the `allow-session` grants of its
ask lines. Any other `deny` line (a block, an address rule, the ceiling, a person's `ask_denied`)
is listed apart (`not_suggested`), as are allowed hosts no manifest entry can name (a platform
destination, an IP address). The DNS responder's lines are counted (`dns_lines`) and left
out: a query is not a connection, and the connection that follows it has a line of its own.
Close lines are not decisions. A line that is not an audit line (truncated, corrupt) is
counted in `skipped`.

Entries are host entries only, never URL prefixes: a host entry is the simplest entry that
admits every path and port seen (in both formats a bare host covers every port; the operator's
port allow-list decides ports). agent.yaml: `host` (covering its subdomains, so a name under
another suggested one is left out); agent.toml: `host` (that host alone). With `registrable`
(`--group`), two or more names under one registrable domain fold into one entry for the domain
(agent.yaml `example.com`, agent.toml `*.example.com`); a name that is itself a public suffix
has no registrable domain and never folds, and neither does a group whose fold the ceiling would
refuse while its names are inside it. With a ceiling, entries it would refuse are listed apart
(`outside_ceiling`), with the ceiling entries that lie under them, if any.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policy.ceiling import Ceiling
from policy.dimensions import Protocol, Verdict
from policy.entries import check_entry
from policy.findings import quote
from policy.manifests import Format
from policy.names import is_under
from policy.reasons import Reason
from policy.trie import SubtreeIndex, suffixes

__all__ = ["Collector", "Outside", "Suggested", "Suggestion", "Unsuggested", "entry_text"]

# The decisions a line may carry; the first two are connections that went through.
_PASSED = (Verdict.ALLOW, Verdict.WOULD_DENY)
# The refusals a manifest entry lifts (policy/asking.py ASKABLE), and the ones of a question
# nobody answered: their hosts become entries.
_LIFTED = frozenset(
    {Reason.NOT_ALLOWED, Reason.PATH_NOT_ALLOWED, Reason.ASK_TIMEOUT, Reason.ASK_OVERLOADED}
)
_DECISIONS = (*_PASSED, Verdict.DENY)
# The audit log's time format (proxy/decide/events.py `timestamp`); compared as text.
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z")
# Names folded into one registrable domain's entry only when there are at least this many.
_GROUP_MIN = 2


@dataclass(slots=True)
class _Tally:
    """What the lines say of one host (or one denied host and reason)."""

    connections: int = 0
    first: str = ""
    last: str = ""
    ports: set[int] = field(default_factory=set)

    def add(self, time: str, port: int | None) -> None:
        self.connections += 1
        self.seen(time, port)

    def seen(self, time: str, port: int | None) -> None:
        """A time and port without a connection (a grant)."""
        if not self.first or time < self.first:
            self.first = time
        if time > self.last:
            self.last = time
        if port is not None:
            self.ports.add(port)

    def merge(self, other: _Tally) -> None:
        self.connections += other.connections
        if other.first and (not self.first or other.first < self.first):
            self.first = other.first
        self.last = max(self.last, other.last)
        self.ports |= other.ports


@dataclass(frozen=True, slots=True)
class Suggested:
    """One entry to declare and what it covers."""

    entry: str  # in the chosen format's grammar
    host: str  # the name it covers (with its subdomains for agent.yaml and a `*.` entry)
    connections: int
    first: str
    last: str
    ports: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "connections": self.connections,
            "first": self.first,
            "last": self.last,
            "ports": list(self.ports),
        }


@dataclass(frozen=True, slots=True)
class Outside:
    """An entry the ceiling would refuse: `under` names the ceiling entries below it."""

    suggested: Suggested
    under: tuple[str, ...]
    message: str

    def to_json(self) -> dict[str, Any]:
        return {**self.suggested.to_json(), "ceiling": list(self.under), "message": self.message}


@dataclass(frozen=True, slots=True)
class Unsuggested:
    """Connections no entry is suggested for: refused (`deny`), or allowed by something no
    manifest entry can name."""

    host: str | None
    decision: str
    reason: str
    connections: int

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "decision": self.decision,
            "reason": self.reason,
            "connections": self.connections,
        }


@dataclass(frozen=True, slots=True)
class Suggestion:
    format: Format
    entries: tuple[Suggested, ...]
    outside_ceiling: tuple[Outside, ...]
    not_suggested: tuple[Unsuggested, ...]
    connections: int  # allow and would_deny lines read
    skipped: int  # lines that are not audit lines
    dns_lines: int  # the DNS responder's decision lines, left out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "entries": [e.to_json() for e in self.entries],
            "outside_ceiling": [o.to_json() for o in self.outside_ceiling],
            "not_suggested": [u.to_json() for u in self.not_suggested],
            "connections": self.connections,
            "skipped_lines": self.skipped,
            "dns_lines": self.dns_lines,
        }


def entry_text(host: str, fmt: Format, *, wildcard: bool) -> str:
    """How an entry for `host` is written: agent.yaml entries always cover subdomains;
    agent.toml writes that as `*.host`."""
    return f"*.{host}" if wildcard and fmt == "agent.toml" else host


class Collector:
    """Reads audit lines one at a time and keeps only counts per host: a long log costs memory
    per distinct host, not per line."""

    def __init__(self) -> None:
        self._passed: dict[str, _Tally] = {}
        self._unsuggested: dict[tuple[str | None, str, str], _Tally] = {}
        self.connections = 0
        self.skipped = 0
        self.dns_lines = 0

    def add(self, line: str) -> None:
        """One line of an audit log (with or without its newline); blank lines are nothing."""
        if not line.strip():
            return
        try:
            record = json.loads(line)
        except ValueError:
            self.skipped += 1
            return
        if not isinstance(record, dict) or record.get("event") == "close":
            if not isinstance(record, dict):
                self.skipped += 1
            return
        if record.get("event") == "ask":
            self._grant(record)
            return
        read = _decision(record)
        if read is None:
            self.skipped += 1
            return
        time, host, port, decision, reason, protocol = read
        if protocol == Protocol.DNS:
            self.dns_lines += 1
            return
        if decision == Verdict.DENY and (reason not in _LIFTED or host is None):
            self._unsuggest(host, decision, reason, time, port)
            return
        self.connections += 1
        why_not = _not_declarable(host, reason)
        if why_not is not None:
            self._unsuggest(host, decision, why_not, time, port)
            return
        assert host is not None
        self._passed.setdefault(host, _Tally()).add(time, port)

    def _grant(self, record: dict[str, Any]) -> None:
        """An ask line: an `allow-session` grant becomes an entry (the connections it let
        through have allow lines of their own, counted there)."""
        time, host, port = record.get("time"), record.get("host"), record.get("port")
        if record.get("action") != "granted" or record.get("decision") != "allow-session":
            return
        if not (isinstance(time, str) and _TIME.fullmatch(time) and isinstance(host, str)):
            self.skipped += 1
            return
        if _not_declarable(host, Reason.ALLOWED) is not None:
            return
        shown = port if type(port) is int and 0 < port < 65536 else None
        self._passed.setdefault(host, _Tally()).seen(time, shown)

    def _unsuggest(
        self, host: str | None, decision: str, reason: str, time: str, port: int | None
    ) -> None:
        self._unsuggested.setdefault((host, decision, reason), _Tally()).add(time, port)

    def suggest(
        self,
        fmt: Format = "agent.yaml",
        *,
        registrable: Callable[[str], str | None] | None = None,
        ceiling: Ceiling | None = None,
    ) -> Suggestion:
        """The entries, minimised (and folded per registrable domain when `registrable` is
        given), split by what `ceiling` admits."""
        covers = _ceiling_index(ceiling)
        chosen = _fold(self._passed, registrable, covers) if registrable else {}
        roots = _minimal(self._passed, chosen, fmt)
        entries: list[Suggested] = []
        outside: list[Outside] = []
        for root, (wildcard, tally) in sorted(roots.items(), key=lambda kv: _order(kv[0])):
            found = Suggested(
                entry_text(root, fmt, wildcard=wildcard),
                root,
                tally.connections,
                tally.first,
                tally.last,
                tuple(sorted(tally.ports)),
            )
            if covers is not None and covers.covering(root) is None:
                outside.append(_outside(found, ceiling, covers))
            else:
                entries.append(found)
        unsuggested = [
            Unsuggested(host, decision, reason, tally.connections)
            for (host, decision, reason), tally in sorted(
                self._unsuggested.items(), key=lambda kv: (-kv[1].connections, str(kv[0]))
            )
        ]
        return Suggestion(
            fmt,
            tuple(entries),
            tuple(outside),
            tuple(unsuggested),
            self.connections,
            self.skipped,
            self.dns_lines,
        )


# -- reading one line ---------------------------------------------------------------------


def _decision(
    record: dict[str, Any],
) -> tuple[str, str | None, int | None, str, str, str | None] | None:
    """(time, host, port, decision, reason, protocol) of a well-formed decision line."""
    if record.get("event") != "decision":
        return None
    time, host, port = record.get("time"), record.get("host"), record.get("port")
    decision, reason, protocol = (
        record.get("decision"),
        record.get("reason"),
        record.get("protocol"),
    )
    if not (isinstance(time, str) and _TIME.fullmatch(time)):
        return None
    if decision not in _DECISIONS or not isinstance(reason, str):
        return None
    if not (host is None or isinstance(host, str)) or not (
        protocol is None or isinstance(protocol, str)
    ):
        return None
    if port is not None and not (type(port) is int and 0 < port < 65536):
        return None
    if decision in _PASSED and host is None:
        return None  # a connection let through names where it went
    return time, host, port, decision, reason, protocol


def _not_declarable(host: str | None, reason: str) -> str | None:
    """Why a host that went through cannot be a manifest entry, or None when it can."""
    if reason == Reason.PLATFORM_DESTINATION:
        return reason  # the operator's route: provided, never declarable
    if host is None:
        return Reason.INVALID_HOST
    problem = check_entry(host)
    return problem.reason if problem is not None else None


# -- choosing the entries ------------------------------------------------------------------


def _ceiling_index(ceiling: Ceiling | None) -> SubtreeIndex[str] | None:
    if ceiling is None:
        return None
    return SubtreeIndex(
        (rule.host or "", f"{rule.id} {quote(rule.pattern)}") for rule in ceiling.rules
    )


def _fold(
    passed: dict[str, _Tally],
    registrable: Callable[[str], str | None],
    covers: SubtreeIndex[str] | None,
) -> dict[str, str]:
    """host -> the registrable domain it folds into, for groups of at least two names. A
    public suffix has no registrable domain (the lookup gives None, or the name itself for a
    name the list does not know) and so never folds; a fold the ceiling would refuse while
    its names are inside it is not made."""
    groups: dict[str, list[str]] = {}
    for host in passed:
        domain = registrable(host)
        if domain is None or not is_under(host, domain) or check_entry(domain) is not None:
            continue
        groups.setdefault(domain, []).append(host)
    folded: dict[str, str] = {}
    for domain, hosts in groups.items():
        if len(hosts) < _GROUP_MIN:
            continue
        if (
            covers is not None
            and covers.covering(domain) is None
            and any(covers.covering(host) is not None for host in hosts)
        ):
            continue
        for host in hosts:
            folded[host] = domain
    return folded


def _minimal(
    passed: dict[str, _Tally], folded: dict[str, str], fmt: Format
) -> dict[str, tuple[bool, _Tally]]:
    """root -> (covers its subdomains, the merged tally of what it covers): each host under its
    fold, then every root under another root that covers subdomains left out."""
    roots: dict[str, tuple[bool, _Tally]] = {}
    for host, tally in passed.items():
        domain = folded.get(host)
        root = domain if domain is not None else host
        # agent.yaml entries always cover subdomains; agent.toml ones only when folded.
        wildcard = fmt == "agent.yaml" or domain is not None
        had = roots.get(root)
        merged = _Tally()
        merged.merge(tally)
        if had is not None:
            merged.merge(had[1])
            wildcard = wildcard or had[0]
        roots[root] = (wildcard, merged)
    for root in sorted(roots, key=lambda name: -name.count(".")):
        wildcard, tally = roots[root]
        cover = next(
            (name for name in suffixes(root, proper=True) if name in roots and roots[name][0]),
            None,
        )
        if cover is not None:
            roots[cover][1].merge(tally)
            del roots[root]
    return roots


def _outside(found: Suggested, ceiling: Ceiling | None, covers: SubtreeIndex[str]) -> Outside:
    under = tuple(entry for name, entry in covers.items() if name and is_under(name, found.host))
    label = ceiling.label if ceiling is not None else "the ceiling"
    if under:
        message = (
            f"{quote(found.entry)} is outside {label}, which admits only "
            f"{', '.join(under[:5])} under it"
        )
    else:
        message = f"no entry of {label} covers {quote(found.entry)}"
    return Outside(found, under, message)


def _order(host: str) -> tuple[str, ...]:
    """Names of one domain side by side: by their labels from the right."""
    return tuple(reversed(host.split(".")))
