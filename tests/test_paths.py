"""URL paths as origin servers read them (policy/paths.py): every reading a mainstream server
may take, the forms refused outright, and the decision against allowed and blocked prefixes.

The properties check the decision against reference readings written here from the standards'
own algorithms (RFC 3986 5.2.4 `remove_dot_segments` on strings, `//` folding as nginx does it,
`;parameters` dropped as Tomcat does), not against the module's own reading code.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policy import PolicyError
from policy.paths import canonical_prefix, decide_path, readings

# -- reference readings ------------------------------------------------------------------------

_UNRESERVED = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def decode_unreserved(path: str) -> str:
    def one(match: re.Match[str]) -> str:
        ch = chr(int(match.group(1), 16))
        return ch if ch in _UNRESERVED else "%" + match.group(1).upper()

    return re.sub(r"%([0-9A-Fa-f]{2})", one, path)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, step by step on the string, as the RFC writes it."""
    inp, out = path, ""
    while inp:
        if inp.startswith("../"):
            inp = inp[3:]
        elif inp.startswith("./"):
            inp = inp[2:]
        elif inp.startswith("/./"):
            inp = "/" + inp[3:]
        elif inp == "/.":
            inp = "/"
        elif inp.startswith("/../") or inp == "/..":
            inp = "/" + inp[4:] if inp.startswith("/../") else "/"
            out = out[: out.rfind("/")] if "/" in out else ""
        elif inp in (".", ".."):
            inp = ""
        else:
            cut = inp.find("/", 1)
            cut = len(inp) if cut < 0 else cut
            out, inp = out + inp[:cut], inp[cut:]
    return out


def rfc(path: str) -> str:
    return remove_dot_segments(decode_unreserved(path))


def folded(path: str) -> str:
    return remove_dot_segments(re.sub("/+", "/", decode_unreserved(path)))


def tomcat(path: str) -> str:
    return folded(re.sub(r"(;|%3[Bb])[^/]*", "", path))


def under(path: str, prefix: str) -> bool:
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def blocked_by(path: str, prefix: str) -> bool:
    path, prefix = path.lower(), prefix.lower()
    return under(path, prefix) or (prefix.endswith("/") and path == prefix[:-1])


def test_the_reference_is_rfc_3986() -> None:
    # RFC 3986 5.4's own examples of dot-segment removal, and the issue's two.
    assert remove_dot_segments("/a/b/c/./../../g") == "/a/g"
    assert remove_dot_segments("mid/content=5/../6") == "mid/6"
    assert remove_dot_segments("/x//../api/") == "/x/api/"
    assert remove_dot_segments("/admin//../x") == "/admin/x"
    assert folded("/x//../api/") == "/api/"


# -- allowed prefixes --------------------------------------------------------------------------

API = ["/api/"]


@pytest.mark.parametrize(
    ("path", "verdict"),
    [
        ("/api/x", "allowed"),
        ("/api/", "allowed"),
        ("/api//", "allowed"),
        ("/api/x//y", "allowed"),
        ("/api/./x", "allowed"),
        ("/api/x/../y", "allowed"),
        ("/%61pi/x", "allowed"),
        ("/api/x;v=1/y", "allowed"),
        ("/api/v1/models/m:predict", "allowed"),  # a colon in a name is fine for allows
        ("/api/caf%C3%A9", "allowed"),
        ("/api/stra%C3%9Fe", "allowed"),  # 'ß' has no one-character ASCII case mapping
        ("/api/100%25", "allowed"),  # a literal '%': nothing for a second decoding to find
        ("/api/%25zz", "allowed"),
        ("/api/x?q=/../../admin", "allowed"),  # the query is not the path
        ("/api/x/", "allowed"),
        # Outside on RFC 3986's reading: path_not_allowed.
        ("/api", "outside"),
        ("/apiary", "outside"),
        ("/x//../api/", "outside"),  # RFC 3986 and WHATWG: /x/api/
        ("/api/../admin", "outside"),
        ("/api/%2e%2e/admin", "outside"),
        ("/api/%2E%2E/admin", "outside"),
        ("/api/.%2e/admin", "outside"),
        ("/api/x/../../admin", "outside"),
        ("/api./x", "outside"),
        ("/api%20/x", "outside"),
        ("/API/x", "outside"),  # allowed prefixes compare exactly
        # Inside on RFC 3986's reading, outside on another: ambiguous.
        ("/api//../x", "ambiguous"),  # nginx, Go: /x
        ("/api/x//../../y", "ambiguous"),  # RFC: /api/y; folded: /y
        ("/api/;/../admin", "ambiguous"),  # Tomcat: /api//../admin folded, /admin
        ("/api/x/..", "ambiguous"),  # Go's ServeMux: /api
        ("/api/.", "ambiguous"),
        ("/x/../api/y", "ambiguous"),  # Express matches the raw path: under /x/
    ],
)
def test_an_allow_holds_on_every_reading(path: str, verdict: str) -> None:
    assert decide_path(path, API, []).verdict == verdict


REFUSED = [
    "api/x",  # not absolute
    "/api/%2fadmin",
    "/api/%2Fadmin",
    "/api/%5cadmin",
    "/api/\\..\\admin",
    "/api/%00",
    "/api/%0a",
    "/api/%7f",
    "/api/%zz",
    "/api/%4",
    "/api/ x",
    "/api/\t",
    "/api/caf\u00e9",
    "/api/#/../../admin",  # a client never sends a fragment; a server may read it as a path
    # Double encoding, in every spelling a second decoding would read.
    "/api/%2561",
    "/api/%252e%252e/admin",
    "/api/%252E%252E/admin",
    "/api/%25%32%65",
    "/api/%25%2532%2565",
    "/%2561dmin/",
    # Escaped bytes that are not UTF-8, or that servers fold to ASCII.
    "/api/%C0%AE%C0%AE/admin",  # overlong '.'
    "/api/%C1%A1",  # overlong 'a'
    "/api/%E9t%E9",  # Latin-1
    "/api/%C3",  # cut short
    "/api/%EF%BC%8F..%EF%BC%8Fadmin",  # fullwidth solidus
    "/api/%EF%BD%81dmin",  # fullwidth 'a'
    "/api/%E2%80%A4%E2%80%A4/admin",  # one dot leader: NFKC '.'
    "/api/%C2%A0",  # NBSP: NFKC ' '
    "/api/%E2%84%AA",  # the Kelvin sign lowercases to 'k'
    "/api/%C5%BF",  # the long s uppercases to 'S'
    "/api/%C4%B1",  # the dotless i uppercases to 'I'
    # Segments whose kind depends on the server.
    "/api/...",
    "/api/..%20/admin",
    "/api/.%20/admin",
    "/api/%20/x",
    "/api/..;/admin",
    "/api/.;x/admin",
    "/api/..%3B/admin",
    "/api/%2e%2e;x/admin",
    "/api/..:x/admin",  # as a Windows name: '..'
    "/api/..%3A%3A$DATA/admin",
    "/api/:x/",  # as a Windows name: empty
    "/api/..%20;x/admin",
]


@pytest.mark.parametrize("path", REFUSED)
def test_forms_no_reading_settles_are_refused(path: str) -> None:
    with pytest.raises(PolicyError) as info:
        readings(path)
    assert info.value.reason == "ambiguous_path"
    assert "servers disagree" in info.value.message
    decided = decide_path(path, API, [])
    assert decided.verdict == "ambiguous" and decided.problem is not None
    assert decide_path(path, None, ["/admin/"]).verdict == "ambiguous"


# -- blocked prefixes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/admin/",
        "/admin",
        "/admin/x",
        "/ADMIN",
        "/Admin/x",
        "/%61dmin/",
        "/%41DMIN/",
        "/admin./",
        "/admin.",
        "/admin..",
        "/admin%20/",
        "/admin%20",
        "/admin.%20./x",
        "/admin;x/",
        "/admin;x",
        "/admin%3Bx/y",
        "/admin::$DATA/x",
        "/admin%3A%3A$DATA/",
        "/admin:$i30:$INDEX_ALLOCATION/x",
        "//admin/",
        "/x/../admin/",
        "/x/%2e%2e/admin/",
        "/x/%2E%2E/admin",
        "/./admin/",
        "/admin/.",
        "/admin//../x",  # RFC 3986: /admin/x
        "/admin/../x",  # dot segments left in (Express): under /admin/
        "/admin/x/../../y",
        "/x;y/../admin/",
        "/api/;/../../admin/",
    ],
)
def test_a_block_catches_every_spelling_a_server_may_read_as_it(path: str) -> None:
    decided = decide_path(path, None, ["/x/y/", "/admin/"])
    assert (decided.verdict, decided.index) == ("blocked", 1), decided
    # The same under an allow that admits the rest of the host.
    assert decide_path(path, ["/"], ["/admin/"]).verdict == "blocked"


@pytest.mark.parametrize(
    "path", ["/administrator", "/admins/", "/public", "/x/admin/", "/admin-x", "/%61dmins"]
)
def test_a_block_is_a_segment_prefix(path: str) -> None:
    assert decide_path(path, None, ["/admin/"]).verdict == "allowed"


def test_a_block_without_a_slash_ends_at_a_segment() -> None:
    assert decide_path("/admin.json", None, ["/admin"]).verdict == "allowed"
    assert decide_path("/admin/x", None, ["/admin"]).verdict == "blocked"
    assert decide_path("/ADMIN.", None, ["/admin"]).verdict == "blocked"


def test_the_deciding_reading_is_reported() -> None:
    decided = decide_path("/admin//../x", None, ["/admin/"])
    assert decided.reading is not None and decided.reading.path == "/admin/x"
    assert "RFC 3986" in decided.reading.how
    decided = decide_path("/api//../x", API, [])
    assert decided.reading is not None and decided.reading.path == "/x"
    assert "folded" in decided.reading.how
    decided = decide_path("/admin%20/", None, ["/admin/"])
    assert decided.reading is not None and "Windows" in decided.reading.how


def test_the_allowed_prefix_that_admits_is_named() -> None:
    assert decide_path("/b/x", ["/a/", "/b/"], []).index == 1
    assert decide_path("/c/x", ["/a/", "/b/"], []).verdict == "outside"


def test_no_prefix_no_look_at_the_path() -> None:
    # A host admitted whole with no blocked path: the path is not read at all.
    assert decide_path("/a%2fb", None, []).verdict == "allowed"


# -- prefixes as written in a manifest ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "canonical"),
    [
        ("/", "/"),
        ("/api/", "/api/"),
        ("/api", "/api"),
        ("/v1/models/m:predict", "/v1/models/m:predict"),
        ("/a//b/", "/a/b/"),
        ("/a/./b", "/a/b"),
        ("/a/../b/", "/b/"),
        ("/%61pi/", "/api/"),
        ("/a%3fb", "/a%3Fb"),
        ("/caf%c3%a9/", "/caf%C3%A9/"),
    ],
)
def test_canonical_prefix(path: str, canonical: str) -> None:
    assert canonical_prefix(path) == canonical


@pytest.mark.parametrize("path", ["/a%2fb/", "/a;x/", "/a%3Bx/", "/admin./", "/a%20/", "/%2561/"])
def test_prefixes_no_request_could_match_on_every_reading_are_refused(path: str) -> None:
    with pytest.raises(PolicyError) as info:
        canonical_prefix(path)
    assert info.value.reason == "ambiguous_path"


# -- properties --------------------------------------------------------------------------------

PIECES = [
    "/", "/", "/", ".", "..", "%2e", "%2E", "%2e%2e", ";", ";x", "a", "api", "admin", "ADMIN",
    "%61", "%20", "%25", "61", ":", "$DATA", "x", "%3B", "%3a", "~", "%7E", "v1", "secret",
]  # fmt: skip
paths = st.lists(st.sampled_from(PIECES), max_size=14).map(lambda t: "/" + "".join(t))
ALLOWED = ["/api/", "/api", "/", "/api/v1/", "/a/", "/admin/x"]
BLOCKED = ["/admin/", "/admin", "/a/", "/api/secret/", "/x/"]


@settings(max_examples=3000, deadline=None)
@given(paths, st.lists(st.sampled_from(ALLOWED), min_size=1, max_size=2))
@example("/x//../api/", ["/api/"])
@example("/api//../x", ["/api/"])
@example("/api/;/../admin", ["/api/"])
def test_an_allowed_path_is_inside_on_every_reference_reading(
    path: str, allowed: list[str]
) -> None:
    decided = decide_path(path, allowed, [])
    if decided.verdict != "allowed":
        return
    for reading in (rfc(path), folded(path), tomcat(path)):
        assert any(under(reading, prefix) for prefix in allowed), (path, reading)
    for reading in readings(path)[0]:
        assert any(under(reading.path, prefix) for prefix in allowed), (path, reading)


@settings(max_examples=3000, deadline=None)
@given(paths, st.sampled_from(BLOCKED))
@example("/admin//../x", "/admin/")
@example("/admin./", "/admin/")
@example("/admin%20/", "/admin/")
def test_a_path_that_passes_a_block_is_outside_it_on_every_reading(path: str, block: str) -> None:
    decided = decide_path(path, None, [block])
    if decided.verdict != "allowed":
        assert decided.verdict in ("blocked", "ambiguous")
        return
    references = (rfc(path), folded(path), tomcat(path), decode_unreserved(path))
    for reading in references:
        assert not blocked_by(reading, block), (path, reading)
    for reading in readings(path)[1]:
        assert not blocked_by(reading.path, block), (path, reading)


@settings(max_examples=1000, deadline=None)
@given(paths)
def test_readings_start_with_rfc_3986_and_blocks_see_more(path: str) -> None:
    try:
        allow, block = readings(path)
    except PolicyError as exc:
        assert exc.reason == "ambiguous_path"
        return
    assert allow[0].path == rfc(path)
    assert set(allow) <= set(block)
    assert any(r.path == folded(path) for r in allow)


@settings(max_examples=1000, deadline=None)
@given(paths)
def test_a_canonical_prefix_is_its_own_only_reading(path: str) -> None:
    try:
        canonical = canonical_prefix(path)
    except PolicyError as exc:
        assert exc.reason == "ambiguous_path"
        return
    assert canonical_prefix(canonical) == canonical
    allow, block = readings(canonical)
    assert [r.path for r in allow] == [canonical]
    assert block[0].path == canonical
