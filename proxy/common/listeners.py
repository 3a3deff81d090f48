"""Addresses the proxy listens on. `parse_listen` reads the `HOST:PORT` of `--admin` and
`--listen`: IP literals only (plus `localhost`, taken as 127.0.0.1 without asking anything),
because the proxy never lets the OS resolve a name.

Proxy listeners as `--listen` writes them: `HOST:PORT` (an HTTP proxy), `http://HOST:PORT`,
`socks5://HOST:PORT` or `transparent://HOST:PORT`; and the DNS listeners of `--dns-listen
HOST:PORT`. Several may be given; each serves the same policy. `OwnListeners` says whether an
address and port reach one of them (every address of a wildcard bind included): the proxy's own
listeners are never a destination (`proxy_loop`)."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeGuard

from proxy.common.errors import ProxyError
from proxy.common.refusals import authority
from proxy.common.terminal import one_line

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


def check_listeners(listeners: list[Listener]) -> None:
    """Two listeners on one address would fail to bind later, less clearly. A DNS listener
    takes its port for TCP too, so it clashes with a proxy listener on the same address. Port
    0 picks a free port for each listener (a DNS listener one port free for UDP and TCP both)."""
    seen: dict[tuple[str, int], Listener] = {}
    for listener in listeners:
        if not listener.port:
            continue
        key = (listener.host, listener.port)
        if key in seen:
            raise ProxyError("invalid_listen", f"{listener} and {seen[key]} use the same address")
        seen[key] = listener


class OwnListeners:
    """The loop guard, the one every plane asks before any dial: whether a connection to
    address:port would reach one of our own listeners, which are never a destination. A listener
    bound to one address is reached by that address alone (127.0.0.2 is not 127.0.0.1's); a wildcard
    one (`0.0.0.0`, `[::]`, each of its own family: ours are v6-only) by every address of this host
    on its port. An IPv4-mapped IPv6 address is its IPv4 address; the unspecified address
    (`0.0.0.0`, `::`), which the kernel dials as loopback, and an address that does not parse are
    ours on every port we listen on (fail closed).

        own = OwnListeners([Listener("http", "0.0.0.0", 3128)])
        own.is_own("127.0.0.2", 3128)     # True: the kernel would hand it to our listener

    A destination on a port none of ours listens on costs one set lookup; the kernel is asked
    (`_is_local`) only for one on the port of a wildcard listener."""

    __slots__ = ("_exact", "_ports", "_wildcards", "listeners")

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self.listeners: tuple[Listener, ...] = ()
        self._ports: set[int] = set()
        self._exact: dict[tuple[str, int], Listener] = {}
        self._wildcards: dict[tuple[int, int], Listener] = {}  # by (IP version, port)
        self.claim(listeners)

    def claim(self, listeners: Iterable[Listener]) -> None:
        """Makes `listeners` (bound: their ports known) ours."""
        for listener in listeners:
            ip = ipaddress.ip_address(listener.host)
            port = listener.port
            if ip.is_unspecified:
                self._wildcards.setdefault((ip.version, port), listener)
            else:
                self._exact.setdefault((str(ip), port), listener)
            self._ports.add(port)
            self.listeners += (listener,)

    def is_own(self, address: str, port: int) -> bool:
        return port in self._ports and self.listener(address, port) is not None

    def listener(self, address: str, port: int) -> Listener | None:
        """The listener of ours that a packet or connection to address:port would reach."""
        if port not in self._ports:
            return None
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            ip = None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip is None or ip.is_unspecified:
            return next(x for x in self.listeners if x.port == port)
        exact = self._exact.get((str(ip), port))
        if exact is not None:
            return exact
        wildcard = self._wildcards.get((ip.version, port))
        if wildcard is not None and _is_local(ip):
            return wildcard
        return None


def _is_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` is an address of this host: loopback (all of 127/8), or one a socket can
    bind to, which is the kernel's own answer for every interface and alias, including ones
    added after start-up (no list to go stale). An IPv6 link-local address counts as local:
    without its zone the kernel cannot say on which interface it is, so we fail closed."""
    if ip.is_loopback or (ip.version == 6 and ip.is_link_local):
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# ports and HOST:PORT

MAX_PORT = 65535


def is_port(value: object) -> TypeGuard[int]:
    """Whether `value` is a port a connection can go to: an int from 1 to 65535 (a bool is not
    one, though Python counts it as an int). Each caller wraps a refusal in its own error, for
    its own input."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PORT


def decimal(text: str) -> int | None:
    """`text` as a whole number written in ASCII digits (a port or an id on a command line),
    else None. `str.isdigit` alone also takes digits such as '²', which `int` then refuses,
    and `int` refuses a number of thousands of digits: a caller that checks a range must
    never get an exception instead."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    # Far below any int-to-text limit Python allows (640 at the least), far above any id.
    return int(digits) if len(digits) <= _MAX_DECIMAL_DIGITS else None


_MAX_DECIMAL_DIGITS = 600


_PORT = re.compile(r"[0-9]{1,5}")
_MAX_LISTEN_TEXT = 300


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or `:PORT` (meaning 127.0.0.1) → (host, port), host in its
    canonical IP spelling. HOST is an IPv4 literal in dotted-quad form, a bracketed IPv6 literal
    (no zone id) or `localhost` (mapped to 127.0.0.1 here, never looked up). Other names are
    refused: the proxy must never ask the OS to resolve one. PORT is decimal 0 to 65535; 0 asks
    for an ephemeral port (the caller reports the one bound). Schemes (`http://`) are the
    caller's to strip. Anything else → ProxyError('invalid_listen')."""
    if not isinstance(text, str):
        raise ProxyError(
            "invalid_listen", f"listen address must be text, not {type(text).__name__}"
        )
    shown = repr(one_line(text, 100))

    def refuse(why: str) -> ProxyError:
        return ProxyError("invalid_listen", f"invalid listen address {shown}: {why}")

    if len(text) > _MAX_LISTEN_TEXT:
        raise refuse("too long")
    if "://" in text:
        raise refuse("no scheme here; write HOST:PORT")
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1 : close + 2] != ":":
            raise refuse("write an IPv6 address as [ADDRESS]:PORT")
        host_text, port_text = text[1:close], text[close + 2 :]
        if "%" in host_text:
            raise refuse("IPv6 zone ids are not supported")
        try:
            host = str(ipaddress.IPv6Address(host_text))
        except ValueError:
            raise refuse(f"{host_text!r} is not an IPv6 address") from None
    else:
        if text.count(":") != 1:
            if text.count(":") > 1:
                raise refuse("write an IPv6 address in brackets: [ADDRESS]:PORT")
            raise refuse("expected HOST:PORT (or :PORT for 127.0.0.1)")
        host_text, port_text = text.split(":")
        if host_text in ("", "localhost"):
            host = "127.0.0.1"
        else:
            try:
                # Strict dotted quad: `127.1`, `0x7f.0.0.1` and leading zeros are refused.
                host = str(ipaddress.IPv4Address(host_text))
            except ValueError:
                raise refuse(
                    f"{host_text!r} is not an IP address (names other than localhost are not "
                    "resolved)"
                ) from None
    if not _PORT.fullmatch(port_text) or int(port_text) > MAX_PORT:
        raise refuse(f"port {port_text[:20]!r} is not a number from 0 to 65535")
    return host, int(port_text)


def format_listen(host: str, port: int) -> str:
    """The inverse of parse_listen, for messages: IPv6 hosts in brackets."""
    return authority(host, port)
