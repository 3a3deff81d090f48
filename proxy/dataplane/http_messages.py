"""The pieces of HTTP/1.1 messages the HTTP plane reads and writes (RFC 9110, 9112): a parsed
request head, its target, the fields that are hop-by-hop, and the heads and body frames sent on.
No sockets here; httptools (llhttp) has already refused what is malformed or smuggles (obs-fold,
Content-Length beside Transfer-Encoding, duplicate Content-Length, bad chunk sizes, bare CR/LF).

    target = absolute_target("http://up.test:8080/a?b")    # ("up.test", 8080, "/a?b") or Refused
    head = request_head("GET", "/a?b", forwarded_fields(fields), framing)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from policy.errors import PolicyError
from policy.reasons import Reason
from policy.urls import split_authority
from proxy.common.refusals import Refused, shown

type Fields = list[tuple[bytes, bytes]]  # (name as sent, value), in order

# Fields that describe one connection, never forwarded (RFC 9110 7.6.1), plus the proxy's own
# (Proxy-Authorization is for this hop; Proxy-Connection is a non-standard Connection) and the
# framing the HTTP plane writes itself (Content-Length is kept: it is the message's own length).
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"http2-settings",
    }
)
MAX_HEAD: Final = 64 << 10  # bytes of a request or response head (URL and fields)
MAX_FIELDS: Final = 200
CHUNKED: Final = "chunked"
LAST_CHUNK: Final = b"0\r\n\r\n"


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str  # as sent (absolute form on an explicit listener, origin form on a transparent)
    version: str  # "1.0" or "1.1"
    fields: Fields
    keep_alive: bool  # what the client's version and Connection field say

    def values(self, name: bytes) -> list[str]:
        return field_values(self.fields, name)


def field_values(fields: Fields, name: bytes) -> list[str]:
    """The values of every field `name` (lowercase), as latin-1 text, in order."""
    return [value.decode("latin-1") for key, value in fields if key.lower() == name]


def has_field(fields: Fields, name: bytes) -> bool:
    return any(key.lower() == name for key, _ in fields)


def body_framing(fields: Fields) -> Refused | tuple[bool, bool]:
    """(has a body, chunked) of a request, or the Refused for a Transfer-Encoding other than
    exactly `chunked`: a coding the proxy would have to pass on undecoded is not worth the
    ambiguity."""
    codings = [v.strip().lower() for v in field_values(fields, b"transfer-encoding")]
    if codings:
        if codings != [CHUNKED]:
            return Refused(
                400,
                Reason.INVALID_REQUEST,
                f"Transfer-Encoding {shown(', '.join(codings))!r} refused",
            )
        return True, True
    lengths = field_values(fields, b"content-length")
    return bool(lengths) and lengths[0].strip() != "0", False


def absolute_target(target: str) -> tuple[str, int, str] | Refused:
    """An explicit proxy's request target, `http://authority[path][?query]`: (host as written,
    port, path and query as sent, "/" when empty). Other schemes are refused by name; a target
    in origin form, with user info, or with an invalid authority is a bad request."""
    scheme, sep, rest = target.partition("://")
    if not sep or not scheme.isascii() or not scheme.isalpha():
        return Refused(
            400, Reason.INVALID_REQUEST, "a request to a proxy needs an absolute http:// URI"
        )
    if scheme.lower() != "http":
        return Refused(
            403,
            Reason.UNSUPPORTED_SCHEME,
            f"scheme {shown(scheme.lower())!r}: only http:// is forwarded (https goes by CONNECT)",
        )
    end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found >= 0:
            end = min(end, found)
    where, path = rest[:end], rest[end:]
    if "@" in where:
        return Refused(400, Reason.INVALID_REQUEST, "user info in a request target")
    if path.startswith("#"):
        return Refused(400, Reason.INVALID_REQUEST, "a fragment in a request target")
    try:
        host, port = split_authority(where)
    except PolicyError as exc:
        return Refused(400, Reason.INVALID_REQUEST, f"invalid request target: {exc.message}")
    if not host:
        return Refused(400, Reason.INVALID_REQUEST, "a request target without a host")
    if path.startswith("?") or not path:
        path = "/" + path
    return host, port if port is not None else 80, path


def forwarded_fields(fields: Fields) -> Fields:
    """The end-to-end fields: hop-by-hop ones dropped, and every field the Connection fields
    name (RFC 9110 7.6.1)."""
    named = {
        token.strip().lower().encode("latin-1")
        for value in field_values(fields, b"connection")
        for token in value.split(",")
    }
    return [
        (k, v) for k, v in fields if (lower := k.lower()) not in HOP_BY_HOP and lower not in named
    ]


def _head(first: bytes, fields: Iterable[tuple[bytes, bytes]], extra: Sequence[bytes]) -> bytes:
    lines = [first]
    lines += [name + b": " + value for name, value in fields]
    lines += extra
    return b"\r\n".join(lines) + b"\r\n\r\n"


def request_head(
    method: str, path: str, fields: Fields, *, chunked: bool, upgrade: bool = False
) -> bytes:
    """The head sent upstream: origin form, HTTP/1.1, the fields as received (end-to-end only),
    then our framing (and the WebSocket upgrade's own two fields)."""
    extra = [b"Transfer-Encoding: chunked"] if chunked else []
    if upgrade:
        extra += [b"Connection: Upgrade", b"Upgrade: websocket"]
    first = f"{method} {path} HTTP/1.1".encode("latin-1")
    return _head(first, fields, extra)


def response_head(status: int, reason: bytes, fields: Fields, extra: Sequence[bytes]) -> bytes:
    return _head(b"HTTP/1.1 %d %s" % (status, reason), fields, extra)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never the last: an empty chunk would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data)
