"""Hostnames: the strict entry grammar, the lenient runtime normaliser, and name classes.

Two audiences with opposite needs share this module:

* Deploy time (`check_entry`): a manifest entry is taken exactly as written. Nothing is
  rewritten, so the value an author reads in review is the value enforced; a refusal names one
  stable reason code and the exact text to write instead.
* Run time (`normalize_host`): a client's requested host is folded to one canonical spelling
  (one trailing dot, case, IDNA UTS-46) so that every spelling of a name meets the same decision,
  and every spelling of an IP address is refused before anything could resolve it.

Underscores: entries refuse them (canonical entries are LDH labels only), while the runtime
accepts them inside labels. Real services still publish such names, an underscore cannot change
which labels a name has (so it cannot smuggle a name past a label-boundary match), and no entry can
contain one, so such a host is only ever admitted by lying under a declared parent. For the same
reason the runtime does not police hyphen placement in ASCII labels ('foo-.example.com' exists in
the wild); U-labels get the full IDNA2008 rules from `idna`.

All IDNA work goes through the `idna` package (IDNA2008 + UTS-46, non-transitional). Python's
built-in codec implements IDNA 2003, which folds 'faß.de' into the different name 'fass.de'.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

import idna

from policy.addresses import parse_address
from policy.errors import PolicyError

__all__ = [
    "DEFAULT_INTERNAL_SUFFIXES",
    "EntryProblem",
    "check_entry",
    "is_under",
    "name_refusal",
    "normalize_host",
    "parse_ip_literal",
    "suggest_entry",
]


@dataclass(frozen=True, slots=True)
class EntryProblem:
    """Why one hostname entry is refused: a stable `reason` code and a `message` naming the fix."""

    reason: str
    message: str


DEFAULT_INTERNAL_SUFFIXES: tuple[str, ...] = (
    # RFC 6762: multicast DNS owns 'local'; Kubernetes puts its cluster domain under it
    # (svc.cluster.local), so these names always mean the sandbox's own network.
    "local",
    # RFC 8375: the residential-network zone. RFC 7686: Tor onion services never resolve through
    # public DNS. RFC 9476: 'alt' is the sanctioned space for non-DNS name systems. RFC 6761:
    # 'invalid' is guaranteed never to resolve. ('test' and 'example' from the same RFC stay
    # allowed on purpose: our own tests run a DNS server of their own for names under them.)
    "home.arpa",
    "onion",
    "alt",
    "invalid",
    # ICANN reserved 'internal' for private use (2024) and has deferred delegation of 'corp' and
    # 'home' indefinitely over name-collision risk; 'lan', 'intranet' and 'private' are among the
    # private TLDs RFC 6762 appendix G records as in use, and 'localdomain' is the /etc/hosts
    # habit (localhost.localdomain). Each names something inside someone's own network.
    "internal",
    "corp",
    "home",
    "lan",
    "intranet",
    "private",
    "localdomain",
    # The reverse-mapping trees name addresses, not hosts: connecting to one is an address
    # literal in disguise.
    "in-addr.arpa",
    "ip6.arpa",
)

_MAX_NAME = 253
_MAX_LABEL = 63
# Beyond this no spelling can become a legal name; stop before doing per-character work on
# hostile megabyte inputs (idna refuses more than 1024 characters in any case).
_MAX_INPUT = 1024
_SHOWN_MAX = 100

# Runtime fast path: lowercase ASCII labels of letters, digits, '-' and '_' (see module doc).
_RUNTIME_HOST_RE = re.compile(r"[a-z0-9_-]{1,63}(?:\.[a-z0-9_-]{1,63})*")
_RUNTIME_BAD_CHAR_RE = re.compile(r"[^a-z0-9_.-]")
_ENTRY_BAD_CHAR_RE = re.compile(r"[^a-z0-9-]")
_LDH_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_CANONICAL_ENTRY_RE = re.compile(rf"(?:{_LDH_LABEL}\.)+{_LDH_LABEL}")
# What the WHATWG URL host parser reads as a number (its "ends in a number" test): a name whose
# last label matches is parsed as IPv4, so for us it is an address, never a name.
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_PATH_START_RE = re.compile(r"[/?#\\]")
_UNICODE_DOTS = ("\u3002", "\uff0e", "\uff61")


# --------------------------------------------------------------------------------------------
# Small shared helpers


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 1] + "…"


def _brief(exc: BaseException) -> str:
    # idna echoes the whole input in its messages; keep ours one bounded line.
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:119] + "…"


def _describe_char(ch: str) -> str:
    if ch.isspace():
        return "contains whitespace"
    if unicodedata.category(ch).startswith("C"):
        return f"contains the control or unassigned character U+{ord(ch):04X}"
    if ch == "*":
        return "contains '*': a wildcard is a pattern, not a hostname"
    if ch == "_":
        return "contains '_': underscores are not allowed in hostnames"
    if ch in "/?#\\":
        return f"contains {ch!r}: give the host alone, without a path"
    if ch == ":":
        return "contains ':': give the host alone, without a port"
    if ch == "@":
        return "contains '@': give the host alone, without credentials"
    if ch in "[]":
        return f"contains {ch!r}: brackets belong only around IPv6 addresses"
    return f"contains {ch!r}, which is not allowed in a hostname"


def _is_numeric_label(label: str) -> bool:
    return _NUMERIC_LABEL_RE.fullmatch(label) is not None


@functools.lru_cache(maxsize=4096)
def _alabel_ok(label: str) -> bool:
    """True when an 'xn--' label is the one canonical A-label of a valid U-label.

    Decoding alone is not enough: a non-canonical Punycode spelling decodes to the same U-label
    as a different wire name, and 'xn--abc-' decodes to plain 'abc'. Cached because the same few
    IDN hosts recur on every connection.
    """
    try:
        ulabel = idna.ulabel(label)
        return not ulabel.isascii() and idna.alabel(ulabel).decode("ascii") == label
    except ValueError:  # IDNAError is a UnicodeError, hence a ValueError
        return False


def _is_ipv6_spelling(text: str) -> bool:
    """Any IPv6 literal a client might send: bracketed or not, with or without a zone id."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    address = text.partition("%")[0]
    if ":" not in address or not address.isascii():
        return False
    try:
        IPv6Address(address)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Run time


def normalize_host(raw: str) -> str:
    """The one canonical spelling of a host a client asked for (lowercase A-labels, no dot).

    Strips one trailing dot, lowercases, applies IDNA UTS-46 (non-transitional) and validates
    lengths. Refuses every IP-literal spelling with reason `ip_literal` and anything else that is
    not a usable name with reason `invalid_host`. Idempotent on every value it accepts.
    """
    if not isinstance(raw, str):
        raise PolicyError("invalid_host", f"invalid host {_shown(raw)}: not a string")
    if raw.isascii():
        name = raw.lower()
    else:
        if len(raw) > _MAX_INPUT:
            raise _invalid_host(raw, f"is longer than {_MAX_NAME} characters")
        try:
            # std3_rules=False: the ASCII that mapping yields is judged below by the same label
            # rule as ASCII input, so both spellings of a name get the same verdict.
            name = idna.uts46_remap(raw, std3_rules=False, transitional=False)
        except ValueError as exc:
            raise _invalid_host(
                raw, f"is not a valid internationalised name ({_brief(exc)})"
            ) from None
    if name.endswith("."):
        name = name[:-1]
    if len(name) <= _MAX_NAME and _RUNTIME_HOST_RE.fullmatch(name):
        if _is_numeric_label(name[name.rfind(".") + 1 :]):
            raise _ip_literal(raw)
        if name.startswith("xn--") or ".xn--" in name:
            for label in name.split("."):
                if label.startswith("xn--") and not _alabel_ok(label):
                    raise _invalid_host(raw, f"label {label!r} is not a valid IDNA A-label")
        return name
    return _normalize_slow(raw, name)


def _normalize_slow(raw: str, name: str) -> str:
    """Everything the fast path does not settle: IPv6 spellings, U-labels, and diagnoses."""
    if not name:
        raise _invalid_host(raw, "is empty")
    if len(name) > _MAX_INPUT:
        raise _invalid_host(raw, f"is longer than {_MAX_NAME} characters")
    if ":" in name or "[" in name or "]" in name:
        # An address with a port glued on is still an address: say so rather than "bad ':'".
        host_part, _, port = name.rpartition(":")
        if _is_ipv6_spelling(name) or (
            port.isdigit()
            and (
                _is_ipv6_spelling(host_part)
                or (host_part and _is_numeric_label(host_part.rpartition(".")[2]))
            )
        ):
            raise _ip_literal(raw)
    labels: list[str] = []
    for label in name.split("."):
        if not label:
            raise _invalid_host(raw, "has an empty label")
        if label.isascii():
            bad = _RUNTIME_BAD_CHAR_RE.search(label)
            if bad:
                raise _invalid_host(raw, _describe_char(bad.group()))
            labels.append(label)
            continue
        try:
            labels.append(idna.alabel(label).decode("ascii"))
        except ValueError as exc:
            raise _invalid_host(raw, f"label {label!r} is not valid IDNA ({_brief(exc)})") from None
    if _is_numeric_label(labels[-1]):
        raise _ip_literal(raw)
    for label in labels:
        if len(label) > _MAX_LABEL:
            raise _invalid_host(raw, f"has a label longer than {_MAX_LABEL} characters")
        if label.startswith("xn--") and not _alabel_ok(label):
            raise _invalid_host(raw, f"label {label!r} is not a valid IDNA A-label")
    result = ".".join(labels)
    if len(result) > _MAX_NAME:
        raise _invalid_host(raw, f"is longer than {_MAX_NAME} characters")
    return result


def _invalid_host(raw: object, what: str) -> PolicyError:
    return PolicyError("invalid_host", f"invalid host {_shown(raw)}: {what}")


def _ip_literal(raw: object) -> PolicyError:
    return PolicyError(
        "ip_literal",
        f"host {_shown(raw)} is an IP address literal in some spelling (URL parsers read a "
        "name ending in a numeric label as one); ask for the hostname instead",
    )


@functools.lru_cache(maxsize=64)
def _suffix_set(extra: tuple[str, ...]) -> frozenset[str]:
    # Cached: the same operator tuple arrives on every connection.
    cleaned = (s.strip().lower().removeprefix("*.").strip(".") for s in extra)
    return frozenset(DEFAULT_INTERNAL_SUFFIXES).union(s for s in cleaned if s)


_DEFAULT_SET = _suffix_set(())


def name_refusal(host: str, internal_suffixes: Iterable[str] = ()) -> tuple[str, str] | None:
    """Why a normalised host can never be an external destination, or None.

    Returns ('loopback_name', msg), ('internal_name', msg) or ('single_label', msg). Meant to
    run before any DNS, so such a name is never even looked up.
    """
    if host == "localhost" or host.endswith(".localhost"):
        return (
            "loopback_name",
            f"{host!r} is a loopback name: it always means the sandbox itself",
        )
    suffixes = _suffix_set(tuple(internal_suffixes)) if internal_suffixes else _DEFAULT_SET
    start = 0
    while True:
        candidate = host[start:]
        if candidate in suffixes:
            return (
                "internal_name",
                f"{host!r} is under {candidate!r}, a name for the sandbox, the cluster or "
                "special use, never a public destination",
            )
        dot = host.find(".", start)
        if dot < 0:
            break
        start = dot + 1
    if "." not in host:
        return (
            "single_label",
            f"{host!r} is a single label: a hostname needs at least two labels "
            "(a bare label resolves against local search domains)",
        )
    return None


def is_under(host: str, suffix: str) -> bool:
    """`host` equals `suffix` or lies below it, on a label boundary."""
    if not suffix or not host.endswith(suffix):
        return False
    return len(host) == len(suffix) or host[-len(suffix) - 1] == "."


def parse_ip_literal(text: str) -> IPv4Address | IPv6Address | None:
    """A canonical IP literal as written in a policy pattern, or None.

    Strict on purpose: IPv4 only as four dotted decimal parts without leading zeros, IPv6 with
    or without brackets and without a zone id. The lenient spellings ('127.1', '0x7f.1') are
    refused elsewhere; a pattern must not depend on how some parser reads them.
    """
    if not isinstance(text, str) or "%" in text:
        return None
    return parse_address(text)


# --------------------------------------------------------------------------------------------
# Deploy time: the entry grammar

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

    if text.startswith("[") or text.count(":") > 1:
        inner = text
        if text.startswith("["):
            close = text.find("]")
            inner = text[: close + 1] if close > 0 else text
        if _is_ipv6_spelling(inner):
            return _Reading(problem=_ip_address_problem(inner))
        return _Reading(
            problem=EntryProblem(
                "invalid_hostname",
                f"{_shown(text)} is not a hostname: brackets and ':' belong only to IPv6 "
                "addresses, which cannot be entries; write the hostname",
            )
        )
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

    if len(text) > _MAX_INPUT:
        return _Reading(problem=_too_long(f"the name is {len(text)} characters long"))
    if not text.isascii():
        try:
            text = idna.uts46_remap(text, std3_rules=False, transitional=False)
        except ValueError as exc:
            return _Reading(
                problem=EntryProblem(
                    "invalid_hostname",
                    f"{_shown(text)} is not a valid internationalised name ({_brief(exc)})",
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
                    f"label {_shown(label)} is not valid IDNA ({_brief(exc)}); write the "
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
