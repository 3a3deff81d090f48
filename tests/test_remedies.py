"""Issue 13: every refusal names the host, the reason and the one change that would allow it,
in the manifest's own grammar, on one printable line an agent can act on (policy/remedies.py).

The remedy per reason is a pure function of the policy (policy/remedies.py, `Policy.remedy`);
the running proxy writes it as the last part of every HTTP refusal's body, while
`X-Egress-Denied` keeps the bare reason code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dns_server import DNSServer
from support.running import HTTPUpstream, RunningProxy, curl, exchange, http_upstream

from policy import Policy, Reason, compile_policy, load_ceiling, load_manifest
from policy.remedies import client_remedy, path_prefix, remedy
from proxy.common.refusals import Refused, refusal_parts, refusal_response

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

LOOPBACK = "127.0.0.1"
YAML = "network:\n  egress: [github.com, up.test]\n"
TOML = (
    "schema_version = 1\n[network_access]\n"
    'allowed = ["https://api.example.com/v1/", "http://plain.test:8080/a/", "1.2.3.4"]\n'
    'blocked = ["evil.example.com", "https://api.example.com/v1/admin/", "9.9.9.0/24"]\n'
)
NO_ENTRY = "no manifest entry can allow it"


def yaml_policy() -> Policy:
    return compile_policy(load_manifest(YAML, source="agent.yaml"))


def toml_policy() -> Policy:
    return compile_policy(load_manifest(TOML, source="agent.toml"))


def refused_remedy(policy: Policy, target: str) -> tuple[str, str | None]:
    decision = policy.decide(target)
    assert not decision.allowed, decision
    return decision.reason, policy.remedy(decision, target)


# -- the pure function, per reason and format ----------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("agent.yaml", "add 'denied.test' to network.egress"),
        ("agent.toml", "add 'denied.test' to network_access.allowed"),
    ],
)
def test_an_undeclared_name_is_added_in_the_manifests_own_grammar(fmt: str, expected: str) -> None:
    assert remedy(Reason.NOT_ALLOWED, "denied.test", manifest_format=fmt) == expected


def test_undeclared_names_through_the_policy_of_each_format() -> None:
    assert refused_remedy(yaml_policy(), "denied.test:443") == (
        "not_allowed",
        "add 'denied.test' to network.egress",
    )
    assert refused_remedy(toml_policy(), "denied.test:443") == (
        "not_allowed",
        "add 'denied.test' to network_access.allowed",
    )


def test_outside_the_ceiling_is_the_operators_change() -> None:
    ceiling = "egress: [github.com]\n"
    policy = compile_policy(
        load_manifest("network:\n  egress: [github.com, pypi.org]\n", source="agent.yaml"),
        load_ceiling(ceiling, source="ceiling.yaml"),
    )
    assert refused_remedy(policy, "pypi.org:443") == (
        "outside_ceiling",
        "the tenant ceiling does not include 'pypi.org': the operator must add it to the ceiling",
    )


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("evil.example.com:443", "remove network_access.blocked[0] ('evil.example.com')"),
        (
            "https://api.example.com/v1/admin/x",
            "remove network_access.blocked[1] ('https://api.example.com/v1/admin/')",
        ),
        ("9.9.9.9:443", "remove network_access.blocked[2] ('9.9.9.0/24')"),
    ],
)
def test_a_block_names_the_entry_to_remove(target: str, expected: str) -> None:
    assert refused_remedy(toml_policy(), target) == ("blocked", expected)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("https://api.example.com/v2/users?q=1", "https://api.example.com/v2/"),
        ("https://api.example.com/v2", "https://api.example.com/v2"),
        ("https://api.example.com/", "https://api.example.com/"),
        # The prefix is the one servers read (%61 is 'a'), on the request's scheme and port.
        ("https://api.example.com/%61pi/x", "https://api.example.com/api/"),
        ("http://plain.test:8080/b/c", "http://plain.test:8080/b/"),
    ],
)
def test_a_path_outside_the_prefixes_names_a_url_prefix_that_covers_it(
    target: str, expected: str
) -> None:
    policy = toml_policy()
    reason, text = refused_remedy(policy, target)
    assert (reason, text) == ("path_not_allowed", f"add '{expected}' to network_access.allowed")
    # The suggested entry is accepted by the manifest loader and does admit the request.
    fixed = TOML.replace('allowed = ["', f'allowed = ["{expected}", "')
    after = compile_policy(load_manifest(fixed, source="agent.toml"))
    assert not after.manifest.findings, after.manifest.findings
    assert after.decide(target).allowed, after.decide(target)


def test_path_prefix_is_the_first_segment_or_the_whole_host() -> None:
    assert path_prefix("/v2/users") == "/v2/"
    assert path_prefix("/v2") == "/v2"
    assert path_prefix("/") == "/"
    # Readings disagree on the first segment (RFC 3986 /x/api/, nginx /api/): the whole host.
    assert path_prefix("/x//../api/") == "/"
    assert path_prefix("/a%2Fb") is None  # refused outright: no prefix admits it


def test_a_path_rule_in_agent_yaml_can_only_add_the_host() -> None:
    text = remedy(Reason.PATH_NOT_ALLOWED, "h.test", path="/x/y", manifest_format="agent.yaml")
    assert text == "add 'h.test' to network.egress"


def test_ambiguous_paths_ask_for_the_plain_form() -> None:
    reason, text = refused_remedy(toml_policy(), "https://api.example.com/a%2Fb")
    assert reason == "ambiguous_path"
    assert text == (
        "request the path in its plain form (no '//', '..', encoded '/' or double encoding)"
    )


@pytest.mark.parametrize(
    ("target", "reason", "expected"),
    [
        ("93.184.216.34:443", "ip_literal", "name the host, not an IP address"),
        ("localhost:80", "loopback_name", f"'localhost' is an internal name; {NO_ENTRY}"),
        ("printer.local:80", "internal_name", f"'printer.local' is an internal name; {NO_ENTRY}"),
        ("buildbox:80", "single_label", "name the host by its fully qualified domain name"),
    ],
)
def test_names_refused_before_any_rule(target: str, reason: str, expected: str) -> None:
    assert refused_remedy(yaml_policy(), target) == (reason, expected)


@pytest.mark.parametrize(
    ("answer", "reason", "expected"),
    [
        (["10.0.0.1"], "private", f"'up.test' resolves to a non-public address; {NO_ENTRY}"),
        (["127.0.0.1"], "loopback", f"'up.test' resolves to a non-public address; {NO_ENTRY}"),
        (
            ["169.254.169.254"],
            "metadata",
            f"'up.test' resolves to a non-public address; {NO_ENTRY}",
        ),
        (["fe80::1"], "link_local", f"'up.test' resolves to a non-public address; {NO_ENTRY}"),
        (
            ["8.8.8.8", "10.0.0.1"],
            "mixed_answer",
            f"'up.test' resolves to a non-public address; {NO_ENTRY}",
        ),
        ([], "no_addresses", f"'up.test' resolves to no address; {NO_ENTRY}"),
    ],
)
def test_address_stage_refusals_say_no_manifest_entry_helps(
    answer: list[str], reason: str, expected: str
) -> None:
    policy = yaml_policy()
    checked = policy.check_addresses("up.test", answer)
    assert (checked.reason, policy.remedy(checked)) == (reason, expected)


def test_an_address_a_manifest_block_refuses_names_the_block() -> None:
    policy = toml_policy()
    for answer in (["9.9.9.9"], ["8.8.8.8", "9.9.9.9"]):
        checked = policy.check_addresses("x.test", answer)
        assert not checked.allowed
        assert policy.remedy(checked) == "remove network_access.blocked[2] ('9.9.9.0/24')"


def test_allowed_has_no_remedy() -> None:
    policy = yaml_policy()
    decision = policy.decide("github.com:443")
    assert decision.allowed and policy.remedy(decision, "github.com:443") is None


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (
            Reason.HOST_MISMATCH,
            "send one Host header naming the host this connection was opened for",
        ),
        (Reason.SNI_MISMATCH, "send the CONNECT host as the TLS SNI"),
        (Reason.UPGRADE_REFUSED, "only WebSocket upgrades pass: send the request without Upgrade"),
        (Reason.ECH_REFUSED, "connect without Encrypted ClientHello (ECH)"),
        (Reason.PROXY_LOOP, f"the destination is the proxy itself; {NO_ENTRY}"),
        (Reason.INVALID_REQUEST, None),
        (Reason.HEADER_TIMEOUT, None),
        (Reason.OVERLOAD, None),
        (Reason.INTERNAL_ERROR, None),
    ],
)
def test_runtime_reasons_give_the_client_its_fix_or_nothing(
    reason: str, expected: str | None
) -> None:
    assert client_remedy(reason) == expected
    assert remedy(reason, "h.test") == expected
    assert Refused(403, reason, "m").remedy == expected


# -- the one line ----------------------------------------------------------------------------------


def test_the_body_ends_with_the_remedy_and_the_header_stays_the_bare_reason() -> None:
    refused = Refused(403, Reason.NOT_ALLOWED, "m", remedy="add 'denied.test' to network.egress")
    headers, body = refusal_parts(403, "denied.test", 443, refused.reason, remedy=refused.remedy)
    assert headers["X-Egress-Denied"] == "not_allowed"
    assert body == (
        b"egress-proxy: denied.test:443 denied: not_allowed: add 'denied.test' to network.egress\n"
    )
    # No remedy: the line is as before.
    assert refusal_parts(503, "proxy", None, "overload", error=True)[1] == (
        b"egress-proxy: proxy failed: overload\n"
    )


def test_an_error_never_carries_a_remedy() -> None:
    refused = Refused(502, Reason.DNS_ERROR, "m", error=True, remedy="ignored")
    assert refused.remedy is None
    response = refusal_response(refused, "up.test", 443)
    assert response.endswith(b"\r\n\r\negress-proxy: up.test:443 failed: dns_error\n")
    assert b"X-Egress-Error: dns_error\r\n" in response


def test_a_hostile_host_stays_one_printable_capped_line() -> None:
    hostile = "a\r\nX-Evil: 1\x00\x7f\u00e9" + "b" * 5000
    text = remedy(Reason.NOT_ALLOWED, hostile)
    assert text is not None
    response = refusal_response(Refused(403, Reason.NOT_ALLOWED, "m", remedy=text), hostile, 443)
    head, body = response.split(b"\r\n\r\n", 1)
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    assert all(0x20 <= byte <= 0x7E for byte in body[:-1]), body[:300]
    assert len(body) < 1024
    assert b"X-Evil" not in head
    assert int(
        dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])[b"Content-Length"]
    ) == len(body)


# -- through the running proxy --------------------------------------------------------------------


@pytest.fixture
def upstream() -> Iterator[HTTPUpstream]:
    with http_upstream() as server:
        yield server


def test_the_running_proxy_names_the_network_egress_entry_on_connect_and_plain_http(
    tmp_path: Path, dns: DNSServer, upstream: HTTPUpstream
) -> None:
    # denied.test resolves (to the listening upstream): only the policy stops it.
    dns.set("denied.test", a=["127.0.0.1"])
    port = upstream.port
    line = f"egress-proxy: denied.test:{port} denied: not_allowed: "
    line += "add 'denied.test' to network.egress\n"
    with RunningProxy(tmp_path, YAML, dns=dns) as proxy:
        answer = exchange(
            proxy.port,
            b"CONNECT denied.test:%d HTTP/1.1\r\nHost: denied.test:%d\r\n\r\n" % (port, port),
            timeout=2.0,
        )
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403 "), answer[:300]
        assert b"\r\nX-Egress-Denied: not_allowed\r\n" in head + b"\r\n", head
        assert body == line.encode()
        plain = curl(proxy.port, f"http://denied.test:{port}/x")
        assert plain.status == 403, plain
        assert plain.headers.get("x-egress-denied") == "not_allowed", plain.headers
        assert plain.body == line
    assert upstream.connections == 0


def test_the_running_proxy_names_a_network_access_allowed_prefix_for_a_path(
    tmp_path: Path, dns: DNSServer, upstream: HTTPUpstream
) -> None:
    port = upstream.port
    # network_access makes it an agent.toml manifest, written here in YAML syntax.
    manifest = f"schema_version: 1\nnetwork_access:\n  allowed: ['http://up.test:{port}/api/']\n"
    dns.set("up.test", a=["127.0.0.1"])
    entry = f"http://up.test:{port}/other/"
    with RunningProxy(tmp_path, manifest, dns=dns) as proxy:
        plain = curl(proxy.port, f"http://up.test:{port}/other/page?q=1")
        assert plain.status == 403, plain
        assert plain.headers.get("x-egress-denied") == "path_not_allowed", plain.headers
        assert plain.body == (
            f"egress-proxy: up.test:{port} denied: path_not_allowed: "
            f"add '{entry}' to network_access.allowed\n"
        )
        assert curl(proxy.port, f"http://up.test:{port}/api/x").status == 200
    assert upstream.requests == ["/api/x"]
    # The entry named is one that admits the request.
    fixed = manifest.replace("allowed: [", f"allowed: ['{entry}', ")
    assert compile_policy(load_manifest(fixed)).decide(f"http://up.test:{port}/other/page").allowed


def test_the_running_proxy_keeps_a_hostile_host_on_one_printable_line(
    tmp_path: Path, dns: DNSServer
) -> None:
    # A Host-less absolute target with a very long name, and a Host header with a control
    # character and a byte beyond ASCII: the refusal is one printable, capped line.
    long_name = ".".join(["a" * 60] * 4) + ".test"  # 249 characters: a valid name
    with RunningProxy(tmp_path, YAML, dns=dns) as proxy:
        for request in (
            b"GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
            % (long_name.encode(), long_name.encode()),
            b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\x01\xe9"
            + b"x" * 3000
            + b"\r\nConnection: close\r\n\r\n",
            b"CONNECT %s:443 HTTP/1.1\r\n\r\n" % (b"\xe9" * 300 + b".test"),
        ):
            answer = exchange(proxy.port, request, timeout=2.0)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 4"), answer[:300]
            assert body.count(b"\n") == 1 and body.endswith(b"\n"), body[:300]
            assert all(0x20 <= byte <= 0x7E for byte in body[:-1]), body[:300]
            assert len(body) < 1024, len(body)
        connect = b"CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n" % ((long_name.encode(),) * 2)
        answer = exchange(proxy.port, connect, timeout=2.0)
        assert (
            answer.partition(b"\r\n\r\n")[2]
            == (
                f"egress-proxy: {long_name[:197]}... denied: not_allowed: "
                f"add '{long_name}' to network.egress\n"
            ).encode()
        )
    assert dns.queries == []
