"""YAML to a Python value, strictly and safely: no duplicate keys, no tags that construct
anything, one document, bounded nesting and alias expansion, and every number within the bounds
of policy/numbers.py, each refusal at its line and column. policy/documents.py is the door."""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from policy.errors import PolicyError
from policy.findings import quote
from policy.numbers import MAX_INT_TEXT, SpelledInt, abridged, check_float, check_int, out_of_range

_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str, source: str, *, max_depth: int, max_nodes: int) -> Any:
    """The one YAML document in `text`, refusing more than `max_depth` levels of nesting and
    more than `max_nodes` values once aliases expand. Raises PolicyError only."""
    try:
        _check_yaml_shape(text, source, max_depth, max_nodes)
        return yaml.load(text, Loader=_StrictLoader)
    except PolicyError as exc:
        exc.source = source
        raise
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    except (ValueError, TypeError, OverflowError) as exc:
        # The safe constructor raises these for values such as an unhashable key.
        raise PolicyError(
            "yaml_value", f"YAML value error: {str(exc)[:200]}", source=source
        ) from None


# PyYAML ships no types: its loader is Any to mypy.
class _StrictLoader(_Loader):  # type: ignore[misc]
    """Safe YAML loading that refuses duplicate mapping keys.

    With duplicates PyYAML keeps the last value silently; another parser may keep the first, so
    the platform and this proxy could enforce different lists.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                duplicate = False  # unhashable keys are refused by the constructor below
            if duplicate:
                mark = key_node.start_mark
                raise PolicyError(
                    "duplicate_key",
                    f"duplicate key {quote(key)}: a key may appear once in a mapping",
                    line=mark.line + 1,
                    column=mark.column + 1,
                )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


_StrictLoader.add_constructor(
    "tag:yaml.org,2002:map",
    lambda loader, node: loader.construct_mapping(node),
)


def _construct_untagged(loader: yaml.BaseLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    raise _at(PolicyError("yaml_value", f"unexpected YAML node {type(node).__name__}"), node)


def _at(error: PolicyError, node: yaml.Node) -> PolicyError:
    """`error` placed at `node`'s line and column."""
    mark = node.start_mark
    if mark is not None:
        error.line, error.column = mark.line + 1, mark.column + 1
    return error


_PLAIN_DECIMAL = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")


def _construct_int(loader: SafeConstructor, node: yaml.ScalarNode) -> int:
    """A YAML integer within bounds; one spelled other than in plain decimal is a SpelledInt."""
    text = loader.construct_scalar(node)
    try:
        if len(text) > MAX_INT_TEXT:
            raise out_of_range(abridged(text))
        value = check_int(loader.construct_yaml_int(node), text)
    except PolicyError as exc:
        raise _at(exc, node) from None
    except ValueError:  # an explicit `!!int` on text that is no integer
        raise _at(PolicyError("yaml_value", f"{quote(text)} is not an integer"), node) from None
    return value if _PLAIN_DECIMAL.fullmatch(text) else SpelledInt(value, text)


def _construct_float(loader: SafeConstructor, node: yaml.ScalarNode) -> float:
    """A finite YAML float: `.inf`, `.nan` and `1.0e999` (which reads as infinity) are refused."""
    text = loader.construct_scalar(node)
    try:
        return check_float(loader.construct_yaml_float(node), text)
    except PolicyError as exc:
        raise _at(exc, node) from None
    except ValueError:  # an explicit `!!float` on text that is no number
        raise _at(PolicyError("yaml_value", f"{quote(text)} is not a number"), node) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


# Application tags ('!Ref', '!!python/object') are read as the plain value under them: they mean
# nothing to us, they must not fail a manifest whose network part is fine, and they never run.
_StrictLoader.add_constructor(None, _construct_untagged)
# Dates are read as the text written: no manifest field we read is a date, and an impossible date
# under a key that is not ours ('released: 2024-02-30') must not fail the whole document.
_StrictLoader.add_constructor(
    "tag:yaml.org,2002:timestamp",
    lambda loader, node: loader.construct_scalar(node),
)


def _yaml_error(exc: yaml.YAMLError, source: str) -> PolicyError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    detail = f"{context}: {problem}" if context else str(problem)
    return PolicyError(
        "yaml_syntax",
        f"YAML syntax error: {detail}",
        source=source,
        line=mark.line + 1 if mark else None,
        column=mark.column + 1 if mark else None,
    )


def _check_yaml_shape(text: str, source: str, max_depth: int, max_nodes: int) -> None:
    """Walk the event stream (flat, cheap) to refuse deep nesting, more than one document, and
    documents whose aliases expand to more than max_nodes nodes ("billion laughs")."""
    depth = 0
    documents = 0
    counts: list[int] = [0]  # expanded node count of each open collection
    anchors: list[str | None] = []
    sizes: dict[str, int] = {}

    def refuse(reason: str, message: str, event: yaml.Event) -> PolicyError:
        mark = event.start_mark
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        return PolicyError(reason, message, source=source, line=line, column=column)

    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > max_depth:
                raise refuse("too_deep", f"nested more than {max_depth} levels deep", event)
            counts.append(0)
            anchors.append(event.anchor)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            size = counts.pop() + 1
            anchor = anchors.pop()
            if anchor is not None:
                sizes[anchor] = size
            counts[-1] += size
        elif isinstance(event, yaml.ScalarEvent):
            counts[-1] += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            counts[-1] += sizes.get(event.anchor, 1) if event.anchor is not None else 1
        elif isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise refuse(
                    "multiple_documents",
                    "more than one YAML document ('---'): a manifest is one document",
                    event,
                )
        if counts[0] > max_nodes or (len(counts) > 1 and counts[-1] > max_nodes):
            if sizes:
                raise refuse(
                    "alias_bomb",
                    f"aliases (*name) expand this document to more than "
                    f"{max_nodes} values: refused as an alias bomb",
                    event,
                )
            raise refuse("too_many_values", f"more than {max_nodes} values in one document", event)
