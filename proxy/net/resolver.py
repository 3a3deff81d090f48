"""Resolve a host once, with dnspython: A and AAAA concurrently, configured nameservers, a
timeout, a TTL-capped cache, negative caching and one in-flight lookup per name.

Why our own resolver: the OS resolver (`getaddrinfo`) accepts IP literals in lenient spellings,
applies search domains and reads /etc/hosts, so a name could reach an address the policy never
saw. Here every nameserver is an IP address (dnspython's query functions connect to it directly,
nothing is handed to the OS), the name is queried as an absolute name, and the answer returned is
the one the caller checks and pins (DESIGN 3.3, 3.5).

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

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
import dns.rrset

from policy import PolicyError, normalize_host
from proxy.errors import ProxyError

if TYPE_CHECKING:
    from proxy.settings import Config

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
    """The nameservers of resolv.conf, read by dnspython (its search domains are ignored)."""
    try:
        system = dns.resolver.Resolver(filename=resolv_conf, configure=True)
    except (dns.exception.DNSException, OSError, ValueError) as exc:
        raise ProxyError(
            "dns_config", f"cannot read the system's DNS configuration {resolv_conf}: {exc}"
        ) from None
    result: list[tuple[str, int]] = []
    for nameserver in system.nameservers:
        if isinstance(nameserver, dns.nameserver.Do53Nameserver):
            result.append(_check_nameserver(nameserver.address, nameserver.port))
        elif isinstance(nameserver, str):
            result.append(_check_nameserver(nameserver, system.port))
        else:  # DoH/DoT: resolv.conf never yields these; refuse rather than guess
            raise ProxyError("dns_config", f"unsupported nameserver {nameserver!r}")
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

        # configure=False: nothing read from the system; search domains and dnspython's own
        # cache off, so every name is asked as given and our cache is the only one.
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, p) for ip, p in self.nameservers]
        resolver.search = []
        resolver.use_search_by_default = False
        resolver.cache = None
        # The overall limit is `timeout` (A and AAAA run side by side, each within it); one
        # attempt gets half of it, which leaves room for a second one (a lost UDP datagram, or
        # the next nameserver when the first is down).
        resolver.timeout = self.timeout / 2
        resolver.lifetime = self.timeout
        # EDNS with the commonly recommended 1232-byte payload: fewer truncations, no
        # fragmentation; larger answers still come over TCP (dnspython retries on TC).
        resolver.use_edns(0, 0, 1232)
        self._resolver = resolver

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
            reason = "dns_ip_literal" if exc.reason == "ip_literal" else "invalid_host"
            raise ProxyError(reason, f"{exc.message}: never resolved") from None
        if normal != host:
            raise ProxyError("invalid_host", f"host {host[:100]!r} is not normalised ({normal!r})")
        try:
            # from_text makes an absolute name (relative to the root): no search domain applies.
            return dns.name.from_text(host)
        except dns.exception.DNSException as exc:
            raise ProxyError("invalid_host", f"invalid host {host[:100]!r}: {exc}") from None

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
            families = await asyncio.gather(
                self._query(qname, dns.rdatatype.A), self._query(qname, dns.rdatatype.AAAA)
            )
            return self._combine(host, families)
        except Exception as exc:
            return _Failure("dns_error", f"{host}: DNS lookup failed ({type(exc).__name__})")

    async def _query(self, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType) -> _Family:
        try:
            answer = await self._resolver.resolve(
                qname, rdtype, raise_on_no_answer=False, lifetime=self.timeout, search=False
            )
        except dns.resolver.NXDOMAIN as exc:
            response = exc.responses().get(qname)
            ttl, cnames = int(self.negative_ttl), ()
            if response is not None:
                try:
                    chaining = response.resolve_chaining()
                    ttl, cnames = chaining.minimum_ttl, _chain(chaining.cnames)
                except dns.exception.DNSException:
                    pass
            return _Family("nxdomain", cnames=cnames, ttl=ttl)
        except dns.exception.Timeout:  # LifetimeTimeout included
            return _Family("timeout")
        except dns.resolver.NoNameservers as exc:
            # Every nameserver answered SERVFAIL/REFUSED, sent garbage or could not be reached.
            return _Family("error", detail=_brief(exc))
        except dns.exception.DNSException as exc:  # YXDOMAIN, ChainTooLong, ...
            return _Family("error", detail=f"{type(exc).__name__}: {_brief(exc)}")
        chaining = answer.chaining_result
        cnames = _chain(chaining.cnames)
        if answer.rrset is None:
            # NODATA: the TTL is the negative one dnspython derived from the SOA (or its default
            # when there is none); ours caps it below.
            return _Family("nodata", cnames=cnames, ttl=chaining.minimum_ttl)
        addresses = tuple(rdata.address for rdata in answer.rrset)
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
                    "dns_timeout", f"{host}: DNS lookup timed out after {self.timeout:g}s"
                )
        for family in families:
            if family.kind == "error":
                return _Failure("dns_error", f"{host}: DNS lookup failed ({family.detail})")
        negative = min(min(f.ttl for f in families), self.negative_ttl)
        if all(f.kind == "nxdomain" for f in families):
            failure = _Failure("dns_nxdomain", f"{host}: no such domain (NXDOMAIN)")
        else:
            failure = _Failure("dns_no_address", f"{host}: the name has no A or AAAA record")
        self._cache_put(host, failure, negative)
        return failure


def _brief(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
