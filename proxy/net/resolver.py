"""Resolve a host once, with dnspython: A and AAAA concurrently, configured nameservers, a
timeout, a TTL-capped cache, negative caching and one in-flight lookup per name.

Why our own resolver: the OS resolver (`getaddrinfo`) accepts IP literals in lenient spellings,
applies search domains and reads /etc/hosts, so a name could reach an address the policy never
saw. Here every nameserver is an IP address (proxy/net/resolver_query.py connects to it directly,
nothing is handed to the OS), the name is queried as an absolute name, and the answer returned is
the one the caller checks and pins (docs/manifests.md, "Runtime rules").

A lookup asks each nameserver in turn, both families in one exchange: an attempt gets half the
timeout, a nameserver that fails (SERVFAIL, REFUSED, an ICMP error) is not asked that family
again, one that stays silent is asked again in the next round while time is left.

The resolver belongs to one event loop: its single-flight tasks are that loop's tasks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

from policy import PolicyError, normalize_host
from policy.reasons import Reason
from policy.text import brief
from proxy.common.errors import ProxyError
from proxy.net.resolver_query import Failed, Reply, ask

if TYPE_CHECKING:
    from proxy.common.settings import Config

DEFAULT_CACHE_CAP = 300.0
DEFAULT_NEGATIVE_TTL = 30.0
DEFAULT_MAX_ENTRIES = 10_000
# A real answer never needs more; a hostile nameserver must not make every check and every
# connection fallback loop walk thousands of addresses.
MAX_ADDRESSES = 64
# dnspython refuses chains longer than 16 links (dns.message.ChainTooLong); this bounds what we
# report when both families bring their own chain.
MAX_CNAME_CHAIN = 34
SYSTEM_RESOLV_CONF = "/etc/resolv.conf"
_RDTYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)
_MAX_TTL = 2**31 - 1
# A failure's detail (dnspython's text of it) in an audit line: a line, not a transcript.
_MAX_DETAIL = 299
MAX_RESOLV_CONF = 64 * 1024


@dataclass(frozen=True, slots=True)
class Answer:
    """One resolved host. `addresses` are A then AAAA, in answer order, without duplicates;
    `cname_chain` names every CNAME owner and target followed (lowercase, no trailing dot),
    empty when there was no CNAME; `ttl` is the smallest TTL of the records used, as the
    nameserver sent it (a cache hit reports the original TTL, not what is left of it)."""

    host: str
    addresses: tuple[str, ...]
    cname_chain: tuple[str, ...] = ()
    ttl: int = 0
    from_cache: bool = False


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed lookup as data: shared waiters each raise a fresh ProxyError from it (raising one
    exception object in many tasks would tangle their tracebacks)."""

    reason: str
    message: str

    def error(self) -> ProxyError:
        return ProxyError(self.reason, self.message)


@dataclass(frozen=True, slots=True)
class _Family:
    """What one query type (A or AAAA) came back with."""

    kind: str  # "answer" | "nodata" | "nxdomain" | "timeout" | "error"
    addresses: tuple[str, ...] = ()
    cnames: tuple[str, ...] = ()
    ttl: int = 0  # positive TTL for "answer", negative TTL for "nodata" and "nxdomain"
    detail: str = ""


@dataclass(slots=True)
class _CacheEntry:
    expires: float
    outcome: Answer | _Failure
    hit: Answer | None = None  # `outcome` as a cache hit delivers it, made on the first hit


def _text(name: dns.name.Name) -> str:
    return name.to_text(omit_final_dot=True).lower()


def _chain(rrsets: Iterable[dns.rrset.RRset]) -> tuple[str, ...]:
    """Owner then target of every CNAME followed, in order, without repeats."""
    names: list[str] = []
    for rrset in rrsets:
        for name in (rrset.name, *(rdata.target for rdata in rrset)):
            text = _text(name)
            if text not in names:
                names.append(text)
    return tuple(names)


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _check_nameserver(address: str, port: int) -> tuple[str, int]:
    # Only IP addresses: a nameserver given by name would need the OS resolver to find it.
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ProxyError("dns_config", f"nameserver {address!r} is not an IP address") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ProxyError("dns_config", f"nameserver {address!r} has an invalid port {port!r}")
    return str(ip), port


def system_nameservers(resolv_conf: str = SYSTEM_RESOLV_CONF) -> list[tuple[str, int]]:
    """The `nameserver` lines of resolv.conf, port 53 (its search domains and options are
    ignored: every name is asked as the absolute name it is)."""
    try:
        with open(resolv_conf, "rb") as file:
            data = file.read(MAX_RESOLV_CONF + 1)
    except OSError as exc:
        raise ProxyError(
            "dns_config",
            f"cannot read the system's DNS configuration {resolv_conf}: {exc.strerror or exc}",
        ) from None
    if len(data) > MAX_RESOLV_CONF:
        raise ProxyError("dns_config", f"{resolv_conf} is larger than {MAX_RESOLV_CONF} bytes")
    result: list[tuple[str, int]] = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        words = line.split()
        # As the C library reads it: a comment starts a line with # or ;.
        if len(words) < 2 or words[0] != "nameserver" or line.lstrip()[0] in "#;":
            continue
        try:
            result.append(_check_nameserver(words[1], 53))
        except ProxyError as exc:
            raise ProxyError("dns_config", f"{resolv_conf}:{number}: {exc.message}") from None
    if not result:
        raise ProxyError("dns_config", f"{resolv_conf} names no nameserver")
    return result


class Resolver:
    """See the module docstring. `resolve()` raises ProxyError with reason `dns_ip_literal`,
    `invalid_host`, `dns_nxdomain`, `dns_no_address`, `dns_timeout` or `dns_error`."""

    def __init__(
        self,
        nameservers: Sequence[tuple[str, int]],
        timeout: float,
        *,
        cache_cap: float = DEFAULT_CACHE_CAP,
        negative_ttl: float = DEFAULT_NEGATIVE_TTL,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if not nameservers:
            raise ProxyError("dns_config", "no nameserver configured")
        if not timeout > 0:
            raise ProxyError("dns_config", f"DNS timeout must be positive, not {timeout!r}")
        if max_entries < 1:
            raise ProxyError("dns_config", f"max_entries must be at least 1, not {max_entries!r}")
        self.nameservers = tuple(_check_nameserver(ip, port) for ip, port in nameservers)
        self.timeout = float(timeout)
        self.cache_cap = float(cache_cap)
        self.negative_ttl = float(negative_ttl)
        self.max_entries = max_entries
        self._clock = clock
        # Insertion order doubles as recency order (move_to_end on a hit): LRU eviction.
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[Answer | _Failure]] = {}

        # The overall limit is `timeout` (A and AAAA side by side, each within it); one attempt
        # at a nameserver gets half of it, which leaves room for a second one (a lost UDP
        # datagram, or the next nameserver when the first is down).
        self.attempt_timeout = self.timeout / 2

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        resolv_conf: str = SYSTEM_RESOLV_CONF,
        clock: Callable[[], float] = time.monotonic,
    ) -> Resolver:
        if config.nameservers is None:
            nameservers = system_nameservers(resolv_conf)
        else:
            nameservers = [(ns.address, ns.port) for ns in config.nameservers]
        return cls(nameservers, config.dns_timeout, clock=clock)

    # -- public ------------------------------------------------------------------------------

    async def resolve(self, host: str) -> Answer:
        """The addresses of `host` (already normalised by policy: lowercase A-labels)."""
        # The cache holds only names that were checked on their way in (below), so a hit needs
        # no check again: it is the common case, once per connection.
        entry = self._cache_get(host)
        if entry is not None:
            if entry.hit is None:
                entry.hit = self._deliver(entry.outcome, from_cache=True)
            return entry.hit
        task = self._inflight.get(host)
        if task is None:
            qname = self._qname(host)  # refuses literals and garbage before any query
            task = asyncio.get_running_loop().create_task(
                self._lookup(host, qname), name=f"dns-resolve {host}"
            )
            self._inflight[host] = task
            task.add_done_callback(lambda done: self._forget(host, done))
        # shield: a caller that is cancelled stops waiting, the shared lookup goes on for the
        # others (and still fills the cache).
        outcome = await asyncio.shield(task)
        return self._deliver(outcome, from_cache=False)

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- internals ---------------------------------------------------------------------------

    def _qname(self, host: str) -> dns.name.Name:
        # The policy's own normaliser is the one judge of what is a name: an IP literal in any
        # spelling is refused, and a host it would spell differently was not handed over
        # normalised (an IDNA mapping here could differ from the one the policy decided on).
        try:
            normal = normalize_host(host)
        except PolicyError as exc:
            reason = (
                Reason.DNS_IP_LITERAL if exc.reason == Reason.IP_LITERAL else Reason.INVALID_HOST
            )
            raise ProxyError(reason, f"{exc.message}: never resolved") from None
        if normal != host:
            raise ProxyError(
                Reason.INVALID_HOST, f"host {host[:100]!r} is not normalised ({normal!r})"
            )
        try:
            # from_text makes an absolute name (relative to the root): no search domain applies.
            return dns.name.from_text(host)
        except dns.exception.DNSException as exc:
            raise ProxyError(Reason.INVALID_HOST, f"invalid host {host[:100]!r}: {exc}") from None

    def _deliver(self, outcome: Answer | _Failure, *, from_cache: bool) -> Answer:
        if isinstance(outcome, _Failure):
            raise outcome.error()
        return dataclasses.replace(outcome, from_cache=True) if from_cache else outcome

    def _forget(self, host: str, task: asyncio.Task[Answer | _Failure]) -> None:
        if self._inflight.get(host) is task:
            del self._inflight[host]

    def _cache_get(self, host: str) -> _CacheEntry | None:
        entry = self._cache.get(host)
        if entry is None:
            return None
        if self._clock() >= entry.expires:
            del self._cache[host]
            return None
        self._cache.move_to_end(host)
        return entry

    def _cache_put(self, host: str, outcome: Answer | _Failure, seconds: float) -> None:
        if seconds <= 0:
            return  # TTL 0 means "do not cache"
        self._cache[host] = _CacheEntry(self._clock() + seconds, outcome)
        self._cache.move_to_end(host)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    async def _lookup(self, host: str, qname: dns.name.Name) -> Answer | _Failure:
        # Never raises (short of cancellation): a shared task's exception would otherwise be
        # raised in every waiter, or logged as never retrieved when nobody waits any more.
        try:
            replies = await self._ask(qname)
            families = [self._family(replies.get(rdtype)) for rdtype in _RDTYPES]
            return self._combine(host, families)
        except Exception as exc:
            return _Failure(Reason.DNS_ERROR, f"{host}: DNS lookup failed ({type(exc).__name__})")

    async def _ask(self, qname: dns.name.Name) -> dict[int, Reply | None]:
        """A and AAAA of `qname`, asked of each nameserver in turn (both families in one
        exchange) until each family has its answer, has failed at every nameserver, or the
        lookup's `timeout` is spent. A family without an answer maps to its last failure, or
        to None (timed out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        answered: dict[int, Reply | None] = {}
        failed: dict[int, set[tuple[str, int]]] = {rdtype: set() for rdtype in _RDTYPES}
        failures: dict[int, Failed] = {}
        while True:
            for nameserver in self.nameservers:
                todo = [t for t in _RDTYPES if t not in answered and nameserver not in failed[t]]
                remaining = deadline - loop.time()
                if not todo or remaining <= 0:
                    continue
                attempt = min(self.attempt_timeout, remaining)
                replies = await ask(nameserver, qname, todo, attempt, tcp_timeout=remaining)
                for rdtype, reply in replies.items():
                    if isinstance(reply, Failed):
                        failed[rdtype].add(nameserver)
                        failures[rdtype] = reply
                    else:
                        answered[rdtype] = reply
            # Open: a family neither answered nor failed at every nameserver (each timed out).
            open_ = [
                t for t in _RDTYPES if t not in answered and len(failed[t]) < len(self.nameservers)
            ]
            if not open_ or deadline - loop.time() <= 0:
                break
        for rdtype in _RDTYPES:
            if rdtype not in answered:
                everywhere = len(failed[rdtype]) == len(self.nameservers)
                answered[rdtype] = failures[rdtype] if everywhere else None
        return answered

    def _family(self, reply: Reply | None) -> _Family:
        """What one family's reply means: its addresses, CNAME chain and TTL."""
        if reply is None:
            return _Family("timeout")
        if isinstance(reply, Failed):
            return _Family("error", detail=reply.detail)
        nxdomain = reply.rcode() == dns.rcode.NXDOMAIN
        try:
            chaining = reply.resolve_chaining()
        except dns.exception.DNSException as exc:  # ChainTooLong, AnswerForNXDOMAIN, ...
            if nxdomain:  # no such name all the same; how long to believe it is ours to say
                return _Family("nxdomain", ttl=int(self.negative_ttl))
            return _Family("error", detail=f"{type(exc).__name__}: {brief(exc, _MAX_DETAIL)}")
        cnames = _chain(chaining.cnames)
        if nxdomain:
            return _Family("nxdomain", cnames=cnames, ttl=min(chaining.minimum_ttl, _MAX_TTL))
        if chaining.answer is None:
            # NODATA: the TTL is the negative one of the SOA (none: the largest TTL there is);
            # ours caps it when caching.
            return _Family("nodata", cnames=cnames, ttl=min(chaining.minimum_ttl, _MAX_TTL))
        addresses = tuple(str(rdata.address) for rdata in chaining.answer)
        return _Family("answer", addresses, cnames, chaining.minimum_ttl)

    def _combine(self, host: str, families: Sequence[_Family]) -> Answer | _Failure:
        answered = [f for f in families if f.kind == "answer"]
        addresses = _dedupe(a for f in answered for a in f.addresses)[:MAX_ADDRESSES]
        if addresses:
            # A family that failed while the other answered: use what answered (a v4-only host
            # behind a flaky AAAA path must still work).
            ttl = min(f.ttl for f in answered)
            chain = tuple(_dedupe(n for f in answered for n in f.cnames))[:MAX_CNAME_CHAIN]
            answer = Answer(host, tuple(addresses), chain, ttl)
            self._cache_put(host, answer, min(ttl, self.cache_cap))
            return answer
        # No address at all: a failure of either family explains it better than "no data", and
        # is not cached (the next request asks again).
        for family in families:
            if family.kind == "timeout":
                return _Failure(
                    Reason.DNS_TIMEOUT, f"{host}: DNS lookup timed out after {self.timeout:g}s"
                )
        for family in families:
            if family.kind == "error":
                return _Failure(Reason.DNS_ERROR, f"{host}: DNS lookup failed ({family.detail})")
        negative = min(min(f.ttl for f in families), self.negative_ttl)
        if all(f.kind == "nxdomain" for f in families):
            failure = _Failure(Reason.DNS_NXDOMAIN, f"{host}: no such domain (NXDOMAIN)")
        else:
            failure = _Failure(Reason.DNS_NO_ADDRESS, f"{host}: the name has no A or AAAA record")
        self._cache_put(host, failure, negative)
        return failure
