"""URL paths as origin servers read them, and the one decision of a path against prefixes.

The proxy forwards a request path byte for byte (it never rewrites what it decided on), so a
path rule has to hold on whatever path the origin serves for those bytes, and servers disagree.
A path is therefore read several ways (`readings`):

- RFC 3986 `remove_dot_segments`, as the WHATWG URL parser does it (browsers, Node's
  `new URL`): `//` is an empty segment that `..` removes, so `/x//../api/` is `/x/api/`;
- with runs of `/` folded first (nginx `merge_slashes`, Apache, Go's `path.Clean`, Tomcat):
  `/x//../api/` is `/api/`;
- with `;parameters` dropped from each segment (Tomcat, Spring, Jetty): `/a;x/b` is `/a/b`;
- with dot segments left in (Express and other routers that match the raw path):
  `/admin/../x` is under `/admin/`;
- without the slash a final dot segment leaves (Go's ServeMux): `/api/x/..` is `/api`;
- for blocks, also as Windows names (IIS): a name loses trailing dots and spaces and any
  `:stream` suffix, so `/admin./`, `/admin%20/` and `/admin::$DATA/` are `/admin/`.

Every reading decodes percent-escapes of unreserved characters (`%61` is `a`, `%2E` is `.`, as
RFC 3986 6.2.2.2 makes them equal) and keeps every other escape, upper-cased. An allowed prefix
must hold on every reading; a blocked prefix applies when any reading matches it. The Windows
reading only shortens names (the forms where it would make an empty or a dot segment are
refused), so it can move a path into a prefix but never out of one: it serves blocks, where
it catches `/admin./`, and stays out of allows, where it would refuse names with a colon
(`/v1/models/m:predict`).

Forms that no set of readings can settle are refused outright (`ambiguous_path`): encoded `/`,
`\\` or control bytes; raw backslashes, spaces, controls, non-ASCII and `#`; double encoding
(`%25` followed by two hex digits: a server that decodes twice reads `%2561` as `a`); escaped
bytes that are not UTF-8 (old decoders read overlong forms as ASCII) or that Unicode
normalisation or case mapping turns into ASCII (fullwidth letters, NBSP, the Kelvin sign); a
segment of only dots and spaces other than `.` and `..`; and a segment that becomes a dot
segment, or empty, once a server drops its `;parameters` or reads it as a Windows name
(`..;/`, `..%20`, `..::$DATA`).

Pure functions: nothing here does I/O.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from policy.errors import PolicyError
from policy.reasons import Reason
from policy.text import clipped

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset("0123456789abcdefABCDEF")
_DOTS = (".", "..")
_SPACE = "%20"
# A path that needs no decoding: printable ASCII without '%', '\\' or '#'.
_PLAIN = re.compile(r"/[!-\"$&-\[\]-~]*")
# Anything that can make the readings differ: '//', dot segments, ';', ':' (raw or escaped),
# names ending in '.' or a space.
_MAY_DIFFER = re.compile(r"//|[;:]|%3B|%3A|\.(?:/|$)|%20(?:/|$)")
_PARAMS = re.compile(r";|%3B")
_STREAM = re.compile(r":|%3A")

RFC_READING = "RFC 3986 (WHATWG URL, Node)"
_FOLDED = "'//' folded (nginx, Apache, Go, Tomcat)"
_NO_PARAMS = "';parameters' dropped (Tomcat, Spring, Jetty)"
_WINDOWS = "Windows names (IIS: trailing dots and spaces and ':streams' dropped)"
_DOTS_LEFT = "dot segments left in (Express, prefix routers)"
_NO_SLASH = "no slash after a final dot segment (Go's ServeMux)"


@dataclass(frozen=True, slots=True)
class Reading:
    """One way a server may read a request path: the path it serves, and which servers."""

    path: str
    how: str


Verdict = Literal["allowed", "blocked", "outside", "ambiguous"]


@dataclass(frozen=True, slots=True)
class PathDecision:
    """What `decide_path` found.

    `allowed`: no blocked prefix matches any reading and (when prefixes restrict) every reading
    lies under an allowed one; `index` is the allowed prefix admitting the RFC 3986 reading.
    `blocked`: `index` is the blocked prefix that `reading` matches. `outside`: the RFC 3986
    reading (`reading`) is under no allowed prefix. `ambiguous`: the form is refused outright
    (`problem` says why), or the RFC 3986 reading is admitted and `reading` is not.
    """

    verdict: Verdict
    index: int | None = None
    reading: Reading | None = None
    problem: str | None = None


def decide_path(path: str, allowed: Sequence[str] | None, blocked: Sequence[str]) -> PathDecision:
    """Decide a request path (a query after `?` is ignored) against path prefixes.

    `allowed` None: the host is admitted whole and only the blocks apply. A prefix ending in
    `/` admits what starts with it; one without ends at a segment (`/api` admits `/api` and
    `/api/x`, not `/apiary`). Blocked prefixes compare case-blind (some servers do) and a
    blocked `/admin/` blocks `/admin` too (many servers serve both alike); allowed prefixes
    compare exactly. Never raises.
    """
    if allowed is None and not blocked:
        return PathDecision("allowed")
    try:
        allow_readings, block_readings = readings(path)
    except PolicyError as exc:
        return PathDecision("ambiguous", problem=exc.message)
    for index, prefix in enumerate(blocked):
        folded = prefix.lower()
        for reading in block_readings:
            if _blocked_by(reading.path.lower(), folded):
                return PathDecision("blocked", index, reading)
    if allowed is None:
        return PathDecision("allowed")
    admitting = [_admitting(reading.path, allowed) for reading in allow_readings]
    if admitting[0] is None:
        return PathDecision("outside", reading=allow_readings[0])
    for reading, admitted in zip(allow_readings, admitting, strict=True):
        if admitted is None:
            return PathDecision("ambiguous", reading=reading)
    return PathDecision("allowed", admitting[0], allow_readings[0])


def readings(path: str) -> tuple[tuple[Reading, ...], tuple[Reading, ...]]:
    """(the readings an allow must hold on, the readings a block is checked on), the RFC 3986
    reading first in both; the second holds the first. PolicyError('ambiguous_path') for the
    forms refused outright (see the module docstring)."""
    lexed = _lex(path.partition("?")[0])
    if not _MAY_DIFFER.search(lexed) and "/." not in lexed:
        only = (Reading(lexed, RFC_READING),)
        return only, only
    segments = lexed.split("/")[1:]
    _refuse_shifting_segments(segments, path)
    found = list(_variants(segments))
    allow = _unique(reading for reading, windows in found if not windows)
    return allow, _unique(reading for reading, _ in found)


def canonical_prefix(path: str) -> str:
    """The spelling a URL pattern's path must have: the one every reading of it agrees on.
    Returns the fixed spelling to suggest (dot segments resolved, `//` folded, escapes
    normalised); PolicyError('ambiguous_path') for a form no request path could match on every
    reading (`;parameters`, names ending in a dot or a space) or one refused outright."""
    allow, _ = readings(path)
    lexed = _lex(path)
    if _PARAMS.search(lexed):
        raise PolicyError(
            Reason.AMBIGUOUS_PATH,
            f"path {_shown(path)} has ';parameters', which servers that drop them never see: "
            "write the prefix without them",
        )
    segments = lexed.split("/")[1:]
    if any(s.endswith((".", _SPACE)) for s in segments if s not in _DOTS):
        raise PolicyError(
            Reason.AMBIGUOUS_PATH,
            f"path {_shown(path)} has a name ending in a dot or a space, which Windows servers "
            "drop: write the prefix without it",
        )
    if len(allow) == 1:
        return allow[0].path
    return _resolve(_folded(segments), slash=True)


# -- comparing ---------------------------------------------------------------------------------


def under(path: str, prefix: str) -> bool:
    """`path` lies under `prefix`: a prefix without a trailing `/` ends at a segment."""
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def _blocked_by(path: str, prefix: str) -> bool:
    return under(path, prefix) or (prefix.endswith("/") and path == prefix[:-1])


def _admitting(path: str, allowed: Sequence[str]) -> int | None:
    return next((i for i, prefix in enumerate(allowed) if under(path, prefix)), None)


# -- reading -----------------------------------------------------------------------------------


def _variants(segments: list[str]) -> Iterator[tuple[Reading, bool]]:
    """Every combination of the server behaviours that apply to these segments, the RFC 3986
    reading first, each with whether it reads Windows names (those are for blocks only)."""
    bare = [s if s in _DOTS else _PARAMS.split(s, 1)[0] for s in segments]
    spellings = {(False, False): segments}
    if bare != segments:
        spellings[True, False] = bare
    windows = [s if s in _DOTS else _windows_name(s) for s in segments]
    if windows != segments:
        spellings[False, True] = windows
        if bare != segments:
            spellings[True, True] = [s if s in _DOTS else _windows_name(s) for s in bare]
    for (params, as_windows), names in spellings.items():
        for fold in (False, True) if "" in names[:-1] else (False,):
            shown = _folded(names) if fold else names
            how = [
                text
                for on, text in ((fold, _FOLDED), (params, _NO_PARAMS), (as_windows, _WINDOWS))
                if on
            ]
            yield Reading(_resolve(shown, slash=True), _how(how)), as_windows
            if shown[-1] in _DOTS:
                yield Reading(_resolve(shown, slash=False), _how([*how, _NO_SLASH])), as_windows
            if any(s in _DOTS for s in shown):
                yield Reading("/" + "/".join(shown), _how([*how, _DOTS_LEFT])), as_windows


def _folded(segments: list[str]) -> list[str]:
    """Runs of '/' folded: no empty segment but a last one (the trailing slash)."""
    return [s for s in segments[:-1] if s] + segments[-1:]


def _windows_name(segment: str) -> str:
    """A name as Windows reads it: cut at a ':' (an NTFS stream), trailing dots and spaces off."""
    name = _STREAM.split(segment, 1)[0]
    while True:
        if name.endswith("."):
            name = name[:-1]
        elif name.endswith(_SPACE):
            name = name[: -len(_SPACE)]
        else:
            return name


def _resolve(segments: list[str], *, slash: bool) -> str:
    """RFC 3986 `remove_dot_segments` on a path's segments: `..` removes the segment before
    it, an empty one included. `slash`: a final dot segment leaves a trailing `/` (RFC 3986,
    WHATWG, nginx); without it, as Go's ServeMux cleans a path."""
    out: list[str] = []
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
            continue
        if i == last and (slash or not out):
            out.append("")
    return "/" + "/".join(out)


def _how(parts: list[str]) -> str:
    return ", ".join(parts) if parts else RFC_READING


def _unique(found: Iterable[Reading]) -> tuple[Reading, ...]:
    seen: dict[str, Reading] = {}
    for reading in found:
        seen.setdefault(reading.path, reading)
    return tuple(seen.values())


# -- refusing ----------------------------------------------------------------------------------


def _refuse_shifting_segments(segments: list[str], path: str) -> None:
    """Refuse the segments whose very kind depends on the server: dots and spaces only, or a
    name that becomes a dot segment (or nothing) once parameters or Windows rules strip it."""
    for segment in segments:
        if segment in _DOTS or not segment:
            continue
        if not segment.replace(_SPACE, "").strip("."):
            raise _ambiguous(path, f"the segment {segment!r} is only dots and spaces")
        bare = _PARAMS.split(segment, 1)[0]
        for name, what in (
            (bare, "without its ;parameters"),
            (_windows_name(segment), "as a Windows name"),
            (_windows_name(bare), "as a Windows name without its ;parameters"),
        ):
            if name in _DOTS:
                raise _ambiguous(path, f"the segment {segment!r} reads as {name!r} {what}")
        if bare and not _windows_name(bare):
            raise _ambiguous(path, f"the segment {segment!r} is empty as a Windows name")


def _lex(path: str) -> str:
    """The path with unreserved escapes decoded and other escapes upper-cased, or
    PolicyError('ambiguous_path') for the forms refused outright."""
    if not path.startswith("/"):
        raise _ambiguous(path, "it does not start with '/'")
    if _PLAIN.fullmatch(path):
        return path
    tokens: list[str] = []  # decoded characters and kept escapes ('%3F')
    high = bytearray()  # the run of escaped bytes >= 0x80 being read
    i, n = 0, len(path)
    while i < n:
        ch = path[i]
        if ch != "%":
            if high:
                tokens += _utf8_run(high, path)
            if ch in "\\#" or not "!" <= ch <= "~":
                raise _ambiguous(path, f"it has a raw {_char(ch)}")
            tokens.append(ch)
            i += 1
            continue
        pair = path[i + 1 : i + 3]
        if len(pair) != 2 or not set(pair) <= _HEX:
            raise _ambiguous(path, "it has a broken percent-escape")
        byte = int(pair, 16)
        i += 3
        if byte >= 0x80:
            high.append(byte)
            continue
        if high:
            tokens += _utf8_run(high, path)
        if byte in (0x2F, 0x5C) or byte < 0x20 or byte == 0x7F:
            raise _ambiguous(path, "it has an encoded slash, backslash or control byte")
        tokens.append(chr(byte) if byte in _UNRESERVED else "%" + pair.upper())
    if high:
        tokens += _utf8_run(high, path)
    for k, token in enumerate(tokens):
        following = tokens[k + 1 : k + 3]
        if token == "%25" and len(following) == 2 and all(t in _HEX for t in following):
            raise _ambiguous(
                path,
                "it is encoded twice ('%25' before two hex digits): a server that decodes "
                "twice reads another path",
            )
    return "".join(tokens)


def _utf8_run(run: bytearray, path: str) -> list[str]:
    """Escaped bytes >= 0x80 as kept escapes, when they are UTF-8 no server can read as ASCII;
    empties `run`."""
    data = bytes(run)
    run.clear()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _ambiguous(
            path, "its escaped bytes are not UTF-8 (old decoders read overlong forms as ASCII)"
        ) from None
    for ch in text:
        # Simple case mappings only (one character): 'ß' -> 'SS' is no server's comparison,
        # while the long s (U+017F) -> 'S' and the Kelvin sign -> 'k' are.
        cased = [m for m in (ch.lower(), ch.upper()) if len(m) == 1]
        if any(c.isascii() for form in (unicodedata.normalize("NFKC", ch), *cased) for c in form):
            raise _ambiguous(
                path,
                f"it has U+{ord(ch):04X}, which Unicode normalisation or case mapping turns "
                "into ASCII",
            )
    return [f"%{b:02X}" for b in data]


def _char(ch: str) -> str:
    if ch in "\\#":
        return f"{ch!r}"
    return f"U+{ord(ch):04X} (space, control or non-ASCII)"


def _ambiguous(path: str, why: str) -> PolicyError:
    return PolicyError(
        Reason.AMBIGUOUS_PATH,
        f"path {_shown(path)} is refused: {why}; servers disagree on what it names",
    )


def _shown(path: str) -> str:
    return repr(clipped(path))
