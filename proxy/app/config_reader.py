"""How the operator config is read, value by value. A `Section` is one mapping of the config
(`limits`, `dns`, an entry of `platform_destinations`) with one reader for each kind of value
a section holds: a bounded whole number, a port, a duration, a flag, a string, a list, a CIDR
list. A reader records a problem at its path instead of raising, so that a config reports every
problem at once, and a section of the config is one small function (proxy/app/config.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from policy import AddressRules, PolicyError
from policy.addresses import IPNetwork
from policy.documents import decode_text, syntax_for
from policy.findings import Finding, describe_type, key_text, quote, unknown_key_message
from policy.numbers import check_prefix_length, whole_number
from proxy.common.errors import ProxyError

# Far beyond any sane timeout, and small enough that no event loop or socket call overflows.
MAX_DURATION = 7 * 24 * 3600.0
_DURATION = re.compile(r"(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")
_DURATION_HINT = "write it like '2s', '10m' or '1h30m'"
# More digits than this in one unit is beyond MAX_DURATION whatever the unit: refused unconverted.
_MAX_DURATION_DIGITS = 9
# Nodes looked at to place the problems of a refused config: far more than any config has, and
# a bound on the walk whatever the document (aliases are followed once).
_MAX_LOCATED_NODES = 100_000
_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_duration(text: Any) -> float:
    """Compact Go-style durations as the manifests write them: `45s`, `10m`, `1h30m`; more
    than zero and at most a week. Anything else raises ValueError saying how to write one."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        like = f"'{text}s'" if type(text) is int and 0 < text <= MAX_DURATION else "'2s', '1m30s'"
        raise ValueError(
            f"{quote(text)} is a number, not a duration; write whole hours, minutes and "
            f"seconds with their units, like {like}"
        )
    if not isinstance(text, str) or not text or not (match := _DURATION.fullmatch(text)):
        raise ValueError(f"{quote(text)} is not a duration; {_DURATION_HINT}")
    if any(len(g.lstrip("0")) > _MAX_DURATION_DIGITS for g in match.groups() if g):
        raise ValueError(f"{quote(text)} is longer than the limit of 168h (a week)")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{quote(text)} must be longer than zero")
    if total > MAX_DURATION:
        raise ValueError(f"{quote(text)} is longer than the limit of 168h (a week)")
    return float(total)


def port_number(value: Any) -> int:
    return whole_number(value, 1, 65535, "a port number")


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{quote(value)} is not true or false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{quote(value)} is not a non-empty string")
    return value


def _cidr(value: Any) -> IPNetwork:
    if isinstance(value, str):
        check_prefix_length(value)
    (network,) = AddressRules.from_strings(allow=[value]).allow
    return network


@dataclass
class ConfigReader:
    """The problems found in one config file, collected. `text`: the file's contents, to place
    each problem at its line and column when the config is refused."""

    source: str
    problems: list[Finding] = field(default_factory=list)
    text: bytes | str | None = None

    def problem(self, path: str, value: Any, reason: str, message: str) -> None:
        self.problems.append(Finding(path, value, reason, message, "error", self.source))

    def convert[T](self, path: str, value: Any, parse: Callable[[Any], T], default: T) -> T:
        """`parse(value)`, or `default` and a problem at `path` saying why it failed."""
        try:
            return parse(value)
        except (ValueError, PolicyError) as exc:
            # PolicyError's str() would repeat a path; the finding names its own.
            why = exc.message if isinstance(exc, PolicyError) else str(exc)
            self.problem(path, value, "invalid_value", why)
            return default

    def items(self, value: Any, path: str) -> list[tuple[str, Any]]:
        """(path, item) of each item of a list; a problem if `value` is no list (None: [])."""
        if value is None:
            return []
        if not isinstance(value, list):
            self.problem(path, value, "not_a_list", f"must be a list, found {describe_type(value)}")
            return []
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]

    def section(
        self, value: Any, path: str, known: tuple[str, ...], *, where: str | None = None
    ) -> Section:
        """The mapping `value` at `path` (None: empty), its keys checked against `known`."""
        if value is None:
            value = {}
        elif not isinstance(value, dict):
            self.problem(
                path, value, "not_a_mapping", f"must be a mapping, found {describe_type(value)}"
            )
            value = {}
        section = Section(self, path, value)
        for key in value:
            if key not in known:
                self.problem(
                    section.path(key),
                    key,
                    "unknown_key",
                    unknown_key_message(key, where or path, known),
                )
        return section

    def finish(self) -> None:
        """Raises ProxyError('invalid_config') listing every problem, if there is one."""
        if not self.problems:
            return
        problems = self._located(self.problems)
        listed = "; ".join(f"{f.path}: {f.message}" for f in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        first = problems[0]
        raise ProxyError(
            "invalid_config",
            f"invalid config: {listed}{more}",
            source=self.source,
            line=first.line,
            column=first.column,
            details=tuple(problems),
        )

    def _located(self, problems: list[Finding]) -> list[Finding]:
        """`problems`, each with the line and column of its path in `text` where it is found
        there (YAML, and JSON, which YAML reads; a TOML config keeps its paths only): an
        operator fixes a file by line, and a path alone may be hard to find in a long one."""
        if self.text is None or syntax_for(self.source) == "toml":
            return problems
        try:
            root = yaml.compose(decode_text(self.text, self.source), Loader=_Loader)
        except (yaml.YAMLError, PolicyError, ValueError, RecursionError):
            return problems  # the text parsed once already; a surprise here costs the places
        marks = _marks(root, {f.path for f in problems})
        return [
            dataclasses.replace(f, line=mark[0], column=mark[1])
            if (mark := marks.get(f.path)) is not None
            else f
            for f in problems
        ]


def _marks(root: yaml.Node | None, wanted: set[str]) -> dict[str, tuple[int, int]]:
    """(line, column), 1-based, of each path of `wanted` in the composed document: a mapping
    entry at its key (the path names the key), a list item at the item. Paths are spelled as
    `Section.path` spells them (key_text, `[index]`)."""
    found: dict[str, tuple[int, int]] = {}
    stack: list[tuple[yaml.Node, str]] = [] if root is None else [(root, "")]
    seen: set[int] = set()
    while stack and len(found) < len(wanted) and len(seen) < _MAX_LOCATED_NODES:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        children: list[tuple[yaml.Node, yaml.Node, str]] = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    name = key_text(key.value)
                    children.append((key, value, f"{path}.{name}" if path else name))
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        for at, value, child in children:
            if child in wanted and child not in found:
                found[child] = (at.start_mark.line + 1, at.start_mark.column + 1)
            stack.append((value, child))
    return found


@dataclass
class Section:
    """One mapping of the config and the readers of its values. A key that is absent (or
    null, where so said) gives the reader's default."""

    reader: ConfigReader
    where: str  # the path of the mapping itself; "" for the top level
    mapping: dict[str, Any]

    def path(self, key: Any) -> str:
        return f"{self.where}.{key_text(key)}" if self.where else key_text(key)

    def get(self, key: str) -> Any:
        return self.mapping.get(key)

    def sub(self, key: str, known: tuple[str, ...]) -> Section:
        return self.reader.section(self.mapping.get(key), self.path(key), known)

    def read[T](self, key: str, parse: Callable[[Any], T], default: T) -> T:
        if key not in self.mapping:
            return default
        return self.reader.convert(self.path(key), self.mapping[key], parse, default)

    def duration(self, key: str, default: float) -> float:
        return self.read(key, parse_duration, default)

    def flag(self, key: str, default: bool) -> bool:
        return self.read(key, _flag, default)

    def text(self, key: str, default: str) -> str:
        return self.read(key, _text, default)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        """One of `choices` (a setting with a few named values: `inspection.mode`, ...)."""

        def parse(value: Any) -> str:
            if value not in choices:
                named = ", ".join(repr(choice) for choice in choices)
                raise ValueError(f"{quote(value)} is not one of {named}")
            return str(value)

        return self.read(key, parse, default)

    def optional_text(self, key: str) -> str | None:
        """A non-empty string, or None when the key is absent or null."""
        if self.mapping.get(key) is None:
            return None
        return self.read(key, _text, None)

    def number(self, key: str, low: int, high: int, what: str, default: int) -> int:
        """A whole number from `low` to `high` in plain decimal (policy.numbers.whole_number)."""
        return self.read(key, lambda value: whole_number(value, low, high, what), default)

    def items(self, key: str) -> list[tuple[str, Any]]:
        return self.reader.items(self.mapping.get(key), self.path(key))

    def ports(self, key: str) -> frozenset[int] | None:
        """A list of port numbers; None when the key is absent, null or not a list (that one
        is a problem)."""
        value = self.mapping.get(key)
        if not isinstance(value, list):
            if value is not None:
                self.items(key)  # the problem: not a list
            return None
        entries = self.items(key)
        return frozenset(self.reader.convert(p, v, port_number, 0) for p, v in entries)

    def cidrs(self, key: str) -> tuple[IPNetwork, ...]:
        """A list of CIDRs, each bad one reported at its own index."""
        networks: list[IPNetwork] = []
        for path, item in self.items(key):
            try:
                networks.append(_cidr(item))
            except PolicyError as exc:
                self.reader.problem(path, item, exc.reason, exc.message)
        return tuple(networks)
