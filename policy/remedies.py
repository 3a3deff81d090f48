"""The one change that would allow a refused destination (every message names the host,
the reason and the manifest change that would allow it: docs/observability.md), worded in
the manifest's own grammar so that an agent (or its author) can act on one line:

    remedy(Reason.NOT_ALLOWED, "denied.test", manifest_format="agent.yaml")
    # "add 'denied.test' to network.egress"

None when no change is worth naming (an internal error, an overload, a malformed request).
Where no manifest entry can allow it (a non-public address, an internal name), the text says so,
so that nobody edits a manifest in vain. Host and path come from clients: whoever writes the
text into a response makes it printable and caps it (proxy/common/refusals.py `shown`).

Pure functions: nothing here does I/O.
"""

from __future__ import annotations

from policy.paths import canonical_prefix, decide_path, readings
from policy.reasons import Reason
from policy.urls import DEFAULT_PORTS, RULE_SCHEME

__all__ = ["client_remedy", "entry", "path_prefix", "remedy"]

_NO_ENTRY = "no manifest entry can allow it"

# Reasons of the address stage, and of the name stage before any rule, that no manifest entry
# can lift (policy/answers.py and policy/addresses.py refuse them whatever the manifest says).
_NON_PUBLIC = frozenset(
    {
        Reason.INVALID_ADDRESS,
        Reason.METADATA,
        Reason.OPERATOR_DENY,
        Reason.IN_CLUSTER,
        Reason.NAT64,
        Reason.THIS_NETWORK,
        Reason.PRIVATE,
        Reason.SHARED_ADDRESS,
        Reason.LOOPBACK,
        Reason.LINK_LOCAL,
        Reason.IETF_PROTOCOL,
        Reason.DS_LITE,
        Reason.DUMMY,
        Reason.NAT64_DISCOVERY,
        Reason.DOCUMENTATION,
        Reason.TO_6TO4_RELAY,
        Reason.TO_6A44_RELAY,
        Reason.BENCHMARKING,
        Reason.RESERVED,
        Reason.BROADCAST,
        Reason.UNSPECIFIED,
        Reason.MULTICAST,
        Reason.IPV4_MAPPED,
        Reason.IPV4_COMPATIBLE,
        Reason.NAT64_LOCAL,
        Reason.DISCARD,
        Reason.TEREDO,
        Reason.ORCHID,
        Reason.SRV6,
        Reason.TO_6TO4,
        Reason.UNIQUE_LOCAL,
        Reason.SITE_LOCAL,
        Reason.MIXED_ANSWER,
        Reason.OUTSIDE_PLATFORM_CIDRS,
    }
)

# What a client can fix itself; the host is not needed to say it.
_CLIENT: dict[str, str] = {
    Reason.IP_LITERAL: "name the host, not an IP address",
    Reason.INVALID_HOST: "name a valid host name",
    Reason.SINGLE_LABEL: "name the host by its fully qualified domain name",
    Reason.INVALID_TARGET: "give host:port, or an absolute http:// or https:// URL",
    Reason.UNSUPPORTED_SCHEME: "send http:// requests as absolute URLs, and https by CONNECT",
    Reason.INVALID_PORT: "use a port from 1 to 65535",
    Reason.AMBIGUOUS_PATH: (
        "request the path in its plain form (no '//', '..', encoded '/' or double encoding)"
    ),
    Reason.HOST_MISMATCH: "send one Host header naming the host this connection was opened for",
    Reason.SNI_MISSING: "send the host name as the TLS SNI",
    Reason.SNI_INVALID: "send the host name as the TLS SNI",
    Reason.SNI_MISMATCH: "send the CONNECT host as the TLS SNI",
    Reason.ECH_REFUSED: "connect without Encrypted ClientHello (ECH)",
    Reason.NOT_TLS: "start the tunnel with a TLS handshake",
    Reason.UPGRADE_REFUSED: "only WebSocket upgrades pass: send the request without Upgrade",
    Reason.PROXY_LOOP: f"the destination is the proxy itself; {_NO_ENTRY}",
    Reason.UNATTRIBUTED: "connect by a host name the session resolves through the proxy's DNS",
    Reason.INSPECTION_UNSUPPORTED: (
        "the host is allowed only for some URL paths: speak HTTP or TLS to it, or allow the host"
    ),
}


# A person's answer (`run --ask`): the entry itself is named by the caller, which knows what was
# asked (Policy.remedy of the refusal that was held); these say what else can be done.
_ASKED: dict[str, str] = {
    Reason.ASK_DENIED: "a person refused it for this session; declare it in the manifest if "
    "it is needed",
    Reason.ASK_TIMEOUT: "nobody answered in time: answer with 'egress-proxy ask', or declare it "
    "in the manifest",
    Reason.ASK_OVERLOADED: "too many connections wait for an answer: answer the pending asks, "
    "or declare it in the manifest",
}


def client_remedy(reason: str) -> str | None:
    """The fix for a refusal that names no manifest entry (the client's own request); None
    when there is none to name (an overload, a timeout, a malformed request, a bug of ours)."""
    return _CLIENT.get(reason)


def path_prefix(path: str) -> str | None:
    """A URL-pattern path that admits `path` on every reading servers give it, as short as
    simple allows: its first segment (`/v2/users` -> `/v2/`), else the whole host (`/`). The
    candidate must be in the normal form a manifest accepts (policy/manifests.py refuses any
    other) and must admit `path` by the very rule the proxy decides with; None if neither does
    (a path the proxy refuses outright, `ambiguous_path`)."""
    try:
        allow, _ = readings(path)
    except Exception:
        return None
    firsts = {reading.path.split("/")[1] for reading in allow}
    candidates = ["/"]
    if len(firsts) == 1:
        (first,) = firsts
        if first:
            # `/v2` alone names itself; anything deeper is under `/v2/`.
            whole = all(reading.path == "/" + first for reading in allow)
            candidates.insert(0, f"/{first}" if whole else f"/{first}/")
    for candidate in candidates:
        try:
            if canonical_prefix(candidate) != candidate:
                continue
        except Exception:
            continue
        if decide_path(path, [candidate], []).verdict == "allowed":
            return candidate
    return None


def _url(host: str, scheme: str | None, port: int | None, prefix: str) -> str:
    rule_scheme = RULE_SCHEME.get(scheme or "", "https")
    where = f"[{host}]" if ":" in host else host
    if port is not None and port != DEFAULT_PORTS[rule_scheme]:
        where = f"{where}:{port}"
    return f"{rule_scheme}://{where}{prefix}"


def entry(
    reason: str,
    host: str,
    *,
    manifest_format: str = "agent.yaml",
    scheme: str | None = None,
    port: int | None = None,
    path: str | None = None,
) -> str | None:
    """The manifest entry that would allow a destination refused for `reason`, in the grammar
    of `manifest_format`: the host for `not_allowed` (and for `path_not_allowed` in agent.yaml,
    which has no URL prefixes), the URL prefix for `path_not_allowed` in agent.toml. None for
    any other reason, or a path no prefix admits on every reading."""
    if reason == Reason.NOT_ALLOWED:
        return host
    if reason != Reason.PATH_NOT_ALLOWED:
        return None
    if manifest_format != "agent.toml":
        return host
    prefix = path_prefix(path) if path is not None else None
    return _url(host, scheme, port, prefix) if prefix is not None else None


def remedy(
    reason: str,
    host: str,
    *,
    manifest_format: str = "agent.yaml",
    rule: str | None = None,
    pattern: str | None = None,
    scheme: str | None = None,
    port: int | None = None,
    path: str | None = None,
) -> str | None:
    """The one change that would allow a destination refused for `reason`, in the grammar of
    `manifest_format` ("agent.yaml": `network.egress`; "agent.toml": `network_access.allowed`
    and `.blocked`). `rule` and `pattern`: the entry that decided (a block to remove);
    `scheme`, `port` and `path`: what was asked, for a URL prefix to add."""
    toml = manifest_format == "agent.toml"
    allowed = "network_access.allowed" if toml else "network.egress"
    if reason in (Reason.NOT_ALLOWED, Reason.PATH_NOT_ALLOWED):
        added = entry(
            reason, host, manifest_format=manifest_format, scheme=scheme, port=port, path=path
        )
        return f"add '{added}' to {allowed}" if added is not None else None
    if reason == Reason.OUTSIDE_CEILING:
        return (
            f"the tenant ceiling does not include '{host}': the operator must add it to the ceiling"
        )
    if reason in (Reason.BLOCKED, Reason.BLOCKED_ADDRESS):
        named = f" ('{pattern}')" if pattern is not None else ""
        if rule is not None:
            return f"remove {rule}{named}"
        return "remove the network_access.blocked entry that names it"
    if reason in _ASKED:
        return _ASKED[reason]
    if reason == Reason.PORT_NOT_ALLOWED:
        where = f"port {port}" if port is not None else "this port"
        return f"{_NO_ENTRY}: the operator must add {where} to the port allow-list"
    if reason == Reason.OPAQUE_NOT_ALLOWED:
        where = f"port {port}" if port is not None else "this port"
        return f"{_NO_ENTRY}: the operator must add {where} to opaque_ports"
    if reason == Reason.INSPECTION_DISABLED:
        return (
            f"the paths of '{host}' are decided per request: the operator must enable TLS "
            "inspection"
        )
    if reason in (Reason.LOOPBACK_NAME, Reason.INTERNAL_NAME):
        return f"'{host}' is an internal name; {_NO_ENTRY}"
    if reason == Reason.INTERNAL_CNAME:
        return f"'{host}' is an alias of an internal name; {_NO_ENTRY}"
    if reason == Reason.NO_ADDRESSES:
        return f"'{host}' resolves to no address; {_NO_ENTRY}"
    if reason in _NON_PUBLIC:
        return f"'{host}' resolves to a non-public address; {_NO_ENTRY}"
    return client_remedy(reason)
