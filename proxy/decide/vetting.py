"""The decision of one destination, shared by both planes so that they cannot drift apart:
name stage, DNS once, address stage, and the metrics and audit line of each step.

    vetter = Vetter(policy, resolver, metrics, audit, plane=Plane.L4)
    vetted = await vetter.vet("pypi.org:443", 443, peer, Protocol.CONNECT, inspecting=False)
    vetted.pinned      # the only addresses the connection may go to

The loop guard is a step of the address stage, so no plane can dial before it: a destination
any of whose checked addresses is one of the proxy's own listeners (`own`, shared by every
Vetter of the process) is refused (`proxy_loop`). A refusal raises `Refused` after its metrics
and audit line are written. What the caller knows of the decision beyond the policy's answer
(the request, the SNI, how the host was known) comes as one `Details` and goes into every line
of the decision as it is. No mitmproxy here.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.asking import ALLOW_ONCE, ALLOW_SESSION, Question
from policy.decisions import Decision
from policy.dimensions import Plane, Protocol, Stage, Verdict
from policy.hostnames import normalize_host, parse_ip_literal
from policy.reasons import Reason
from proxy.common.bounded import Bounded
from proxy.common.errors import ProxyError
from proxy.common.listeners import OwnListeners
from proxy.common.refusals import Refused, authority
from proxy.decide.asks import OVERLOADED, RELOAD, TIMEOUT, Asks
from proxy.decide.events import NO_DETAILS, DecisionEvent, Details
from proxy.decide.planes import Update
from proxy.decide.resolving import Resolves

# The resolver's reason for NOERROR with no A or AAAA record (proxy/net/resolver.py).

if TYPE_CHECKING:
    from policy import AddressDecision, Policy
    from proxy.decide.events import AuditSink, MetricsSink


# The refusals of a person's answer (or of its absence): their remedy is the entry asked about.
_ASKED = frozenset({Reason.ASK_DENIED, Reason.ASK_TIMEOUT, Reason.ASK_OVERLOADED})

_SESSION_PREFIX = os.urandom(6).hex()
_COUNTER = itertools.count(1)


def next_connection_id() -> str:
    """An id for a new connection, unique within the process and, with the random prefix drawn
    at start, across the session's restarts and the other sessions whose lines are collected
    together (no random draw per connection: that is a system call on every accept)."""
    return f"{_SESSION_PREFIX}-{next(_COUNTER):x}"


@dataclass(frozen=True, slots=True)
class Peer:
    """The client connection a decision is for, as audit lines name it."""

    client: tuple[str, int] | None
    connection: str


@dataclass(frozen=True, slots=True)
class Vetted:
    decision: Decision  # the name stage
    checked: AddressDecision  # the address stage
    pinned: tuple[str, ...]  # checked, in answer order


def _allow_message(vetted: Vetted) -> str:
    return f"{vetted.decision.message}; {vetted.checked.message}"


def _named(details: Details, decision: Decision) -> Details:
    """`details` for a refusal after the name stage and before any address was checked: the
    line names the rule and ceiling that admitted the name, where `details` names none (made
    only for such a refusal, off the allowed path)."""
    return dataclasses.replace(
        details,
        rule=details.rule if details.rule is not None else decision.rule,
        ceiling=details.ceiling if details.ceiling is not None else decision.ceiling,
    )


# Bounded: its arguments come from clients (SNI, Host); a busy session names the same few.
@functools.lru_cache(maxsize=4096)
def canonical_host(host: str) -> str:
    """The policy's spelling of a host, for comparing an SNI or a Host header with what was
    decided (the same two steps Policy.decide takes). Garbage stays as is, marked so that it
    compares unequal to every host."""
    literal = parse_ip_literal(host)
    if literal is not None:
        return str(literal)
    try:
        return normalize_host(host)
    except Exception:
        return "\0" + host


# Per policy, the name-stage and address-stage answers already given (both are pure functions
# of the policy and their arguments): a busy session asks the same few hosts again and again.
# Bounded, as the keys come from clients and DNS answers (proxy/common/bounded.py), and only
# short targets (a host name is at most 253 characters) and short answers are kept.
MEMO_ENTRIES = 1024
MEMO_TARGET = 300
MEMO_ADDRESSES = 16


class _Memo:
    __slots__ = ("addresses", "decisions", "policy")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.decisions: Bounded[str, Decision] = Bounded(MEMO_ENTRIES)
        self.addresses: Bounded[tuple[str, tuple[str, ...], tuple[str, ...]], AddressDecision] = (
            Bounded(MEMO_ENTRIES)
        )


class Vetter:
    """Decides destinations for one plane (`l4` or `l7`); `policy` and `resolver` are swapped
    by a reload, and a decision in flight keeps the policy it started with. `learn`: learning
    mode (`run --learn`, Policy.learn): a refusal only a manifest entry could lift is let
    through and written as `would_deny`; a reload may turn it off, never on. `asks`: asking
    mode (`run --ask`, proxy/decide/asks.py, shared by every Vetter): such a refusal is held
    while a person decides, and the session's grants apply to every decision. `own`: the
    proxy's own listeners, never a destination (claimed as they are bound)."""

    def __init__(
        self,
        policy: Policy,
        resolver: Resolves,
        metrics: MetricsSink | None = None,
        audit: AuditSink | None = None,
        *,
        # Or its value, as the composition root (proxy/app/runtime.py) spells it: made a Plane
        # here, once, so that anything else fails at start-up (ValueError), not on a line.
        plane: Plane | str,
        learn: bool = False,
        asks: Asks | None = None,
        own: OwnListeners | None = None,
    ) -> None:
        self.policy = policy
        self.own = own if own is not None else OwnListeners()
        self.learn = learn
        self.asks = asks
        self.resolver = resolver
        self.metrics = metrics
        self.audit = audit
        self.plane = Plane(plane)
        self._memo = _Memo(policy)

    def configure(self, update: Update) -> None:
        """What a plane's Vetter holds of a reload (proxy/decide/planes.py). A decision in flight
        keeps the policy it started with."""
        if update.policy is not None:
            self.policy = update.policy
        if update.resolver is not None:
            self.resolver = update.resolver
        if update.stop_learning:
            self.learn = False
        if update.stop_asking:
            self.asks = None

    def _memo_of(self, policy: Policy) -> _Memo:
        memo = self._memo
        if memo.policy is not policy:
            memo = _Memo(policy)
            if policy is self.policy:  # a decision begun before a reload keeps its own
                self._memo = memo
        return memo

    def decide(self, target: str, policy: Policy | None = None) -> Decision:
        """`policy.decide(target)` (the current policy by default), remembered per policy."""
        if policy is None:
            policy = self.policy
        decisions = self._memo_of(policy).decisions
        decision = decisions.get(target)
        if decision is None:
            decision = policy.decide(target)
            if len(target) <= MEMO_TARGET:
                decisions.put(target, decision)
        if not decision.allowed:
            if self.learn:
                decision = policy.learn(decision, target)
            elif self.asks is not None:
                decision = policy.granted(decision, target, self.asks.grants)
        return decision

    def _check_addresses(
        self,
        policy: Policy,
        host: str,
        addresses: tuple[str, ...],
        cname_chain: tuple[str, ...],
    ) -> AddressDecision:
        """`policy.check_addresses(...)`, remembered per policy (a cached DNS answer is the
        same tuple each time)."""
        checks = self._memo_of(policy).addresses
        key = (host, addresses, cname_chain)
        checked = checks.get(key)
        if checked is None:
            checked = policy.check_addresses(host, addresses, cname_chain=cname_chain)
            if len(addresses) + len(cname_chain) <= MEMO_ADDRESSES:
                checks.put(key, checked)
        return checked

    # -- metrics and audit -------------------------------------------------------------------

    def event(self, event: DecisionEvent) -> None:
        if event.ech and self.metrics is not None:
            # Counted with the line: a tunnel has one decision line once its ClientHello was
            # read (one decision, one line), so each tunnel whose hello carried ECH or ESNI
            # counts once, under the decision it got.
            self.metrics.tls_ech(event.decision, event.protocol)
        if self.audit is not None:
            self.audit.decision(event)

    def record(
        self,
        result: Decision | AddressDecision,
        peer: Peer,
        protocol: Protocol,
        details: Details = NO_DETAILS,
        *,
        named: Decision | None = None,
        port: int | None = None,
    ) -> None:
        """Metrics and audit for an answer of the policy core (`named`, `port`: an address
        decision's name-stage decision and port, DecisionEvent.from_policy)."""
        if self.metrics is not None:
            self.metrics.record(result, self.plane)
        self.event(
            DecisionEvent.from_policy(
                result,
                plane=self.plane,
                protocol=protocol,
                client=peer.client,
                connection=peer.connection,
                details=details,
                named=named,
                port=port,
            )
        )

    def allowed(
        self,
        peer: Peer,
        protocol: Protocol,
        *,
        stage: Stage,
        vetted: Vetted | None = None,
        port: int | None = None,
        details: Details = NO_DETAILS,
    ) -> None:
        """The allow line of a destination whose last stage is the caller's (the SNI gate after
        `vet(..., final=False)`): one line for the whole decision, with what vetting found."""
        if vetted is None:
            self._own(Verdict.ALLOW, Reason.ALLOWED, peer, protocol, stage, details, port=port)
            return
        decision = vetted.decision
        if decision.would_deny:
            # Let through by learning: the line says what it would have been, and why.
            verdict, reason = Verdict.WOULD_DENY, decision.reason
        else:
            verdict, reason = Verdict.ALLOW, Reason.ALLOWED
        self._own(verdict, reason, peer, protocol, stage, details, host=decision.host, port=port,
                  message=_allow_message(vetted), vetted=vetted)  # fmt: skip

    def refusal(
        self,
        refused: Refused,
        peer: Peer,
        host: str | None,
        port: int | None,
        protocol: Protocol,
        *,
        stage: Stage = Stage.ENGINE,
        vetted: Vetted | None = None,
        details: Details = NO_DETAILS,
    ) -> None:
        """Metrics and audit for a denial the policy core did not produce itself (`vetted`: a
        destination vetted this far, whose rule and addresses the line then names)."""
        self._own(Verdict.DENY, refused.reason, peer, protocol, stage, details, host=host,
                  port=port, message=refused.message, vetted=vetted)  # fmt: skip

    def _own(
        self,
        verdict: Verdict,
        reason: str,
        peer: Peer,
        protocol: Protocol,
        stage: Stage,
        details: Details,
        *,
        host: str | None = None,
        port: int | None = None,
        message: str | None = None,
        vetted: Vetted | None = None,
    ) -> None:
        """A line of the Vetter's own: what the caller knows (`details`, whose rule and
        ceiling, where set, are the line's) and what vetting found."""
        if self.metrics is not None:
            self.metrics.decision(verdict, reason, stage, self.plane)
        rule = ceiling = None
        resolved = pinned = None
        if vetted is not None:
            rule, ceiling = vetted.decision.rule, vetted.decision.ceiling
            resolved = tuple(v.address for v in vetted.checked.verdicts)
            pinned = vetted.pinned
        event = DecisionEvent.of(
            verdict, reason, details, stage=stage, plane=self.plane, protocol=protocol,
            client=peer.client, connection=peer.connection, host=host, port=port, rule=rule,
            ceiling=ceiling, resolved=resolved, pinned=pinned, message=message,
        )  # fmt: skip
        self.event(event)

    # -- the stages --------------------------------------------------------------------------

    async def vet(
        self,
        target: str,
        port: int | None,
        peer: Peer,
        protocol: Protocol,
        *,
        inspecting: bool,
        decision: Decision | None = None,
        final: bool = True,
        details: Details = NO_DETAILS,
    ) -> Vetted:
        """Name stage on `target` (an authority, a URL, or a bare host with `port` None: the DNS
        responder's question), DNS once, address stage. A host
        whose rules need inspection passes only when the caller is `inspecting`. `decision`:
        the name stage already taken by the caller on this very policy. Raises Refused (403
        for denials, 502 for DNS failures).

        One decision, one line: a denial is written at the stage that denied it, with what was
        known by then (the rule that admitted the name, the addresses); an allow is written
        here, at the address stage, when `final`, else by the caller's own last stage
        (`allowed(..., vetted=...)`, the SNI gate of a tunnel)."""
        policy = self.policy  # one policy for the whole decision, even across a reload
        if decision is None:
            decision = self.decide(target, policy)
        if not decision.allowed:
            decision, policy = await self._refused(
                policy, decision, target, peer, protocol, details
            )
        if decision.needs_inspection and not inspecting:
            refused = Refused(
                403,
                Reason.INSPECTION_UNSUPPORTED,
                "this host's rules need TLS inspection, not loaded",
            )
            self.refusal(refused, peer, decision.host, port, protocol, stage=Stage.NAME,
                         details=_named(details, decision))  # fmt: skip
            raise refused
        host = decision.host
        literal = parse_ip_literal(host)
        addresses: tuple[str, ...]
        cname_chain: tuple[str, ...] = ()
        if literal is not None:
            addresses = (str(literal),)
        else:
            started = time.monotonic()
            try:
                answer = await self.resolver.resolve(host)
            except ProxyError as exc:
                if self.metrics is not None:
                    self.metrics.dns_lookup(time.monotonic() - started, exc.reason)
                if exc.reason != Reason.DNS_NO_ADDRESS:
                    # Every DNS failure, a timeout included, is a 502 (docs/commands.md); 504 is
                    # kept for an upstream that does not answer the connect.
                    refused = Refused(502, exc.reason, exc.message, error=True)
                    self.refusal(refused, peer, host, port, protocol, stage=Stage.DNS,
                                 details=_named(details, decision))  # fmt: skip
                    raise refused from None
                # An answer with no address is an answer: the address stage refuses it
                # (`no_addresses`, 403), as `explain --resolve HOST=` does.
                answer = None
            if answer is not None and self.metrics is not None:
                self.metrics.dns_lookup(time.monotonic() - started, "ok")
            if answer is None:
                addresses = ()
            else:
                addresses, cname_chain = tuple(answer.addresses), tuple(answer.cname_chain)
        vetted = self._address_stage(
            policy, decision, addresses, cname_chain, peer, protocol, port, details
        )
        if final:
            self.allowed(peer, protocol, stage=Stage.ADDRESS, vetted=vetted, port=port,
                         details=details)  # fmt: skip
        return vetted

    async def vet_attributed(
        self,
        names: Sequence[str],
        address: str,
        port: int,
        peer: Peer,
        protocol: Protocol,
        *,
        scheme: str | None = None,
        details: Details = NO_DETAILS,
    ) -> Vetted:
        """A connection to `address`, which the session's DNS answered for `names` (the most
        recent first) and which carries no name of its own: each name decided on `port` (as a
        `scheme` stream, e.g. `ssh`, when given) until one is allowed, then the address stage
        on `address` alone. No DNS: the address was checked when it was answered, and the
        client goes to that address, not to whatever the name resolves to now. Raises Refused
        after its line (the first name's refusal when none is allowed, or when a person asked
        about it refuses); the allow line is the caller's."""
        policy = self.policy
        refused: tuple[Decision, str] | None = None
        for name in names:
            where = authority(name, port)
            target = f"{scheme}://{where}" if scheme else where
            decision = self.decide(target, policy)
            if decision.allowed:
                break
            if refused is None:
                refused = (decision, target)
        else:
            assert refused is not None, "attributed to no name"
            decision, target = refused
            decision, policy = await self._refused(
                policy, decision, target, peer, protocol, details
            )
        return self._address_stage(policy, decision, (address,), (), peer, protocol, port, details)

    async def _refused(
        self,
        policy: Policy,
        decision: Decision,
        target: str,
        peer: Peer,
        protocol: Protocol,
        details: Details,
    ) -> tuple[Decision, Policy]:
        """A name-stage refusal: Refused after its line, unless a person may be asked (`run
        --ask`): then held while one decides, and the allowed decision and the policy in force
        by then (a reload while held) are returned."""
        question = policy.question(decision, target) if self.asks is not None else None
        if question is None:
            self.record(decision, peer, protocol, details)
            raise Refused(
                403, decision.reason, decision.message, remedy=policy.remedy(decision, target)
            )
        return await self._ask(decision, question, target, peer, protocol, details)

    def _address_stage(
        self,
        policy: Policy,
        decision: Decision,
        addresses: tuple[str, ...],
        cname_chain: tuple[str, ...],
        peer: Peer,
        protocol: Protocol,
        port: int | None,
        details: Details,
    ) -> Vetted:
        """The address stage on one answer for an allowed name, the loop guard last (a
        connection on a `port`; a DNS question has none): what vetting found, or Refused after
        its line (which names the name's rule and ceiling, and `details`)."""
        checked = self._check_addresses(policy, decision.host, addresses, cname_chain)
        if not checked.allowed or not checked.pinned:
            self.record(checked, peer, protocol, details, named=decision, port=port)
            raise Refused(
                403,
                checked.reason or Reason.NO_ADDRESSES,
                checked.message,
                remedy=policy.remedy(checked),
            )
        vetted = Vetted(decision, checked, tuple(checked.pinned))
        if port is not None and any(self.own.is_own(address, port) for address in vetted.pinned):
            refused = Refused(
                403,
                Reason.PROXY_LOOP,
                f"{authority(decision.host, port)} is this proxy's own listener",
            )
            self.refusal(refused, peer, decision.host, port, protocol, stage=Stage.ADDRESS,
                         vetted=vetted, details=details)  # fmt: skip
            raise refused
        return vetted

    async def _ask(
        self,
        refused: Decision,
        question: Question,
        target: str,
        peer: Peer,
        protocol: Protocol,
        details: Details,
    ) -> tuple[Decision, Policy]:
        """Hold the connection until a person answers `question` (proxy/decide/asks.py): the
        allowed decision and the policy in force once answered, or Refused after its line is
        written (denied, timed out, overloaded, or refused by a reload's policy). Fails
        closed: an error while holding is a denial."""
        asks = self.asks
        assert asks is not None
        decision = refused
        while True:
            policy = self.policy
            try:
                outcome, ask = await asks.hold(
                    question,
                    target=target,
                    entry=policy.entry(decision, target) or decision.host,
                    reason=decision.reason,
                    protocol=protocol,
                    plane=self.plane,
                    peer=peer,
                )
            except Exception as exc:
                outcome, ask = f"error: {type(exc).__name__}", None
            policy = self.policy  # a reload while held: decided under the new policy
            current = self.decide(target, policy)  # a session grant made by the answer applies
            rule = f"ask:{ask}"
            if current.allowed or outcome == RELOAD:
                decision = current
                question = policy.question(current, target)  # type: ignore[assignment]
                if current.allowed or question is None or self.asks is None:
                    break
                continue  # still a person's to decide: asked again
            decision = self._answered(policy, current, target, outcome, rule)
            if outcome == ALLOW_ONCE and decision.allowed:
                asks.remember_once(target)
            break
        if decision.allowed:
            return decision, policy
        self.record(decision, peer, protocol, details)
        remedy = policy.remedy(refused, target) if decision.reason in _ASKED else None
        raise Refused(
            403,
            decision.reason,
            decision.message,
            remedy=remedy or policy.remedy(decision, target),
        )

    @staticmethod
    def _answered(
        policy: Policy, current: Decision, target: str, outcome: str, rule: str
    ) -> Decision:
        """The name-stage decision a person's answer (or its absence) makes of `current`."""
        if policy.question(current, target) is None:
            return current  # no longer a person's to decide (a grant denied it, a reload)
        if outcome in (ALLOW_ONCE, ALLOW_SESSION):
            # `allow-session` with the session's grants full: it holds for this ask alone.
            return policy.answered(current, target, rule, allow=True)
        host, port = current.host, current.port
        if outcome == TIMEOUT:
            return Decision(
                False, Reason.ASK_TIMEOUT, f"{host}: nobody answered the ask in time ({rule})",
                host, port, rule,
            )  # fmt: skip
        if outcome == OVERLOADED:
            return Decision(
                False, Reason.ASK_OVERLOADED,
                f"{host}: too many connections are waiting for a person's answer", host, port,
            )  # fmt: skip
        # deny, deny-session, or an error while holding: fail closed.
        return policy.answered(current, target, rule, allow=False)

    def still_asked(self, target: str) -> bool:
        """After a reload: whether `target`, held for a person's answer, is still a person's
        to decide under the current policy (its grants applied)."""
        decision = self.decide(target)
        return not decision.allowed and self.policy.question(decision, target) is not None

    def still_allowed(self, target: str, pinned: Sequence[str], inspected: bool) -> bool:
        """After a reload: whether a live connection's destination is still allowed (name
        stage on what was decided, address stage on the checked addresses). A passthrough
        connection cannot be inspected after the fact: it goes when inspection is needed.
        A connection held for a person's answer stays: the answer is decided under the new
        policy (Asks.reconsider)."""
        policy = self.policy
        asks = self.asks
        if asks is not None and asks.holding(target):
            return True
        decision = self.decide(target, policy)  # learning, while it lasts, keeps what it let in
        if not decision.allowed and asks is not None and asks.allowed_once(target):
            # Let through once by a person, and still only a person's to refuse: it stays.
            decision = policy.answered(decision, target, "ask", allow=True)
        if not decision.allowed or (decision.needs_inspection and not inspected):
            return False
        if not pinned:
            return False
        return bool(policy.check_addresses(decision.host, pinned).allowed)
