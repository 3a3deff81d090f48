"""The CONNECT head parser of the front door (proxy/dataplane/heads.py, on httptools) against
h11 as an oracle: for every generated head, valid or hostile, both accept it with the same host,
port and trailing bytes, or both refuse it; the only differences allowed are the refusals of
ours that h11 does not make, each named below."""

from __future__ import annotations

import time

import h11
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policy import PolicyError
from policy.urls import split_authority
from proxy.common.refusals import Refused
from proxy.dataplane.heads import MAX_CONNECT_HEAD, head_state, parse_connect

CURL_HEAD = (
    b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nUser-Agent: curl/8.5.0\r\n"
    b"Proxy-Connection: Keep-Alive\r\n\r\n"
)


def h11_reading(data: bytes) -> tuple[str, int, bytes] | None:
    """What h11 makes of a CONNECT head: (host, port, trailing bytes), or None (refused)."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_CONNECT_HEAD)
    try:
        connection.receive_data(data)
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request) or event.method != b"CONNECT":
        return None
    try:
        host, port = split_authority(event.target.decode("ascii"))
    except (PolicyError, UnicodeDecodeError):
        return None
    if port is None or not host:
        return None
    rest, _ = connection.trailing_data
    return host, port, bytes(rest)


def ours(data: bytes) -> tuple[str, int, bytes] | None:
    head = parse_connect(data)
    return None if isinstance(head, Refused) else (head.host, head.port, head.rest)


def stricter_by_design(data: bytes) -> bool:
    """Heads we refuse although h11 takes them: a body announced on a CONNECT (RFC 9110 gives
    CONNECT no content; a framing header there is a smuggling attempt), and a line that does not
    end in CRLF (h11 takes a bare LF; RFC 9112 lets a recipient refuse it, and parsers that
    disagree on line ends are how requests are smuggled), and obs-fold (a header line that begins
    with white space: RFC 9112 lets a proxy refuse it, and it is refused everywhere here), and a
    version other than HTTP/1.0 and 1.1 (h11 reads any HTTP/x.y; there is no CONNECT of
    HTTP/1.x framing in another version), and a control byte (DEL, or below space other than
    tab) anywhere in the head, which llhttp refuses in header values."""
    end = data.find(b"\r\n\r\n")
    head = data[: end if end >= 0 else len(data)]
    lowered = head.lower()
    if b"\ncontent-length:" in lowered or b"\ntransfer-encoding:" in lowered:
        return True
    if b"\r\n " in head or b"\r\n\t" in head:
        return True
    if any(byte == 0x7F or (byte < 0x20 and byte not in b"\t\r\n") for byte in head):
        return True
    line = head.split(b"\r\n", 1)[0]
    if not (line.endswith((b" HTTP/1.1", b" HTTP/1.0"))):
        return True
    return head.replace(b"\r\n", b"").count(b"\n") + head.replace(b"\r\n", b"").count(b"\r") > 0


def _mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` 7 times in 8 (one_of weighs its branches alike): about half of the heads are
    plain enough for the quick path, the rest break one rule or another."""
    return st.integers(0, 7).flatmap(lambda n: rare if n == 0 else usual)


# Pieces a client (or an attacker) puts in a head: mostly well-formed, with the bytes that each
# rule of HTTP/1.1 (and of h11) is about mixed in.
_ODD_BYTES = [b"\x00", b"\x7f", b"\x80", b"\xff", b"\r", b"\n", b" ", b"\t", b"\x01", b'"', b"("]
_TARGETS = _mostly(
    st.sampled_from([b"pypi.org:443", b"[::1]:443", b"127.0.0.1:8443", b"xn--bcher-kva.example:1"]),
    st.one_of(
        st.sampled_from(
            [
                b"pypi.org",
                b":443",
                b"a:b",
                b"exa mple.com:443",
                b"h:99999",
                b"*",
                b"/path",
                b"http://pypi.org:443/",
                b"",
            ]
        ),
        st.lists(
            st.sampled_from([b"a", b"0", b".", b":", b"[", b"]", b"-", *_ODD_BYTES]), max_size=8
        ).map(b"".join),
    ),
)
_VERSIONS = _mostly(
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]),
    st.sampled_from([b"HTTP/2.0", b"HTTP/1.x", b"http/1.1", b"HTTP/1.1 ", b""]),
)
_METHODS = _mostly(st.just(b"CONNECT"), st.sampled_from([b"CONNECT ", b"CONNECTX", b"CONNECT\t"]))
_NAMES = _mostly(
    st.sampled_from([b"Host", b"host", b"HOST", b"User-Agent", b"Proxy-Connection"]),
    st.one_of(
        st.sampled_from(
            [
                b"Content-Length",
                b"content-length",
                b"Transfer-Encoding",
                b"Upgrade",
                b"Expect",
                b"X-Odd!#$%&'*+.^_`|~",
            ]
        ),
        st.lists(st.sampled_from([b"a", b"-", b" ", b":", *_ODD_BYTES]), max_size=4).map(b"".join),
    ),
)
_VALUES = _mostly(
    st.sampled_from([b"pypi.org:443", b"", b"curl/8.5.0", b"Keep-Alive", b"a  b", b"0", b"12"]),
    st.one_of(
        st.sampled_from([b"chunked", b"gzip", b"1, 1", b"1,2", b"100-continue"]),
        st.lists(st.sampled_from([b"v", b"1", b",", b" ", b"\t", *_ODD_BYTES]), max_size=6).map(
            b"".join
        ),
    ),
)
_SEPARATORS = _mostly(st.sampled_from([b": ", b":"]), st.sampled_from([b" : ", b":\t", b": \t "]))
_EOLS = _mostly(st.just(b"\r\n"), st.sampled_from([b"\n", b"\r", b"\r\r\n"]))
_HEADER = st.tuples(_NAMES, _SEPARATORS, _VALUES, _EOLS).map(b"".join)
_FOLD = st.tuples(st.sampled_from([b" ", b"\t"]), _VALUES, _EOLS).map(b"".join)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    line = b" ".join([draw(_METHODS), draw(_TARGETS), draw(_VERSIONS)]) + draw(_EOLS)
    headers = draw(st.lists(_mostly(_HEADER, _FOLD), max_size=4))
    end = draw(_mostly(st.just(b"\r\n"), st.sampled_from([b"\n", b"", b"\r\n\r\n"])))
    rest = draw(
        st.sampled_from([b"", b"\x16\x03\x01\x00\x05hello", b"\r\n", b"GET / HTTP/1.1\r\n"])
    )
    return line + b"".join(headers) + end + rest


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
@example(CURL_HEAD)
@example(CURL_HEAD + b"\x16\x03\x01")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n")  # no Host: refused on HTTP/1.1
@example(b"CONNECT pypi.org:443 HTTP/1.0\r\n\r\n")  # HTTP/1.0 needs none
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\nHost: a\n\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: \x80\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\n\n\r\n\r\n")
@example(b"CONNECT [github.com]:443 HTTP/1.1\r\nHost: a\r\n\r\n")
def test_our_parser_reads_every_head_as_h11_does(head: bytes) -> None:
    if head_state(head) != "connect":
        return  # not a whole CONNECT head: never parsed as one
    expected = h11_reading(head)
    got = ours(head)
    if got is None and expected is not None and stricter_by_design(head):
        return
    assert got == expected


def test_the_heads_clients_send_are_read() -> None:
    for head in (
        CURL_HEAD,
        b"CONNECT pypi.org:443 HTTP/1.0\r\n\r\n",
        b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: [2001:db8::1]:443\r\n\r\n",
        b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nUser-Agent: Go-http-client/1.1"
        b"\r\nProxy-Authorization: Basic dTpw\r\n\r\n",
    ):
        parsed = parse_connect(head + b"\x16\x03")
        assert not isinstance(parsed, Refused), head
        assert parsed.rest == b"\x16\x03"


def test_refusals_name_what_is_wrong() -> None:
    cases = {
        b"CONNECT a:1 HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n": "no body",
        b"CONNECT a:1 HTTP/1.1\r\n\r\n": "exactly one Host",
        b"CONNECT a HTTP/1.1\r\nHost: a\r\n\r\n": "HOST:PORT",
        b"CONNECT a:1 HTTP/1.1\r\nHost: a\r\n x\r\n\r\n": "invalid CONNECT request",
    }
    for head, text in cases.items():
        refused = parse_connect(head)
        assert isinstance(refused, Refused) and refused.status == 400, head
        assert text in refused.message, (head, refused.message)
    big = b"CONNECT a:1 HTTP/1.1\r\nHost: a\r\nX: " + b"x" * MAX_CONNECT_HEAD + b"\r\n\r\n"
    assert head_state(big) == "connect"
    refused = parse_connect(big)
    assert isinstance(refused, Refused) and refused.status == 431


def test_hostile_lines_are_refused_at_once() -> None:
    """A 16 KiB header line of whitespace with a bad byte at the end is refused in one pass."""
    head = b"CONNECT a:1 HTTP/1.1\r\nHost: a\r\nX: " + b" \t" * 8000 + b"\x01\r\n\r\n"
    started = time.process_time()
    assert isinstance(parse_connect(head), Refused)
    assert time.process_time() - started < 0.5
