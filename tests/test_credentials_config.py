"""The operator config's `credentials`, read as hostile input (every problem at its path and
file:line:column), the secrets read from files and variables (never shown in a message), the
check of each host against the policy, the pure injection both planes share, and COMMAND's
environment in the sandbox (the placeholder, never the secret)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from policy import compile_policy, load_manifest
from proxy.app.config import load_config
from proxy.app.credentials_config import SANDBOX_VARIABLES, credential_findings, reserved_variables
from proxy.app.secrets import MAX_SECRET, load_secrets
from proxy.boundary.sandbox.children import DROPPED_VARIABLES, PROXY_VARIABLES
from proxy.boundary.sandbox.command import command_env
from proxy.boundary.sandbox.options import RunAs
from proxy.common.errors import ProxyError
from proxy.common.settings import Config, Credential, Secret
from proxy.decide.injection import inject, render

GOOD = {
    "name": "github",
    "host": "api.github.com",
    "header": "Authorization",
    "value_file": "/run/secrets/github-token",
    "template": "Bearer {value}",
    "placeholder": "EGRESS-PLACEHOLDER-github",
    "env": "GITHUB_TOKEN",
}


def config_of(*entries: dict[str, Any], extra: str = "") -> str:
    import json

    return f"credentials: {json.dumps(list(entries))}\n{extra}"


def problems(text: str) -> dict[str, Any]:
    with pytest.raises(ProxyError) as info:
        load_config(text, source="config.yaml")
    assert info.value.reason == "invalid_config"
    return {f.path: f for f in info.value.details}


def test_a_full_entry_loads() -> None:
    config = load_config(config_of({**GOOD, "allow_plain_http": True}), source="c.yaml")
    (credential,) = config.credentials
    assert credential == Credential(
        "github", "api.github.com", "Authorization", "/run/secrets/github-token", None,
        "Bearer {value}", "EGRESS-PLACEHOLDER-github", "GITHUB_TOKEN", True, "credentials[0]",
    )  # fmt: skip
    assert credential.secret is None  # parsing reads no secret (check never does)
    minimal = {"name": "k", "host": "api.example.com", "header": "X-Key", "value_env": "K"}
    (plain,) = load_config(config_of(minimal)).credentials
    assert (plain.template, plain.placeholder, plain.env, plain.allow_plain_http) == (
        "{value}", None, None, False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        ({"name": "GitHub"}, "name", "lowercase letters"),
        ({"name": "a-b"}, "name", "lowercase letters"),
        ({"name": 7}, "name", "found a number"),
        ({"name": None}, "name", "is required"),
        ({"host": "*.github.com"}, "host", "never to its subdomains"),
        ({"host": "API.github.com"}, "host", "api.github.com"),
        ({"host": "10.0.0.1"}, "host", "IP address"),
        ({"host": "https://api.github.com"}, "host", "scheme"),
        ({"host": "api.github.com:443"}, "host", "port"),
        ({"header": "Host"}, "header", "proxy owns"),
        ({"header": "content-length"}, "header", "proxy owns"),
        ({"header": "Transfer-Encoding"}, "header", "proxy owns"),
        ({"header": "Connection"}, "header", "proxy owns"),
        ({"header": "Keep-Alive"}, "header", "proxy owns"),
        ({"header": "Upgrade"}, "header", "proxy owns"),
        ({"header": "TE"}, "header", "proxy owns"),
        ({"header": "Proxy-Authorization"}, "header", "proxy owns"),
        ({"header": ":authority"}, "header", "pseudo-header"),
        ({"header": "X Key"}, "header", "not a header field name"),
        ({"header": "X-Key\r\nEvil: 1"}, "header", "not a header field name"),
        ({"template": "Bearer"}, "template", "exactly once"),
        ({"template": "{value} {value}"}, "template", "exactly once"),
        ({"template": "Bearer {value} {x}"}, "template", "no other brace"),
        ({"template": "Bearer {value}}"}, "template", "no other brace"),
        ({"template": "Bearer\r\n{value}"}, "template", "visible ASCII"),
        ({"template": " {value}"}, "template", "start or end with a space"),
        ({"placeholder": "has space"}, "placeholder", "not a placeholder"),
        ({"placeholder": "x" * 300}, "placeholder", "at most 256"),
        ({"placeholder": "caf\u00e9"}, "placeholder", "not a placeholder"),
        ({"env": "1BAD"}, "env", "not an environment variable name"),
        ({"env": "HTTPS_PROXY"}, "env", "sandbox sets itself"),
        ({"env": "SSL_CERT_FILE"}, "env", "sandbox sets itself"),
        ({"env": "PATH"}, "env", "sandbox sets itself"),
        ({"value_file": "relative/token"}, "value_file", "absolute path"),
        ({"value_env": "X"}, "value_env", "not both"),
        ({"allow_plain_http": "yes"}, "allow_plain_http", "true or false"),
        ({"extra": 1}, "extra", "unknown key"),
    ],
)
def test_each_hostile_entry_is_refused_at_its_path(
    change: dict[str, Any], path: str, says: str
) -> None:
    entry = {**GOOD, **change}
    found = problems(config_of(entry))
    assert f"credentials[0].{path}" in found, found
    assert says in found[f"credentials[0].{path}"].message


def test_problems_are_reported_together_with_their_lines() -> None:
    text = (
        "credentials:\n"
        "  - name: a\n    host: a.example.com\n    header: Host\n    value_env: A\n"
        "  - name: a\n    host: a.example.com\n    header: X-K\n    env: K\n"
        "  - 7\n"
    )
    found = problems(text)
    assert found["credentials[0].header"].line == 4
    assert found["credentials[1]"].message.startswith("give exactly one of value_file")
    assert "needs a placeholder" in found["credentials[1].env"].message
    assert found["credentials[1].env"].line == 9
    assert "must be a mapping" in found["credentials[2]"].message


def test_names_variables_and_headers_are_unique() -> None:
    other = {**GOOD, "host": "uploads.github.com"}
    found = problems(config_of(GOOD, other))
    assert "already credentials[0]'s" in found["credentials[1].name"].message
    assert "already credentials[0]'s" in found["credentials[1].env"].message
    again = {**GOOD, "name": "second", "env": "OTHER", "header": "authorization"}
    assert "credentials[1].header" in problems(config_of(GOOD, again))


def test_env_without_placeholder_is_refused() -> None:
    entry = {k: v for k, v in GOOD.items() if k != "placeholder"}
    found = problems(config_of(entry))
    assert "EGRESS-PLACEHOLDER-github" in found["credentials[0].env"].message


def test_credentials_need_inspection() -> None:
    found = problems(config_of(GOOD, extra="inspection:\n  enabled: false\n"))
    assert "inspection.enabled: true" in found["credentials"].message


def test_the_sandbox_variables_are_all_reserved() -> None:
    # children.py is above the config's layer, so its names are repeated there: kept in step.
    assert {*PROXY_VARIABLES, *DROPPED_VARIABLES, "NO_PROXY", "no_proxy"} <= SANDBOX_VARIABLES
    assert "NODE_EXTRA_CA_CERTS" in reserved_variables()


# -- the secrets ------------------------------------------------------------------------------


def credential(**changes: Any) -> Credential:
    base = Credential("api", "api.test", "Authorization", None, "V", "Bearer {value}",
                      "PH", None, False, "credentials[0]")  # fmt: skip
    return dataclasses.replace(base, **changes)


def loaded(tmp_path: Path, data: bytes) -> bytes:
    path = tmp_path / "secret"
    path.write_bytes(data)
    config = Config(credentials=(credential(value_file=str(path), value_env=None),))
    (out,) = load_secrets(config).credentials
    assert out.secret is not None
    return out.secret.reveal()


def test_one_trailing_newline_is_not_part_of_the_secret(tmp_path: Path) -> None:
    assert loaded(tmp_path, b"abc\n") == b"abc"
    assert loaded(tmp_path, b"abc\r\n") == b"abc"
    assert loaded(tmp_path, b"abc") == b"abc"
    assert loaded(tmp_path, b"a b") == b"a b"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "empty"),
        (b"\n", "empty"),
        (b"SECRETPART\n\n", "CR, LF or NUL"),
        (b"SECRETPART\r\nEvil: 1", "CR, LF or NUL"),
        (b"SECRETPART\rx", "CR, LF or NUL"),
        (b"SECRETPART\0x", "CR, LF or NUL"),
        (b"SECRETPART\x1bx", "control or non-ASCII"),
        ("SECRETPART\u00e9".encode(), "control or non-ASCII"),
        (b" SECRETPART", "starts or ends with a space"),
        (b"S" * (MAX_SECRET + 2), "larger than"),
    ],
)
def test_a_secret_that_cannot_go_in_a_header_is_refused_unshown(
    tmp_path: Path, data: bytes, says: str
) -> None:
    with pytest.raises(ProxyError) as info:
        loaded(tmp_path, data)
    error = info.value
    assert error.reason == "credential_unreadable"
    assert says in str(error)
    assert "SECRETPART" not in str(error) and "SSSS" not in str(error)
    assert [d.path for d in error.details] == ["credentials[0].value_file"]


def test_unreadable_files_and_variables_name_the_entry(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    entries = (
        credential(name="missing", value_file=str(tmp_path / "absent"), value_env=None),
        credential(name="dir", value_file=str(tmp_path), value_env=None, path="credentials[1]"),
        credential(name="fifo", value_file=str(fifo), value_env=None, path="credentials[2]"),
        credential(name="unset", value_env="EGRESS_T_UNSET", path="credentials[3]"),
        credential(name="wide", value_env="EGRESS_T_WIDE", path="credentials[4]"),
    )
    with pytest.raises(ProxyError) as info:
        load_secrets(Config(credentials=entries, source="c.yaml"), {"EGRESS_T_WIDE": "\u00e9"})
    messages = {d.path: d.message for d in info.value.details}
    assert "'missing'" in messages["credentials[0].value_file"]
    assert "No such file" in messages["credentials[0].value_file"]
    assert "not a regular file" in messages["credentials[1].value_file"]
    assert "not a regular file" in messages["credentials[2].value_file"]
    assert "EGRESS_T_UNSET is not set" in messages["credentials[3].value_env"]
    assert "non-ASCII" in messages["credentials[4].value_env"]
    assert info.value.source == "c.yaml"


def test_a_secret_never_prints() -> None:
    marker = uuid.uuid4().hex
    config = Config(credentials=(credential(secret=Secret(marker.encode())),))
    assert marker not in repr(config) and marker not in str(config)
    assert marker not in repr(config.credentials[0].secret)


# -- against the policy -----------------------------------------------------------------------


def test_a_credential_host_must_be_allowed_on_its_ports() -> None:
    policy = compile_policy(load_manifest("network:\n  egress: [api.test]\n"))
    allowed = Config(credentials=(credential(),), source="c.yaml")
    assert credential_findings(policy, allowed) == []
    subdomain_only = compile_policy(
        load_manifest(
            'schema_version = 1\n[network_access]\nallowed = ["sub.api.test"]\n', source="a.toml"
        )
    )
    (finding,) = credential_findings(subdomain_only, allowed)
    assert finding.path == "credentials[0].host" and "api.test:443" in finding.message
    ports = Config(
        credentials=(credential(allow_plain_http=True),),
        operator=dataclasses.replace(allowed.operator, ports=frozenset({443})),
    )
    policy = compile_policy(load_manifest("network:\n  egress: [api.test]\n"), None, ports.operator)
    (finding,) = credential_findings(policy, ports)
    assert "api.test:80" in finding.message


# -- the injection both planes share ---------------------------------------------------------


def with_secret(value: bytes = b"S3CRET", **changes: Any) -> Credential:
    return credential(secret=Secret(value), **changes)


def test_a_placeholder_is_replaced_only_where_it_is_exactly_the_template() -> None:
    ours = with_secret()
    fields = [
        (b"Accept", b"*/*"),
        (b"authorization", b"Bearer PH "),  # whitespace around a value is not part of it
        (b"Authorization", b"Bearer PHX"),
        (b"X-Other", b"Bearer PH"),
    ]
    out, applied = inject([ours], "api.test", fields, plain_http=False)
    assert applied == ("api",)
    assert out == [
        (b"Accept", b"*/*"),
        (b"authorization", b"Bearer S3CRET"),
        (b"Authorization", b"Bearer PHX"),
        (b"X-Other", b"Bearer PH"),
    ]
    # Another host, a subdomain, or plain HTTP without allow_plain_http: untouched.
    for host, plain in (("other.test", False), ("sub.api.test", False), ("api.test", True)):
        assert inject([ours], host, fields, plain_http=plain) == (fields, ())
    plain_ok = with_secret(allow_plain_http=True)
    assert inject([plain_ok], "api.test", fields, plain_http=True)[1] == ("api",)
    assert inject([ours], "api.test", [(b"Accept", b"*/*")], plain_http=False)[1] == ()


def test_without_a_placeholder_the_header_is_ours_alone() -> None:
    ours = with_secret(header="X-Api-Key", template="{value}", placeholder=None)
    fields = [(b"x-api-key", b"guess"), (b"Accept", b"*/*"), (b"X-API-KEY", b"again")]
    out, _ = inject([ours], "api.test", fields, plain_http=False)
    assert out == [(b"X-Api-Key", b"S3CRET"), (b"Accept", b"*/*")]
    out, _ = inject([ours], "api.test", [(b"accept", b"*/*")], plain_http=False, lowercase=True)
    assert out == [(b"accept", b"*/*"), (b"x-api-key", b"S3CRET")]
    assert render("token={value};", b"v") == b"token=v;"


def test_a_credential_whose_secret_was_not_read_is_never_applied() -> None:
    assert inject([credential()], "api.test", [], plain_http=False) == ([], ())


# -- the sandbox ------------------------------------------------------------------------------


def test_command_gets_the_placeholder_and_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("REAL_TOKEN", secret)
    monkeypatch.setenv("ALSO_EXPORTED", f"Bearer {secret}")
    monkeypatch.setenv("GITHUB_TOKEN", "stale")
    monkeypatch.setenv("UNRELATED", "kept")
    entries = (
        with_secret(secret.encode(), value_env="REAL_TOKEN", env="GITHUB_TOKEN",
                    placeholder="EGRESS-PLACEHOLDER-github"),
    )  # fmt: skip
    env = command_env(
        "http://10.0.0.1:3128", "ns", RunAs(0, 0, "root", "/root"), credentials=entries
    )
    assert env["GITHUB_TOKEN"] == "EGRESS-PLACEHOLDER-github"
    assert "REAL_TOKEN" not in env and "ALSO_EXPORTED" not in env
    assert env["UNRELATED"] == "kept"
    assert all(secret not in value for value in env.values())


def test_the_example_config_has_a_credential_for_its_platform_destination() -> None:
    examples = Path(__file__).resolve().parent.parent / "examples"
    config = load_config((examples / "config.yaml").read_bytes(), source="config.yaml")
    (entry,) = config.credentials
    assert (entry.name, entry.host, entry.env) == (
        "model_gateway",
        "gateway.platform.svc.cluster.local",
        "MODEL_GATEWAY_TOKEN",
    )
    policy = compile_policy(
        load_manifest("network:\n  egress: [pypi.org]\n"), None, config.operator
    )
    assert credential_findings(policy, config) == []
