import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy import PolicyError
from policy.urls import Target, normalize_path, parse_target, path_has_prefix, path_views


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/", "/"),
        ("/api/", "/api/"),
        ("/api/v1/x", "/api/v1/x"),
        ("/api/../admin", "/admin"),
        ("/api/%2e%2e/admin", "/admin"),
        ("/api/%2E%2E/admin", "/admin"),
        ("/api/.%2e/admin", "/admin"),
        ("/%61pi/", "/api/"),
        ("/a//b", "/a/b"),
        ("/api//../admin", "/admin"),
        ("/a/./b/.", "/a/b/"),
        ("/api/x/..", "/api/"),
        ("/..", "/"),
        ("/../../etc/passwd", "/etc/passwd"),
        ("/a%3fb", "/a%3Fb"),
        ("/caf%c3%a9", "/caf%C3%A9"),
        ("/~user/%7euser", "/~user/~user"),
    ],
)
def test_normalize_path(path: str, expected: str) -> None:
    assert normalize_path(path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "api/",  # relative
        "/a%2fb",  # encoded slash: servers disagree
        "/a%2Fb",
        "/a%5cb",  # encoded backslash
        "/a\\..\\admin",
        "/a%00b",
        "/a%zz",
        "/a%4",
        "/..;/admin",
        "/api/.;x/admin",
        "/a b",
        "/caf\u00e9",
    ],
)
def test_normalize_path_refuses_ambiguous_paths(path: str) -> None:
    with pytest.raises(PolicyError) as info:
        normalize_path(path)
    assert info.value.reason == "ambiguous_path"


@given(st.text(alphabet="/.%2eE5cCfF_a~;", max_size=30).map(lambda s: "/" + s))
def test_normalize_path_is_idempotent_and_dot_free(path: str) -> None:
    try:
        once = normalize_path(path)
    except PolicyError as exc:
        assert exc.reason == "ambiguous_path"
        return
    assert normalize_path(once) == once
    assert "/../" not in once + "/" and "/./" not in once + "/"
    assert "//" not in once


@pytest.mark.parametrize(
    ("path", "prefix", "expected"),
    [
        ("/api/x", "/api/", True),
        ("/api/", "/api/", True),
        ("/api", "/api/", False),
        ("/apiary", "/api/", False),
        ("/api", "/api", True),
        ("/api/x", "/api", True),
        ("/apiary", "/api", False),
        ("/anything", "/", True),
    ],
)
def test_path_has_prefix_respects_segments(path: str, prefix: str, expected: bool) -> None:
    assert path_has_prefix(path, prefix) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("github.com", Target("github.com")),
        ("github.com:8443", Target("github.com", 8443)),
        ("[::1]:80", Target("::1", 80)),
        ("[2001:db8::1]", Target("2001:db8::1")),
        ("::1", Target("::1")),
        ("https://a.example/x?q#f", Target("a.example", None, "https", "/x")),
        ("HTTP://A.example:8080", Target("A.example", 8080, "http", "/")),
        ("wss://a.example/socket", Target("a.example", None, "wss", "/socket")),
        ("https://[2001:db8::1]:8443/", Target("2001:db8::1", 8443, "https", "/")),
    ],
)
def test_parse_target(text: str, expected: Target) -> None:
    assert parse_target(text) == expected


def test_effective_port_defaults_from_scheme() -> None:
    assert parse_target("https://a.example/").effective_port == 443
    assert parse_target("ws://a.example/").effective_port == 80
    assert parse_target("a.example").effective_port is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "invalid_target"),
        ("ftp://a.example/", "unsupported_scheme"),
        ("https://user:pw@a.example/", "invalid_target"),
        ("https://good.example@evil.example/", "invalid_target"),
        ("a.example:0", "invalid_port"),
        ("a.example:65536", "invalid_port"),
        ("a.example:+80", "invalid_port"),
        ("a.example:８０", "invalid_port"),
        ("a.example/path", "invalid_target"),
        ("[::1", "invalid_target"),
        ("[::1]x", "invalid_target"),
        ("a.example\r\nHost: evil", "invalid_target"),
        ("a" * 9000, "invalid_target"),
    ],
)
def test_parse_target_refuses(text: str, reason: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_target(text)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("path", "views"),
    [
        ("/api/x", ("/api/x",)),
        ("/api/secret;jsessionid=1/data", ("/api/secret;jsessionid=1/data", "/api/secret/data")),
        ("/api/;/../admin", ("/api/admin", "/admin")),
        ("/a;b", ("/a;b", "/a")),
    ],
)
def test_path_views_cover_servers_that_drop_parameters(path: str, views: tuple[str, ...]) -> None:
    assert path_views(path) == views
