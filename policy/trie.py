"""A suffix trie over DNS labels: lookup costs one probe per label of the host, whatever the
number of rules.

A node is a name's suffix (`github.com` is the child of `com` by the label `github`). Nodes are
addressed by that suffix in one dict instead of through a child map per node: the walk is the
same (one probe per label), and building 100 000 rules creates one small object per rule host
instead of one object and one dict per label, which is what made compiling large policies slow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class _Node[T]:
    __slots__ = ("block_exact", "block_subtree", "block_urls", "exact", "subtree", "urls")

    def __init__(self) -> None:
        self.exact: list[T] | None = None
        self.subtree: list[T] | None = None
        self.block_exact: list[T] | None = None
        self.block_subtree: list[T] | None = None
        self.urls: list[T] | None = None
        self.block_urls: list[T] | None = None


class Match[T]:
    """What the trie holds for one host. `subtree` and `block` are the deepest entries on the
    path to the host (the most specific rule names the decision)."""

    __slots__ = ("block", "block_urls", "exact", "subtree", "urls")

    def __init__(
        self,
        exact: list[T] | None,
        subtree: list[T] | None,
        block: list[T] | None,
        urls: list[T] | None,
        block_urls: list[T] | None,
    ) -> None:
        self.exact = exact
        self.subtree = subtree
        self.block = block
        self.urls = urls
        self.block_urls = block_urls


def suffixes(host: str, *, proper: bool = False) -> Iterator[str]:
    """`host` (unless `proper`), then each parent domain, then "" (the root): deepest first."""
    start = 0
    if proper:
        start = host.find(".") + 1
        if not start:
            if host:
                yield ""
            return
    while True:
        yield host[start:]
        dot = host.find(".", start)
        if dot < 0:
            break
        start = dot + 1
    if host:
        yield ""


class SuffixTrie[T]:
    """Entries are attached to a host in a slot (exact, subtree, block_exact, block_subtree,
    urls, block_urls); the empty host "" is the root, and a `subtree` entry there covers every
    name."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node[T]] = {}
        self.size = 0

    def add(self, host: str, slot: str, entry: T) -> None:
        node = self._nodes.get(host)
        if node is None:
            node = self._nodes[host] = _Node()
        entries = getattr(node, slot)
        if entries is None:
            setattr(node, slot, [entry])
        else:
            entries.append(entry)
        self.size += 1

    def match(self, host: str) -> Match[T]:
        nodes = self._nodes
        node = nodes.get(host)
        subtree = block = None
        if node is not None:
            subtree = node.subtree
            block = node.block_exact or node.block_subtree
        # The parents of `host`, nearest first: the first subtree and block found are deepest.
        start = 0
        while True:
            dot = host.find(".", start)
            parent = host[dot + 1 :] if dot >= 0 else ""
            above = nodes.get(parent)
            if above is not None:
                if subtree is None:
                    subtree = above.subtree
                if block is None:
                    block = above.block_subtree
            if dot < 0 or not host:
                break
            start = dot + 1
        if node is None:
            return Match(None, subtree, block, None, None)
        return Match(node.exact, subtree, block, node.urls, node.block_urls)

    def entries(self) -> Iterator[tuple[str, str, list[T]]]:
        """(host, slot, entries) for everything held: for reports and reference matchers."""
        for host, node in self._nodes.items():
            for slot in _Node.__slots__:
                held = getattr(node, slot)
                if held is not None:
                    yield host, slot, held


class SubtreeIndex[T]:
    """Names that each cover themselves and every name below (a tenant ceiling), looked up by
    the deepest entry covering a host: one probe per label, like the trie."""

    def __init__(self, entries: Iterable[tuple[str, T]]) -> None:
        self._by_name: dict[str, T] = {}
        for name, entry in entries:
            self._by_name.setdefault(name, entry)

    def items(self) -> Iterable[tuple[str, T]]:
        return self._by_name.items()

    def covering(self, host: str) -> T | None:
        by_name = self._by_name
        start = 0
        while True:
            found = by_name.get(host[start:])
            if found is not None:
                return found
            dot = host.find(".", start)
            if dot < 0:
                break
            start = dot + 1
        return by_name.get("") if host else None
