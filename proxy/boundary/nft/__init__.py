"""The nftables rule sets of the boundary, in two shapes: the pod's shared network namespace
(the Kubernetes sidecar, `pod.py`) and the host side of a sandbox session's veth (`sandbox.py`).
Each is rendered as nft text (`chains.py`), loaded atomically with `nft -f -`, read back and
compared with what the text promises (`compare.py`, `load.py`); a rule set that does not load
exactly as rendered is removed again, never left half in place."""
