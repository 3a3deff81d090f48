"""Hostnames at run time: the lenient normaliser, the name classes, IP literals, and the small
helpers the deploy-time grammar (policy/entries.py) shares.

`normalize_host` folds a client's requested host to one canonical spelling (one trailing dot,
case, IDNA UTS-46) so that every spelling of a name meets the same decision, and refuses every
spelling of an IP address before anything could resolve it.

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
from ipaddress import IPv4Address, IPv6Address

import idna

from policy.addresses import parse_address
from policy.errors import PolicyError
from policy.reasons import Reason
from policy.text import brief, clipped

__all__ = [
    "DEFAULT_INTERNAL_SUFFIXES",
    "is_under",
    "name_refusal",
    "normalize_host",
    "parse_ip_literal",
]


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
# What the WHATWG URL host parser reads as a number (its "ends in a number" test): a name whose
# last label matches is parsed as IPv4, so for us it is an address, never a name.
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")


# --------------------------------------------------------------------------------------------
# Small shared helpers


def _shown(value: object) -> str:
    return clipped(repr(value), _SHOWN_MAX - 1)


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
        raise PolicyError(Reason.INVALID_HOST, f"invalid host {_shown(raw)}: not a string")
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
                raw, f"is not a valid internationalised name ({brief(exc)})"
            ) from None
    if name.endswith("."):
        name = name[:-1]
    if len(name) <= _MAX_NAME and _RUNTIME_HOST_RE.fullmatch(name):
        if _is_numeric_label(name[name.rfind(".") + 1 :]):
            raise _ip_literal(raw)
        if name.startswith("xn--") or ".xn--" in name:
            for label in name.split("."):
                if label.startswith("xn--") and not _alabel_ok(label):
                    raise _invalid_host(raw, f"label {_shown(label)} is not a valid IDNA A-label")
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
            raise _invalid_host(
                raw, f"label {_shown(label)} is not valid IDNA ({brief(exc)})"
            ) from None
    if _is_numeric_label(labels[-1]):
        raise _ip_literal(raw)
    for label in labels:
        if len(label) > _MAX_LABEL:
            raise _invalid_host(raw, f"has a label longer than {_MAX_LABEL} characters")
        if label.startswith("xn--") and not _alabel_ok(label):
            raise _invalid_host(raw, f"label {_shown(label)} is not a valid IDNA A-label")
    result = ".".join(labels)
    if len(result) > _MAX_NAME:
        raise _invalid_host(raw, f"is longer than {_MAX_NAME} characters")
    return result


def _invalid_host(raw: object, what: str) -> PolicyError:
    return PolicyError(Reason.INVALID_HOST, f"invalid host {_shown(raw)}: {what}")


def _ip_literal(raw: object) -> PolicyError:
    return PolicyError(
        Reason.IP_LITERAL,
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
            Reason.LOOPBACK_NAME,
            f"{host!r} is a loopback name: it always means the sandbox itself",
        )
    suffixes = _suffix_set(tuple(internal_suffixes)) if internal_suffixes else _DEFAULT_SET
    start = 0
    while True:
        candidate = host[start:]
        if candidate in suffixes:
            return (
                Reason.INTERNAL_NAME,
                f"{host!r} is under {candidate!r}, a name for the sandbox, the cluster or "
                "special use, never a public destination",
            )
        dot = host.find(".", start)
        if dot < 0:
            break
        start = dot + 1
    if "." not in host:
        return (
            Reason.SINGLE_LABEL,
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
