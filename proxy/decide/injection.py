"""Credential injection, the part both planes share: which of the operator's credentials a
request gets, and its header fields with them in. Pure functions of values; no mitmproxy, no
I/O (the interception engine's adapter is proxy/l7/injector.py, the plain-HTTP plane calls
`inject` where it rebuilds the request head).

    fields, applied = inject(credentials, "api.github.com", fields, plain_http=False)
    applied     # ("github",): the names of those put in, for the audit line and the metric

A credential goes to its exact host only (the policy's canonical spelling, never a subdomain),
and over plain HTTP only when its entry says `allow_plain_http`. With a placeholder it replaces
only a field whose value is exactly the template around the placeholder (`Bearer
EGRESS-PLACEHOLDER-github`); without one it is set on every request, replacing whatever the
client sent under that name. The caller injects only after the request is allowed, and sends it
only to a checked address of that host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from proxy.common.settings import Credential
    from proxy.decide.events import MetricsSink

type Fields = list[tuple[bytes, bytes]]  # (name as sent, value), in order

VALUE: Final = "{value}"
_OWS: Final = b" \t"  # whitespace around a field value is not part of it (RFC 9110 5.5)


def render(template: str, value: bytes) -> bytes:
    """The field value: `template` (checked to hold `{value}` once, ASCII) around `value`."""
    before, _, after = template.partition(VALUE)
    return before.encode("ascii") + value + after.encode("ascii")


def for_host(
    credentials: Sequence[Credential], host: str, *, plain_http: bool
) -> tuple[Credential, ...]:
    """The credentials of `host` (canonical) that this request's scheme may carry."""
    return tuple(
        c
        for c in credentials
        if c.host == host and c.secret is not None and (c.allow_plain_http or not plain_http)
    )


def inject_one(fields: Fields, credential: Credential, *, lowercase: bool = False) -> Fields | None:
    """`fields` with `credential` in, or None when it does not apply (a placeholder credential
    and no field carrying the placeholder). `lowercase`: the request is HTTP/2, whose field
    names are lowercase."""
    assert credential.secret is not None
    name = credential.header.lower().encode("ascii")
    value = render(credential.template, credential.secret.reveal())
    if credential.placeholder is not None:
        wanted = render(credential.template, credential.placeholder.encode("ascii"))
        out = [
            (key, value) if key.lower() == name and raw.strip(_OWS) == wanted else (key, raw)
            for key, raw in fields
        ]
        return out if out != fields else None
    # Every field of that name goes (a client's own value, a second copy); ours takes the place
    # of the first, so the order of the others stays as sent.
    spelled = name if lowercase else credential.header.encode("ascii")
    kept: Fields = []
    placed = False
    for key, raw in fields:
        if key.lower() != name:
            kept.append((key, raw))
        elif not placed:
            kept.append((spelled, value))
            placed = True
    if not placed:
        kept.append((spelled, value))
    return kept


def inject(
    credentials: Sequence[Credential],
    host: str,
    fields: Fields,
    *,
    plain_http: bool,
    lowercase: bool = False,
) -> tuple[Fields, tuple[str, ...]]:
    """`fields` with every credential of `host` that applies put in, and their names."""
    applied: list[str] = []
    if not credentials:
        return fields, ()
    for credential in for_host(credentials, host, plain_http=plain_http):
        changed = inject_one(fields, credential, lowercase=lowercase)
        if changed is not None:
            fields = changed
            applied.append(credential.name)
    return fields, tuple(applied)


def audit_name(applied: Sequence[str]) -> str | None:
    """What a decision line's `credential` says: the name, or the names joined by commas when
    one host has several (names hold no comma); None when none was put in."""
    return ",".join(applied) if applied else None


def counted(metrics: MetricsSink | None, applied: Sequence[str]) -> str | None:
    """Counts each credential put in (both planes, once per request), and returns what the
    request's decision line says of them (`audit_name`)."""
    if metrics is not None:
        for name in applied:
            metrics.credential_injected(name)
    return audit_name(applied)
