"""The CONNECT head parser of the front door (proxy/frontdoor.py `_parse_connect`): its quick
path for plain heads must answer exactly as h11 does, for every head, valid or hostile.

A differential test: each generated head goes through `_parse_connect` and through h11 alone
(the parser as it was before the quick path), and the two answers must be identical: the same
host, port and trailing bytes, or the same refusal (status, reason, message)."""

from __future__ import annotations

import h11
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policy import PolicyError
from policy.urls import split_authority
from proxy.dataplane.frontdoor import MAX_CONNECT_HEAD, _parse_connect, _plain_connect
from proxy.reasons import INVALID_REQUEST, Refused

CURL_HEAD = (
    b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nUser-Agent: curl/8.5.0\r\n"
    b"Proxy-Connection: Keep-Alive\r\n\r\n"
)


def h11_only(data: bytes) -> tuple[str, int, bytes] | Refused:
    """`_parse_connect` with h11 alone."""
    if len(data) > MAX_CONNECT_HEAD and b"\r\n\r\n" not in data[:MAX_CONNECT_HEAD]:
        return Refused(431, INVALID_REQUEST, "the CONNECT head is too large")
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_CONNECT_HEAD)
    try:
        connection.receive_data(data)
        event = connection.next_event()
    except h11.RemoteProtocolError as exc:
        return Refused(400, INVALID_REQUEST, f"invalid CONNECT request: {exc}")
    if not isinstance(event, h11.Request) or event.method != b"CONNECT":
        return Refused(400, INVALID_REQUEST, "invalid CONNECT request")
    try:
        host, port = split_authority(event.target.decode("ascii"))
    except (PolicyError, UnicodeDecodeError) as exc:
        return Refused(400, INVALID_REQUEST, f"invalid CONNECT target: {exc}")
    if port is None or not host:
        return Refused(400, INVALID_REQUEST, "a CONNECT target is HOST:PORT")
    rest, _ = connection.trailing_data
    return host, port, bytes(rest)


def answer(result: tuple[str, int, bytes] | Refused) -> object:
    if isinstance(result, Refused):
        return ("refused", result.status, result.reason, result.message)
    return result


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
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n")  # no Host: h11 refuses HTTP/1.1
@example(b"CONNECT pypi.org:443 HTTP/1.0\r\n\r\n")  # HTTP/1.0 needs none
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\nHost: a\n\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: \x80\r\n\r\n")
@example(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: a\r\n\n\r\n\r\n")
def test_quick_path_answers_as_h11_does(head: bytes) -> None:
    assert answer(_parse_connect(head)) == answer(h11_only(head))


def test_quick_path_takes_what_clients_send() -> None:
    """The heads curl, Python and Go clients send take the quick path (else it buys nothing)."""
    for head in (
        CURL_HEAD,
        b"CONNECT pypi.org:443 HTTP/1.0\r\n\r\n",
        b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: [2001:db8::1]:443\r\n\r\n",
        b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nUser-Agent: Go-http-client/1.1"
        b"\r\nProxy-Authorization: Basic dTpw\r\n\r\n",
    ):
        assert _plain_connect(head + b"\x16\x03") is not None, head
        assert _plain_connect(head + b"\x16\x03")[1] == b"\x16\x03"  # type: ignore[index]


def test_quick_path_is_linear_on_hostile_lines() -> None:
    """A 16 KiB header line of whitespace with a bad byte at the end is refused at once (the
    header pattern cannot backtrack)."""
    import time

    head = b"CONNECT a:1 HTTP/1.1\r\nHost: a\r\nX: " + b" \t" * 8000 + b"\x01\r\n\r\n"
    started = time.process_time()
    assert _plain_connect(head) is None
    assert time.process_time() - started < 0.5
    assert answer(_parse_connect(head)) == answer(h11_only(head))
