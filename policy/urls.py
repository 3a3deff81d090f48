"""Targets (what a client asks for), parsed for decisions: scheme, host, port and path.

The path is kept as sent; how it is read against path rules is policy/paths.py's business.
Brackets hold an IPv6 literal and nothing else: `[github.com]` is not a way to write
`github.com`, and is refused as an invalid host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from policy.errors import PolicyError
from policy.names import _is_ipv6_spelling
from policy.reasons import Reason

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443, "ssh": 22}
# Streams that are neither TLS nor HTTP (`explain ssh://host`, and what the data plane decides a
# tunnel's first bytes were): no URL-prefix rule speaks of them, and `tcp` names no default port.
STREAM_SCHEMES = frozenset({"ssh", "tcp"})
SCHEMES = frozenset(DEFAULT_PORTS) | STREAM_SCHEMES
# WebSocket upgrades are decided by the HTTP rules of the request that opens them.
RULE_SCHEME = {"http": "http", "https": "https", "ws": "http", "wss": "https"}
TLS_SCHEMES = frozenset({"https", "wss"})

_PORT = re.compile(r"[0-9]{1,5}")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, slots=True)
class Target:
    """What a client asked for. `host` is as written (the brackets of an IPv6 literal
    stripped), not yet normalised; `path` is as sent, without the query."""

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
        raise PolicyError(
            Reason.INVALID_PORT, f"{what} {text[:20]!r} is not a number from 1 to 65535"
        )
    return int(text)


def split_authority(authority: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 → (host, port).

    Brackets must hold an IPv6 literal (a zone id may follow it: it is refused later as an IP
    literal); anything else in them is PolicyError('invalid_host'), never the name inside."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise PolicyError(Reason.INVALID_TARGET, f"unclosed '[' in {authority[:100]!r}")
        host, rest = authority[1:end], authority[end + 1 :]
        if not _is_ipv6_spelling(host):
            raise PolicyError(
                Reason.INVALID_HOST,
                f"invalid host {authority[: end + 1][:100]!r}: brackets hold an IPv6 address "
                "and nothing else",
            )
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise PolicyError(
                Reason.INVALID_TARGET, f"unexpected text after ']' in {authority[:100]!r}"
            )
        return host, parse_port(rest[1:])
    if "]" in authority:
        raise PolicyError(Reason.INVALID_HOST, f"invalid host {authority[:100]!r}: a stray ']'")
    if authority.count(":") > 1:
        return authority, None  # a bare IPv6 literal; the name stage refuses it
    host, sep, port = authority.partition(":")
    return host, (parse_port(port) if sep else None)


def parse_target(text: str) -> Target:
    """A target as written on a command line or in a request: host, host:port, [v6]:port, URL."""
    if not text or len(text) > 8192:
        raise PolicyError(Reason.INVALID_TARGET, "a target must be 1 to 8192 characters")
    if _CONTROL_OR_SPACE.search(text):
        raise PolicyError(
            Reason.INVALID_TARGET, f"whitespace or control character in {text[:100]!r}"
        )
    match = _SCHEME.match(text)
    if not match:
        if "/" in text or "?" in text or "#" in text:
            raise PolicyError(
                Reason.INVALID_TARGET, f"{text[:100]!r}: give a host, host:port or a full URL"
            )
        host, port = split_authority(text)
        return Target(host=host, port=port)
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise PolicyError(
            Reason.UNSUPPORTED_SCHEME,
            f"scheme {scheme!r} is not one of http, https, ws, wss, ssh, tcp",
        )
    rest = text[match.end() :]
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        raise PolicyError(Reason.INVALID_TARGET, "credentials in a URL (user@host) are refused")
    host, port = split_authority(authority)
    if scheme in STREAM_SCHEMES:
        if path not in ("", "/"):
            raise PolicyError(
                Reason.INVALID_TARGET, f"{text[:100]!r}: an {scheme}:// target has no path"
            )
        if port is None and scheme not in DEFAULT_PORTS:
            raise PolicyError(
                Reason.INVALID_TARGET, f"{text[:100]!r}: a tcp:// target names its port"
            )
        return Target(host=host, port=port, scheme=scheme)
    # The query goes; a '#' before it stays in the path, where a path rule refuses it (a client
    # never sends a fragment, and a server may read '/api#/../x' as a path).
    path = path.split("?", 1)[0]
    if not path.startswith("/"):
        path = "/" + path
    return Target(host=host, port=port, scheme=scheme, path=path)
