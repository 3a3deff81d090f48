"""`python -m proxy.probes`: the deployed manifests and the sandbox canary run the probes by this
name (deploy/kubernetes/gateway/agent.yaml), so it stays where it was; the command line is
proxy/cli/probes.py, the probes proxy/boundary/probes/."""

from proxy.cli.probes import main

if __name__ == "__main__":
    raise SystemExit(main())
