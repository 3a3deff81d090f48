"""What benchmarks/policy_decide.py measures of each rule set: load and compile time (wall, CPU,
inside cyclic-GC collections), compile memory, and Policy.decide() per decision against the
same Policy with every SuffixTrie swapped for a linear scan (LinearIndex)."""

from __future__ import annotations

import copy
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy import Ceiling, Decision, Manifest, Policy, compile_policy, load_ceiling, load_manifest
from policy.hostnames import is_under
from policy.manifests import Format
from policy.trie import Match, SuffixTrie

# Repeated load and compile samples of one case stop once this much time is spent.
BUDGET_S = 15.0
# The entry slots of a trie node, as Match reports them.
SLOTS = ("exact", "subtree", "block_exact", "block_subtree", "urls", "block_urls")


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


def measure_builds(cases: list[Case], settings: Settings, log: Callable[[str], None]) -> None:
    """measure_build() of every case in turn, then a check that each variant's mix gets the
    same answers at every size."""
    manifests: dict[str, tuple[Manifest, list[float]]] = {}
    for case in cases:
        measure_build(case, settings, manifests, log)
        gc.collect()
        # The kept policies stay alive to the end: out of every later collection, so neither a
        # later compile nor the decision rounds pay for walking them.
        gc.freeze()
    manifests.clear()
    for variant in variants_of(cases):
        group = [c for c in cases if c.variant == variant]
        # A target that is a miss at one size and a hit at another would compare unlike work.
        if any(c.outcomes != group[0].outcomes for c in group):
            differ = [
                f"{c.size}: {o}" for c in group for o in c.outcomes if o not in group[0].outcomes
            ]
            raise SystemExit(f"{variant}: the mix gets other answers at other sizes: {differ}")


def variants_of(cases: Sequence[Case]) -> list[str]:
    """The cases' variants, in the order they come."""
    return sorted({c.variant for c in cases}, key=[c.variant for c in cases].index)


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
    variants = variants_of(cases)
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


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
