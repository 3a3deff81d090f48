"""CONNECT heads, read with httptools (llhttp): strict CRLF framing, no obs-fold, no bare CR or
LF, bounded. What a proxy must refuse on top of what the parser refuses is refused here: a body
on a CONNECT (Content-Length or Transfer-Encoding: a smuggling vector, and RFC 9110 gives
CONNECT no content), a missing or repeated Host on HTTP/1.1, a target that is not HOST:PORT."""

from __future__ import annotations

import re
from dataclasses import dataclass

import httptools

from policy import PolicyError
from policy.reasons import Reason
from policy.urls import split_authority
from proxy.common.refusals import Refused

# A CONNECT head is a line and a few headers; anything near this is not a CONNECT we want.
MAX_CONNECT_HEAD = 16 * 1024
CONNECT = b"CONNECT "
_REQUEST_LINE = re.compile(rb"CONNECT ([\x21-\x7e]+) HTTP/1\.([01])")


# Not frozen: one is made on every connection's path, and a frozen dataclass's __init__ costs
# three to four times a plain one's (object.__setattr__ per field). Treated as a value all the same.
@dataclass(slots=True)
class ConnectHead:
    host: str  # as written, brackets stripped
    port: int
    rest: bytes  # what the client sent after the head


def head_state(data: bytes | bytearray) -> str:
    """`connect` (a whole CONNECT head is there, or too much for one), `more` (a CONNECT head
    so far, not yet ended) or `other` (not a CONNECT: another request, or not HTTP)."""
    if not CONNECT.startswith(bytes(data[: len(CONNECT)])):
        return "other"
    if len(data) < len(CONNECT):
        return "more"
    if b"\r\n\r\n" in data or len(data) > MAX_CONNECT_HEAD:
        return "connect"
    return "more"


class _Validating:
    """httptools' protocol object for a head it only validates: no callbacks, so parsing never
    calls back into Python; what is kept of the head is read off its bytes, once llhttp
    accepted them (a header line then starts right after a CRLF, its name before a colon)."""

    __slots__ = ()


def parse_connect(data: bytes | bytearray) -> ConnectHead | Refused:
    """The CONNECT head at the start of `data` (head_state said `connect`), or the refusal to
    answer with."""
    end = data.find(b"\r\n\r\n")
    if end < 0 or end + 4 > MAX_CONNECT_HEAD:
        return Refused(431, Reason.INVALID_REQUEST, "the CONNECT head is too large")
    whole = bytes(data[: end + 4])
    parser = httptools.HttpRequestParser(_Validating())
    try:
        parser.feed_data(whole)
    except httptools.HttpParserUpgrade:
        pass  # CONNECT: the parser stops at the end of the head, as it should
    except httptools.HttpParserError as exc:
        return Refused(400, Reason.INVALID_REQUEST, f"invalid CONNECT request: {exc}")
    else:
        return Refused(400, Reason.INVALID_REQUEST, "invalid CONNECT request")
    line = _REQUEST_LINE.fullmatch(whole, 0, whole.find(b"\r\n"))
    if parser.get_method() != b"CONNECT" or line is None:
        # llhttp takes a run of spaces and any HTTP/x.y on the request line; one space each
        # and HTTP/1.x are the only spellings every reader agrees on.
        return Refused(400, Reason.INVALID_REQUEST, "invalid CONNECT request line")
    headers = whole[line.end() :].lower()
    if b"\r\ncontent-length:" in headers or b"\r\ntransfer-encoding:" in headers:
        return Refused(400, Reason.INVALID_REQUEST, "a CONNECT request has no body")
    hosts = headers.count(b"\r\nhost:")
    if hosts > 1 or (hosts == 0 and line[2] == b"1"):
        return Refused(
            400, Reason.INVALID_REQUEST, "an HTTP/1.1 request needs exactly one Host header"
        )
    target = line[1]
    try:
        host, port = split_authority(target.decode("ascii"))
    except (PolicyError, UnicodeDecodeError) as exc:
        return Refused(400, Reason.INVALID_REQUEST, f"invalid CONNECT target: {exc}")
    if port is None or not host:
        return Refused(400, Reason.INVALID_REQUEST, "a CONNECT target is HOST:PORT")
    return ConnectHead(host, port, bytes(data[end + 4 :]))
