"""A TLS ClientHello reader for the L4 fast path: pure (no I/O, no asyncio, no mitmproxy).

The fast path must check the SNI of a CONNECT tunnel without importing mitmproxy (about 10 MB
per session), and the ClientHello is hostile input. So this module reads only what the gate needs
(the record framing, the ClientHello's fixed fields, the extension list, server_name and ALPN) and
refuses anything it cannot read one way only.

    hello = parse_client_hello(data)  # None: wait for more bytes
    hello.sni                         # "example.com", or None without a server_name extension

Formats: RFC 8446 §5.1 (records), §4.1.2 (ClientHello), §4.2 (extensions); RFC 6066 §3
(server_name); RFC 7301 §3.1 (ALPN).

The reference for the meaning of the result is mitmproxy's own parser
(`mitmproxy.proxy.layers.tls.parse_client_hello` and `mitmproxy.tls.ClientHello`), which the L7
engine uses; tests/test_clienthello.py checks the two against each other. Where a hello is
accepted by both, `sni` and `alpn_protocols` are the same, except for the deliberate differences
below. This parser is stricter: mitmproxy's ignores most declared vector lengths and reads to the
end of the message instead, which lets one byte string mean two things.

Refused by both (each `detail` here): `not_tls` (the first bytes cannot start a handshake
record), `record_header` (a later record is not a handshake record), `empty_record`, `truncated`
(a vector runs past the end of the message).

Stricter than mitmproxy (refused here, with these details, where mitmproxy accepts the hello or
at least some such hellos):

- `record_overflow`: a record longer than 2^14 bytes (RFC 8446 §5.1).
- `too_long`: the records carrying the hello exceed MAX_CLIENT_HELLO bytes (mitmproxy waits for
  up to 16 MiB).
- `handshake_type`: the first handshake message is not a ClientHello (mitmproxy never looks).
- `trailing_data`: bytes after the ClientHello in its last record (a client's first flight has
  nothing else in a handshake record; later records, e.g. 0-RTT data, are not looked at).
- `session_id_length` (> 32), `cipher_suites_length` (odd or empty), `compression_methods_length`
  (empty): the RFC's bounds.
- `extensions_length`: the extension block's length is not exactly what is left of the message.
- `duplicate_extension`: two extensions of one type (RFC 8446 §4.2 forbids it; mitmproxy takes the
  first valid server_name and the first ALPN, a server may take another one).
- `server_name_list`: the server_name list length is not the extension's length, or the list is
  empty or cut short (an empty extension is a ServerHello's, never a ClientHello's).
- `server_name_count`: more than one entry in the server_name list. RFC 6066 allows one name per
  name type and host_name is the only type; mitmproxy reports no SNI then (`sni is None`),
  OpenSSL refuses the hello. Refused, because "no SNI" would be a reading the server may not share.
- `server_name_type`: the one entry is not a host_name (mitmproxy: no SNI; OpenSSL refuses).
- `server_name_invalid`: the host_name is not an ASCII DNS name by mitmproxy's syntax (labels of
  1-63 letters, digits, `-`, `_`; at most 255 bytes with one optional trailing dot): empty,
  non-ASCII, a space or other character, an empty label. mitmproxy reports no SNI for those,
  except that its check also passes an IP address literal (RFC 6066 forbids them; `::1`,
  `fe80::1%eth0` are refused here, dotted IPv4 is a valid name by the syntax and passes to the
  policy, which refuses IP literals itself) and a label that ends in a newline (its regular
  expression ends in `$`, which matches before a final `\\n`: `example.com\\n` passes there).
- `alpn_list`, `alpn_empty_protocol`: the ALPN list length is not the extension's length, the
  list is empty, or a protocol name is empty (RFC 7301 §3.1).

Laxer than mitmproxy (a name here, no SNI there): mitmproxy also requires the host_name to
decode with Python's IDNA 2003 codec, so an A-label valid under IDNA 2008 / UTS-46 but not under
IDNA 2003 (`xn--fa-hia.de`, faß.de) reads as "no SNI" there. The policy normalises names with
UTS-46 (never IDNA 2003), so this parser returns the A-label as sent and leaves the name to the
policy, like every other name.

Bounded work: one pass over the record headers up to the end of the hello (never past
MAX_CLIENT_HELLO bytes of `data`), one join of the fragments, one pass over the message. Each
call starts over, so a caller that calls again after every read pays the record walk again: for
a client that dribbles one-byte records that is up to ~10,000 headers (~10 ms here) per call
until the cap; call again only when more bytes have arrived.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from policy.reasons import Reason

__all__ = [
    "ENCRYPTED_CLIENT_HELLO",
    "ESNI",
    "MAX_CLIENT_HELLO",
    "MAX_RECORD_PAYLOAD",
    "TOO_LONG",
    "ClientHello",
    "ClientHelloError",
    "parse_client_hello",
    "starts_like_tls",
]

TOO_LONG = "too_long"

# A real ClientHello is a few KiB (a post-quantum key share adds about 1-2 KiB); this bounds
# the bytes a caller buffers before the answer is no longer "wait for more".
MAX_CLIENT_HELLO = 64 * 1024
MAX_RECORD_PAYLOAD = 1 << 14

# Extensions that carry the real server name encrypted, so that the SNI the gate reads may not be
# the name served: ECH (draft-ietf-tls-esni-18 onwards, `encrypted_client_hello`) and the older
# draft ESNI (`encrypted_server_name`, drafts 01-06). GREASE ECH (RFC 9849 §6.2) uses 0xfe0d too
# and cannot be told apart from real ECH without the server's keys.
ENCRYPTED_CLIENT_HELLO = 0xFE0D
ESNI = 0xFFCE
_HIDDEN_NAME = frozenset({ENCRYPTED_CLIENT_HELLO, ESNI})

_HANDSHAKE = 0x16
_CLIENT_HELLO = 0x01
_SERVER_NAME = 0x0000
_ALPN = 0x0010
_HOST_NAME = 0x00
_MAX_SESSION_ID = 32
_MAX_HOST_NAME = 255
_U16 = struct.Struct(">H").unpack_from
_U16_U16 = struct.Struct(">HH").unpack_from
# mitmproxy's label syntax (mitmproxy.net.check) for every label, one optional trailing dot; one
# match for the whole name (a match per label cost three times as much). Each label ends at its
# dot, so the match never backtracks across labels.
_HOST_NAME_SYNTAX = re.compile(rb"(?:[A-Za-z0-9_-]{1,63}\.)*[A-Za-z0-9_-]{1,63}\.?")


class ClientHelloError(ValueError):
    """Bytes that are not, or not only, a well-formed TLS ClientHello.

    `reason` is one of Reason.NOT_TLS (the first bytes cannot start a TLS handshake record),
    Reason.INVALID_CLIENT_HELLO (TLS, but malformed or ambiguous) and TOO_LONG (over
    MAX_CLIENT_HELLO); `detail` is a stable snake_case name of the failed check, finer than
    `reason` (see the module docstring). A ValueError, as mitmproxy's parser raises, so callers
    written for that one catch this one.
    """

    def __init__(self, reason: str, message: str, *, detail: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ClientHello:
    """What the gate needs of a ClientHello."""

    sni: str | None
    """The host_name of the server_name extension as sent (case and one trailing dot kept),
    None without a server_name extension."""
    alpn_protocols: tuple[bytes, ...]
    """The ALPN protocol names in the client's order; empty without the extension."""
    legacy_version: int
    """The ClientHello's legacy_version (0x0303 for TLS 1.2 and 1.3)."""
    cipher_suites: tuple[int, ...]
    extensions: tuple[int, ...]
    """The extension types in the client's order (GREASE values included)."""
    end: int
    """How many bytes of `data` the records carrying the ClientHello take; bytes after that
    (e.g. a ChangeCipherSpec or 0-RTT data record) were not looked at."""

    @property
    def hidden_name(self) -> int | None:
        """ENCRYPTED_CLIENT_HELLO or ESNI when the hello carries one (the first in the client's
        order), else None: the name served may then not be `sni`."""
        for kind in self.extensions:
            if kind in _HIDDEN_NAME:
                return kind
        return None


def starts_like_tls(data: bytes) -> bool:
    """Whether `data` (non-empty) can be the start of a TLS handshake record: content type 0x16,
    then version 3.0-3.3 (SSL 3.0 to TLS 1.2; TLS 1.3 keeps 3.1 or 3.3 on the record layer).
    Fewer than three bytes are judged on what is there."""
    return bool(data) and _record_header_problem(data[:3]) is None


def parse_client_hello(data: bytes | bytearray) -> ClientHello | None:
    """The ClientHello at the start of `data`, the bytes a client sent so far on a tunnel.

    Returns None while the hello is incomplete (it may be split across reads and across several
    records); raises ClientHelloError as soon as the bytes so far cannot be the start of a
    well-formed ClientHello. Call it again with all the bytes once more have arrived.
    """
    data = bytes(data)
    size = len(data)
    fragments: list[bytes] = []
    head = b""  # the first handshake bytes (type and length), up to 4
    need = 0  # the handshake message's length, header included; 0 until the header is known
    have = 0  # handshake bytes in the complete records so far
    offset = 0
    while True:
        if (
            offset + 5 <= size
            and data[offset] == _HANDSHAKE
            and data[offset + 1] == 3
            and data[offset + 2] <= 3
        ):
            length = _U16(data, offset + 3)[0]
        else:
            _check_record_header(data[offset : offset + 5], offset)
            return None  # a good header, cut short
        if length == 0:
            # RFC 8446 §5.1: no empty handshake fragments (mitmproxy refuses them too).
            raise _invalid("empty_record", f"empty record at byte {offset}")
        if length > MAX_RECORD_PAYLOAD:
            raise _invalid(
                "record_overflow",
                f"record at byte {offset} is {length} bytes, over {MAX_RECORD_PAYLOAD}",
            )
        end = offset + 5 + length
        if end > MAX_CLIENT_HELLO:
            raise _too_long(f"the ClientHello's records run past {MAX_CLIENT_HELLO} bytes")
        fragment = data[offset + 5 : end]
        if not need:
            # Judged on the first bytes, even of an incomplete record: a refusal needs no wait.
            head += fragment[: 4 - len(head)]
            need = _handshake_length(head)
        if need and have + length > need:
            # Known from the record header already: no need to wait for the record's end.
            raise _invalid(
                "trailing_data",
                f"{have + length - need} bytes after the ClientHello in its last record",
            )
        if end > size:
            return None
        fragments.append(fragment)
        have += length
        if need and have == need:
            return _parse_message(b"".join(fragments), end)
        offset = end


def _check_record_header(header: bytes, offset: int) -> None:
    """Refuses `header` (up to 5 bytes, maybe fewer) if it cannot be a handshake record's."""
    problem = _record_header_problem(header)
    if problem is None:
        return
    if offset == 0:
        raise ClientHelloError(
            Reason.NOT_TLS, f"not a TLS handshake record: {problem}", detail=Reason.NOT_TLS
        )
    raise _invalid("record_header", f"record at byte {offset}: {problem}")


def _record_header_problem(header: bytes) -> str | None:
    if header[:1] and header[0] != _HANDSHAKE:
        return f"content type {header[0]:#04x}, not handshake (0x16)"
    if header[1:2] and header[1] != 3:
        return f"record version major {header[1]}, not 3"
    if header[2:3] and header[2] > 3:
        return f"record version 3.{header[2]}, not 3.0-3.3"
    return None


def _handshake_length(head: bytes) -> int:
    """The handshake message's length (header included) from its first bytes; 0 when fewer
    than 4 are known. Refuses a message that is no ClientHello or too long, on the first
    bytes that show it."""
    if head and head[0] != _CLIENT_HELLO:
        raise _invalid("handshake_type", f"handshake type {head[0]}, not ClientHello (1)")
    if len(head) < 4:
        return 0
    need = 4 + int.from_bytes(head[1:4])
    if need + 5 > MAX_CLIENT_HELLO:
        raise _too_long(f"a ClientHello of {need} bytes is over {MAX_CLIENT_HELLO}")
    return need


def _parse_message(msg: bytes, end: int) -> ClientHello:
    """The ClientHello in `msg`, one whole handshake message (its 4-byte header included)."""
    # Flat code with one cursor: this runs once per tunnel, and helper calls per field cost
    # more than the parsing itself.
    n = len(msg)
    pos = 4 + 2 + 32  # handshake header, legacy_version, random
    if pos + 1 > n:
        raise _cut("legacy_version, random or legacy_session_id")
    legacy_version = _U16(msg, 4)[0]
    sid_len = msg[pos]
    if sid_len > _MAX_SESSION_ID:
        raise _invalid("session_id_length", f"legacy_session_id of {sid_len} bytes, over 32")
    pos += 1 + sid_len
    if pos + 2 > n:
        raise _cut("legacy_session_id or cipher_suites")
    suites_len = _U16(msg, pos)[0]
    pos += 2
    if pos + suites_len > n:
        raise _cut("cipher_suites")
    if not suites_len or suites_len % 2:
        raise _invalid("cipher_suites_length", f"cipher_suites of {suites_len} bytes")
    cipher_suites = struct.unpack_from(f">{suites_len // 2}H", msg, pos)
    pos += suites_len
    if pos + 1 > n:
        raise _cut("legacy_compression_methods")
    methods_len = msg[pos]
    pos += 1 + methods_len
    if pos > n:
        raise _cut("legacy_compression_methods")
    if not methods_len:
        raise _invalid("compression_methods_length", "no legacy_compression_methods")

    sni: str | None = None
    alpn: tuple[bytes, ...] = ()
    types: list[int] = []
    if pos < n:  # before TLS 1.3 the whole extension block may be absent
        if pos + 2 > n:
            raise _cut("extensions length")
        declared = _U16(msg, pos)[0]
        pos += 2
        if declared != n - pos:
            raise _invalid(
                "extensions_length",
                f"extensions block of {declared} bytes, {n - pos} bytes left in the message",
            )
        seen: set[int] = set()
        while pos < n:
            if pos + 4 > n:
                raise _cut("extension header")
            kind, ext_len = _U16_U16(msg, pos)
            pos += 4
            if pos + ext_len > n:
                raise _cut(f"extension {kind:#06x}")
            if kind in seen:
                raise _invalid("duplicate_extension", f"extension {kind:#06x} appears twice")
            seen.add(kind)
            types.append(kind)
            if kind == _SERVER_NAME:
                sni = _server_name(msg[pos : pos + ext_len])
            elif kind == _ALPN:
                alpn = _alpn(msg[pos : pos + ext_len])
            pos += ext_len
    return ClientHello(
        sni=sni,
        alpn_protocols=alpn,
        legacy_version=legacy_version,
        cipher_suites=cipher_suites,
        extensions=tuple(types),
        end=end,
    )


def _server_name(ext: bytes) -> str:
    """RFC 6066 §3: server_name_list<1..2^16-1> of {name_type, HostName<1..2^16-1>}, here with
    exactly one entry, a host_name."""
    n = len(ext)
    if n <= 2 or _U16(ext, 0)[0] != n - 2:
        raise _invalid("server_name_list", "server_name list empty or not the extension's length")
    if n < 5 or 5 + _U16(ext, 3)[0] > n:
        raise _invalid("server_name_list", "server_name list cut short")
    name_end = 5 + _U16(ext, 3)[0]
    if name_end < n:
        raise _invalid("server_name_count", "server_name list holds more than one name")
    if ext[2] != _HOST_NAME:
        raise _invalid("server_name_type", f"server_name type {ext[2]}, not host_name (0)")
    name = ext[5:name_end]
    if not _valid_host_name(name):
        raise _invalid("server_name_invalid", f"server_name {name[:64]!r} is not a DNS name")
    return name.decode("ascii")


def _valid_host_name(name: bytes) -> bool:
    return 0 < len(name) <= _MAX_HOST_NAME and _HOST_NAME_SYNTAX.fullmatch(name) is not None


def _alpn(ext: bytes) -> tuple[bytes, ...]:
    """RFC 7301 §3.1: protocol_name_list<2..2^16-1> of ProtocolName<1..2^8-1>."""
    n = len(ext)
    if n <= 2 or _U16(ext, 0)[0] != n - 2:
        raise _invalid("alpn_list", "ALPN list empty or not the extension's length")
    names: list[bytes] = []
    pos = 2
    while pos < n:
        name_len = ext[pos]
        if not name_len:
            raise _invalid("alpn_empty_protocol", "empty ALPN protocol name")
        pos += 1 + name_len
        if pos > n:
            raise _invalid("alpn_list", "ALPN list cut short")
        names.append(ext[pos - name_len : pos])
    return tuple(names)


def _cut(what: str) -> ClientHelloError:
    return _invalid("truncated", f"{what} runs past the end of the message")


def _invalid(detail: str, message: str) -> ClientHelloError:
    # Callers say "invalid ClientHello" themselves (sni_gate, frontdoor): the message is the why.
    return ClientHelloError(Reason.INVALID_CLIENT_HELLO, message, detail=detail)


def _too_long(message: str) -> ClientHelloError:
    return ClientHelloError(TOO_LONG, message, detail=TOO_LONG)
