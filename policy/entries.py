"""Hostname entries at deploy time: the strict grammar of a manifest or ceiling entry.

An entry is taken exactly as written. Nothing is rewritten, so the value an author reads in
review is the value enforced; a refusal names one stable reason code and the exact text to
write instead (`check_entry`, `suggest_entry`). The run-time side (a client's requested host)
is policy/names.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import idna

from policy.names import (
    _MAX_INPUT,
    _MAX_LABEL,
    _MAX_NAME,
    _alabel_ok,
    _describe_char,
    _is_ipv6_spelling,
    _is_numeric_label,
    _shown,
    name_refusal,
)
from policy.text import brief

__all__ = ["EntryProblem", "check_entry", "suggest_entry"]


@dataclass(frozen=True, slots=True)
class EntryProblem:
    """Why one hostname entry is refused: a stable `reason` code and a `message` naming the fix."""

    reason: str
    message: str


_ENTRY_BAD_CHAR_RE = re.compile(r"[^a-z0-9-]")
_LDH_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_CANONICAL_ENTRY_RE = re.compile(rf"(?:{_LDH_LABEL}\.)+{_LDH_LABEL}")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_PATH_START_RE = re.compile(r"[/?#\\]")
_UNICODE_DOTS = ("\u3002", "\uff0e", "\uff61")

# A structural decoration the author added around an otherwise valid host. When the host itself
# is fine, the first of these (in this order) is the reported reason, with the host as the fix.
_FIX_ORDER = ("scheme", "wildcard", "port", "path", "userinfo", "leading_dot", "whitespace")
_FIX_REASON = {"userinfo": "invalid_hostname", "leading_dot": "invalid_hostname"}
_FIX_TEXT = {
    "scheme": "an entry is a bare hostname and matches the host alone, so a scheme would be "
    "ignored",
    "wildcard": "wildcards are not allowed (an entry already covers all its subdomains)",
    "port": "an entry is a bare hostname and matches the host alone, so a port would be ignored",
    "path": "an entry is a bare hostname and matches the host alone, so a path would be ignored",
    "userinfo": "credentials are not part of a hostname",
    "leading_dot": "a leading dot is not needed (an entry already covers all its subdomains)",
    "whitespace": "the entry has surrounding whitespace",
}


@dataclass(slots=True)
class _Reading:
    """What `_read_entry` made of a raw entry: a canonical host candidate and the decorations
    stripped to reach it, or the problem that stopped it."""

    host: str = ""
    fixes: tuple[str, ...] = ()
    problem: EntryProblem | None = None


def _read_entry(value: object) -> _Reading:
    if not isinstance(value, str):
        return _Reading(
            problem=EntryProblem(
                "invalid_hostname", f"expected a hostname string, got {type(value).__name__}"
            )
        )
    if not value:
        return _Reading(problem=EntryProblem("empty", "the entry is empty: write a hostname"))
    text = value.strip()
    if not text:
        return _Reading(
            problem=EntryProblem("empty", "the entry is only whitespace: write a hostname")
        )
    fixes: set[str] = set()
    if text != value:
        fixes.add("whitespace")
    text = _strip_url_parts(text, fixes)
    problem = _bracket_problem(text)
    if problem is not None:
        return _Reading(problem=problem)
    if ":" in text:
        fixes.add("port")
        text = text.partition(":")[0]
    if "*" in text:
        if not text.startswith("*.") or "*" in text[2:]:
            return _Reading(
                problem=EntryProblem(
                    "wildcard",
                    "wildcards are not allowed anywhere in an entry: an entry already covers "
                    "all its subdomains, so write the common parent domain",
                )
            )
        fixes.add("wildcard")
        text = text[2:]
    return _canonical_reading(text, fixes)


def _strip_url_parts(text: str, fixes: set[str]) -> str:
    """The entry without a scheme (or a bare '//'), a path and credentials, each noted in
    `fixes`."""
    scheme = _SCHEME_RE.match(text)
    if scheme:
        fixes.add("scheme")
        text = text[scheme.end() :]
    elif text.startswith("//"):
        fixes.add("scheme")
        text = text[2:]
    path = _PATH_START_RE.search(text)
    if path:
        fixes.add("path")
        text = text[: path.start()]
    if "@" in text:
        fixes.add("userinfo")
        text = text.rpartition("@")[2]
    return text


def _bracket_problem(text: str) -> EntryProblem | None:
    """Brackets or several ':' mean an IPv6 address, or nothing a hostname can be."""
    if not text.startswith("[") and text.count(":") <= 1:
        return None
    inner = text
    if text.startswith("["):
        close = text.find("]")
        inner = text[: close + 1] if close > 0 else text
    if _is_ipv6_spelling(inner):
        return _ip_address_problem(inner)
    return EntryProblem(
        "invalid_hostname",
        f"{_shown(text)} is not a hostname: brackets and ':' belong only to IPv6 "
        "addresses, which cannot be entries; write the hostname",
    )


def _canonical_reading(text: str, fixes: set[str]) -> _Reading:
    """The case-folded A-label spelling of what is left of the entry."""
    if len(text) > _MAX_INPUT:
        return _Reading(problem=_too_long(f"the name is {len(text)} characters long"))
    if not text.isascii():
        try:
            text = idna.uts46_remap(text, std3_rules=False, transitional=False)
        except ValueError as exc:
            return _Reading(
                problem=EntryProblem(
                    "invalid_hostname",
                    f"{_shown(text)} is not a valid internationalised name ({brief(exc)})",
                )
            )
    if text.startswith(".") and not text.startswith(".."):
        fixes.add("leading_dot")
        text = text[1:]
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    if not text:
        return _Reading(problem=EntryProblem("invalid_hostname", "the entry has no hostname in it"))
    labels = text.split(".")
    if all(_is_numeric_label(label) for label in labels):
        return _Reading(problem=_ip_address_problem(text))
    canonical: list[str] = []
    for label in labels:
        if label.isascii():
            canonical.append(label.lower())
            continue
        try:
            canonical.append(idna.alabel(label).decode("ascii"))
        except ValueError as exc:
            return _Reading(
                problem=EntryProblem(
                    "invalid_hostname",
                    f"label {_shown(label)} is not valid IDNA ({brief(exc)}); write the "
                    "hostname in its A-label form",
                )
            )
    ordered = tuple(fix for fix in _FIX_ORDER if fix in fixes)
    return _Reading(host=".".join(canonical), fixes=ordered)


def _ip_address_problem(text: str) -> EntryProblem:
    return EntryProblem(
        "ip_address",
        f"{_shown(text)} is an IP address: an address carries no DNS identity, and an entry "
        "matches the hostname a client asks for; write the hostname instead",
    )


def _too_long(what: str) -> EntryProblem:
    return EntryProblem(
        "too_long",
        f"{what}; a hostname may have at most {_MAX_NAME} characters and each label at most "
        f"{_MAX_LABEL}: write the real, shorter hostname",
    )


def _host_problem(
    host: str, internal_suffixes: Iterable[str], allow_internal: bool
) -> EntryProblem | None:
    """What is wrong with a case-folded, A-label host candidate itself, if anything."""
    labels = host.split(".")
    if "" in labels:
        return EntryProblem(
            "invalid_hostname", f"{_shown(host)} has an empty label: remove the stray dot"
        )
    for label in labels:
        bad = _ENTRY_BAD_CHAR_RE.search(label)
        if bad:
            return EntryProblem(
                "wildcard" if bad.group() == "*" else "invalid_hostname",
                f"{_shown(host)} {_describe_char(bad.group())}; a hostname has only letters, "
                "digits, '-' and '.'",
            )
    for label in labels:
        if len(label) > _MAX_LABEL:
            return _too_long(f"the label {label[:20]!r}… is {len(label)} characters long")
    if len(host) > _MAX_NAME:
        return _too_long(f"the name is {len(host)} characters long")
    for label in labels:
        if label.startswith("xn--") and not _alabel_ok(label):
            return EntryProblem(
                "invalid_hostname",
                f"the label {label!r} is not a valid IDNA A-label: compute it from the Unicode "
                "name with an IDNA2008 tool",
            )
        if label.startswith("-") or label.endswith("-"):
            return EntryProblem(
                "invalid_hostname",
                f"the label {label!r} starts or ends with '-'; a label must begin and end with "
                "a letter or digit",
            )
    if not allow_internal:
        refusal = name_refusal(host, internal_suffixes)
        if refusal is not None:
            reason, message = refusal
            if reason == "single_label":
                return EntryProblem(reason, f"{message}; write the full name with its domain")
            return EntryProblem(
                reason,
                f"{message}; platform destinations are provided by the operator and are not "
                "declared",
            )
    if _is_numeric_label(labels[-1]):
        return EntryProblem(
            "numeric_tld",
            f"the last label of {host!r} is a number, so URL parsers would read the name as an "
            "IPv4 address; write a hostname that ends in a real top-level domain",
        )
    return None


def _not_canonical_problem(value: str, host: str) -> EntryProblem:
    differences = []
    if any(ch.isupper() for ch in value):
        differences.append("uppercase letters")
    if value.endswith((".", *_UNICODE_DOTS)):
        differences.append("a trailing dot")
    if not value.isascii():
        differences.append("Unicode labels instead of their A-label form")
    detail = ", ".join(differences) or "a non-canonical spelling"
    return EntryProblem("not_canonical", f"not canonical ({detail}): write {host!r}")


def check_entry(
    value: str, *, internal_suffixes: Iterable[str] = (), allow_internal: bool = False
) -> EntryProblem | None:
    """Validate one hostname entry exactly as written; None when it is valid.

    `internal_suffixes` (operator-configured) add to DEFAULT_INTERNAL_SUFFIXES.
    `allow_internal` lifts the loopback, internal-name and single-label refusals (platform
    destinations, blocked patterns) and keeps every syntax rule.
    """
    # Nearly every entry is already canonical: do not take it apart to find nothing to fix.
    # (Numeric last labels go the long way: IP spellings are told apart there.)
    if (
        isinstance(value, str)
        and len(value) <= _MAX_NAME
        and "xn--" not in value
        and _CANONICAL_ENTRY_RE.fullmatch(value)
        and not _is_numeric_label(value.rpartition(".")[2])
    ):
        return _host_problem(value, internal_suffixes, allow_internal)
    return _check_entry_in_full(value, internal_suffixes, allow_internal)


def _check_entry_in_full(
    value: str, internal_suffixes: Iterable[str], allow_internal: bool
) -> EntryProblem | None:
    reading = _read_entry(value)
    if reading.problem is not None:
        return reading.problem
    problem = _host_problem(reading.host, internal_suffixes, allow_internal)
    if problem is not None:
        return problem
    if reading.fixes:
        fix = reading.fixes[0]
        return EntryProblem(_FIX_REASON.get(fix, fix), f"{_FIX_TEXT[fix]}: write {reading.host!r}")
    if value != reading.host:
        return _not_canonical_problem(value, reading.host)
    return None


def suggest_entry(value: str) -> str | None:
    """The canonical entry a refused value most likely meant, when that is itself valid.

    Strips whitespace, a scheme, credentials, a port, a path, a leading '*.' and one trailing
    dot, lowercases, and converts U-labels to A-labels. A valid entry is its own suggestion.
    """
    reading = _read_entry(value)
    if reading.problem is not None or _host_problem(reading.host, (), False) is not None:
        return None
    return reading.host
