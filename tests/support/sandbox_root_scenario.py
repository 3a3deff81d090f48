"""COMMAND of tests/test_sandbox.py's root case, run by `egress-proxy sandbox --user root` inside
the session namespace: root there flushes the namespace's whole nftables rule set (and could add
any rule of its own), then tries the bypasses again with proxy.probes, ICMP included (root may
open raw sockets). The boundary lives in the host namespace, so none of it may get through.
Prints one JSON object.

    sandbox_root_scenario.py HOST4 HOST6 OBS_TCP4 OBS_TCP6 OBS_UDP4 OBS_UDP6
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from proxy.boundary.probes.runner import run_probes
from proxy.boundary.probes.spec import parse_spec


def main() -> int:
    host4, host6 = sys.argv[1], sys.argv[2]
    obs_tcp4, obs_tcp6, obs_udp4, obs_udp6 = (int(x) for x in sys.argv[3:7])
    nft = shutil.which("nft") or "nft"
    flush = subprocess.run([nft, "flush", "ruleset"], capture_output=True, text=True, timeout=30)
    listing = subprocess.run([nft, "list", "ruleset"], capture_output=True, text=True, timeout=30)
    spec = parse_spec(
        {
            "tcp": [
                {"name": "tcp_v4_direct", "address": host4, "port": obs_tcp4},
                {"name": "tcp_v6_direct", "address": host6, "port": obs_tcp6},
            ],
            "udp": [
                {"name": "udp_v4", "address": host4, "port": obs_udp4, "expect": "no_echo"},
                {"name": "udp_v6", "address": host6, "port": obs_udp6, "expect": "no_echo"},
            ],
            "icmp": [
                {"name": "icmp_v4", "address": host4, "expect": "no_echo"},
                {"name": "icmp_v6", "address": host6, "expect": "no_echo"},
            ],
            "dns": [
                {"name": "dns_v4", "server": host4, "port": 53, "qname": "denied.test"},
                {"name": "dns_v6", "server": host6, "port": 53, "qname": "denied.test"},
            ],
        }
    )
    results = run_probes(spec)
    print(
        json.dumps(
            {
                "flush_rc": flush.returncode,
                "flush_stderr": flush.stderr,
                "ruleset_after_flush": listing.stdout,
                "probes": [r.to_json() for r in results],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
