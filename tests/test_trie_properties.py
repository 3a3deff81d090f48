"""The compiled trie agrees with a slow reference matcher written straight from the rules:
a linear scan over every rule, with the ceiling applied as a second, separate test."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from policy import compile_policy, load_ceiling, load_manifest
from policy.hostnames import is_under
from policy.trie import SubtreeIndex, SuffixTrie, suffixes

LABELS = st.sampled_from(["a", "b", "c", "xn--bcher-kva"])
TLDS = st.sampled_from(["com", "org"])


@st.composite
def hostnames(draw: st.DrawFn, min_labels: int = 1) -> str:
    labels = draw(st.lists(LABELS, min_size=min_labels, max_size=4))
    return ".".join([*labels, draw(TLDS)])


patterns = st.one_of(hostnames(), hostnames().map(lambda h: "*." + h))


def reference(
    host: str, allowed: list[str], blocked: list[str], ceiling: list[str] | None, mode: str
) -> bool:
    def matches(pattern: str) -> bool:
        if pattern.startswith("*."):
            return is_under(host, pattern[2:])
        return host == pattern

    if any(matches(p) for p in blocked):
        return False
    declared = mode != "allowlist" or any(matches(p) for p in allowed)
    in_ceiling = ceiling is None or any(is_under(host, c) for c in ceiling)
    return declared and in_ceiling


def rule_matches(policy_rule: str, host: str, allowed: list[str]) -> bool:
    if not policy_rule.startswith("network_access.allowed["):
        return True
    pattern = allowed[int(policy_rule.split("[")[1].rstrip("]"))]
    return is_under(host, pattern[2:]) if pattern.startswith("*.") else host == pattern


@settings(max_examples=400, deadline=None)
@given(
    allowed=st.lists(patterns, max_size=8),
    blocked=st.lists(patterns, max_size=3),
    ceiling=st.one_of(st.none(), st.lists(hostnames(), max_size=4)),
    hosts=st.lists(hostnames(), min_size=1, max_size=12),
)
def test_toml_policy_agrees_with_reference(
    allowed: list[str], blocked: list[str], ceiling: list[str] | None, hosts: list[str]
) -> None:
    text = json.dumps({"network_access": {"allowed": allowed, "blocked": blocked}})
    manifest = load_manifest(text, source="agent.json")
    c = load_ceiling(json.dumps({"egress": ceiling})) if ceiling is not None else None
    policy = compile_policy(manifest, c)
    for host in hosts:
        decision = policy.decide(host)
        expected = reference(host, allowed, blocked, ceiling, manifest.mode)
        assert decision.allowed is expected, (host, decision)
        if decision.allowed:
            # The named rule really admits the host (soundness of attribution).
            assert rule_matches(decision.rule or "", host, allowed), (host, decision.rule)
            if ceiling is not None and manifest.mode == "allowlist":
                index = int((decision.ceiling or "[x]").split("[")[1].rstrip("]"))
                assert is_under(host, ceiling[index])


@settings(max_examples=300, deadline=None)
@given(
    egress=st.lists(hostnames(min_labels=1), max_size=8),
    ceiling=st.one_of(st.none(), st.lists(hostnames(), max_size=4)),
    public=st.booleans(),
    hosts=st.lists(hostnames(), min_size=1, max_size=12),
)
def test_yaml_policy_agrees_with_reference(
    egress: list[str], ceiling: list[str] | None, public: bool, hosts: list[str]
) -> None:
    network = {"egress_mode": "public"} if public else {"egress": egress}
    manifest = load_manifest(json.dumps({"network": network}), source="agent.json")
    c = load_ceiling(json.dumps({"egress": ceiling})) if ceiling is not None else None
    policy = compile_policy(manifest, c)
    subtrees = ["*." + e for e in egress]
    for host in hosts:
        expected = reference(host, subtrees, [], ceiling, manifest.mode)
        assert policy.decide(host).allowed is expected, host


@given(st.lists(hostnames(), max_size=20), hostnames())
def test_subtree_index_finds_the_deepest_cover(entries: list[str], probe: str) -> None:
    index: SubtreeIndex[str] = SubtreeIndex((e, e) for e in entries)
    cover = index.covering(probe)
    covering = [e for e in entries if is_under(probe, e)]
    if cover is None:
        assert covering == []
    else:
        assert cover in covering
        assert all(len(cover) >= len(e) for e in covering)


def test_large_trie_lookups() -> None:
    big: SuffixTrie[int] = SuffixTrie()
    for i in range(20_000):
        big.add(f"h{i}.example{i % 50}.com", "subtree", i)
    assert big.size == 20_000
    assert big.match("h7.example7.com").subtree == [7]
    assert big.match("x.y.h7.example7.com").subtree == [7]
    assert big.match("h7.example8.com").subtree is None
    assert big.match("example7.com").subtree is None


def test_suffixes_walk_from_the_name_to_the_root() -> None:
    assert list(suffixes("a.b.com")) == ["a.b.com", "b.com", "com", ""]
    assert list(suffixes("a.b.com", proper=True)) == ["b.com", "com", ""]
    assert list(suffixes("com", proper=True)) == [""]
    assert list(suffixes("")) == [""]
    assert list(suffixes("", proper=True)) == []
