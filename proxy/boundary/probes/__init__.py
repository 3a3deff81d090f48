"""Probes of an egress boundary from the agent's position: each tries one way out and says
whether the boundary held. Used by `egress-proxy boundary verify` (the Kubernetes verify init
container) and by `egress-proxy sandbox` (the canary run inside the session namespace).

    tcp_answered_by_proxy("tcp_v4_direct", "192.0.2.1", 80)   # tcp.py: the proxy must answer
    udp_blocked("udp_v4", "192.0.2.1", 9, expect="local_refusal")   # udp.py
    python -m proxy.probes --spec '{"tcp": [{"name": "t", "address": "192.0.2.1", "port": 80}]}' \\
        --as-user 65534:65534                          # spec.py, runner.py, proxy/cli/probes.py

Every address is an IP literal: a probe never asks the OS resolver (a name could point anywhere).
A probe passes only on positive evidence that the boundary held; anything it cannot interpret is a
failure, said in `detail`.
"""
