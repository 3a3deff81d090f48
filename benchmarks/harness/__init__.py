"""The benchmark harness: egress-proxy against squid, tinyproxy and the others on loopback
(benchmarks/README.md). `main` holds the options and the order of the rounds; run it as
`python benchmarks/bench.py` (what `make bench` does) or `python -m benchmarks.harness`."""
