"""Proxy listeners as `--listen` writes them: `HOST:PORT` (an HTTP proxy), `http://HOST:PORT`
or `socks5://HOST:PORT`. Several may be given; each serves the same policy."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.admin import format_listen, parse_listen
from proxy.errors import ProxyError

SCHEMES = ("http", "socks5")


@dataclass(frozen=True, slots=True)
class Listener:
    # "http" (explicit HTTP proxy: CONNECT and plain HTTP), "socks5", or "transparent"
    # (redirected connections, `--mode transparent`).
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{format_listen(self.host, self.port)}"


def parse_listener(text: str) -> Listener:
    """`[SCHEME://]HOST:PORT` → Listener; a bare address is an HTTP proxy. Raises
    ProxyError('invalid_listen')."""
    scheme, sep, rest = text.partition("://") if isinstance(text, str) else ("", "", text)
    if not sep:
        scheme, rest = "http", text
    elif scheme.lower() not in SCHEMES:
        raise ProxyError(
            "invalid_listen",
            f"invalid listen address {text[:100]!r}: scheme {scheme[:20]!r} is not one of "
            + ", ".join(f"{s}://" for s in SCHEMES),
        )
    host, port = parse_listen(rest)
    return Listener(scheme.lower(), host, port)


def check_listeners(listeners: list[Listener]) -> None:
    """Two listeners on one address would fail to bind later, less clearly. (mitmproxy also
    refuses port 0 twice on one host.)"""
    seen: dict[tuple[str, int], Listener] = {}
    for listener in listeners:
        key = (listener.host, listener.port)
        if key in seen:
            raise ProxyError(
                "invalid_listen",
                f"{listener} and {seen[key]} use the same address"
                + (" (give each its own port)" if not listener.port else ""),
            )
        seen[key] = listener
