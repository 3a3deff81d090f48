"""Proxy listeners as `--listen` writes them: `HOST:PORT` (an HTTP proxy), `http://HOST:PORT`,
`socks5://HOST:PORT` or `transparent://HOST:PORT`; and the DNS listeners of `--dns-listen
HOST:PORT`. Several may be given; each serves the same policy."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.admin import format_listen, parse_listen
from proxy.errors import ProxyError

SCHEMES = ("http", "socks5", "transparent")


@dataclass(frozen=True, slots=True)
class Listener:
    # "http" (explicit HTTP proxy: CONNECT and plain HTTP), "socks5", "transparent"
    # (connections redirected to it by netfilter), or "dns" (the DNS responder, UDP and TCP on
    # one port; `--dns-listen`, never a `--listen` scheme).
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{format_listen(self.host, self.port)}"


def parse_listener(text: str, *, bare: str = "http") -> Listener:
    """`[SCHEME://]HOST:PORT` → Listener; a bare address gets the scheme `bare` (an HTTP
    proxy, or "transparent" under `--mode transparent`). Raises ProxyError('invalid_listen')."""
    scheme, sep, rest = text.partition("://") if isinstance(text, str) else ("", "", text)
    if not sep:
        scheme, rest = bare, text
    elif scheme.lower() not in SCHEMES:
        raise ProxyError(
            "invalid_listen",
            f"invalid listen address {text[:100]!r}: scheme {scheme[:20]!r} is not one of "
            + ", ".join(f"{s}://" for s in SCHEMES),
        )
    host, port = parse_listen(rest)
    return Listener(scheme.lower(), host, port)


def parse_dns_listener(text: str) -> Listener:
    """`HOST:PORT` of `--dns-listen` → Listener("dns", ...). Raises ProxyError('invalid_listen')."""
    if isinstance(text, str) and "://" in text:
        raise ProxyError(
            "invalid_listen",
            f"invalid DNS listen address {text[:100]!r}: write HOST:PORT (it serves UDP and TCP)",
        )
    host, port = parse_listen(text)
    return Listener("dns", host, port)


def check_listeners(listeners: list[Listener], *, engine_only: bool = False) -> None:
    """Two listeners on one address would fail to bind later, less clearly. A DNS listener
    takes its port for TCP too, so it clashes with a proxy listener on the same address. Port
    0 picks a free port for each listener, except that mitmproxy refuses port 0 twice on one
    host: it serves the DNS listeners, and with `--engine-only` every listener."""
    seen: dict[tuple[str, int], Listener] = {}
    for listener in listeners:
        in_engine = engine_only or listener.scheme == "dns"
        if not listener.port and not in_engine:
            continue
        key = (listener.host, listener.port)
        if key in seen:
            raise ProxyError(
                "invalid_listen",
                f"{listener} and {seen[key]} use the same address"
                + (" (give each its own port)" if not listener.port else ""),
            )
        seen[key] = listener
