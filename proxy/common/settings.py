"""The operator's settings as the runtime reads them: plain values, built by the config loader
(proxy/app/config.py) and passed down to every plane. Nothing here reads a file."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy import OperatorRules

DEFAULT_CA_DIR = "~/.local/share/egress-proxy/ca"

# `inspection.mode`: which allowed TLS connections the interception engine serves. PREFIXES:
# only hosts whose rules decide paths (URL prefixes); ALL: every one, so that the name inside
# (Host, later :authority) is checked against the SNI and ECH or domain fronting cannot hide it.
PREFIXES = "prefixes"
ALL = "all"
INSPECTION_MODES = (PREFIXES, ALL)

# `tls.ech`: what the SNI gate does with a ClientHello carrying ECH (0xfe0d) or draft ESNI
# (0xffce), whose real name is encrypted. ECH_ALLOW (the default): passed on, marked in its audit
# lines and counted, because GREASE ECH looks like real ECH and common browsers send it;
# ECH_REFUSE: closed at the gate (`ech_refused`) before any byte goes upstream.
ECH_ALLOW = "allow"
ECH_REFUSE = "refuse"
ECH_MODES = (ECH_ALLOW, ECH_REFUSE)

# `learn` (top level): whether `run --learn` may start. LEARN_ALLOW (the default): it may;
# LEARN_FORBID: it exits naming the key, and a reload that brings it stops a learning session's
# learning (proxy/app/runtime.py).
ALLOW = "allow"
FORBID = "forbid"
LEARN_ALLOW, LEARN_FORBID = ALLOW, FORBID
LEARN_MODES = (ALLOW, FORBID)

# `ask` (top level): whether `run --ask` may start, as `learn` says for `--learn`. ASK_FORBID:
# it exits naming the key, before anything listens.
ASK_ALLOW, ASK_FORBID = ALLOW, FORBID
ASK_MODES = (ALLOW, FORBID)


# `dns.attribution_grace`: how long past its TTL an answered address still names its host for a
# redirected connection that carries no name (proxy/decide/attribution.py).
DEFAULT_ATTRIBUTION_GRACE = 300.0


@dataclass(frozen=True, slots=True)
class Nameserver:
    address: str
    port: int = 53


@dataclass(frozen=True, slots=True)
class Limits:
    connect_timeout: float = 10.0
    idle_timeout: float = 600.0
    header_timeout: float = 10.0
    max_connections: int = 1024
    # Asking a person (`run --ask`, proxy/decide/asks.py): how long an ask waits for its
    # answer, and how many asks may be pending and connections held for them at once.
    ask_timeout: float = 30.0
    max_asks: int = 64
    max_held: int = 256


class Secret:
    """A credential's value (proxy/app/credentials_config.py reads it): bytes that never print, so a
    Config in a log line, a traceback or a repr shows that there is one and nothing of it."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = value

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class Credential:
    """One entry of the operator's `credentials` (proxy/app/credentials_config.py): the header put
    into requests to `host` alone, valued `template` with the secret in place of `{value}`."""

    name: str  # in audit lines and metrics
    host: str  # exact, canonical: never its subdomains
    header: str  # a field name, as the operator wrote it
    value_file: str | None  # exactly one of these two says where the secret is
    value_env: str | None
    template: str = "{value}"
    placeholder: str | None = None  # set: only a header equal to the template around it
    env: str | None = None  # the sandbox gives COMMAND this variable, set to the placeholder
    allow_plain_http: bool = False
    path: str = "credentials"  # where it is in the config, for messages
    # Read at start-up and on each reload; None in a config that was only parsed (`check`).
    secret: Secret | None = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> str:
        """Where the secret comes from, as messages name it (never the secret itself)."""
        if self.value_file is not None:
            return f"value_file {self.value_file}"
        return f"value_env {self.value_env}"


@dataclass(frozen=True, slots=True)
class Config:
    operator: OperatorRules = field(default_factory=OperatorRules)
    nameservers: tuple[Nameserver, ...] | None = None  # None: the system's resolv.conf
    dns_timeout: float = 5.0
    ca_dir: str = DEFAULT_CA_DIR
    # PEM bundle that upstream certificates of inspected hosts are verified against; None:
    # certifi's Mozilla bundle (mitmproxy's default).
    upstream_ca: str | None = None
    limits: Limits = field(default_factory=Limits)
    source: str | None = None
    inspection_mode: str = PREFIXES  # one of INSPECTION_MODES
    tls_ech: str = ECH_ALLOW  # one of ECH_MODES; a reload changes it for later tunnels
    learn: str = LEARN_ALLOW  # one of LEARN_MODES
    ask: str = ASK_ALLOW  # one of ASK_MODES
    # Where the session's trust bundle and CA certificate are published (proxy/tls/bundle.py);
    # None: beside the CA, once the CA is loaded. Set, the CA is loaded at start.
    trust_dir: str | None = None
    # The operator's `credentials`, each with its secret once read (Credential.secret).
    credentials: tuple[Credential, ...] = ()
    attribution_grace: float = DEFAULT_ATTRIBUTION_GRACE
