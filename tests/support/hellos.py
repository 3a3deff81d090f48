"""ClientHellos for the tests: built byte by byte (TLS's vectors, records, extensions), for the
parser's edge cases, and the first flight of a real client (Python's ssl, that is OpenSSL)."""

from __future__ import annotations

import functools
import ssl
from typing import Any

import pytest

from proxy.decide.clienthello import MAX_RECORD_PAYLOAD


def vec8(data: bytes) -> bytes:
    return bytes([len(data)]) + data


def vec16(data: bytes) -> bytes:
    return len(data).to_bytes(2) + data


def handshake(body: bytes, kind: int = 1) -> bytes:
    return bytes([kind]) + len(body).to_bytes(3) + body


def records(message: bytes, sizes: list[int] | None = None, version: int = 0x0301) -> bytes:
    """`message` framed as handshake records whose payloads take `sizes` in turn (cycled)."""
    sizes = sizes or [MAX_RECORD_PAYLOAD]
    out: list[bytes] = []
    pos = 0
    i = 0
    while pos < len(message):
        chunk = message[pos : pos + sizes[i % len(sizes)]]
        out.append(b"\x16" + version.to_bytes(2) + vec16(chunk))
        pos += len(chunk)
        i += 1
    return b"".join(out)


def sni_ext(*names: bytes, name_type: int = 0) -> tuple[int, bytes]:
    return 0, vec16(b"".join(bytes([name_type]) + vec16(n) for n in names))


def alpn_ext(*protocols: bytes) -> tuple[int, bytes]:
    return 16, vec16(b"".join(vec8(p) for p in protocols))


def hello_body(
    extensions: list[tuple[int, bytes]] | None,
    *,
    version: int = 0x0303,
    session_id: bytes = b"\x55" * 32,
    suites: bytes = b"\x13\x01\x13\x02",
    compression: bytes = b"\x00",
) -> bytes:
    body = version.to_bytes(2) + b"\xaa" * 32 + vec8(session_id) + vec16(suites)
    body += vec8(compression)
    if extensions is not None:
        body += vec16(b"".join(kind.to_bytes(2) + vec16(data) for kind, data in extensions))
    return body


def tls(extensions: list[tuple[int, bytes]] | None, **fields: Any) -> bytes:
    return records(handshake(hello_body(extensions, **fields)))


BASE_EXTENSIONS: list[tuple[int, bytes]] = [
    sni_ext(b"example.com"),
    alpn_ext(b"h2", b"http/1.1"),
    (43, vec8(b"\x03\x04\x03\x03")),
    (51, vec16(b"\x00\x1d" + vec16(b"\x42" * 32))),
]


@functools.cache
def python_hello(sni: str | None, alpn: tuple[str, ...] = ()) -> bytes:
    """The first flight of Python's ssl (OpenSSL) client."""
    context = ssl.create_default_context()
    if sni is None:
        context.check_hostname = False
    if alpn:
        context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()
