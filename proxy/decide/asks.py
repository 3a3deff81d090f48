"""Holding a refused connection while a person decides (`egress-proxy run --ask`).

The policy core says what may be asked and what the answers mean (policy/asking.py); this is
the waiting. Every plane's name stage goes through the Vetter (proxy/decide/vetting.py), which
asks here when a refusal may be asked about:

    outcome, ask = await asks.hold(question, target=..., entry=..., reason=..., ...)
    asks.answer(ask, "allow-session")      # from the admin listener (proxy/ops/admin.py)

Identical questions share one pending ask, and every connection held for it waits on the same
future. Bounded: `max_pending` asks and `max_held` connections at once (over either: the
connection is refused as `ask_overloaded`, nobody is asked), and `timeout` seconds per ask
(then every connection held for it is refused as `ask_timeout`). A client that goes away while
held is forgotten: its connection's task is cancelled, and only the count of held connections
changes. A reload re-decides the pending asks (`reconsider`): an ask the new policy decides
without a person is over, and its connections are decided again under the new policy.

Each ask, answer, grant and timeout is an audit line (`"event": "ask"`) and counts in
`egress_asks_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import typing
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final

from policy.asking import ANSWERS, SESSION_ANSWERS, Question, SessionGrants
from policy.dimensions import Plane, Protocol
from proxy.common.refusals import authority
from proxy.common.settings import Limits
from proxy.decide.events import MAX_FIELD, MAX_PATH, timestamp


class Peer(typing.Protocol):
    """The client connection that asks (proxy/decide/vetting.py Peer), as audit lines name it."""

    @property
    def client(self) -> tuple[str, int] | None: ...

    @property
    def connection(self) -> str: ...


class HeldClient(typing.Protocol):
    """The connection whose task waits here, as a plane gives it (proxy/dataplane/connection.py
    Connection): told when it is held and let go, and asked whether its client has gone."""

    def held(self) -> None: ...

    def released(self) -> None: ...

    def abandoned(self) -> bool:
        """Whether the client went away while held; True ends its connection, which cancels
        the waiting task."""
        ...


__all__ = ["HELD_CLIENT", "AskEvent", "AskLimits", "Asks", "HeldClient", "Pending"]

# What `hold` answers besides a person's answer (policy/asking.py ANSWERS).
TIMEOUT = "timeout"
OVERLOADED = "overloaded"
RELOAD = "reload"
OUTCOMES = frozenset({*ANSWERS, TIMEOUT, OVERLOADED, RELOAD})

# How often a held connection's client is looked at (has it gone?).
WATCH_SECONDS = 0.5
# The targets a person allowed once, remembered so that a reload does not close what they let
# through (bounded: the oldest are forgotten first).
MAX_ONCE = 4096
# What a `GET /asks/stream` subscriber may fall behind by before it is dropped.
MAX_BACKLOG = 256

# Set by a plane around a connection's setup task: the connection held while its task waits,
# which can tell whether its client has gone (then the connection is ended, which cancels the
# task that waits). None where nothing can tell (a DNS query, a request inside interception:
# those wait for the answer or the timeout).
HELD_CLIENT: ContextVar[HeldClient | None] = ContextVar("egress_held_client", default=None)


# The operator's limits (`limits.ask_timeout`, `max_asks`, `max_held`) as they default.
_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True)
class AskLimits:
    timeout: float = _LIMITS.ask_timeout
    max_pending: int = _LIMITS.max_asks
    max_held: int = _LIMITS.max_held
    max_grants: int = 4096

    @classmethod
    def of(cls, limits: Limits) -> AskLimits:
        """The ask limits of an operator config's `limits`."""
        return cls(
            timeout=limits.ask_timeout, max_pending=limits.max_asks, max_held=limits.max_held
        )


@dataclass(slots=True)
class Pending:
    """One question waiting for a person, and the connections held for it."""

    id: str
    question: Question
    target: str  # what the first connection asked for: re-decided by a reload
    entry: str
    reason: str
    protocol: Protocol
    plane: Plane
    since: str
    future: asyncio.Future[str]
    held: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The ask as `GET /asks` and `GET /asks/stream` show it."""
        return {
            "id": self.id,
            **self.question.to_json(),
            "protocol": self.protocol,
            "plane": self.plane,
            "reason": self.reason,
            "entry": self.entry,
            "held": self.held,
            "since": self.since,
        }


@dataclass(frozen=True, slots=True)
class AskEvent:
    """One audit line of an ask: `asked`, `answered`, `granted`, `timeout`, `overloaded` (a
    connection refused without asking) or `reconsidered` (a reload decided it)."""

    action: str
    ask: str | None
    question: Question
    entry: str | None = None
    reason: str | None = None
    protocol: Protocol | None = None
    plane: Plane | None = None
    held: int | None = None
    decision: str | None = None  # the answer
    grant: str | None = None  # the grant's rule, e.g. "session.grants[0]"
    connection: str | None = None
    client: str | None = None

    def line(self, *, session: str | None, now: float) -> str:
        record: dict[str, Any] = {
            "time": timestamp(now),
            "event": "ask",
            "session": session,
            "action": self.action,
            "ask": self.ask,
            "connection": self.connection,
            "client": self.client,
            "plane": self.plane,
            "protocol": self.protocol,
            **self.question.to_json(),
            "reason": self.reason,
            "entry": self.entry,
            "held": self.held,
            "decision": self.decision,
            "grant": self.grant,
        }
        for key, value in record.items():
            # Hosts and paths come from clients (normalised, but long): capped, as every line.
            cap = MAX_PATH if key in ("path", "entry") else MAX_FIELD
            if isinstance(value, str) and len(value) > cap:
                record[key] = value[:cap]
        return json.dumps(record, ensure_ascii=True, separators=(",", ":"))


class Asks:
    """The pending asks and the grants of one session, shared by every Vetter of the proxy.
    Lives on the event loop; `audit` and `count` are the audit log's `write` and the metrics'
    `ask` (both never raise)."""

    def __init__(
        self,
        limits: AskLimits | None = None,
        *,
        audit: Callable[[AskEvent], None] | None = None,
        count: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.limits = limits or AskLimits()
        self.grants = SessionGrants(self.limits.max_grants)
        self._audit = audit
        self._count = count
        self._clock = clock
        self._pending: dict[str, Pending] = {}  # by id, oldest first
        self._by_question: dict[Question, Pending] = {}
        self._held = 0
        self._holding: dict[str, int] = {}  # target -> connections held for it
        self._once: OrderedDict[str, None] = OrderedDict()
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()

    # -- reading -------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        return self._held

    def pending(self) -> list[dict[str, Any]]:
        """The pending asks, oldest first (`GET /asks`)."""
        return [pending.to_json() for pending in self._pending.values()]

    def holding(self, target: str) -> bool:
        """Whether a connection for `target` is held now (a reload leaves it to `reconsider`)."""
        return target in self._holding

    def allowed_once(self, target: str) -> bool:
        """Whether a person allowed `target` once (its connections outlive a reload that still
        leaves it to a person)."""
        return target in self._once

    def subscribe(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue that gets every new ask (`GET /asks/stream`); None in it: dropped (it fell
        behind). Give it back with `unsubscribe`."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(MAX_BACKLOG + 1)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(queue)

    # -- holding -------------------------------------------------------------------------------

    async def hold(
        self,
        question: Question,
        *,
        target: str,
        entry: str,
        reason: str,
        protocol: Protocol,
        plane: Plane,
        peer: Peer,
    ) -> tuple[str, str | None]:
        """Wait for the answer to `question`: (outcome, ask id). The outcome is a person's
        answer (policy/asking.py ANSWERS), `timeout`, `reload` (decide again under the new
        policy) or `overloaded` (nobody asked; the id is None)."""
        pending = self._by_question.get(question)
        limits = self.limits
        if self._held >= limits.max_held or (
            pending is None and len(self._pending) >= limits.max_pending
        ):
            self._emit(AskEvent(OVERLOADED, None, question, entry, reason, protocol, plane,
                                connection=peer.connection, client=_client(peer)))  # fmt: skip
            return OVERLOADED, None
        if pending is None:
            pending = self._ask(question, target, entry, reason, protocol, plane, peer)
        client = HELD_CLIENT.get()
        pending.held += 1
        self._held += 1
        self._holding[target] = self._holding.get(target, 0) + 1
        try:
            if client is not None:
                client.held()
            return await _wait(pending.future, client), pending.id
        finally:
            if client is not None:
                client.released()
            pending.held -= 1
            self._held -= 1
            left = self._holding.pop(target) - 1
            if left:
                self._holding[target] = left

    def _ask(
        self,
        question: Question,
        target: str,
        entry: str,
        reason: str,
        protocol: Protocol,
        plane: Plane,
        peer: Peer,
    ) -> Pending:
        loop = asyncio.get_running_loop()
        ask = secrets.token_hex(8)
        pending = Pending(ask, question, target, entry, reason, protocol, plane,
                          timestamp(self._clock()), loop.create_future())  # fmt: skip
        pending.timer = loop.call_later(self.limits.timeout, self._expire, ask)
        self._pending[ask] = pending
        self._by_question[question] = pending
        self._emit(AskEvent("asked", ask, question, entry, reason, protocol, plane,
                            connection=peer.connection, client=_client(peer)))  # fmt: skip
        shown = pending.to_json()
        shown["held"] = 1  # the connection that asks is held from now on
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_BACKLOG:
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(shown)
        return pending

    def _end(self, ask: str) -> Pending | None:
        pending = self._pending.pop(ask, None)
        if pending is None:
            return None
        self._by_question.pop(pending.question, None)
        if pending.timer is not None:
            pending.timer.cancel()
        return pending

    def _expire(self, ask: str) -> None:
        pending = self._end(ask)
        if pending is not None:
            self._emit(_event(TIMEOUT, pending), TIMEOUT)
            pending.future.set_result(TIMEOUT)

    # -- answers -------------------------------------------------------------------------------

    def answer(self, ask: str, decision: str) -> dict[str, Any] | None:
        """A person's answer to the pending ask `ask`; None when it is not pending. What it
        did: the ask as it was, the answer, and the grant made (None for a one-off answer, or
        when the session's grants are full and the answer held for this ask alone)."""
        if decision not in ANSWERS:
            raise ValueError(f"not an answer: {decision!r}")
        pending = self._end(ask)
        if pending is None:
            return None
        shown = pending.to_json()
        self._emit(_event("answered", pending, decision=decision), decision)
        grant = None
        if decision in SESSION_ANSWERS:
            made = self.grants.add(
                pending.question, pending.entry, decision, ask=ask, time=timestamp(self._clock())
            )
            if made is not None:
                grant = made.to_json()
                self._emit(_event("granted", pending, decision=decision, grant=made.rule))
        pending.future.set_result(decision)
        return {"ask": shown, "decision": decision, "grant": grant}

    def remember_once(self, target: str) -> None:
        once = self._once
        once[target] = None
        once.move_to_end(target)
        while len(once) > MAX_ONCE:
            once.popitem(last=False)

    def reconsider(self, still_asked: Callable[[str], bool]) -> int:
        """After a reload: every pending ask whose first target the new policy no longer
        leaves to a person is over, and its connections decide again (`reload`). Returns how
        many asks ended. A failing check ends the ask (its connections are decided again,
        under the new policy: fail closed)."""
        ended = 0
        for ask, pending in list(self._pending.items()):
            try:
                keep = still_asked(pending.target)
            except Exception:
                keep = False
            if keep:
                continue
            self._end(ask)
            self._emit(_event("reconsidered", pending), RELOAD)
            pending.future.set_result(RELOAD)
            ended += 1
        return ended

    def close(self) -> None:
        """The proxy stops: every subscriber's stream ends."""
        for queue in list(self._subscribers):
            queue.put_nowait(None)
        self._subscribers.clear()

    # -- lines and counts ----------------------------------------------------------------------

    def _emit(self, event: AskEvent, outcome: str | None = None) -> None:
        if outcome is None and event.action == OVERLOADED:
            outcome = OVERLOADED
        if self._audit is not None:
            self._audit(event)
        if outcome is not None and self._count is not None:
            self._count(outcome)


def _event(action: str, pending: Pending, **fields: Any) -> AskEvent:
    return AskEvent(
        action,
        pending.id,
        pending.question,
        pending.entry,
        pending.reason,
        pending.protocol,
        pending.plane,
        held=pending.held,
        **fields,
    )


def _client(peer: Peer) -> str | None:
    client = peer.client
    if client is None:
        return None
    return authority(client[0], client[1])


async def _wait(future: asyncio.Future[str], client: HeldClient | None) -> str:
    """The shared answer (never cancelled by one waiter leaving), looking at the client every
    WATCH_SECONDS when a plane said how: a client gone ends its connection, which cancels the
    task waiting here."""
    if client is None:
        return await asyncio.shield(future)
    while True:
        done, _ = await asyncio.wait({future}, timeout=WATCH_SECONDS)
        if done:
            return future.result()
        if client.abandoned():
            # The plane ended the connection (cancelling this task); if it could not, the wait
            # goes on until the answer or the timeout.
            await asyncio.sleep(0)
