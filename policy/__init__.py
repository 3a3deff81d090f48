"""egress-proxy's decision core: pure (no I/O, no sockets, no asyncio, no mitmproxy).

    from policy import compile_policy, load_manifest
    policy = compile_policy(load_manifest("network:\\n  egress: [github.com]\\n"))
    assert policy.decide("api.github.com:443").allowed

`decide` is the name stage (before any DNS); `check_addresses` is the address stage for one
DNS answer. Both return values and never raise; loaders raise PolicyError for unusable input
and report problems as Findings.
"""

from policy.addresses import AddressRules, Verdict, classify, parse_address
from policy.ceiling import Ceiling, load_ceiling
from policy.compiler import Grant, Policy, check_manifest, compile_policy
from policy.decisions import AddressDecision, Decision
from policy.errors import PolicyError
from policy.findings import Finding
from policy.hostnames import check_entry, normalize_host
from policy.manifests import Manifest, load_manifest
from policy.operator import OperatorRules, PlatformDestination
from policy.reasons import Reason
from policy.rules import Rule
from policy.urls import Target, parse_target

__all__ = [
    "AddressDecision",
    "AddressRules",
    "Ceiling",
    "Decision",
    "Finding",
    "Grant",
    "Manifest",
    "OperatorRules",
    "PlatformDestination",
    "Policy",
    "PolicyError",
    "Reason",
    "Rule",
    "Target",
    "Verdict",
    "check_entry",
    "check_manifest",
    "classify",
    "compile_policy",
    "load_ceiling",
    "load_manifest",
    "normalize_host",
    "parse_address",
    "parse_target",
]
