"""Targets (what a client asks for) and URL paths, parsed for decisions.

Path prefixes are compared on a normalised path so that `/api/../admin` cannot pass as
`/api/`. Constructs that origin servers disagree about (encoded slashes, backslashes, `..;`)
are refused outright: if we cannot know which path the server will serve, we do not guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from policy.errors import PolicyError

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# WebSocket upgrades are decided by the HTTP rules of the request that opens them.
RULE_SCHEME = {"http": "http", "https": "https", "ws": "http", "wss": "https"}
TLS_SCHEMES = frozenset({"https", "wss"})

_PORT = re.compile(r"[0-9]{1,5}")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset("0123456789abcdefABCDEF")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, slots=True)
class Target:
    """What a client asked for. `host` is as written (brackets stripped), not yet normalised."""

    host: str
    port: int | None = None
    scheme: str | None = None
    path: str | None = None

    @property
    def effective_port(self) -> int | None:
        if self.port is not None:
            return self.port
        return DEFAULT_PORTS.get(self.scheme) if self.scheme else None


def parse_port(text: str, what: str = "port") -> int:
    if not _PORT.fullmatch(text) or not 0 < int(text) < 65536:
        raise PolicyError("invalid_port", f"{what} {text[:20]!r} is not a number from 1 to 65535")
    return int(text)


def split_authority(authority: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 → (host, port)."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise PolicyError("invalid_target", f"unclosed '[' in {authority[:100]!r}")
        host, rest = authority[1:end], authority[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise PolicyError("invalid_target", f"unexpected text after ']' in {authority[:100]!r}")
        return host, parse_port(rest[1:])
    if authority.count(":") > 1:
        return authority, None  # a bare IPv6 literal; the name stage refuses it
    host, sep, port = authority.partition(":")
    return host, (parse_port(port) if sep else None)


def parse_target(text: str) -> Target:
    """A target as written on a command line or in a request: host, host:port, [v6]:port, URL."""
    if not text or len(text) > 8192:
        raise PolicyError("invalid_target", "a target must be 1 to 8192 characters")
    if _CONTROL_OR_SPACE.search(text):
        raise PolicyError("invalid_target", f"whitespace or control character in {text[:100]!r}")
    match = _SCHEME.match(text)
    if not match:
        if "/" in text or "?" in text or "#" in text:
            raise PolicyError(
                "invalid_target", f"{text[:100]!r}: give a host, host:port or a full URL"
            )
        host, port = split_authority(text)
        return Target(host=host, port=port)
    scheme = match.group(1).lower()
    if scheme not in DEFAULT_PORTS:
        raise PolicyError(
            "unsupported_scheme", f"scheme {scheme!r} is not one of http, https, ws, wss"
        )
    rest = text[match.end() :]
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        raise PolicyError("invalid_target", "credentials in a URL (user@host) are refused")
    host, port = split_authority(authority)
    path = path.split("#", 1)[0].split("?", 1)[0] or "/"
    return Target(host=host, port=port, scheme=scheme, path=path)


def path_views(path: str) -> tuple[str, ...]:
    """Every reading of `path` a prefix rule must agree with: the normalised path, and when it
    has `;parameters`, the normalised path with them dropped (Tomcat and Spring drop them before
    resolving `..`). An allow must admit every view; a block refuses if any view matches."""
    plain = normalize_path(path)
    if ";" not in path:
        return (plain,)
    return plain, normalize_path(path, drop_parameters=True)


def normalize_path(path: str, *, drop_parameters: bool = False) -> str:
    """The path a prefix rule is compared with, or PolicyError('ambiguous_path').

    Percent-encoded unreserved characters are decoded, other escapes upper-cased, runs of `/`
    folded (many servers fold them before resolving `..`), and dot segments removed.
    """
    if not path.startswith("/"):
        raise PolicyError("ambiguous_path", f"path {path[:100]!r} does not start with '/'")
    out: list[str] = []
    i, n = 0, len(path)
    while i < n:
        ch = path[i]
        if ch == "%":
            hexpair = path[i + 1 : i + 3]
            if len(hexpair) != 2 or not set(hexpair) <= _HEX:
                raise PolicyError("ambiguous_path", f"broken percent-escape in {path[:100]!r}")
            byte = int(hexpair, 16)
            if byte in _UNRESERVED:
                out.append(chr(byte))
            elif byte in (0x2F, 0x5C) or byte < 0x20 or byte == 0x7F:
                raise PolicyError(
                    "ambiguous_path",
                    f"encoded slash, backslash or control byte in {path[:100]!r}: servers "
                    "disagree on what it means",
                )
            else:
                out.append("%" + hexpair.upper())
            i += 3
            continue
        if ch == "\\" or ord(ch) < 0x21 or ord(ch) > 0x7E:
            raise PolicyError(
                "ambiguous_path",
                f"backslash, space, control or non-ASCII character in {path[:100]!r}",
            )
        out.append(ch)
        i += 1
    segments = "".join(out).split("/")
    resolved: list[str] = []
    for segment in segments[1:]:
        if segment.startswith((".;", "..;")):
            raise PolicyError("ambiguous_path", f"dot segment with parameters in {path[:100]!r}")
        if drop_parameters:
            segment = segment.split(";", 1)[0]
        if segment == "..":
            if resolved:
                resolved.pop()
        elif segment not in (".", ""):
            resolved.append(segment)
    trailing = segments[-1] in ("", ".", "..") and len(segments) > 1
    result = "/" + "/".join(resolved)
    if trailing and resolved:
        result += "/"
    return result


def path_has_prefix(path: str, prefix: str) -> bool:
    """Prefix match on a normalised path; a prefix without a trailing `/` ends at a segment."""
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")
