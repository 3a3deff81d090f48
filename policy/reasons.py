"""The one catalog of reason codes: every code an audit line, a metric label, an
`X-Egress-Denied`/`X-Egress-Error` header or a refusal can carry, one rule per code.

Members are `str` (a StrEnum): they compare, hash and format as their bare value, so
`Reason.NOT_ALLOWED == "not_allowed"` and audit lines, headers and labels carry
`"not_allowed"`, never the member's name.

Not here: the input-error codes of PolicyError/ProxyError and of Findings (a manifest, ceiling,
config or probe file that cannot be used, a bad command line: `invalid_manifest`,
`invalid_yaml`, `too_many_entries`, `dns_config`, `usage`, ...). Those are errors that stop a
load or a command, never the answer to a connection, and they stay where they are raised.
"""

from __future__ import annotations

from enum import StrEnum, unique

__all__ = ["Reason"]


@unique
class Reason(StrEnum):
    # -- the policy core, name stage (policy/compiler.py, policy/grants.py) -------------------
    ALLOWED = "allowed"  # a manifest rule admits the host (and port, path)
    PLATFORM_DESTINATION = "platform_destination"  # an operator platform destination admits it
    BLOCKED = "blocked"  # a manifest block rule names the host or URL
    NOT_ALLOWED = "not_allowed"  # no rule of the manifest admits the host
    OUTSIDE_CEILING = "outside_ceiling"  # a rule admits it, but the tenant's ceiling does not
    PORT_NOT_ALLOWED = "port_not_allowed"  # the host is admitted, on other ports only
    PATH_NOT_ALLOWED = "path_not_allowed"  # the host is admitted, on other paths only
    AMBIGUOUS_PATH = "ambiguous_path"  # a path servers read differently, or a refused form
    INSPECTION_DISABLED = "inspection_disabled"  # paths decide, but TLS inspection is off
    OPAQUE_NOT_ALLOWED = "opaque_not_allowed"  # not TLS or HTTP, on a port not in opaque_ports
    INTERNAL_ERROR = "internal_error"  # a bug of ours while deciding: fail closed
    # -- the host itself, before any rule (policy/names.py, policy/urls.py) -------------------
    IP_LITERAL = "ip_literal"  # the host is an IP address in any spelling
    INVALID_HOST = "invalid_host"  # the host is not a valid (normalisable) host name
    LOOPBACK_NAME = "loopback_name"  # localhost or a name under .localhost
    INTERNAL_NAME = "internal_name"  # a name under an internal suffix (.local, .internal, ...)
    SINGLE_LABEL = "single_label"  # a name of one label (no domain)
    INVALID_TARGET = "invalid_target"  # the target (authority or URL) cannot be parsed
    UNSUPPORTED_SCHEME = "unsupported_scheme"  # a URL scheme other than http/https
    INVALID_PORT = "invalid_port"  # a port that is not a number from 1 to 65535
    # -- the policy core, address stage (policy/answers.py) ------------------------------------
    MIXED_ANSWER = "mixed_answer"  # some addresses of an answer are refused: refused whole
    NO_ADDRESSES = "no_addresses"  # an answer with no address at all
    BLOCKED_ADDRESS = "blocked_address"  # a platform destination's address its rule blocks
    OUTSIDE_PLATFORM_CIDRS = "outside_platform_cidrs"  # outside its platform destination's CIDRs
    INTERNAL_CNAME = "internal_cname"  # the answer went through an internal name (CNAME)
    PLATFORM_CIDR = "platform_cidr"  # a non-public address inside a platform destination's CIDRs
    # -- one address (policy/addresses.py): operator lists and the special-address table ------
    INVALID_ADDRESS = "invalid_address"  # not an IP address
    METADATA = "metadata"  # a cloud metadata endpoint
    OPERATOR_DENY = "operator_deny"  # in the operator's deny list
    IN_CLUSTER = "in_cluster"  # in the operator's in-cluster ranges
    OPERATOR_ALLOW = "operator_allow"  # a special address the operator's allow list admits
    NAT64 = "nat64"  # a NAT64 (64:ff9b::/96) address whose embedded IPv4 is not public
    GLOBAL = "global"  # a globally reachable address (the only public row)
    THIS_NETWORK = "this_network"  # 0.0.0.0/8
    PRIVATE = "private"  # RFC 1918 private-use
    SHARED_ADDRESS = "shared_address"  # 100.64.0.0/10, carrier-grade NAT
    LOOPBACK = "loopback"  # 127.0.0.0/8, ::1
    LINK_LOCAL = "link_local"  # 169.254.0.0/16, fe80::/10
    IETF_PROTOCOL = "ietf_protocol"  # IETF protocol assignments (192.0.0.0/24, 2001::/23)
    DS_LITE = "ds_lite"  # 192.0.0.0/29, IPv4 service continuity
    DUMMY = "dummy"  # 192.0.0.8/32, IPv4 dummy address
    NAT64_DISCOVERY = "nat64_discovery"  # 192.0.0.170-171, NAT64/DNS64 discovery
    DOCUMENTATION = "documentation"  # documentation ranges (TEST-NET-*, 2001:db8::/32, ...)
    TO_6TO4_RELAY = "6to4_relay"  # 192.88.99.0/24, deprecated 6to4 relay anycast
    TO_6A44_RELAY = "6a44_relay"  # 192.88.99.2/32, 6a44 relay anycast
    BENCHMARKING = "benchmarking"  # 198.18.0.0/15, 2001:2::/48
    RESERVED = "reserved"  # 240.0.0.0/4, and IPv6 reserved by the IETF or unallocated
    BROADCAST = "broadcast"  # 255.255.255.255
    UNSPECIFIED = "unspecified"  # 0.0.0.0/32, ::
    MULTICAST = "multicast"  # 224.0.0.0/4, ff00::/8
    IPV4_MAPPED = "ipv4_mapped"  # ::ffff:0:0/96
    IPV4_COMPATIBLE = "ipv4_compatible"  # ::/96, deprecated IPv4-compatible
    NAT64_LOCAL = "nat64_local"  # 64:ff9b:1::/48, local-use translation
    DISCARD = "discard"  # 100::/64, discard-only
    TEREDO = "teredo"  # 2001::/32
    ORCHID = "orchid"  # 2001:10::/28, the deprecated ORCHID (v1)
    SRV6 = "srv6"  # 5f00::/16, SRv6 SIDs
    TO_6TO4 = "6to4"  # 2002::/16
    UNIQUE_LOCAL = "unique_local"  # fc00::/7
    SITE_LOCAL = "site_local"  # fec0::/10, deprecated site-local
    # -- what a client sent (proxy/dataplane, proxy/decide, proxy/l7) -------------------------
    HOST_MISMATCH = "host_mismatch"  # a Host header or request target names another host
    NOT_VETTED = "not_vetted"  # the engine was asked to dial a destination never vetted
    SNI_MISSING = "sni_missing"  # the ClientHello has no SNI
    SNI_INVALID = "sni_invalid"  # the SNI is not a host name
    SNI_MISMATCH = "sni_mismatch"  # the SNI is a host name, but not the tunnel's host
    ECH_REFUSED = "ech_refused"  # the ClientHello carries ECH or ESNI and `tls.ech` is refuse
    NOT_TLS = "not_tls"  # a tunnel's first bytes are not a TLS handshake record
    INVALID_CLIENT_HELLO = "invalid_client_hello"  # TLS, but the ClientHello is malformed
    INVALID_REQUEST = "invalid_request"  # an HTTP request (or CONNECT head) that cannot be parsed
    INSPECTION_UNSUPPORTED = "inspection_unsupported"  # paths decide on a protocol not inspected
    UPGRADE_REFUSED = "upgrade_refused"  # an Upgrade to anything but WebSocket
    CONNECT_REFUSED = "connect_refused"  # a CONNECT inside interception (h2 extended CONNECT too)
    HEADER_TIMEOUT = "header_timeout"  # no complete head (or ClientHello) within the time limit
    NO_ORIGINAL_DESTINATION = "no_original_destination"  # a transparent connection not redirected
    UNATTRIBUTED = "unattributed"  # an address the session's DNS never answered for a name
    PROXY_LOOP = "proxy_loop"  # a destination that is one of the proxy's own listeners
    OVERLOAD = "overload"  # a connection or query over the configured limits
    NOT_SOCKS5 = "not_socks5"  # what came to a SOCKS5 listener is not SOCKS5
    SOCKS_NO_METHOD = "socks_no_acceptable_method"  # no offered method is 0x00 (no auth)
    SOCKS_COMMAND = "socks_command_unsupported"  # a command other than CONNECT
    SOCKS_ADDRESS_TYPE = "socks_address_type_unsupported"  # not IPv4, a name or IPv6
    # -- the upstream (proxy/net/dialing.py, the HTTP plane, the engine) ----------------------
    UPSTREAM_REFUSED = "upstream_refused"  # every checked address refused the TCP connection
    UPSTREAM_TIMEOUT = "upstream_timeout"  # the TCP connect timed out
    UPSTREAM_ERROR = "upstream_error"  # the upstream closed early or sent an invalid response
    UPSTREAM_TLS = "upstream_tls"  # an inspected upstream's certificate failed verification
    # -- the resolver (proxy/net/resolver.py) -------------------------------------------------
    DNS_IP_LITERAL = "dns_ip_literal"  # the resolver was handed an IP literal: never resolved
    DNS_TIMEOUT = "dns_timeout"  # no answer within the DNS timeout
    DNS_ERROR = "dns_error"  # the lookup failed (SERVFAIL, network error, bad reply)
    DNS_NXDOMAIN = "dns_nxdomain"  # no such domain
    DNS_NO_ADDRESS = "dns_no_address"  # the name exists, with no A or AAAA record
    # -- the DNS responder (proxy/dns_responder/) ----------------------------------------------
    DNS_QTYPE_NOT_SERVED = "dns_qtype_not_served"  # a query type other than A/AAAA
    DNS_OPCODE_NOT_SERVED = "dns_opcode_not_served"  # an opcode other than QUERY
    DNS_CLASS_NOT_SERVED = "dns_class_not_served"  # a class other than IN
    DNS_MALFORMED = "dns_malformed"  # a message that cannot be parsed
    DNS_NOT_A_QUERY = "dns_not_a_query"  # a response, or not exactly one question
    # -- why a connection ended (close lines) -------------------------------------------------
    CLOSED = "closed"  # both directions ended with EOF
    CLIENT_CLOSED = "client_closed"  # the client closed before a relay began
    RESET = "reset"  # a reset (or a send/receive error) on either side
    ERROR = "error"  # a bug of ours while relaying: both sides reset
    IDLE_TIMEOUT = "idle_timeout"  # nothing moved for the idle timeout
    SHUTDOWN = "shutdown"  # the proxy stopped
    DRAIN_TIMEOUT = "drain_timeout"  # the proxy stopped and the drain time ran out
    POLICY_RELOAD = "policy_reload"  # a reload no longer allows the connection's destination
    CLIENT_TLS_FAILED = "client_tls_failed"  # the client's TLS handshake with the engine failed
    # -- asking a person (`run --ask`: policy/asking.py, proxy/decide/asks.py) ----------------
    ASK_DENIED = "ask_denied"  # a person refused it, once or for the session
    ASK_TIMEOUT = "ask_timeout"  # held, and nobody answered within limits.ask_timeout
    ASK_OVERLOADED = "ask_overloaded"  # over the caps on pending asks or held connections
