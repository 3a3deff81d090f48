"""Benchmark of the policy decision core: decisions per second, load and compile time, and
compile memory for policies of 10, 1 000 and 100 000 rules; the suffix trie against a linear scan.

    .venv/bin/python benchmarks/policy_decide.py            # full run (make bench-policy)
    .venv/bin/python benchmarks/policy_decide.py --quick    # one load and compile per set
    .venv/bin/python benchmarks/policy_decide.py --json results.json

Goals (from the issue): a decision on a 100 000-rule policy within 2x of a 10-rule one, and
compile_policy on 100 000 rules under 1 s. Everything is generated from a seed; no network, no
files read except /proc for the machine description.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Measure this checkout's policy/, not whatever an installed copy points at.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policy import (  # noqa: E402
    Ceiling,
    Decision,
    Manifest,
    Policy,
    compile_policy,
    load_ceiling,
    load_manifest,
)
from policy.hostnames import is_under  # noqa: E402
from policy.manifests import Format  # noqa: E402
from policy.trie import Match, SuffixTrie  # noqa: E402

DEFAULT_SIZES = (10, 1_000, 100_000)
DEFAULT_SEED = 20_240_501
VARIANTS = ("agent.yaml", "agent.toml", "agent.yaml+ceiling")
GOAL_DECISION_RATIO = 2.0
GOAL_COMPILE_MS = 1_000.0
MIB = 1024 * 1024
# Repeated load and compile samples of one case stop once this much time is spent.
BUDGET_S = 15.0
# The entry slots of a trie node, as Match reports them.
SLOTS = ("exact", "subtree", "block_exact", "block_subtree", "urls", "block_urls")

# --------------------------------------------------------------------------------------------
# Deterministic rule sets
#
# One seeded stream of unique hostnames feeds every size, so the 10-rule set is a prefix of the
# 1 000-rule set, which is a prefix of the 100 000-rule set. The decision mix is built from the
# first 10 entries, so every size answers the very same targets with the same outcome.

# Weighted like a real allow-list: mostly .com, a long tail, and two-label public suffixes.
_TLDS: tuple[tuple[str, int], ...] = (
    ("com", 30),
    ("org", 8),
    ("net", 7),
    ("io", 7),
    ("dev", 4),
    ("ai", 3),
    ("app", 3),
    ("cloud", 2),
    ("de", 4),
    ("fr", 3),
    ("jp", 3),
    ("nl", 2),
    ("se", 1),
    ("ch", 1),
    ("eu", 1),
    ("us", 2),
    ("ca", 2),
    ("in", 2),
    ("info", 2),
    ("xyz", 2),
    ("tech", 1),
    ("co.uk", 4),
    ("com.au", 2),
    ("com.br", 2),
    ("co.jp", 1),
)
_TLD_NAMES = tuple(t for t, _ in _TLDS)
_TLD_WEIGHTS = tuple(w for _, w in _TLDS)
_SIMPLE_TLDS = tuple(t for t in _TLD_NAMES if "." not in t)
# Consonant-vowel syllables and a few tech words make pronounceable, brand-like labels.
_WORDS = (
    "bright",
    "cloud",
    "data",
    "flow",
    "forge",
    "grid",
    "hub",
    "lab",
    "link",
    "node",
    "pixel",
    "soft",
    "stack",
    "sync",
    "works",
)
_SYLLABLES = (*(c + v for c in "bcdfghklmnprstvz" for v in "aeiou"), *_WORDS)
_SERVICE_LABELS = (
    "api",
    "www",
    "cdn",
    "static",
    "auth",
    "login",
    "files",
    "download",
    "docs",
    "registry",
    "objects",
    "storage",
    "edge",
    "assets",
    "media",
    "git",
    "ci",
    "mirror",
    "pkg",
    "uploads",
    "data",
    "metrics",
    "status",
    "eu",
    "us",
    "us-east-1",
    "eu-west-1",
    "ap-south-1",
    "v1",
    "v2",
    "internal-api",
    "gateway",
    "search",
)
_URL_PATHS = ("v1", "v2", "repos", "simple", "api/v3", "packages", "download", "graphql")
# The first entries get fixed shapes so the 10-rule set has every depth and kind the mix needs.
_FIRST_DEPTHS = (2, 4, 3, 2, 4, 3, 2, 3, 4, 2)
_FIRST_TOML_KINDS = ("exact", "wildcard", "url", "exact", "wildcard", "exact", "url", "wildcard")
_FIRST_CEILING_CUTS = ("parent", "parent", "narrow", "none", "parent", "parent", "none", "narrow")


def _brand(rng: random.Random) -> str:
    word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 2, 3, 3, 4))))
    roll = rng.random()
    if roll < 0.1:
        word += str(rng.randint(1, 99))
    elif roll < 0.2:
        word += "-" + rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES)
    return word


def hostnames(seed: int, avoid: frozenset[str] = frozenset()) -> Iterator[str]:
    """An endless stream of unique, valid hostnames of 2-4 labels, none under a domain of
    `avoid`."""
    rng = random.Random(seed)
    seen: set[str] = set()
    domains: list[str] = []
    # The first entries' domains are theirs alone: no later entry may sit on, above or below
    # them, so the mix built from them gets the same answers at every size.
    reserved = set(avoid)
    i = 0
    while True:
        first = i < len(_FIRST_DEPTHS)
        depth = _FIRST_DEPTHS[i] if first else rng.choices((2, 3, 4), (45, 35, 20))[0]
        # Reusing a registrable domain gives the trie the shared suffixes real lists have
        # (api.x.com, cdn.x.com, x.com).
        if domains and not first and rng.random() < 0.3:
            domain = rng.choice(domains)
        else:
            tld = rng.choice(_SIMPLE_TLDS) if first else rng.choices(_TLD_NAMES, _TLD_WEIGHTS)[0]
            domain = f"{_brand(rng)}.{tld}"
            if domain in reserved:
                continue
            if first:
                reserved.add(domain)
            else:
                domains.append(domain)
        labels = domain.split(".")
        while len(labels) < depth:
            sub = rng.choice(_SERVICE_LABELS) if rng.random() < 0.7 else _brand(rng)
            labels.insert(0, sub)
        host = ".".join(labels)
        if host in seen:
            continue
        seen.add(host)
        i += 1
        yield host


def take(stream: Iterator[str], n: int) -> list[str]:
    return [next(stream) for _ in range(n)]


def registrable(host: str) -> str:
    labels = host.split(".")
    keep = 3 if ".".join(labels[-2:]) in _TLD_NAMES else 2
    return ".".join(labels[-keep:])


def yaml_manifest(hosts: Sequence[str]) -> str:
    lines = [
        f"# generated by benchmarks/policy_decide.py: {len(hosts)} entries",
        "name: bench-agent",
        "network:",
        "  egress_mode: allowlist",
        "  egress:",
    ]
    lines += [f"    - {h}" for h in hosts]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class TomlEntry:
    kind: str  # exact, wildcard, url
    host: str
    path: str = ""

    @property
    def pattern(self) -> str:
        if self.kind == "wildcard":
            return f"*.{self.host}"
        if self.kind == "url":
            return f"https://{self.host}/{self.path}/"
        return self.host


def toml_entries(hosts: Sequence[str], seed: int) -> list[TomlEntry]:
    rng = random.Random(seed + 1)
    out = []
    for i, host in enumerate(hosts):
        if i < len(_FIRST_TOML_KINDS):
            kind = _FIRST_TOML_KINDS[i]
        else:
            kind = rng.choices(("exact", "wildcard", "url"), (45, 40, 15))[0]
        path = rng.choice(_URL_PATHS) if kind == "url" else ""
        out.append(TomlEntry(kind, host, path))
    return out


def toml_blocks(entries: Sequence[TomlEntry]) -> list[str]:
    """Blocks carved out of allowed entries (admin hosts, private paths), as real manifests do.
    Few of them: manifests.py compares each allowed entry with each blocked one."""
    limit = min(20, max(2, len(entries) // 100))
    out = []
    for e in entries:
        if e.kind == "wildcard":
            out.append(f"admin.{e.host}")
        elif e.kind == "url":
            out.append(f"https://{e.host}/{e.path}/private/")
        if len(out) == limit:
            break
    return out


def toml_manifest(entries: Sequence[TomlEntry], blocks: Sequence[str]) -> str:
    lines = [
        f"# generated by benchmarks/policy_decide.py: {len(entries)} allowed entries",
        "schema_version = 1",
        'name = "bench-agent"',
        "",
        "[network_access]",
        "allowed = [",
    ]
    lines += [f'  "{e.pattern}",' for e in entries]
    lines += ["]", "blocked = ["]
    lines += [f'  "{b}",' for b in blocks]
    lines += ["]"]
    return "\n".join(lines) + "\n"


def ceiling_hosts(hosts: Sequence[str], seed: int) -> list[str]:
    """A ceiling about as large as the manifest: parents that admit entries whole, deeper names
    that cut an entry down (the intersection's subtrees_below path), entries left outside, and
    unrelated names the tenant admits but this manifest does not use."""
    rng = random.Random(seed + 2)
    out: list[str] = []
    seen: set[str] = set()
    for i, host in enumerate(hosts):
        if i < len(_FIRST_CEILING_CUTS):
            cut = _FIRST_CEILING_CUTS[i]
        else:
            cut = rng.choices(("parent", "narrow", "none"), (50, 25, 25))[0]
        name = {"parent": registrable(host), "narrow": f"api.{host}", "none": ""}[cut]
        if name and name not in seen:
            seen.add(name)
            out.append(name)
    padding = hostnames(seed + 3, frozenset(registrable(h) for h in hosts[:10]))
    while len(out) < len(hosts):
        name = next(padding)
        if name not in seen:
            seen.add(name)
            out.append(name)
    return out


def ceiling_text(hosts: Sequence[str]) -> str:
    lines = ["tenant: bench", "egress:"] + [f"  - {h}" for h in hosts]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# The decision mix


def _miss(candidate: str, covered: Callable[[str], bool]) -> str:
    """`candidate`, with a label changed (the leftmost that helps) until no rule of the largest
    set covers it, so a miss stays a miss at every size."""
    labels = candidate.split(".")
    for k in range(len(labels) - 1):
        for n in range(100):
            trial = [*labels[:k], f"{labels[k]}-{n}" if n else labels[k], *labels[k + 1 :]]
            if not covered(".".join(trial)):
                return ".".join(trial)
    raise SystemExit(f"no uncovered variant of {candidate!r}: change the seed")


def decision_mix(
    variant: str,
    first: Sequence[str],
    entries: Sequence[TomlEntry],
    covered: Callable[[str], bool],
) -> list[str]:
    """Targets as a client sends them: hits deep and shallow, subdomains of hits, and misses that
    stop at different depths of the trie. Built from the first 10 hosts (and their agent.toml
    entries), which every size shares."""
    shallow = next(h for h in first if h.count(".") == 1)
    deeps = [h for h in first if h.count(".") == 3]
    # A sibling miss walks deep only if the deep entry's parents are not rules themselves.
    deep = next((h for h in deeps if not covered(h.partition(".")[2])), deeps[0])
    brand, tld = shallow.split(".")
    misses = [
        _miss(f"unlisted{brand}.{tld}", covered),  # walk stops at the second label
        _miss(f"evil{shallow}", covered),  # suffix look-alike: not on a label boundary
        _miss("zz-sibling." + deep.partition(".")[2], covered),  # walk goes 3 labels deep
        _miss("docs.nowhere.example", covered),  # TLD no rule uses: stops at once
    ]
    if variant in ("agent.yaml", "agent.yaml+ceiling"):
        return [
            shallow,
            f"{shallow}:443",
            deep,
            f"www.{shallow}",
            f"objects.eu.{deep}:443",
            f"a.b.c.{shallow}",
            first[2],
            f"api.{first[2]}",  # with a ceiling: admitted only through a narrower ceiling entry
            f"https://{first[5]}/simple/requests/",
            *misses,
        ]
    exact = next(e.host for e in entries if e.kind == "exact")
    wildcard = next(e for e in entries if e.kind == "wildcard")
    url = next(e for e in entries if e.kind == "url")
    return [
        exact,  # exact hit
        f"{exact}:443",
        f"www.{exact}",  # an exact entry does not cover its subdomains
        wildcard.host,  # *.x covers x itself
        f"a.b.{wildcard.host}:443",
        f"admin.{wildcard.host}",  # blocked
        f"{url.host}:443",  # URL entry, CONNECT: allowed, paths decided per request
        f"https://{url.host}/{url.path}/items/1",  # under the prefix
        f"https://{url.host}/elsewhere",  # outside the prefix
        f"https://{url.host}/{url.path}/private/x",  # blocked prefix
        *misses,
    ]


# --------------------------------------------------------------------------------------------
# The linear-scan baseline


class LinearIndex:
    """What the trie replaces: every entry in a flat list, each compared with `is_under` (subtree
    slots) or `==` (exact and URL slots). It answers `match` with the same Match the trie gives,
    so swapping it into a Policy changes the lookup and nothing else."""

    def __init__(self, entries: Sequence[tuple[str, str, list[Any]]]) -> None:
        by_slot: dict[str, list[tuple[str, list[Any]]]] = {slot: [] for slot in SLOTS}
        for host, slot, items in entries:
            by_slot[slot].append((host, items))
        self._subtree = by_slot["subtree"]
        self._block_subtree = by_slot["block_subtree"]
        self._exact = by_slot["exact"]
        self._block_exact = by_slot["block_exact"]
        self._urls = by_slot["urls"]
        self._block_urls = by_slot["block_urls"]
        self.size = sum(len(items) for _, _, items in entries)

    @classmethod
    def from_trie(cls, trie: SuffixTrie[Any]) -> LinearIndex:
        return cls(list(trie.entries()))

    @staticmethod
    def _deepest(host: str, rows: list[tuple[str, list[Any]]]) -> list[Any] | None:
        best: list[Any] | None = None
        best_len = -1
        for suffix, items in rows:
            # "" is the root entry (public mode): it covers every name, which is_under does not.
            if (not suffix or is_under(host, suffix)) and len(suffix) > best_len:
                best, best_len = items, len(suffix)
        return best

    @staticmethod
    def _equal(host: str, rows: list[tuple[str, list[Any]]]) -> list[Any] | None:
        for name, items in rows:
            if name == host:
                return items
        return None

    def match(self, host: str) -> Match[Any]:
        subtree = self._deepest(host, self._subtree)
        block = self._equal(host, self._block_exact) or self._deepest(host, self._block_subtree)
        return Match(
            self._equal(host, self._exact),
            subtree,
            block,
            self._equal(host, self._urls),
            self._equal(host, self._block_urls),
        )


def linear_policy(policy: Policy) -> Policy:
    """A copy of `policy` whose every SuffixTrie is replaced by a LinearIndex."""
    clone = copy.copy(policy)
    names = list(getattr(policy, "__dict__", ())) or [
        name for cls in type(policy).__mro__ for name in getattr(cls, "__slots__", ())
    ]
    swapped = 0
    for name in names:
        value = getattr(policy, name, None)
        if isinstance(value, SuffixTrie):
            setattr(clone, name, LinearIndex.from_trie(value))
            swapped += 1
    if not swapped:
        raise SystemExit("Policy holds no SuffixTrie attribute: update linear_policy()")
    return clone


# --------------------------------------------------------------------------------------------
# Measurement


@dataclass(slots=True)
class Case:
    """One rule set of one variant, and everything measured on it."""

    variant: str
    size: int
    manifest_text: str
    ceiling_text: str | None
    mix: list[str]
    manifest_load_ms: list[float] = field(default_factory=list)
    ceiling_load_ms: list[float] = field(default_factory=list)
    compile_ms: list[float] = field(default_factory=list)
    compile_cpu_ms: list[float] = field(default_factory=list)
    compile_gc_ms: list[float] = field(default_factory=list)  # inside cyclic collections
    memory_method: str = ""
    peak_bytes: int | None = None
    retained_bytes: int = 0
    grants: int = 0
    trie: Policy | None = None
    linear: Policy | None = None
    trie_reps: int = 0
    linear_reps: int = 0
    linear_pass_ns: int = 0  # one pass over the mix, timed while verifying
    trie_wall_ns: list[float] = field(default_factory=list)  # per decision, one per round
    trie_cpu_ns: list[float] = field(default_factory=list)
    linear_wall_ns: list[float] = field(default_factory=list)
    linear_cpu_ns: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)  # per round, against the smallest size
    outcomes: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def format(self) -> Format:
        return "agent.toml" if self.variant == "agent.toml" else "agent.yaml"

    @property
    def load_ms(self) -> list[float]:
        if not self.ceiling_load_ms:
            return self.manifest_load_ms
        # The ceiling may have fewer samples than the manifest it shares (time budget).
        return [m + c for m, c in zip(self.manifest_load_ms, self.ceiling_load_ms, strict=False)]


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    linear_rounds: int
    sample_ms: float
    load_reps: int
    compile_reps: int
    tracemalloc: bool


FULL = Settings(
    rounds=15,
    linear_rounds=5,
    sample_ms=100,
    load_reps=3,
    compile_reps=5,
    tracemalloc=True,
)
# --quick: one load and one compile of each set (at 100 000 rules they are most of the run),
# memory as the RSS growth of that compile instead of a separate, slower tracemalloc run, and
# one linear-scan sample (a pass over the mix takes most of a second at 100 000 rules; the
# speed-up is in the thousands, so one sample says enough).
QUICK = Settings(
    rounds=5,
    linear_rounds=1,
    sample_ms=20,
    load_reps=1,
    compile_reps=1,
    tracemalloc=False,
)


class GcClock:
    """Wall time spent inside cyclic-GC collections while installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.ns = 0
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._start


@dataclass(frozen=True, slots=True)
class Timing:
    wall_ms: float
    cpu_ms: float  # tells the code's own cost from time lost to other processes
    gc_ms: float


def timed[T](fn: Callable[[], T]) -> tuple[Timing, T]:
    # Every sample starts from the same heap, so one sample does not pay for another's garbage.
    gc.collect()
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        cpu = time.process_time_ns()
        start = time.perf_counter_ns()
        result = fn()
        wall = time.perf_counter_ns() - start
        cpu = time.process_time_ns() - cpu
    finally:
        gc.callbacks.remove(clock)
    return Timing(wall / 1e6, cpu / 1e6, clock.ns / 1e6), result


def budgeted(reps: int, budget_s: float) -> Iterator[int]:
    """Up to `reps` iterations, fewer once `budget_s` is spent (one at least): at 100 000 rules
    with a ceiling a compile takes seconds, and the run must stay bounded."""
    start = time.perf_counter()
    for i in range(reps):
        if i and time.perf_counter() - start > budget_s:
            return
        yield i


def rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def measure_build(
    case: Case,
    settings: Settings,
    manifests: dict[str, tuple[Manifest, list[float]]],
    log: Callable[[str], None],
) -> None:
    """Load, compile and memory for one case; keeps the compiled Policy on the case.

    Policies kept from earlier cases are frozen out of the cyclic GC (see main), so each compile
    pays for collections over its own manifest and allocations only, as a proxy loading this
    one policy would. The agent.yaml+ceiling case reuses the agent.yaml manifest it shares,
    load time included, rather than parse 100 000 entries again.
    """
    shared = manifests.get(case.manifest_text)
    if shared is not None:
        manifest, case.manifest_load_ms = shared[0], list(shared[1])
    else:
        for _ in budgeted(settings.load_reps, BUDGET_S):
            timing, manifest = timed(
                lambda: load_manifest(case.manifest_text, source=case.format, format=case.format)
            )
            case.manifest_load_ms.append(timing.wall_ms)
        manifests[case.manifest_text] = (manifest, case.manifest_load_ms)
    if not manifest.ok:
        errors = [f for f in manifest.findings if f.is_error][:3]
        raise SystemExit(f"generated {case.variant} manifest is invalid: {errors}")
    ceiling: Ceiling | None = None
    if case.ceiling_text is not None:
        text = case.ceiling_text
        for _ in budgeted(len(case.manifest_load_ms), BUDGET_S):
            timing, ceiling = timed(lambda: load_ceiling(text, source="ceiling.yaml"))
            case.ceiling_load_ms.append(timing.wall_ms)

    policy: Policy | None = None
    for _ in budgeted(settings.compile_reps, BUDGET_S):
        policy = None  # the previous sample's Policy must not sit in this sample's heap
        rss_before = rss_bytes()
        timing, policy = timed(lambda: compile_policy(manifest, ceiling))
        case.compile_ms.append(timing.wall_ms)
        case.compile_cpu_ms.append(timing.cpu_ms)
        case.compile_gc_ms.append(timing.gc_ms)
        if not case.memory_method:
            case.memory_method = "rss_delta"
            case.retained_bytes = rss_bytes() - rss_before
    assert policy is not None
    if settings.tracemalloc:
        gc.collect()
        tracemalloc.start()
        try:
            traced = compile_policy(manifest, ceiling)
            case.retained_bytes, case.peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del traced
        case.memory_method = "tracemalloc"
    case.trie = policy
    case.grants = len(policy.grants)
    case.linear = linear_policy(policy)
    verify(case)
    log(
        f"  {case.variant:<19} {case.size:>7} rules: load {median(case.load_ms):8.1f} ms, "
        f"compile {median(case.compile_ms):8.1f} ms"
    )


def run_pass(decide: Callable[[str], Decision], mix: Sequence[str], reps: int) -> tuple[int, int]:
    """(wall ns, CPU ns) for `reps` passes over the mix, with the GC paused as timeit does."""
    gc.collect()
    gc.disable()
    try:
        wall0 = time.perf_counter_ns()
        cpu0 = time.process_time_ns()
        for _ in range(reps):
            for target in mix:
                decide(target)
        cpu = time.process_time_ns() - cpu0
        wall = time.perf_counter_ns() - wall0
    finally:
        gc.enable()
    return wall, cpu


def reps_for(wall_ns: int, reps: int, sample_ms: float) -> int:
    return max(1, round(reps * sample_ms * 1e6 / max(wall_ns, 1)))


def calibrate(decide: Callable[[str], Decision], mix: Sequence[str], sample_ms: float) -> int:
    """Passes per sample so one sample lasts about `sample_ms`."""
    reps = 1
    while True:
        wall, _ = run_pass(decide, mix, reps)
        if wall >= sample_ms * 1e6 / 4 or reps >= 1 << 20:
            return reps_for(wall, reps, sample_ms)
        reps *= 4


def verify(case: Case) -> None:
    """The baseline must give the very same Decisions as the trie, or the speed-up is not a
    comparison of two lookups. Times the linear pass on the way: at 100 000 rules one pass is
    a sample already, and calibrating would cost another."""
    assert case.trie is not None and case.linear is not None
    linear_ns = 0
    for target in case.mix:
        fast = case.trie.decide(target)
        start = time.perf_counter_ns()
        slow = case.linear.decide(target)
        linear_ns += time.perf_counter_ns() - start
        if fast != slow:
            raise SystemExit(
                f"{case.variant} {case.size} rules: trie and linear scan disagree on {target!r}:"
                f"\n  trie:   {fast}\n  linear: {slow}"
            )
        if fast.reason == "internal_error":
            raise SystemExit(f"{case.variant}: {target!r} hit an internal error: {fast}")
        case.outcomes.append((target, fast.allowed, fast.reason))
    case.linear_pass_ns = linear_ns


def measure_decisions(cases: list[Case], settings: Settings, log: Callable[[str], None]) -> None:
    variants = sorted({c.variant for c in cases}, key=[c.variant for c in cases].index)
    for variant in variants:
        group = [c for c in cases if c.variant == variant]
        assert group[0].trie is not None
        # Same number of passes at every size: equal work, so ns/decision compare directly.
        reps = calibrate(group[0].trie.decide, group[0].mix, settings.sample_ms)
        for case in group:
            assert case.linear is not None
            case.trie_reps = reps
            if case.linear_pass_ns * 4 < settings.sample_ms * 1e6:
                case.linear_reps = calibrate(case.linear.decide, case.mix, settings.sample_ms)
            else:
                case.linear_reps = reps_for(case.linear_pass_ns, 1, settings.sample_ms)
    # Linear samples ride in evenly spread rounds next to the trie's, so a noisy stretch of the
    # shared machine slows both alike instead of skewing the speed-up.
    linear_rounds = {
        r * settings.rounds // settings.linear_rounds for r in range(settings.linear_rounds)
    }
    log(
        f"{settings.rounds} interleaved rounds over {len(cases)} policies "
        f"(linear scan in {len(linear_rounds)} of them)"
    )
    for r in range(settings.rounds):
        # Alternate the order so no size always runs right after a given other one.
        for case in cases if r % 2 == 0 else reversed(cases):
            assert case.trie is not None and case.linear is not None
            n = len(case.mix)
            wall, cpu = run_pass(case.trie.decide, case.mix, case.trie_reps)
            case.trie_wall_ns.append(wall / (case.trie_reps * n))
            case.trie_cpu_ns.append(cpu / (case.trie_reps * n))
            if r in linear_rounds:
                wall, cpu = run_pass(case.linear.decide, case.mix, case.linear_reps)
                case.linear_wall_ns.append(wall / (case.linear_reps * n))
                case.linear_cpu_ns.append(cpu / (case.linear_reps * n))
        for variant in variants:
            group = [c for c in cases if c.variant == variant]
            for case in group:
                case.ratio.append(case.trie_wall_ns[-1] / group[0].trie_wall_ns[-1])


# --------------------------------------------------------------------------------------------
# Reporting


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "git": commit,
    }


def command() -> str:
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(Path.cwd()))
    except ValueError:
        shown = str(exe)
    return shlex.join([shown, *sys.argv])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(case: Case) -> dict[str, Any]:
    trie_ns = median(case.trie_wall_ns)
    linear_ns = median(case.linear_wall_ns)
    return {
        "variant": case.variant,
        "rules": case.size,
        "grants": case.grants,
        "load_validate_ms": {
            "median": median(case.load_ms),
            "samples": case.load_ms,
            "manifest_samples": case.manifest_load_ms,
            "ceiling_samples": case.ceiling_load_ms,
        },
        "compile_ms": {"median": median(case.compile_ms), "samples": case.compile_ms},
        "compile_cpu_ms": {"median": median(case.compile_cpu_ms), "samples": case.compile_cpu_ms},
        "compile_in_gc_ms": {"median": median(case.compile_gc_ms), "samples": case.compile_gc_ms},
        "compile_memory": {
            "method": case.memory_method,
            "peak_mib": None if case.peak_bytes is None else case.peak_bytes / MIB,
            "retained_mib": case.retained_bytes / MIB,
        },
        "trie": {
            "decisions_per_s": 1e9 / trie_ns,
            "wall_ns_per_decision": {"median": trie_ns, "rounds": case.trie_wall_ns},
            "cpu_ns_per_decision": {
                "median": median(case.trie_cpu_ns),
                "rounds": case.trie_cpu_ns,
            },
            "ratio_to_smallest": {"median": median(case.ratio), "rounds": case.ratio},
            "passes_per_sample": case.trie_reps,
            "decisions_per_pass": len(case.mix),
        },
        "linear": {
            "decisions_per_s": 1e9 / linear_ns,
            "wall_ns_per_decision": {"median": linear_ns, "rounds": case.linear_wall_ns},
            "cpu_ns_per_decision": {
                "median": median(case.linear_cpu_ns),
                "rounds": case.linear_cpu_ns,
            },
            "passes_per_sample": case.linear_reps,
        },
        "trie_speedup": linear_ns / trie_ns,
    }


def _memory_cell(mem: dict[str, Any]) -> str:
    if mem["peak_mib"] is None:
        # RSS moves in pages and reuses freed arenas: below a MiB it says nothing.
        return f"{mem['retained_mib']:,.1f}" if mem["retained_mib"] >= 1 else "< 1"
    return f"{mem['peak_mib']:,.2f} ({mem['retained_mib']:,.2f})"


def table(rows: list[dict[str, Any]], traced: bool) -> str:
    memory = "compile MiB peak (kept)" if traced else "compile MiB (RSS growth)"
    head = (
        f"| manifest | rules | load+validate ms | compile ms | {memory} "
        "| trie decisions/s | wall µs/dec | CPU µs/dec | vs smallest | linear decisions/s "
        "| trie speed-up |"
    )
    out = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        t, lin = r["trie"], r["linear"]
        out.append(
            f"| {r['variant']} | {r['rules']:,} "
            f"| {r['load_validate_ms']['median']:,.1f} "
            f"| {r['compile_ms']['median']:,.1f} "
            f"| {_memory_cell(r['compile_memory'])} "
            f"| {t['decisions_per_s']:,.0f} "
            f"| {t['wall_ns_per_decision']['median'] / 1e3:.2f} "
            f"| {t['cpu_ns_per_decision']['median'] / 1e3:.2f} "
            f"| {t['ratio_to_smallest']['median']:.2f}x "
            f"| {lin['decisions_per_s']:,.0f} "
            f"| {r['trie_speedup']:,.1f}x |"
        )
    return "\n".join(out)


def notes(settings: Settings, cases: Sequence[Case], smallest: int) -> str:
    mix = "/".join(sorted({str(len(c.mix)) for c in cases}, key=int))
    if settings.tracemalloc:
        memory = (
            "tracemalloc peak during one compile_policy() (a separate, untimed run), and in\n"
            "  brackets what is still allocated when it returns: the Policy's own size."
        )
    else:
        memory = (
            "growth of the process RSS over the timed compile_policy() (--quick skips\n"
            "  the slower tracemalloc run); close to the Policy's own size."
        )
    return f"""\
What each figure covers:
- load+validate: load_manifest() on the generated text (document parse + the entry grammar and
  its findings); for agent.yaml+ceiling plus load_ceiling() on the ceiling. Median of
  {settings.load_reps} (fewer past {BUDGET_S:g} s). Not part of the compile goal.
- compile: compile_policy() alone on the loaded manifest (deploy-time checks, ceiling
  intersection, building the tries), cyclic GC on as in production. Median of
  {settings.compile_reps} (fewer past {BUDGET_S:g} s). The goal of < 1 000 ms is for this
  figure; the goal lines below add its CPU time and the part spent in GC collections.
- compile MiB: {memory}
- trie decisions/s: Policy.decide() over a fixed mix of {mix} targets (host, host:port, URLs;
  hits deep and shallow, subdomains of hits, misses), median of {settings.rounds} rounds of
  perf_counter_ns samples (~{settings.sample_ms:g} ms each) interleaved across all policies; GC
  paused while sampling. CPU µs/dec: time.process_time_ns over the same samples.
- vs smallest: wall time per decision over that of the {smallest}-rule policy of the same
  manifest in the same round, median over rounds (goal: <= {GOAL_DECISION_RATIO:.2f}x).
- linear decisions/s: the same Policy.decide() with every SuffixTrie swapped for a flat list
  scanned with is_under()/== ({settings.linear_rounds} of the same rounds); it gives identical
  Decisions on the mix (checked). trie speed-up = linear time / trie time."""


def goals(rows: list[dict[str, Any]], largest: int, smallest: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["rules"] != largest:
            continue
        ratio = r["trie"]["ratio_to_smallest"]["median"]
        compile_ms = r["compile_ms"]["median"]
        out.append(
            {
                "variant": r["variant"],
                "rules": largest,
                "smallest": smallest,
                "decision_ratio": ratio,
                "decision_goal_met": ratio <= GOAL_DECISION_RATIO,
                "compile_ms": compile_ms,
                "compile_cpu_ms": r["compile_cpu_ms"]["median"],
                "compile_goal_met": compile_ms < GOAL_COMPILE_MS,
                "compile_in_gc_ms": r["compile_in_gc_ms"]["median"],
            }
        )
    return out


def goal_line(g: dict[str, Any]) -> str:
    return (
        f"- {g['variant']}: a decision at {g['rules']:,} rules takes {g['decision_ratio']:.2f}x "
        f"that at {g['smallest']} (goal <= {GOAL_DECISION_RATIO:g}x): "
        f"{'met' if g['decision_goal_met'] else 'MISSED'}; compile {g['compile_ms']:,.0f} ms "
        f"(goal < {GOAL_COMPILE_MS:,.0f} ms): {'met' if g['compile_goal_met'] else 'MISSED'} "
        f"[{g['compile_cpu_ms']:,.0f} ms CPU; {g['compile_in_gc_ms']:,.0f} ms of the wall time "
        "inside cyclic-GC collections]"
    )


# --------------------------------------------------------------------------------------------


def build_cases(sizes: Sequence[int], seed: int, variants: Sequence[str]) -> list[Case]:
    largest = max(sizes)
    hosts = take(hostnames(seed), largest)
    suffixes = set(hosts)

    def covered(name: str) -> bool:
        # Subtree semantics, the widest any variant gives a host; a ceiling only narrows.
        labels = name.split(".")
        return any(".".join(labels[i:]) in suffixes for i in range(len(labels)))

    entries = toml_entries(hosts, seed)
    cases = []
    for variant in variants:
        mix = decision_mix(variant, hosts[:10], entries[:10], covered)
        for size in sizes:
            ceiling = None
            if variant == "agent.toml":
                part = entries[:size]
                text = toml_manifest(part, toml_blocks(part))
            else:
                text = yaml_manifest(hosts[:size])
                if variant == "agent.yaml+ceiling":
                    ceiling = ceiling_text(ceiling_hosts(hosts[:size], seed))
            cases.append(Case(variant, size, text, ceiling, mix))
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions: one load and one compile per rule set, 5 decision rounds",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="comma-separated rule counts, each >= 10 (default: %(default)s)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated manifests to run (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < 10 or sizes[-1] > 1_000_000:
        parser.error("--sizes: each size must be between 10 and 1 000 000")
    settings = QUICK if args.quick else FULL
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    info = machine()
    log(f"generating rule sets (seed {args.seed}, sizes {', '.join(map(str, sizes))})")
    cases = build_cases(sizes, args.seed, variants)
    log("load, compile, memory, and a check of the linear scan against the trie")
    manifests: dict[str, tuple[Manifest, list[float]]] = {}
    for case in cases:
        measure_build(case, settings, manifests, log)
        gc.collect()
        # The kept policies stay alive to the end: out of every later collection, so neither a
        # later compile nor the decision rounds pay for walking them.
        gc.freeze()
    manifests.clear()
    for variant in variants:
        group = [c for c in cases if c.variant == variant]
        # A target that is a miss at one size and a hit at another would compare unlike work.
        if any(c.outcomes != group[0].outcomes for c in group):
            differ = [
                f"{c.size}: {o}" for c in group for o in c.outcomes if o not in group[0].outcomes
            ]
            raise SystemExit(f"{variant}: the mix gets other answers at other sizes: {differ}")
    measure_decisions(cases, settings, log)

    rows = [summary(c) for c in cases]
    met = goals(rows, sizes[-1], sizes[0])
    elapsed = time.perf_counter() - started
    print(f"# policy_decide ({'quick' if args.quick else 'full'})\n")
    print(f"Command: `{command()}`  ")
    print(
        f"Machine: {info['nproc']} CPUs usable ({info['cpu_count']} online), {info['cpu_model']}; "
        f"{info['python']}; {info['platform']}  "
    )
    print(
        f"Load average at start: {' '.join(info['loadavg_at_start'])}; git {info['git']}; "
        f"seed {args.seed}; run took {elapsed:.1f} s\n"
    )
    print(table(rows, settings.tracemalloc))
    print()
    print(notes(settings, cases, sizes[0]))
    print("\nGoals:")
    for g in met:
        print(goal_line(g))
    print("\nDecision mix (same targets and answers at every size):")
    for variant in variants:
        first = next(c for c in cases if c.variant == variant)
        shown = ", ".join(f"{t} {'✓' if ok else '✗ ' + why}" for t, ok, why in first.outcomes)
        print(f"- {variant}: {shown}")

    if args.json:
        payload = {
            "benchmark": "policy_decide",
            "schema": 1,
            "command": command(),
            "quick": args.quick,
            "seed": args.seed,
            "sizes": sizes,
            "settings": dataclasses.asdict(settings),
            "machine": info,
            "elapsed_s": elapsed,
            "goals": met,
            "results": rows,
            "mix": {
                v: [
                    {"target": t, "allowed": ok, "reason": why}
                    for t, ok, why in next(c for c in cases if c.variant == v).outcomes
                ]
                for v in variants
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
