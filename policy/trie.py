"""A suffix trie over DNS labels (reversed), so lookup costs one step per label of the host,
whatever the number of rules."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


class _Node[T]:
    __slots__ = (
        "block_exact",
        "block_subtree",
        "block_urls",
        "children",
        "exact",
        "subtree",
        "urls",
    )

    def __init__(self) -> None:
        self.children: dict[str, _Node[T]] | None = None
        self.exact: list[T] | None = None
        self.subtree: list[T] | None = None
        self.block_exact: list[T] | None = None
        self.block_subtree: list[T] | None = None
        self.urls: list[T] | None = None
        self.block_urls: list[T] | None = None


@dataclass(frozen=True, slots=True)
class Match[T]:
    """What the trie holds for one host. `subtree` and `block` are the deepest entries on the
    path to the host (the most specific rule names the decision)."""

    exact: list[T] | None
    subtree: list[T] | None
    block: list[T] | None
    urls: list[T] | None
    block_urls: list[T] | None


class SuffixTrie[T]:
    """Entries are attached to a host in one of SLOTS; the empty host "" is the root, and a
    `subtree` entry there covers every name."""

    def __init__(self) -> None:
        self._root: _Node[T] = _Node()
        self.size = 0

    def _node(self, host: str) -> _Node[T]:
        node = self._root
        if not host:
            return node
        for label in reversed(host.split(".")):
            if node.children is None:
                node.children = {}
            child = node.children.get(label)
            if child is None:
                child = node.children[label] = _Node()
            node = child
        return node

    def add(self, host: str, slot: str, entry: T) -> None:
        node = self._node(host)
        entries = getattr(node, slot)
        if entries is None:
            setattr(node, slot, [entry])
        else:
            entries.append(entry)
        self.size += 1

    def match(self, host: str) -> Match[T]:
        node: _Node[T] | None = self._root
        assert node is not None
        subtree = node.subtree
        block = node.block_subtree
        for label in reversed(host.split(".")):
            children = node.children
            node = children.get(label) if children is not None else None
            if node is None:
                return Match(None, subtree, block, None, None)
            if node.subtree is not None:
                subtree = node.subtree
            if node.block_subtree is not None:
                block = node.block_subtree
        return Match(node.exact, subtree, node.block_exact or block, node.urls, node.block_urls)

    def covering(self, host: str) -> list[T] | None:
        """The deepest `subtree` entries at `host` or above it."""
        return self.match(host).subtree

    def subtrees_below(self, host: str) -> Iterator[tuple[str, list[T]]]:
        """(host, entries) for every `subtree` slot strictly below `host`."""
        node: _Node[T] | None = self._root
        labels = list(reversed(host.split("."))) if host else []
        for label in labels:
            node = node.children.get(label) if node and node.children else None
            if node is None:
                return
        stack: list[tuple[_Node[T], list[str]]] = [(node, labels)] if node else []
        while stack:
            current, path = stack.pop()
            for label, child in (current.children or {}).items():
                child_path = [*path, label]
                if child.subtree is not None:
                    yield ".".join(reversed(child_path)), child.subtree
                stack.append((child, child_path))
