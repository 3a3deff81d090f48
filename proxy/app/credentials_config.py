"""The operator config's `credentials` section: its entries read and checked as hostile input
(`read_credentials`, one section of proxy/app/config.py), the secrets read from their files or
variables (proxy/app/secrets.py), and each host checked against the compiled policy
(`credential_findings`: `check` reports them, `run` refuses them).

    credentials:
      - name: github                 # audit lines and metrics; unique
        host: api.github.com         # exact host
        header: Authorization
        value_file: /run/secrets/github-token   # or value_env: NAME
        template: "Bearer {value}"   # optional
        placeholder: EGRESS-PLACEHOLDER-github   # optional
        env: GITHUB_TOKEN            # optional, needs placeholder
        allow_plain_http: false      # optional

No message here ever holds a secret: a value that cannot be used is described, never shown.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from policy.findings import Finding, describe_type, quote
from policy.hostnames import check_entry
from proxy.common.errors import ProxyError
from proxy.common.settings import Config, Credential
from proxy.decide.injection import VALUE

if TYPE_CHECKING:
    from policy import Policy
    from proxy.app.config_reader import ConfigReader, Section

KEYS: Final = (
    "name",
    "host",
    "header",
    "value_file",
    "value_env",
    "template",
    "placeholder",
    "env",
    "allow_plain_http",
)
# The shape of a reason code, so a name is also a metric label as it is (proxy/ops/metrics.py).
_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.6.2 tchar
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_PLACEHOLDER: Final = 256
MAX_TEMPLATE: Final = 256
# Fields the proxy itself must own: the request's target and framing, the connection's own
# (hop-by-hop, RFC 9110 7.6.1) and the proxy's (Proxy-*, matched by prefix below).
_OWNED: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "http2-settings",
    }
)
# What the sandbox sets in COMMAND's environment itself (proxy/boundary/sandbox/command.py and
# children.py, which this layer may not import: tests/test_credentials_config.py checks the two
# agree); with the trust variables (proxy/tls/bundle.py), what a credential's `env` may not be.
SANDBOX_VARIABLES: Final = frozenset(
    {
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "http_proxy",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
        "FTP_PROXY",
        "ftp_proxy",
        "NO_PROXY",
        "no_proxy",
        "EGRESS_PROXY_SANDBOX",
        "HOME",
        "USER",
        "LOGNAME",
        "PATH",
    }
)


def reserved_variables() -> frozenset[str]:
    """Every variable the sandbox sets for COMMAND itself."""
    # Imported here: the trust module is not needed to read a config without credentials.
    from proxy.tls.bundle import TRUST_VARIABLES

    return SANDBOX_VARIABLES | {name for name, _, _ in TRUST_VARIABLES}


# -- the section ---------------------------------------------------------------------------


def read_credentials(top: Section, *, inspection_enabled: bool) -> tuple[Credential, ...]:
    """The `credentials` list, every problem recorded at its path (`credentials[0].host`)."""
    reader = top.reader
    credentials: list[Credential] = []
    for path, item in top.items("credentials"):
        credential = _entry(reader, path, item)
        if credential is not None:
            credentials.append(credential)
    _check_unique(reader, credentials)
    if top.get("credentials") and not inspection_enabled:
        reader.problem(
            "credentials",
            "credentials",
            "inspection_disabled",
            "a credential is put in inside TLS interception, which needs inspection.enabled: true",
        )
    return tuple(credentials)


def _entry(reader: ConfigReader, path: str, item: Any) -> Credential | None:
    if not isinstance(item, dict):
        reader.problem(
            path,
            item,
            "not_a_mapping",
            "must be a mapping with name, host, header and value_file or value_env, found "
            f"{describe_type(item)}",
        )
        return None
    entry = reader.section(item, path, KEYS, where=path)
    count = len(reader.problems)
    name = _required(entry, "name", _check_name)
    host = _required(entry, "host", _check_host)
    header = _required(entry, "header", _check_header)
    value_file, value_env = _source(entry)
    template = entry.read("template", _check_template, VALUE)
    placeholder = entry.read("placeholder", _check_placeholder, None)
    env = entry.read("env", _check_env, None)
    plain = entry.flag("allow_plain_http", False)
    if env is not None and placeholder is None and "placeholder" not in item:
        reader.problem(
            entry.path("env"),
            env,
            "missing_key",
            "needs a placeholder: the sandbox sets the variable to the placeholder, and "
            "without one the header is set on every request whatever the client sends; add "
            f"placeholder: EGRESS-PLACEHOLDER-{name or 'NAME'}",
        )
    if len(reader.problems) > count or None in (name, host, header):
        return None
    assert name is not None and host is not None and header is not None
    return Credential(
        name, host, header, value_file, value_env, template, placeholder, env, plain, path
    )


def _required(entry: Section, key: str, check: Any) -> str | None:
    if key not in entry.mapping or entry.get(key) is None:
        entry.reader.problem(entry.path(key), None, "missing_key", "is required")
        return None
    result: str | None = entry.read(key, check, None)
    return result


def _source(entry: Section) -> tuple[str | None, str | None]:
    """`value_file` or `value_env`, exactly one."""
    value_file = entry.read("value_file", _check_file, None)
    value_env = entry.read("value_env", _check_variable, None)
    given = [key for key in ("value_file", "value_env") if entry.get(key) is not None]
    if len(given) != 1:
        entry.reader.problem(
            entry.path("value_env") if given else entry.where,
            None,
            "invalid_value" if given else "missing_key",
            "give exactly one of value_file (a file holding the secret) and value_env (a "
            "variable holding it)" + (", not both" if given else ""),
        )
    return value_file, value_env


def _check_unique(reader: ConfigReader, credentials: Sequence[Credential]) -> None:
    """Names identify a credential in audit lines and metrics; one host's header can hold only
    one credential; one variable can hold only one placeholder."""
    seen: dict[tuple[str, Any], Credential] = {}
    for credential in credentials:
        keys = (
            ("name", credential.name),
            ("header", (credential.host, credential.header.lower())),
            ("env", credential.env),
        )
        for key, value in keys:
            if value is None:
                continue
            first = seen.setdefault((key, value), credential)
            if first is credential:
                continue
            what = {
                "name": f"the name {quote(credential.name)}",
                "header": f"{credential.host}'s header {quote(credential.header)}",
                "env": f"the variable {quote(credential.env)}",
            }[key]
            reader.problem(
                f"{credential.path}.{key}",
                value if key != "header" else credential.header,
                f"duplicate_{key}",
                f"{what} is already {first.path}'s",
            )


# -- values --------------------------------------------------------------------------------


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be {what}, found {describe_type(value)}")
    if not value:
        raise ValueError(f"must be {what}, found an empty string")
    return value


def _check_name(value: Any) -> str:
    text = _text(value, "a name string")
    if not _NAME.fullmatch(text):
        raise ValueError(
            f"{quote(text)} is not a credential name: lowercase letters, digits and '_', "
            "starting with a letter, at most 64 (it labels audit lines and metrics)"
        )
    return text


def _check_host(value: Any) -> str:
    text = _text(value, "a hostname string")
    if "*" in text:
        raise ValueError(
            f"{quote(text)}: a credential goes to one exact host, never to its subdomains; "
            "write the host itself (one entry per host)"
        )
    # allow_internal: a platform destination may be an in-cluster name; the policy check at
    # start-up decides whether the session may reach it at all.
    problem = check_entry(text, allow_internal=True)
    if problem is not None:
        raise ValueError(problem.message)
    return text


def _check_header(value: Any) -> str:
    text = _text(value, "a header field name")
    lower = text.lower()
    if text.startswith(":"):
        raise ValueError(f"{quote(text)} is a pseudo-header, which the proxy writes itself")
    if not _TOKEN.fullmatch(text) or len(text) > 128:
        raise ValueError(f"{quote(text)} is not a header field name (RFC 9110 token characters)")
    if lower in _OWNED or lower.startswith("proxy-"):
        raise ValueError(
            f"{quote(text)} describes the request's framing, target or connection, which the "
            "proxy owns; a credential goes in another header (Authorization, X-Api-Key, ...)"
        )
    return text


def _check_template(value: Any) -> str:
    text = _text(value, "a template string")
    rest = text.replace(VALUE, "", 1)
    if VALUE not in text or "{" in rest or "}" in rest:
        raise ValueError(
            f"{quote(text)} must hold {VALUE} exactly once and no other brace "
            "(like 'Bearer {value}')"
        )
    if len(text) > MAX_TEMPLATE or not _visible(text, spaces=True):
        raise ValueError(
            f"a template is at most {MAX_TEMPLATE} visible ASCII characters and spaces"
        )
    if text != text.strip(" "):
        raise ValueError("a template may not start or end with a space (a header value's edges)")
    return text


def _check_placeholder(value: Any) -> str:
    text = _text(value, "a placeholder string")
    if not _TOKEN.fullmatch(text) or len(text) > MAX_PLACEHOLDER:
        raise ValueError(
            f"{quote(text)} is not a placeholder: at most {MAX_PLACEHOLDER} letters, digits and "
            "token characters ('-', '_', '.', ...), no spaces"
        )
    return text


def _check_variable(value: Any) -> str:
    text = _text(value, "an environment variable name")
    if not _VARIABLE.fullmatch(text):
        raise ValueError(
            f"{quote(text)} is not an environment variable name (letters, digits and '_', "
            "not starting with a digit)"
        )
    return text


def _check_env(value: Any) -> str:
    text = _check_variable(value)
    if text in reserved_variables():
        raise ValueError(
            f"{quote(text)} is a variable the sandbox sets itself (proxy, trust or user "
            "variables); name another"
        )
    return text


def _check_file(value: Any) -> str:
    text = _text(value, "a file path")
    if "\0" in text:
        raise ValueError("a file path cannot hold a NUL")
    if not (text.startswith("/") or text.startswith("~/")):
        # The proxy may run from another directory than the one the config was written in
        # (the sandbox runs it from /): a relative path would name another file there.
        raise ValueError(f"{quote(text)} must be an absolute path ('/run/secrets/...')")
    return text


def _visible(text: str, *, spaces: bool) -> bool:
    low = 0x20 if spaces else 0x21
    return all(low <= ord(c) <= 0x7E for c in text)


# -- against the policy --------------------------------------------------------------------


def credential_findings(policy: Policy, config: Config) -> list[Finding]:
    """A credential whose host the session may not reach over HTTPS (port 443), or over plain
    HTTP (port 80) where it allows plain HTTP, is a mistake: refused, naming the entry."""
    findings: list[Finding] = []
    for credential in config.credentials:
        ports = (443, 80) if credential.allow_plain_http else (443,)
        for port in ports:
            decision = policy.decide(f"{credential.host}:{port}")
            if decision.allowed:
                continue
            findings.append(
                Finding(
                    f"{credential.path}.host",
                    credential.host,
                    "credential_not_allowed",
                    f"credential {credential.name!r} is for {credential.host}:{port}, which the "
                    f"policy refuses ({decision.reason}); allow the host in the manifest (and "
                    "the ceiling), or remove the credential",
                    "error",
                    config.source,
                )
            )
            break
    return findings


def check_credentials(policy: Policy, config: Config) -> None:
    """ProxyError('invalid_config') when `credential_findings` has any."""
    findings = credential_findings(policy, config)
    if findings:
        listed = "; ".join(f"{f.path}: {f.message}" for f in findings)
        raise ProxyError(
            "invalid_config",
            f"invalid config: {listed}",
            source=config.source,
            details=tuple(findings),
        )
