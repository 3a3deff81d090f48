"""The rule sets of benchmarks/policy_decide.py, generated from a seed: hostnames, the manifests
(agent.yaml, agent.toml with blocked entries, a tenant ceiling) and the decision mix. Imports
nothing of policy/: the benchmark harness builds its scale workload's manifests from the same
stream (benchmarks/harness/rounds.py) without loading the code it measures from outside.

One seeded stream of unique hostnames feeds every size, so the 10-rule set is a prefix of the
1 000-rule set, which is a prefix of the 100 000-rule set. The decision mix is built from the
first 10 entries, so every size answers the very same targets with the same outcome.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

DEFAULT_SIZES = (10, 1_000, 100_000)
DEFAULT_SEED = 20_240_501
VARIANTS = ("agent.yaml", "agent.toml", "agent.yaml+ceiling")

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


@dataclass(frozen=True, slots=True)
class RuleSet:
    """One rule set of one variant: the texts to load and the targets to decide."""

    variant: str
    size: int
    manifest_text: str
    ceiling_text: str | None
    mix: list[str]


def rule_sets(sizes: Sequence[int], seed: int, variants: Sequence[str]) -> list[RuleSet]:
    largest = max(sizes)
    hosts = take(hostnames(seed), largest)
    suffixes = set(hosts)

    def covered(name: str) -> bool:
        # Subtree semantics, the widest any variant gives a host; a ceiling only narrows.
        labels = name.split(".")
        return any(".".join(labels[i:]) in suffixes for i in range(len(labels)))

    entries = toml_entries(hosts, seed)
    sets = []
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
            sets.append(RuleSet(variant, size, text, ceiling, mix))
    return sets
