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
