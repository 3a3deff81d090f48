"""Asking a person (`egress-proxy run --ask`): which refusals may be asked about, what the
question is, and the answers a session keeps (its grants).

Only the name stage's "the manifest does not say so" refusals are asked about, and only inside
the tenant ceiling: the host is not declared (`not_allowed`), or declared for other paths
(`path_not_allowed`). Everything a person's answer must not override is decided as ever and
never asked: the ceiling (declared or not), blocked entries, IP literals and internal names, the
operator's ports, the address stage, the SNI gate.

    question = policy.question(decision, target)   # None: not asked, the refusal stands
    grants = SessionGrants()
    grants.add(question, "pypi.org", ALLOW_SESSION, ask="3f2a", time="2026-12-05T10:00:00Z")
    policy.granted(decision, target, grants)        # allowed, its rule "session.grants[0]"

Identical questions (same host, port, and path prefix when a path decided) share one pending
ask. A session grant admits what its question names: the host on any port (as a host entry
does), or the URL prefix (scheme, port, path) when a path decided. A deny-session grant refuses
later identical questions without asking.

Pure: no I/O, no clock (the caller hands over the time as text). The holding of connections
while a person decides is proxy/decide/asks.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from policy.paths import decide_path
from policy.reasons import Reason
from policy.urls import DEFAULT_PORTS, RULE_SCHEME, Target

__all__ = [
    "ALLOW_ONCE",
    "ALLOW_SESSION",
    "ANSWERS",
    "ASKABLE",
    "DENY",
    "DENY_SESSION",
    "Question",
    "SessionGrant",
    "SessionGrants",
    "is_askable",
]

ASKABLE: frozenset[str] = frozenset({Reason.NOT_ALLOWED, Reason.PATH_NOT_ALLOWED})

# A person's answers, exactly as `POST /asks/ID` takes them.
ALLOW_ONCE = "allow-once"
ALLOW_SESSION = "allow-session"
DENY = "deny"
DENY_SESSION = "deny-session"
ANSWERS: tuple[str, ...] = (ALLOW_ONCE, ALLOW_SESSION, DENY, DENY_SESSION)
# The answers that outlive the ask (a grant).
SESSION_ANSWERS = frozenset({ALLOW_SESSION, DENY_SESSION})


def is_askable(reason: str) -> bool:
    """Whether a refusal for `reason` is one a person may be asked about (the ceiling and the
    question are Policy.question's to check)."""
    return reason in ASKABLE


@dataclass(frozen=True, slots=True)
class Question:
    """What a person is asked: may `host` (on `port`) be reached, or, when a path decided, the
    URL prefix `scheme://host:port` + `path`. Equal questions share one ask."""

    host: str
    port: int | None
    path: str | None = None  # a URL-pattern path prefix (policy/remedies.py path_prefix)
    scheme: str | None = None  # "http" or "https", with `path`

    def admits(self, host: str, target: Target) -> bool:
        """Whether an allow grant for this question admits `target` (on `host`, normalised):
        the host on every port and path, or a request inside the URL prefix."""
        if host != self.host:
            return False
        if self.path is None:
            return True
        if target.path is None or target.scheme is None:
            return False
        scheme = RULE_SCHEME.get(target.scheme)
        port = target.port if target.port is not None else DEFAULT_PORTS.get(target.scheme)
        if scheme != self.scheme or port != self.port:
            return False
        return decide_path(target.path, [self.path], []).verdict == "allowed"

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "path": self.path}


@dataclass(frozen=True, slots=True)
class SessionGrant:
    """One answer that outlives its ask: `allow-session` or `deny-session` for `question`."""

    index: int
    question: Question
    entry: str  # the manifest entry that would allow it, in the manifest's grammar
    decision: str  # ALLOW_SESSION or DENY_SESSION
    ask: str  # the id of the ask it answered
    time: str  # when it was given, as the audit log writes times

    @property
    def rule(self) -> str:
        """How decisions name it (where a manifest rule would be named): its place in
        `GET /grants`."""
        return f"session.grants[{self.index}]"

    @property
    def allows(self) -> bool:
        return self.decision == ALLOW_SESSION

    def to_json(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            **self.question.to_json(),
            "decision": self.decision,
            "ask": self.ask,
            "time": self.time,
        }


class SessionGrants:
    """The grants of one session, in the order given, found by host. Bounded by `limit`: a full
    set takes no more (`add` returns None) and the answer then holds for its ask alone."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._grants: list[SessionGrant] = []
        self._by_host: dict[str, list[SessionGrant]] = {}

    def __len__(self) -> int:
        return len(self._grants)

    def __iter__(self) -> Iterator[SessionGrant]:
        return iter(tuple(self._grants))

    def add(
        self, question: Question, entry: str, decision: str, *, ask: str, time: str
    ) -> SessionGrant | None:
        if decision not in SESSION_ANSWERS:
            raise ValueError(f"not a session answer: {decision!r}")
        if len(self._grants) >= self.limit:
            return None
        grant = SessionGrant(len(self._grants), question, entry, decision, ask, time)
        self._grants.append(grant)
        self._by_host.setdefault(question.host, []).append(grant)
        return grant

    def find(self, question: Question, target: Target) -> SessionGrant | None:
        """The grant that answers `question` (asked on `target`): a deny-session of this very
        question first (fail closed), else the first allow-session admitting the target."""
        grants = self._by_host.get(question.host, ())
        for grant in grants:
            if not grant.allows and grant.question == question:
                return grant
        for grant in grants:
            if grant.allows and grant.question.admits(question.host, target):
                return grant
        return None

    def to_json(self) -> list[dict[str, Any]]:
        return [grant.to_json() for grant in self._grants]
