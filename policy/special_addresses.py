"""The address table: which IP destinations count as public.

Transcribed by hand from the IANA IPv4 and IPv6 Special-Purpose Address Registries (the
"Globally Reachable" column; rows marked N/A are taken as not reachable, since a proxy must fail
closed), plus the rows of the general address-space registries that a proxy has to know about.
`policy.addresses` indexes this data; nothing here has behaviour.

Keep each row on one line and each tuple sorted by address, then prefix length: the tests check
both, and that every row is exercised by at least one address.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.reasons import Reason


@dataclass(frozen=True, slots=True)
class Block:
    """One row: a prefix, its registry name and RFCs, and whether it is globally reachable.

    `reason` is our stable snake_case code for the row (`global` exactly when reachable); it
    is what audit lines and metrics carry.
    """

    prefix: str
    name: str
    rfc: str
    globally_reachable: bool
    reason: str


@dataclass(frozen=True, slots=True)
class MetadataAddress:
    """A cloud instance-metadata or platform endpoint: refused whatever the operator allows."""

    address: str
    name: str


# IANA IPv4 Special-Purpose Address Registry.
IPV4_SPECIAL: tuple[Block, ...] = (
    Block("0.0.0.0/8", "This network", "RFC 791", False, Reason.THIS_NETWORK),
    # Connecting to 0.0.0.0 reaches the local host on Linux.
    Block("0.0.0.0/32", "This host on this network", "RFC 1122", False, Reason.UNSPECIFIED),
    Block("10.0.0.0/8", "Private-Use", "RFC 1918", False, Reason.PRIVATE),
    Block("100.64.0.0/10", "Shared Address Space", "RFC 6598", False, Reason.SHARED_ADDRESS),
    Block("127.0.0.0/8", "Loopback", "RFC 1122", False, Reason.LOOPBACK),
    Block("169.254.0.0/16", "Link Local", "RFC 3927", False, Reason.LINK_LOCAL),
    Block("172.16.0.0/12", "Private-Use", "RFC 1918", False, Reason.PRIVATE),
    Block("192.0.0.0/24", "IETF Protocol Assignments", "RFC 6890", False, Reason.IETF_PROTOCOL),
    Block("192.0.0.0/29", "IPv4 Service Continuity Prefix", "RFC 7335", False, Reason.DS_LITE),
    Block("192.0.0.8/32", "IPv4 dummy address", "RFC 7600", False, Reason.DUMMY),
    Block("192.0.0.9/32", "Port Control Protocol Anycast", "RFC 7723", True, Reason.GLOBAL),
    Block(
        "192.0.0.10/32",
        "Traversal Using Relays around NAT Anycast",
        "RFC 8155",
        True,
        Reason.GLOBAL,
    ),
    Block(
        "192.0.0.170/32", "NAT64/DNS64 Discovery", "RFC 8880, 7050", False, Reason.NAT64_DISCOVERY
    ),
    Block(
        "192.0.0.171/32", "NAT64/DNS64 Discovery", "RFC 8880, 7050", False, Reason.NAT64_DISCOVERY
    ),
    Block("192.0.2.0/24", "Documentation (TEST-NET-1)", "RFC 5737", False, Reason.DOCUMENTATION),
    Block("192.31.196.0/24", "AS112-v4", "RFC 7535", True, Reason.GLOBAL),
    Block("192.52.193.0/24", "AMT", "RFC 7450", True, Reason.GLOBAL),
    # Globally Reachable is N/A: the allocation was terminated in 2015.
    Block(
        "192.88.99.0/24", "Deprecated (6to4 Relay Anycast)", "RFC 7526", False, Reason.TO_6TO4_RELAY
    ),
    Block("192.88.99.2/32", "6a44-relay anycast address", "RFC 6751", False, Reason.TO_6A44_RELAY),
    Block("192.168.0.0/16", "Private-Use", "RFC 1918", False, Reason.PRIVATE),
    Block("192.175.48.0/24", "Direct Delegation AS112 Service", "RFC 7534", True, Reason.GLOBAL),
    Block("198.18.0.0/15", "Benchmarking", "RFC 2544", False, Reason.BENCHMARKING),
    Block("198.51.100.0/24", "Documentation (TEST-NET-2)", "RFC 5737", False, Reason.DOCUMENTATION),
    Block("203.0.113.0/24", "Documentation (TEST-NET-3)", "RFC 5737", False, Reason.DOCUMENTATION),
    Block("240.0.0.0/4", "Reserved", "RFC 1112", False, Reason.RESERVED),
    Block("255.255.255.255/32", "Limited Broadcast", "RFC 8190, 919", False, Reason.BROADCAST),
)

# IANA IPv6 Special-Purpose Address Registry.
IPV6_SPECIAL: tuple[Block, ...] = (
    Block("::/128", "Unspecified Address", "RFC 4291", False, Reason.UNSPECIFIED),
    Block("::1/128", "Loopback Address", "RFC 4291", False, Reason.LOOPBACK),
    Block("::ffff:0:0/96", "IPv4-mapped Address", "RFC 4291", False, Reason.IPV4_MAPPED),
    # Reachable per the registry; `policy.addresses` classifies the embedded IPv4 instead.
    Block("64:ff9b::/96", "IPv4-IPv6 Translation (NAT64)", "RFC 6052", True, Reason.GLOBAL),
    Block(
        "64:ff9b:1::/48", "Local-Use IPv4-IPv6 Translation", "RFC 8215", False, Reason.NAT64_LOCAL
    ),
    Block("100::/64", "Discard-Only Address Block", "RFC 6666", False, Reason.DISCARD),
    Block("100:0:0:1::/64", "Dummy IPv6 Prefix", "RFC 9780", False, Reason.DUMMY),
    Block("2001::/23", "IETF Protocol Assignments", "RFC 2928", False, Reason.IETF_PROTOCOL),
    # Globally Reachable is N/A; Teredo tunnels to an IPv4 host we never get to check.
    Block("2001::/32", "TEREDO", "RFC 4380, 8190", False, Reason.TEREDO),
    Block("2001:1::1/128", "Port Control Protocol Anycast", "RFC 7723", True, Reason.GLOBAL),
    Block(
        "2001:1::2/128",
        "Traversal Using Relays around NAT Anycast",
        "RFC 8155",
        True,
        Reason.GLOBAL,
    ),
    Block("2001:1::3/128", "DNS-SD SRP Anycast", "RFC 9665", True, Reason.GLOBAL),
    Block("2001:2::/48", "Benchmarking", "RFC 5180", False, Reason.BENCHMARKING),
    Block("2001:3::/32", "AMT", "RFC 7450", True, Reason.GLOBAL),
    Block("2001:4:112::/48", "AS112-v6", "RFC 7535", True, Reason.GLOBAL),
    # Globally Reachable is N/A: ORCHIDv1 was returned to IANA in 2014.
    Block("2001:10::/28", "Deprecated (previously ORCHID)", "RFC 4843", False, Reason.ORCHID),
    Block("2001:20::/28", "ORCHIDv2", "RFC 7343", True, Reason.GLOBAL),
    Block("2001:30::/28", "Drone Remote ID Protocol Entity Tags", "RFC 9374", True, Reason.GLOBAL),
    Block("2001:db8::/32", "Documentation", "RFC 3849", False, Reason.DOCUMENTATION),
    # Globally Reachable is N/A; 6to4 tunnels to an IPv4 host we never get to check.
    Block("2002::/16", Reason.TO_6TO4, "RFC 3056", False, Reason.TO_6TO4),
    Block("2620:4f:8000::/48", "Direct Delegation AS112 Service", "RFC 7534", True, Reason.GLOBAL),
    Block("3fff::/20", "Documentation", "RFC 9637", False, Reason.DOCUMENTATION),
    Block("5f00::/16", "Segment Routing (SRv6) SIDs", "RFC 9602", False, Reason.SRV6),
    Block("fc00::/7", "Unique-Local", "RFC 4193, 8190", False, Reason.UNIQUE_LOCAL),
    Block("fe80::/10", "Link-Local Unicast", "RFC 4291", False, Reason.LINK_LOCAL),
)

# From the IANA IPv4/IPv6 Address Space and Multicast registries, and our defaults. The default
# rows make the lookup total: IPv4 outside the special rows is public, while IPv6 is public only
# inside 2000::/3, so space IANA has not allocated yet fails closed.
ADDRESS_SPACE: tuple[Block, ...] = (
    Block("0.0.0.0/0", "IPv4 unicast", "RFC 791", True, Reason.GLOBAL),
    Block("224.0.0.0/4", "Multicast", "RFC 5771", False, Reason.MULTICAST),
    Block("::/0", "Reserved by IETF or unallocated", "RFC 4291", False, Reason.RESERVED),
    # Deprecated, yet the stack still turns ::a.b.c.d into a connection to a.b.c.d.
    Block(
        "::/96", "IPv4-compatible Address (deprecated)", "RFC 4291", False, Reason.IPV4_COMPATIBLE
    ),
    Block("2000::/3", "Global Unicast", "RFC 4291", True, Reason.GLOBAL),
    # Deprecated, but old networks still route it internally.
    Block("fec0::/10", "Site-Local Unicast (deprecated)", "RFC 3879", False, Reason.SITE_LOCAL),
    Block("ff00::/8", "Multicast", "RFC 4291", False, Reason.MULTICAST),
)

BLOCKS: tuple[Block, ...] = IPV4_SPECIAL + IPV6_SPECIAL + ADDRESS_SPACE

# Cloud metadata and platform endpoints hand out credentials or act for the instance. Most sit in
# link-local, shared or unique-local space the table already refuses; listing them keeps them
# refused when an operator allows those ranges, and catches the public one (Azure's WireServer).
METADATA: tuple[MetadataAddress, ...] = (
    MetadataAddress("100.100.100.200", "Alibaba Cloud instance metadata"),  # Alibaba Cloud
    MetadataAddress("168.63.129.16", "Azure WireServer (agent, DNS, health probe)"),  # Azure
    MetadataAddress("169.254.0.23", "Tencent Cloud instance metadata"),  # Tencent Cloud
    MetadataAddress("169.254.42.42", "Scaleway instance metadata"),  # Scaleway
    MetadataAddress("169.254.169.123", "AWS Time Sync Service"),  # AWS
    MetadataAddress("169.254.169.250", "AWS Windows KMS activation"),  # AWS
    MetadataAddress("169.254.169.251", "AWS Windows KMS activation"),  # AWS
    MetadataAddress("169.254.169.253", "AWS VPC DNS resolver"),  # AWS
    MetadataAddress("169.254.169.254", "cloud instance metadata"),  # AWS, GCP, Azure, OCI, ...
    MetadataAddress("169.254.170.2", "AWS ECS task metadata and credentials"),  # AWS ECS
    MetadataAddress("169.254.170.23", "AWS EKS Pod Identity Agent"),  # AWS EKS
    MetadataAddress("192.0.0.192", "Oracle Cloud instance metadata"),  # Oracle Cloud (Classic)
    MetadataAddress("fd00:42::42", "Scaleway instance metadata (IPv6)"),  # Scaleway
    MetadataAddress("fd00:ec2::23", "AWS EKS Pod Identity Agent (IPv6)"),  # AWS EKS
    MetadataAddress("fd00:ec2::123", "AWS Time Sync Service (IPv6)"),  # AWS
    MetadataAddress("fd00:ec2::250", "AWS Windows KMS activation (IPv6)"),  # AWS
    MetadataAddress("fd00:ec2::253", "AWS VPC DNS resolver (IPv6)"),  # AWS
    MetadataAddress("fd00:ec2::254", "AWS instance metadata (IMDS, IPv6)"),  # AWS
    MetadataAddress("fd20:ce::254", "GCP instance metadata (IPv6)"),  # Google Cloud
)
